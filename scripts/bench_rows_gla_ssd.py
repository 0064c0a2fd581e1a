"""Benchmark rows for ``scripts/bench_kernels.py``: GLA, simple GLA (the SSD form of fla) and Mamba2's SSD.

``gla`` vs fla 0.6.0 ``chunk_gla`` (targets on the H200, fwd+bwd: 3.08 ms at 4 x 4096, 3.99 ms at
1 x 16384), ``simple_gla`` vs fla ``chunk_simple_gla`` (1.38 / 1.68 ms), and ``ssd`` (ttr's
Mamba2 form, one group, state size = head dim; no fla counterpart). Gates as in fla's own
benchmarks: ``logsigmoid(x) / 16`` per key dimension for GLA, ``logsigmoid(x)`` per head otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ttr.kernels.gla import chunk_gla, reference_gla
from ttr.kernels.ssd import chunk_simple_gla, chunk_ssd, reference_simple_gla, reference_ssd
from ttr.scripts.bench_kernels import ROWS, Row


def _qkv(B, T, H, D, dtype, device):
    return {
        "q": torch.randn(B, T, H, D, device=device, dtype=dtype),
        "k": torch.randn(B, T, H, D, device=device, dtype=dtype),
        "v": torch.randn(B, T, H, D, device=device, dtype=dtype),
    }


def gla_inputs(B, T, H, D, dtype, device):
    return {**_qkv(B, T, H, D, dtype, device), "g": F.logsigmoid(torch.randn(B, T, H, D, device=device)) / 16}


def simple_gla_inputs(B, T, H, D, dtype, device):
    return {**_qkv(B, T, H, D, dtype, device), "g": F.logsigmoid(torch.randn(B, T, H, device=device))}


def ssd_inputs(B, T, H, D, dtype, device):
    return {
        "x": torch.randn(B, T, H, D, device=device, dtype=dtype),
        "dt": F.softplus(torch.randn(B, T, H, device=device) - 3.0),
        "A": -torch.rand(H, device=device).mul(15).add(1),
        "B": (torch.randn(B, T, 1, D, device=device) * D**-0.5).to(dtype),
        "C": torch.randn(B, T, 1, D, device=device, dtype=dtype),
    }


def _fla(name: str):
    def call(**x):
        import fla.ops.common.chunk_o as chunk_o

        # fla 0.6.0 refuses its gated backward on Hopper with Triton < 3.7.1 (its issue #640);
        # for timing only, the guard is lifted (the table says so).
        chunk_o.TRITON_ABOVE_3_7_1 = True
        if name == "gla":
            from fla.ops.gla import chunk_gla as fla_chunk_gla
            return fla_chunk_gla(x["q"], x["k"], x["v"], x["g"])
        from fla.ops.simple_gla import chunk_simple_gla as fla_chunk_simple_gla
        return fla_chunk_simple_gla(x["q"], x["k"], x["v"], x["g"])
    return call


ROWS["gla"] = Row(lambda **x: chunk_gla(x["q"], x["k"], x["v"], x["g"]), _fla("gla"), gla_inputs,
                  lambda **x: reference_gla(x["q"], x["k"], x["v"], x["g"]))
ROWS["simple_gla"] = Row(lambda **x: chunk_simple_gla(x["q"], x["k"], x["v"], x["g"]), _fla("simple_gla"),
                         simple_gla_inputs, lambda **x: reference_simple_gla(x["q"], x["k"], x["v"], x["g"]))
ROWS["ssd"] = Row(lambda **x: chunk_ssd(x["x"], x["dt"], x["A"], x["B"], x["C"]), None, ssd_inputs,
                  lambda **x: reference_ssd(x["x"], x["dt"], x["A"], x["B"], x["C"]))
