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


# Per-stage timing of the GLA pipeline and launch alternatives for its own stages (GPU):
#   python -m ttr.scripts.bench_rows_gla_ssd [--op gla|simple_gla] [--shapes 4x4096,1x16384] [--sweep]
# A winning alternative goes into the heuristic defaults of kernels/common/intra_vector_gate.py.
GLA_SWEEP = {
    "vector_gate_scores": [dict(BK=bk, num_warps=nw, num_stages=ns) for bk in (32, 64) for nw in (2, 4, 8)
                           for ns in (1, 2, 3)],
    "vector_gate_intra_bwd": [dict(BK=bk, num_warps=nw, num_stages=ns) for bk in (32, 64) for nw in (4, 8)
                              for ns in (1, 2)],
    # the sequential state pass (two_level=False) against the two-level one's tiles
    "state_fwd": [dict(two_level=False)],
    "state_bwd": [dict(two_level=False)],
    "state_fwd_scan": [dict(BK=bk, BV=bv, num_warps=nw, num_stages=ns) for bk, bv in ((16, 32), (32, 32), (32, 64),
                       (64, 64)) for nw in (2, 4) for ns in (2, 4)],
    "state_bwd_scan": [dict(BK=bk, BV=bv, num_warps=4, num_stages=ns) for bk, bv in ((16, 32), (32, 32), (32, 64))
                       for ns in (2, 4)],
}


def gla_stage_calls(B, T, H=16, D=128, device="cuda"):
    """One closure per stage of chunk_gla's forward and backward, on bf16 inputs."""
    from ttr.kernels.common import intra_vector_gate as vg
    from ttr.kernels.common.cumsum import chunk_local_cumsum
    from ttr.kernels.common.index import prepare_chunks
    from ttr.kernels.common.state import state_bwd, state_fwd

    x = gla_inputs(B, T, H, D, torch.bfloat16, device)
    q, k, v, g = x["q"], x["k"], x["v"], x["g"]
    do, scale = torch.randn_like(v), D**-0.5
    plan = prepare_chunks(None, B, T, device=device)
    gk = chunk_local_cumsum(g, plan)
    h, _, _ = state_fwd(k, v, plan, gk=gk)
    A = vg.vector_gate_scores(q, k, gk, plan, scale=scale)
    dvi = vg.vector_gate_dv(A, do, plan)
    dh, _, _ = state_bwd(q, k, do, dvi, plan, scale=scale, gk=gk)
    dA = vg.vector_gate_dA(v, do, plan, scale=scale)
    dqi, dki = vg.vector_gate_intra_bwd(q, k, gk, dA, plan)
    return {
        "cumsum": lambda: chunk_local_cumsum(g, plan),
        "state_fwd": lambda: state_fwd(k, v, plan, gk=gk),
        "vector_gate_scores": lambda: vg.vector_gate_scores(q, k, gk, plan, scale=scale),
        "vector_gate_output": lambda: vg.vector_gate_output(q, v, gk, A, h, plan, scale=scale),
        "vector_gate_dv": lambda: vg.vector_gate_dv(A, do, plan),
        "state_bwd": lambda: state_bwd(q, k, do, dvi, plan, scale=scale, gk=gk),
        # the same calls again under the names of the two-level pass's scan tunings (for --sweep)
        "state_fwd_scan": lambda: state_fwd(k, v, plan, gk=gk),
        "state_bwd_scan": lambda: state_bwd(q, k, do, dvi, plan, scale=scale, gk=gk),
        "vector_gate_dA": lambda: vg.vector_gate_dA(v, do, plan, scale=scale),
        "vector_gate_intra_bwd": lambda: vg.vector_gate_intra_bwd(q, k, gk, dA, plan),
        "vector_gate_bwd_dqkg": lambda: vg.vector_gate_bwd_dqkg(q, k, v, gk, h, dh, do, dqi, dki, plan,
                                                                scale=scale),
    }


# the scalar-gate pipeline (simple GLA; SSD runs the same kernels): output-stage launch alternatives
SIMPLE_GLA_SWEEP = {
    # BK 32 left out: an illegal memory access on the H200 (Triton 3.6), not reproduced by the interpreter
    "output_bwd_dqk": [dict(BK=bk, num_warps=nw, num_stages=ns) for bk in (64, 128) for nw in (4, 8)
                       for ns in (1, 2, 3)],
    "output_fwd": [dict(BV=bv, num_warps=nw, num_stages=ns) for bv in (64, 128) for nw in (4, 8) for ns in (2, 3)],
    "output_bwd_dv": [dict(num_warps=nw, num_stages=ns) for nw in (2, 4, 8) for ns in (1, 2, 3)],
    "state_fwd": [dict(two_level=False), dict(two_level=True)],
    "state_bwd": [dict(two_level=False), dict(two_level=True)],
}


def simple_gla_stage_calls(B, T, H=16, D=128, device="cuda"):
    """One closure per stage of chunk_simple_gla's forward and backward, on bf16 inputs."""
    from ttr.kernels.common.cumsum import chunk_local_cumsum
    from ttr.kernels.common.index import prepare_chunks
    from ttr.kernels.common.output import output_bwd_dqk, output_bwd_dv, output_fwd
    from ttr.kernels.common.state import state_bwd, state_fwd

    x = simple_gla_inputs(B, T, H, D, torch.bfloat16, device)
    q, k, v, g = x["q"], x["k"], x["v"], x["g"]
    do, scale = torch.randn_like(v), D**-0.5
    plan = prepare_chunks(None, B, T, device=device)
    gc = chunk_local_cumsum(g, plan)
    h, _, _ = state_fwd(k, v, plan, g=gc)
    dvi = output_bwd_dv(q, k, do, plan, scale=scale, g=gc)
    dh, _, _ = state_bwd(q, k, do, dvi, plan, scale=scale, g=gc)
    return {
        "cumsum": lambda: chunk_local_cumsum(g, plan),
        "state_fwd": lambda: state_fwd(k, v, plan, g=gc),
        "output_fwd": lambda: output_fwd(q, k, v, h, plan, scale=scale, g=gc),
        "output_bwd_dv": lambda: output_bwd_dv(q, k, do, plan, scale=scale, g=gc),
        "state_bwd": lambda: state_bwd(q, k, do, dvi, plan, scale=scale, g=gc),
        "output_bwd_dqk": lambda: output_bwd_dqk(q, k, v, h, dh, do, plan, scale=scale, g=gc),
        "cumsum_reverse": lambda: chunk_local_cumsum(gc, plan, reverse=True),
    }


def main(argv=None) -> int:
    import argparse
    import sys

    from ttr.scripts.bench_utils import time_stages

    parser = argparse.ArgumentParser(description="per-stage ms of chunk_gla / chunk_simple_gla (bf16, H=16, K=V=128)")
    parser.add_argument("--shapes", default="4x4096,1x16384", help="comma-separated BxT")
    parser.add_argument("--op", choices=("gla", "simple_gla"), default="gla")
    parser.add_argument("--sweep", action="store_true", help="also time the launch alternatives")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    for shape in args.shapes.split(","):
        B, T = (int(s) for s in shape.split("x"))
        calls, sweep = (gla_stage_calls, GLA_SWEEP) if args.op == "gla" else (simple_gla_stage_calls, SIMPLE_GLA_SWEEP)
        time_stages(calls(B, T), f"{args.op} {B}x{T}", sweep if args.sweep else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
