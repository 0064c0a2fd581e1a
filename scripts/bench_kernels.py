"""Kernel benchmark: ttr next to fla 0.6.0 or SDPA, forward and forward+backward (GPU).

One process, bf16, 16384 tokens per batch (B x T with T in 2048 ... 16384), median ms of
``triton.testing.do_bench``, timed for ttr and the reference in turn ``--rounds`` times (default 3)
and reported as each one's median. Each row times ttr's op and its reference on the same inputs, and gives
the peak memory of one forward+backward of each (MiB above the inputs), the worst relative RMS error
of ttr against the reference over the output and every input gradient at the benchmark's shape,
and ttr's worst relative RMS error against the float64 per-token oracle at a small size (B = 1,
T = 1024, at most 4 heads).

Ops and their references: ``gated_delta``, ``delta`` (fla ``chunk_gated_delta_rule`` /
``chunk_delta_rule``), ``gla`` (fla ``chunk_gla``), ``simple_gla`` (fla ``chunk_simple_gla``),
``ssd`` (ttr's Mamba2 input form, against fla ``chunk_simple_gla`` on the same inputs mapped as
Mamba2 does: B and C expanded over the heads of their group, v = x dt, g = A dt, scale 1; the
map is done beforehand, so the reference's time is fla's kernel alone),
``swa`` (ttr's attention with a window, against SDPA with a boolean band mask) and ``attn`` (full
causal, against SDPA's flash backend). Gates as in fla's own benchmarks: ``logsigmoid(x) / 16`` per
key dimension for GLA, ``logsigmoid(x)`` per head otherwise.

Shapes (``--shapes``): ``preset`` (default) derives each op's shape from the model presets
(``--presets``, default every 1.3B preset) through the mixer each block runs (``LAYER_OPS``), plus
the ``VARIANTS`` (Mamba2 with N = 64 in 8 groups); ``uniform`` runs every op at H = 16, K = V = 128;
``all`` both.

Usage: ``ttr bench [--shapes preset] [--ops delta,ssd] [--seqlens 2048,4096] [--json OUT.json]``;
``--dry-run`` lists the rows without running them (no GPU needed). ``--lift-fla-guard`` lets fla run
its gated backward on Hopper with Triton < 3.7.1 (fla issue #640; timing only, and the table says
so); without it those fla cells are empty there.
Each row gives both sides' fwd+bwd twice: ``do_bench``'s median, which measures from the first
launch (so a call whose host time exceeds its kernel time is timed as the host), and the GPU's
own time (``_gpu_fwd_bwd``: the calls queued behind a GPU sleep), with a ratio for each.
``--profile`` prints instead the CUDA kernels of ttr's fwd+bwd per planned row (``torch.profiler``,
ms per iteration) and the host time of one call, then its reference's on the same inputs
(``--no-reference``: ttr's alone; ``--no-fla``: SDPA's only), so the two can be compared kernel
by kernel.
``--stages`` times each engine stage of ``gated_delta``, ``delta``, ``gla`` or ``simple_gla`` (SSD
runs simple GLA's kernels) and with ``--sweep`` the launch alternatives of ``SWEEPS``, fastest
first: a winner becomes the stage's default in ``kernels/common`` (``ttr.scripts.bench_stages``).
``--chunk-states auto,keep`` times ttr's op of each planned row under each ``TTR_CHUNK_STATES``
choice in turn, with the memory the forward holds for the backward under each: what keeping the
states costs and saves (``bench_stages.chunk_states_table``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F

TOKENS = 16384
HEADS = 16
HEAD_DIM = 128
SEQLENS = (2048, 4096, 8192, 16384)
ORACLE_T = 1024
# mamba_ssm's Mamba2 (and Hugging Face's) default chunk size
MAMBA_SSM_CHUNK = 256
SSD_REFERENCES = ("fla", "mamba_ssm")
SIZE = "1.3b"
SHAPE_SETS = ("preset", "uniform", "all")


@dataclass(frozen=True)
class Shape:
    """One op at one head layout. ``K`` is the key dim (SSD: the state size N; attention: the head
    dim), ``V`` the value dim (SSD: the head dim P). ``groups`` (None: none) is G sets of keys each
    shared by H / G heads: SSD's B/C groups, attention's key/value heads. ``presets`` names the
    presets that run it."""

    op: str
    H: int
    K: int
    V: int
    groups: int | None = None
    window: int | None = None
    presets: tuple[str, ...] = ()

    def label(self) -> str:
        if self.op == "ssd":
            return f"H={self.H} P={self.V} N={self.K} G={self.groups}"
        if self.op in ("swa", "attn"):
            kv = f" KV={self.groups}" if self.groups not in (None, self.H) else ""
            return f"H={self.H}{kv} D={self.K}" + (f" W={self.window}" if self.window else "")
        return f"H={self.H} K={self.K} V={self.V}"

    def small(self) -> Shape:
        """The oracle's shape: at most 4 heads (or one per group), the same dims and window."""
        group = self.H // self.groups if self.groups else 1
        heads = max(min(self.H, 4) // group, 1) * group
        return replace(self, H=heads, groups=heads // group if self.groups else None)


def _kv_heads(c) -> int | None:
    return None if c.attn_num_kv_heads == c.attn_num_heads else c.attn_num_kv_heads


# the kernel op each mixer runs, at the shape a config gives it
LAYER_OPS = {
    "gated_deltanet": lambda c: Shape("gated_delta", c.num_heads, c.head_dim, c.value_head_dim),
    "delta_net": lambda c: Shape("delta", c.num_heads, c.head_dim, c.value_head_dim),
    "gla": lambda c: Shape("gla", c.num_heads, c.head_dim, c.value_head_dim),
    "mamba2": lambda c: Shape("ssd", c.mamba_num_heads, c.mamba_state_size, c.mamba_head_dim,
                              groups=c.mamba_n_groups),
    "swa": lambda c: Shape("swa", c.attn_num_heads, c.attn_head_dim, c.attn_head_dim, groups=_kv_heads(c),
                           window=c.window_size),
    "attn": lambda c: Shape("attn", c.attn_num_heads, c.attn_head_dim, c.attn_head_dim, groups=_kv_heads(c)),
}

# more settings of one mixer, measured next to the presets' own: Mamba2 with the state size and
# groups of the Mamba-2 paper's smaller models
VARIANTS = {"mamba2": [dict(mamba_state_size=64, mamba_n_groups=8)]}


def default_presets() -> list[str]:
    from ttr.models.presets import list_presets

    return [p for p in list_presets() if p.endswith(f"-{SIZE}")]


def preset_shapes(presets: list[str] | None = None) -> list[Shape]:
    """Every distinct op shape the blocks of ``presets`` run (and the ``VARIANTS``), in the order of
    ``rows()``; each lists the presets that run it."""
    from ttr.models.presets import get_preset

    found: dict[Shape, list[str]] = {}
    for name in presets or default_presets():
        config = get_preset(name)
        layer_types = list(dict.fromkeys(config.layer_types))
        unknown = [t for t in layer_types if t not in LAYER_OPS]
        if unknown:
            raise ValueError(f"preset {name}: no kernel shape known for layer types {unknown} (see LAYER_OPS)")
        runs = [(LAYER_OPS[t](config), name) for t in layer_types]
        for t in layer_types:
            for overrides in VARIANTS.get(t, []):
                tag = ", ".join(f"{k}={v}" for k, v in overrides.items())
                runs.append((LAYER_OPS[t](get_preset(name, **overrides)), f"{name} with {tag}"))
        for shape, tag in runs:
            found.setdefault(shape, []).append(tag)
    order = list(rows())
    shapes = [replace(s, presets=tuple(tags)) for s, tags in found.items()]
    return sorted(shapes, key=lambda s: order.index(s.op))


def uniform_shape(op: str) -> Shape:
    """``op`` at H = HEADS, K = V = HEAD_DIM (SSD: one group; SWA: the presets' window)."""
    from ttr.models.configuration import TTRConfig

    return Shape(op, HEADS, HEAD_DIM, HEAD_DIM, groups=1 if op == "ssd" else None,
                 window=TTRConfig().window_size if op == "swa" else None)


@dataclass
class Row:
    ttr: Callable  # (**inputs) -> output tensor
    reference: Callable | None  # same call convention, or None
    reference_name: str
    make_inputs: Callable  # (B, T, shape, dtype, device) -> dict of inputs
    oracle: Callable  # float64 oracle, same call convention


def _qk(B, T, s: Shape, dtype, device):
    return {"q": torch.randn(B, T, s.H, s.K, device=device, dtype=dtype),
            "k": torch.randn(B, T, s.H, s.K, device=device, dtype=dtype),
            "v": torch.randn(B, T, s.H, s.V, device=device, dtype=dtype)}


def delta_inputs(gated: bool):
    def make(B, T, s, dtype, device):
        x = {**_qk(B, T, s, dtype, device), "beta": torch.rand(B, T, s.H, device=device).to(dtype)}
        x["k"] = F.normalize(x["k"].float(), dim=-1).to(dtype)
        if gated:
            x["g"] = F.logsigmoid(torch.randn(B, T, s.H, device=device) + 2.0)
        return x
    return make


def gla_inputs(B, T, s, dtype, device):
    return {**_qk(B, T, s, dtype, device), "g": F.logsigmoid(torch.randn(B, T, s.H, s.K, device=device)) / 16}


def simple_gla_inputs(B, T, s, dtype, device):
    return {**_qk(B, T, s, dtype, device), "g": F.logsigmoid(torch.randn(B, T, s.H, device=device))}


def ssd_native_inputs(B, T, s, dtype, device):
    """Mamba2's inputs (x, dt, A, B, C), as ttr's op and mamba_ssm's kernel take them."""
    return {
        "x": torch.randn(B, T, s.H, s.V, device=device, dtype=dtype),
        "dt": F.softplus(torch.randn(B, T, s.H, device=device) - 3.0),
        "A": -torch.rand(s.H, device=device).mul(15).add(1),
        "B": (torch.randn(B, T, s.groups, s.K, device=device) * s.K**-0.5).to(dtype),
        "C": torch.randn(B, T, s.groups, s.K, device=device, dtype=dtype),
    }


def ssd_inputs(B, T, s, dtype, device):
    """Mamba2's inputs for ttr's op, and the same math as simple GLA's ``q, k, v, g`` (B and C
    expanded over the heads, ``v = x dt``, ``g = A dt``) as inputs of their own for fla's op: the
    reference is timed as its kernel alone, not with the torch ops that map the inputs onto it."""
    from ttr.kernels.ssd.reference import ssd_as_simple_gla

    x = ssd_native_inputs(B, T, s, dtype, device)
    mapped = ssd_as_simple_gla(x["x"], x["dt"], x["A"], x["B"], x["C"])
    # copies: with one head per group q and k would be C and B themselves, one leaf in two roles
    return {**x, **{n: t.clone(memory_format=torch.contiguous_format) for n, t in zip(("q", "k", "v", "g"), mapped)}}


def _mamba_ssm(**x):
    """The authors' SSD kernel (mamba_ssm's ``mamba_chunk_scan_combined``, imported at the first call:
    not a dependency), at the chunk size its Mamba2 models run."""
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    return mamba_chunk_scan_combined(x["x"], x["dt"], x["A"], x["B"], x["C"], chunk_size=MAMBA_SSM_CHUNK)


def attention_inputs(B, T, s, dtype, device):
    from ttr.kernels.attention.reference import band_mask

    kv = s.groups or s.H
    x = {"q": torch.randn(B, T, s.H, s.K, device=device, dtype=dtype),
         "k": torch.randn(B, T, kv, s.K, device=device, dtype=dtype),
         "v": torch.randn(B, T, kv, s.K, device=device, dtype=dtype), "window": s.window}
    if s.window is not None:  # SDPA's mask, built once outside the timing
        x["mask"] = band_mask(T, s.window, device)
    return x


def _fla(name: str):
    """fla 0.6.0's op of row ``name``, imported at the first call (fla is not a dependency)."""
    def call(**x):
        if name == "delta":
            from fla.ops.delta_rule import chunk_delta_rule
            return chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"])[0]
        if name == "gated_delta":
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
            return chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"])[0]
        if name == "gla":
            from fla.ops.gla import chunk_gla
            return chunk_gla(x["q"], x["k"], x["v"], x["g"])[0]
        from fla.ops.simple_gla import chunk_simple_gla
        if name == "ssd":
            return chunk_simple_gla(x["q"], x["k"], x["v"], x["g"], scale=1.0)[0]
        return chunk_simple_gla(x["q"], x["k"], x["v"], x["g"])[0]
    return call


def _sdpa(**x):
    q, k, v = (x[n].transpose(1, 2) for n in ("q", "k", "v"))
    gqa = q.shape[1] != k.shape[1]
    if x["window"] is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=x["mask"], enable_gqa=gqa)
    return o.transpose(1, 2)


def rows(ssd_reference: str = "fla") -> dict[str, Row]:
    """Every op of the table, in its order; ``ssd_reference`` picks the ``ssd`` rows' reference
    (``SSD_REFERENCES``)."""
    from ttr.kernels.attention import attention, reference_attention
    from ttr.kernels.delta import chunk_delta_rule, reference_delta_rule
    from ttr.kernels.gated_delta import chunk_gated_delta_rule, reference_gated_delta_rule
    from ttr.kernels.gla import chunk_gla, reference_gla
    from ttr.kernels.ssd import chunk_simple_gla, chunk_ssd, reference_simple_gla, reference_ssd

    qkvg = lambda fn: lambda **x: fn(x["q"], x["k"], x["v"], x["g"])[0]  # noqa: E731
    qkvb = lambda fn: lambda **x: fn(x["q"], x["k"], x["v"], x["beta"])[0]  # noqa: E731
    qkvgb = lambda fn: lambda **x: fn(x["q"], x["k"], x["v"], x["g"], x["beta"])[0]  # noqa: E731
    ssd = lambda fn: lambda **x: fn(x["x"], x["dt"], x["A"], x["B"], x["C"])[0]  # noqa: E731
    attn = lambda fn: lambda **x: fn(x["q"], x["k"], x["v"], window=x["window"])  # noqa: E731
    return {
        "gated_delta": Row(qkvgb(chunk_gated_delta_rule), _fla("gated_delta"), "fla chunk_gated_delta_rule",
                           delta_inputs(True), qkvgb(reference_gated_delta_rule)),
        "delta": Row(qkvb(chunk_delta_rule), _fla("delta"), "fla chunk_delta_rule", delta_inputs(False),
                     qkvb(reference_delta_rule)),
        "gla": Row(qkvg(chunk_gla), _fla("gla"), "fla chunk_gla", gla_inputs, qkvg(reference_gla)),
        "simple_gla": Row(qkvg(chunk_simple_gla), _fla("simple_gla"), "fla chunk_simple_gla", simple_gla_inputs,
                          qkvg(reference_simple_gla)),
        "ssd": Row(ssd(chunk_ssd), _fla("ssd"), "fla chunk_simple_gla (B, C expanded beforehand)", ssd_inputs,
                   ssd(reference_ssd)) if ssd_reference == "fla" else
        Row(ssd(chunk_ssd), _mamba_ssm, f"mamba_ssm mamba_chunk_scan_combined (chunk {MAMBA_SSM_CHUNK})",
            ssd_native_inputs, ssd(reference_ssd)),
        "swa": Row(attn(attention), _sdpa, "SDPA, band mask", attention_inputs, attn(reference_attention)),
        "attn": Row(attn(attention), _sdpa, "SDPA, is_causal", attention_inputs, attn(reference_attention)),
    }


def _leaves(x: dict) -> list[torch.Tensor]:
    return [t for t in x.values() if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _inputs(row: Row, B: int, T: int, s: Shape, device, dtype=torch.bfloat16) -> tuple[dict, torch.Tensor]:
    """Inputs that require grad, and an output gradient."""
    x = row.make_inputs(B, T, s, dtype, device)
    for t in _leaves(x):
        t.requires_grad_(True)
    return x, torch.randn(B, T, s.H, s.V, device=device, dtype=dtype)


def _bench(fn, x, do, backward: bool, device) -> float:
    leaves = _leaves(x)

    def step():
        if not backward:
            with torch.no_grad():
                return fn(**x)
        fn(**x).backward(do)

    if device.type != "cuda":  # a CPU smoke run: the code path, not a measurement
        from ttr.scripts.bench_utils import time_ms

        def reset_and_step():
            for t in leaves:
                t.grad = None
            step()
        return time_ms(reset_and_step, reps=2, warmup=1, device=device)
    from triton.testing import do_bench

    return do_bench(step, warmup=25, rep=100, grad_to_none=leaves if backward else None, return_mode="median")


def _fwd_bwd_step(fn, x, do) -> Callable[[], None]:
    """One forward+backward of ``fn`` on ``x``, the inputs' gradients cleared first."""
    leaves = _leaves(x)

    def step():
        for t in leaves:
            t.grad = None
        fn(**x).backward(do)
    return step


def _gpu_fwd_bwd(fn, x, do) -> float:
    """ms of the GPU's own work per fwd+bwd (``bench_utils.gpu_ms``): ``do_bench`` times from the
    first launch, so where launching takes the host longer than the kernels take the GPU it times
    the host; this times the kernels alone."""
    from ttr.scripts.bench_utils import gpu_ms

    return gpu_ms(_fwd_bwd_step(fn, x, do))


def _peak(fn, x, do) -> float | None:
    """MiB one fwd+bwd allocates above its inputs, the gradients it writes included: the previous
    call's gradients are freed before the baseline is read, not inside the measured step."""
    from ttr.scripts.bench_utils import peak_mib

    for t in _leaves(x):
        t.grad = None
    return peak_mib(_fwd_bwd_step(fn, x, do))


def _outputs(fn, x, do) -> list[torch.Tensor | None]:
    """The output and every input gradient of one forward+backward."""
    leaves = _leaves(x)
    for t in leaves:
        t.grad = None
    o = fn(**x)
    o.backward(do.to(o.dtype))
    return [o.detach()] + [None if t.grad is None else t.grad.clone() for t in leaves]


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item() if torch.isfinite(a).all() else float("inf")


def max_rel_error(first: list, second: list) -> float:
    """Worst relative RMS error of ``first`` against ``second``, tensor by tensor."""
    return max(_rel(a, b) for a, b in zip(first, second) if a is not None and b is not None)


def oracle_error(row: Row, s: Shape, device) -> float:
    """Worst relative RMS error of the output and every gradient, bf16 ttr vs the float64 oracle."""
    small = s.small()
    # a window shorter than the sequence, so that the band is what is checked
    x, do = _inputs(row, 1, max(ORACLE_T, 2 * (s.window or 0)), small, device)
    leaves = {id(t) for t in _leaves(x)}
    x64 = {n: t.detach().double().requires_grad_(True) if id(t) in leaves else t for n, t in x.items()}
    return max_rel_error(_outputs(row.ttr, x, do), _outputs(row.oracle, x64, do.double()))


def plan(shape_set: str, ops: list[str] | None, presets: list[str] | None, seqlens: list[int],
         tokens: int) -> list[tuple[Shape, int, int]]:
    """The rows to run: ``(shape, B, T)``."""
    shapes = []
    if shape_set in ("preset", "all"):
        shapes += [s for s in preset_shapes(presets) if ops is None or s.op in ops]
    if shape_set in ("uniform", "all"):
        shapes += [uniform_shape(op) for op in ops or rows()]
    return [(s, max(1, tokens // T), T) for s in shapes for T in seqlens]


def _reference_wanted(row: Row, references: str) -> bool:
    """Whether ``row``'s reference runs under ``references``: "all", "sdpa" (those that are not
    fla's) or "none"."""
    if row.reference is None:
        return False
    return references == "all" or (references == "sdpa" and not row.reference_name.startswith("fla"))


def measure(row: Row, s: Shape, B: int, T: int, device, references: str = "all", rounds: int = 1) -> dict:
    """One row: times, peak memory and errors of ttr and its reference (``references``: "all",
    "sdpa" for the SDPA ones only, "none"); a failing reference leaves its cells empty and its error
    in ``errors``. With ``rounds`` > 1 both are timed again in turn, ttr then the reference, that many
    times in all, and each time is the median of its rounds (``*_rounds_ms`` keeps them): a drift of
    the GPU's clocks or of the host's load during the row then reaches both sides alike, where one
    pass per side would put all of it on whichever ran in it. The turns are between two sides, so a
    row without a reference (none wanted, or it failed) is timed once."""
    r = {"op": s.op, "shape": s.label(), **asdict(s), "B": B, "T": T, "reference": row.reference_name,
         "errors": {}}
    x, do = _inputs(row, B, T, s, device)
    impls = [("ttr", row.ttr)] + ([("ref", row.reference)] if _reference_wanted(row, references) else [])
    outputs, times = {}, {}

    from ttr.scripts.bench_utils import error_text

    def fail(label, e):  # a failing reference must not hide ttr's numbers, nor ttr's the reference's
        r["errors"][label] = error_text(e)
        print(f"{s.op} {s.label()} {label} B={B} T={T}: {r['errors'][label]}", file=sys.stderr, flush=True)

    def time_both(label, fn, x, do):
        times.setdefault(label, ([], [], []))
        times[label][0].append(_bench(fn, x, do, False, device))
        times[label][1].append(_bench(fn, x, do, True, device))
        if device.type == "cuda":
            times[label][2].append(_gpu_fwd_bwd(fn, x, do))

    for label, fn in impls:
        try:
            time_both(label, fn, x, do)
            r[f"{label}_peak_mib"] = _peak(fn, x, do)
            outputs[label] = _outputs(fn, x, do)
        except Exception as e:
            fail(label, e)
            times.pop(label, None)
    for _ in range(rounds - 1 if len(times) == 2 else 0):
        for label, fn in impls:
            if label in times:
                try:
                    time_both(label, fn, x, do)
                except Exception as e:
                    fail(label, e)
                    times.pop(label)
    for label, (fwd, fwd_bwd, gpu) in times.items():
        r[f"{label}_fwd_ms"], r[f"{label}_fwd_bwd_ms"] = statistics.median(fwd), statistics.median(fwd_bwd)
        if gpu:
            r[f"{label}_gpu_fwd_bwd_ms"] = statistics.median(gpu)
        if len(fwd) > 1:
            r[f"{label}_fwd_rounds_ms"], r[f"{label}_fwd_bwd_rounds_ms"] = fwd, fwd_bwd
            if gpu:
                r[f"{label}_gpu_fwd_bwd_rounds_ms"] = gpu
    if len(outputs) == 2:
        r["rel_err_vs_ref"] = max_rel_error(outputs["ttr"], outputs["ref"])
    del outputs, x, do
    return r


# (header, key, format); a key ``a/b`` is the ratio of two times
COLUMNS = [("ttr fwd", "ttr_fwd_ms", ".3f"), ("ref fwd", "ref_fwd_ms", ".3f"),
           ("ttr fwd+bwd", "ttr_fwd_bwd_ms", ".3f"), ("ref fwd+bwd", "ref_fwd_bwd_ms", ".3f"),
           ("ttr / ref", "ttr_fwd_bwd_ms/ref_fwd_bwd_ms", ".2f"),
           ("ttr GPU fwd+bwd", "ttr_gpu_fwd_bwd_ms", ".3f"), ("ref GPU fwd+bwd", "ref_gpu_fwd_bwd_ms", ".3f"),
           ("GPU ttr / ref", "ttr_gpu_fwd_bwd_ms/ref_gpu_fwd_bwd_ms", ".2f"),
           ("ttr MiB", "ttr_peak_mib", ".0f"), ("ref MiB", "ref_peak_mib", ".0f"),
           ("err vs ref", "rel_err_vs_ref", ".1e"), ("err vs oracle", "oracle_rel_err", ".1e")]


def _cell(r: dict, key: str, fmt: str) -> str:
    num, _, den = key.partition("/")
    value = r.get(num) if not den else (r[num] / r[den] if r.get(num) and r.get(den) else None)
    return "" if value is None else format(value, fmt)


def format_row(r: dict) -> str:
    if r.get("skipped"):
        return f"| {r['op']} | {r['reference']} | {r['shape']} | {r['B']} x {r['T']} | {r['skipped']} |"
    cells = [_cell(r, key, fmt) for _, key, fmt in COLUMNS]
    return f"| {r['op']} | {r['reference']} | {r['shape']} | {r['B']} x {r['T']} | " + " | ".join(cells) + " |"


def run(todo: list[tuple[Shape, int, int]], device=None, references: str = "all", oracle: bool = True,
        fla_note: str | None = None, budget: float | None = None, write: Callable | None = None,
        rounds: int = 1, ssd_reference: str = "fla") -> tuple[str, dict]:
    """The markdown table and its JSON of ``todo`` (from ``plan``); rows not started within ``budget``
    seconds are listed as skipped. ``write(table, data)`` gets both after every row; ``rounds`` as in
    ``measure``, ``ssd_reference`` as in ``rows``."""
    from ttr.scripts.bench_utils import Deadline, describe_environment, environment

    device = torch.device(device or "cuda")
    env = environment(device)
    deadline = Deadline(budget)
    table = rows(ssd_reference)
    timing = (f"median ms (do_bench, from the first launch; GPU: the kernels alone, queued behind a GPU sleep)"
              f"{f', the median of {rounds} rounds in turn' if rounds > 1 else ''}"
              if device.type == "cuda" else "CPU: code paths only, the times measure nothing")
    header = [
        f"{describe_environment(env)}; bf16, {timing}; peak MiB of one fwd+bwd above its inputs; "
        f"errors: worst relative RMS error over the output and every input gradient, ttr against the reference "
        f"at the row's shape, and against the float64 oracle (B=1, T={ORACLE_T} or twice the window, at most 4 "
        "heads)",
        "",
        "| op | reference | shape | B x T | " + " | ".join(c for c, _, _ in COLUMNS) + " |",
        "|" + "---|" * (4 + len(COLUMNS)),
    ]
    footer = []
    runs_by = {(s.op, s.label()): s.presets for s, _, _ in todo}
    if any(runs_by.values()):
        footer += ["", "Shapes and the presets that run them:"]
        footer += [f"- {op} {label}: {', '.join(p)}" for (op, label), p in runs_by.items() if p]
    if fla_note:
        footer += ["", fla_note]
    print("\n".join(header), flush=True)
    results, oracle_errors = [], {}

    def report() -> tuple[str, dict]:
        return "\n".join(header + [format_row(r) for r in results] + footer), \
            {"environment": env, "fla_note": fla_note, "rows": results}

    for s, B, T in todo:
        row = table[s.op]
        if deadline.expired():
            r = {"op": s.op, "shape": s.label(), **asdict(s), "B": B, "T": T, "reference": row.reference_name,
                 "skipped": "not run: time budget spent"}
        else:
            r = measure(row, s, B, T, device, references, rounds)
            key = replace(s, presets=())
            if oracle and key not in oracle_errors:
                try:
                    oracle_errors[key] = oracle_error(row, s, device)
                except Exception as e:  # reported in the row; the timings stand
                    oracle_errors[key] = None
                    r["errors"]["oracle"] = f"{type(e).__name__}: {e}"[:300]
            r["oracle_rel_err"] = oracle_errors.get(key)
        results.append(r)
        print(format_row(r), flush=True)
        if write is not None:
            write(*report())
    return report()


def _profile_row(fn, x: dict, do: torch.Tensor, device, iters: int) -> tuple[float, float, list]:
    """(kernel ms per fwd+bwd, host ms per call, [(kernel name, launches per call, ms per call)]) of
    ``fn`` (a row's ``ttr`` or ``reference``) on inputs ``x`` (``_inputs``) and output gradient ``do``."""
    import time

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from ttr.scripts.bench_utils import kernel_times

    step = _fwd_bwd_step(fn, x, do)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):  # not synchronised: the host runs ahead of the GPU as long as it can
        step()
    host = (time.perf_counter() - t0) / iters * 1e3
    sync()
    with torch_profile(activities=[ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]) as p:
        for _ in range(iters):
            step()
        sync()
    kernels = kernel_times(p, iters)
    return sum(k[2] for k in kernels), host, kernels


def profile(todo: list[tuple[Shape, int, int]], device=None, iters: int = 10, references: str = "none",
            ssd_reference: str = "fla") -> str:
    """Per-kernel GPU time (ms per fwd+bwd) and host ms per call of ttr's rows ``todo`` (``plan``) and
    of each row's reference on the same inputs (``references`` as ``measure`` takes it: "all", "sdpa"
    or "none"), as markdown. A reference that fails leaves its error in its block's place."""
    from ttr.scripts.bench_utils import error_text

    device = torch.device(device or "cuda")
    table = rows(ssd_reference)
    lines = []
    for s, B, T in todo:
        row = table[s.op]
        sides = [("ttr", row.ttr)] + ([(row.reference_name, row.reference)] if _reference_wanted(row, references)
                                      else [])
        x, do = _inputs(row, B, T, s, device)
        for name, fn in sides:
            title = f"{s.op} {s.label()} {B} x {T}" + ("" if name == "ttr" else f", {name}")
            try:
                total, host, kernels = _profile_row(fn, x, do, device, iters)
            except Exception as e:  # a reference that does not run here: its error, ttr's block stands
                if name == "ttr":
                    raise
                block = [f"{title}: {error_text(e)}", ""]
            else:
                block = [f"{title}: kernels {total:.3f} ms per fwd+bwd, host {host:.3f} ms per call", "",
                         "| kernel | launches per call | ms per call |", "|---|---|---|"]
                block += [f"| {k[:60]} | {n:g} | {ms:.3f} |" for k, n, ms in kernels] + [""]
            print("\n".join(block), flush=True)
            lines += block
    return "\n".join(lines)


def parse_selection(parser, ops: str | None, presets: str | None, allowed: list[str]):
    """``--ops`` and ``--presets`` as lists (None: all of them); an unknown name is a parser error
    that names the flag."""
    from ttr.models.presets import list_presets

    chosen = []
    for flag, value, known in (("--ops", ops, allowed), ("--presets", presets, None)):
        names = value.split(",") if value else None
        known = known if known is not None else list_presets()
        bad = [n for n in names or [] if n not in known]
        if bad:
            parser.error(f"{flag}: unknown {bad}; expected some of {known}")
        chosen.append(names)
    return tuple(chosen)


def main(argv: list[str] | None = None) -> int:
    from ttr.scripts.bench_stages import STAGE_CALLS, chunk_states_table, profile_stages, sweep_stages
    from ttr.scripts.bench_utils import (
        LIFT_FLA_GUARD_HELP,
        chunk_state_choices,
        environment,
        fla_guard_note,
        lift_fla_guard,
    )

    names = list(rows())
    parser = argparse.ArgumentParser(prog="ttr bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="preset", choices=SHAPE_SETS,
                        help="preset: the shapes the presets run (default); uniform: H=16, K=V=128; all: both")
    parser.add_argument("--presets", default=None,
                        help=f"comma-separated presets whose shapes to run (default: every {SIZE} preset)")
    parser.add_argument("--ops", default=None, help=f"comma-separated ops (default: all of {','.join(names)})")
    parser.add_argument("--seqlens", default=",".join(map(str, SEQLENS)))
    parser.add_argument("--tokens", type=int, default=TOKENS, help="tokens per batch (B = tokens // T)")
    parser.add_argument("--no-fla", action="store_true",
                        help="skip the fla references (SDPA's and mamba_ssm's still run)")
    parser.add_argument("--ssd-reference", default="fla", choices=SSD_REFERENCES,
                        help="the ssd rows' reference: fla's chunk_simple_gla on the mapped inputs (default), or "
                             "the authors' kernel, mamba_ssm's mamba_chunk_scan_combined (its Triton sources "
                             "importable as mamba_ssm.ops.triton)")
    parser.add_argument("--no-reference", action="store_true", help="skip every reference (fla, mamba_ssm and SDPA)")
    parser.add_argument("--no-oracle", action="store_true", help="skip the error against the float64 oracle")
    parser.add_argument("--lift-fla-guard", action="store_true", help=LIFT_FLA_GUARD_HELP)
    parser.add_argument("--rounds", type=int, default=3,
                        help="time ttr and the reference in turn this many times per row and report each one's "
                             "median (default 3)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds; rows not started by then are listed as skipped")
    parser.add_argument("--device", default="cuda", help="cuda; cpu runs the code paths only (no measurement)")
    parser.add_argument("--dry-run", action="store_true", help="list the rows and exit")
    parser.add_argument("--out", default=None, help="also write the table to this file")
    parser.add_argument("--json", default=None, help="also write the rows and the environment to this JSON file")
    parser.add_argument("--stages", action="store_true",
                        help=f"time each engine stage instead ({', '.join(STAGE_CALLS)})")
    parser.add_argument("--sweep", nargs="?", const="all", default=None, metavar="STAGES",
                        help="with --stages: also time launch alternatives (of every stage, or of the "
                             "comma-separated STAGES only)")
    parser.add_argument("--sweep-top", type=int, default=5, metavar="N",
                        help="with --sweep: list the N fastest alternatives of each stage (0: all of them)")
    parser.add_argument("--chunk-states", default=None, metavar="CHOICES",
                        help="time ttr's ops under each TTR_CHUNK_STATES choice (comma-separated, of auto, keep, "
                             "recompute) in turn on one set of inputs, --rounds times, with the memory each holds "
                             "for the backward")
    parser.add_argument("--profile", action="store_true",
                        help="per-kernel GPU time and host time of ttr's rows and of their references "
                             "(--no-reference: ttr's alone, --no-fla: SDPA's only)")
    args = parser.parse_args(argv)
    allowed = list(STAGE_CALLS) if args.stages else names
    ops, presets = parse_selection(parser, args.ops, args.presets, allowed)
    sweep = sweep_stages(parser, args.sweep, ops or allowed) if args.stages else None
    try:
        seqlens = [int(t) for t in args.seqlens.split(",")]
    except ValueError:
        parser.error(f"--seqlens: expected comma-separated integers, got {args.seqlens!r}")
    if any(t < 1 for t in seqlens) or args.tokens < 1:
        parser.error("--seqlens and --tokens must be positive")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.sweep_top < 0:
        parser.error(f"--sweep-top must be 0 (all) or more, got {args.sweep_top}")
    choices = chunk_state_choices(parser, args.chunk_states)
    if choices and (args.stages or args.profile):
        parser.error("--chunk-states times the whole op: not with --stages or --profile")
    todo = plan(args.shapes, ops, presets, seqlens, args.tokens)
    if not todo and not args.stages:
        parser.error(f"--ops {args.ops}: no preset runs them (--shapes uniform runs every op)")
    if args.dry_run:
        reference_names = {op: row.reference_name for op, row in rows(args.ssd_reference).items()}
        for s, B, T in todo:
            print(f"{s.op} {s.label()} {B} x {T}: {reference_names[s.op]}; {', '.join(s.presets) or args.shapes}")
        return 0
    if (args.ssd_reference == "mamba_ssm" and not args.no_reference and not args.stages and not args.profile
            and any(s.op == "ssd" for s, _, _ in todo)):
        try:
            import mamba_ssm.ops.triton.ssd_combined  # noqa: F401
        except ImportError as e:
            parser.error(f"--ssd-reference mamba_ssm: mamba_ssm.ops.triton.ssd_combined does not import ({e})")
    device = torch.device(args.device)
    if (args.stages or args.profile) and device.type != "cuda":
        parser.error(f"--{'stages' if args.stages else 'profile'} times CUDA kernels: it needs --device cuda, "
                     f"not {args.device}")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("ttr bench needs a CUDA GPU (--dry-run lists the rows; --device cpu runs the code paths)",
              file=sys.stderr)
        return 2
    data = None
    references = "none" if args.no_reference else "sdpa" if args.no_fla else "all"
    if choices:
        table, found = chunk_states_table(todo, choices, device, rounds=args.rounds)
        data = {"environment": environment(device), "rounds": args.rounds, "chunk_states": found}
    elif args.stages:
        table = profile_stages(ops or allowed, [(max(1, args.tokens // t), t) for t in seqlens],
                               sweep, top=args.sweep_top)
    elif args.profile:
        if args.lift_fla_guard and references == "all":
            lift_fla_guard()
        table = profile(todo, references=references, ssd_reference=args.ssd_reference)
    else:
        lifted = args.lift_fla_guard and references == "all" and lift_fla_guard() is not None
        note = fla_guard_note(lifted) if references == "all" else None
        settings = {"shapes": args.shapes, "tokens": args.tokens, "rounds": args.rounds,
                    "ssd_reference": args.ssd_reference}
        table, data = run(todo, device, references=references, oracle=not args.no_oracle,
                          fla_note=note, budget=args.time_budget, rounds=args.rounds,
                          ssd_reference=args.ssd_reference,
                          write=lambda text, data: _write(args, text, {**data, **settings}))
        data.update(settings)
        print("\n" + table)
    _write(args, table, data)
    return 0


def _write(args, table: str, data: dict | None) -> None:
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    if args.json and data is not None:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
