"""Kernel benchmark: ttr vs fla 0.6.0 vs SDPA causal, forward and forward+backward (GPU).

One process, bf16, H = 16, K = V = 128, 16384 tokens per batch (B x T with T in 2048 ... 16384);
median ms from ``triton.testing.do_bench``; plus ttr's relative RMS error against the float64
per-token oracle at a small size (worst of the output and every input gradient). Rows:
``gated_delta``, ``delta`` (fla ``chunk_gated_delta_rule`` / ``chunk_delta_rule``), ``gla`` (fla
``chunk_gla``), ``simple_gla`` (fla ``chunk_simple_gla``, the SSD form) and ``ssd`` (ttr's Mamba2
input form: one group, state size = head dim; no fla counterpart). Gates as in fla's own
benchmarks: ``logsigmoid(x) / 16`` per key dimension for GLA, ``logsigmoid(x)`` per head otherwise.

Usage: ``ttr bench [--ops delta,gated_delta] [--seqlens 2048,4096] [--out table.md]``.
``--lift-fla-guard`` lets fla run its gated backward on Hopper with Triton < 3.7.1 (fla issue #640;
timing only, and the table says so); without it those fla cells read n/a there.
``--profile`` prints instead the CUDA kernels of ttr's fwd+bwd per row (``torch.profiler``, ms per
iteration) and the host time of one call: a row whose host time approaches its kernel time is
timed as the host, not the GPU (``do_bench`` measures from the first launch).
``--stages`` times each engine stage of ``gated_delta``, ``delta``, ``gla`` or ``simple_gla`` (SSD
runs simple GLA's kernels) and with ``--sweep`` the launch alternatives of ``SWEEPS``, fastest
first: a winner becomes the stage's default in ``kernels/common``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

TOKENS = 16384
HEADS = 16
HEAD_DIM = 128
SEQLENS = (2048, 4096, 8192, 16384)


@dataclass
class Row:
    ttr: Callable  # (**inputs) -> (o, state)
    fla: Callable | None  # same call convention, or None when fla has no such op
    make_inputs: Callable  # (B, T, H, D, dtype, device) -> dict of tensors
    reference: Callable  # float64 oracle, same call convention


def _qkv(B, T, H, D, dtype, device):
    return {name: torch.randn(B, T, H, D, device=device, dtype=dtype) for name in ("q", "k", "v")}


def delta_inputs(gated: bool):
    def make(B, T, H, D, dtype, device):
        x = {**_qkv(B, T, H, D, dtype, device), "beta": torch.rand(B, T, H, device=device).to(dtype)}
        x["k"] = F.normalize(x["k"].float(), dim=-1).to(dtype)
        if gated:
            x["g"] = F.logsigmoid(torch.randn(B, T, H, device=device) + 2.0)
        return x
    return make


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
    """fla 0.6.0's op of row ``name``, imported at the first call (fla is not a dependency)."""
    def call(**x):
        if name == "delta":
            from fla.ops.delta_rule import chunk_delta_rule
            return chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"])
        if name == "gated_delta":
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
            return chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"])
        if name == "gla":
            from fla.ops.gla import chunk_gla
            return chunk_gla(x["q"], x["k"], x["v"], x["g"])
        from fla.ops.simple_gla import chunk_simple_gla
        return chunk_simple_gla(x["q"], x["k"], x["v"], x["g"])
    return call


def rows() -> dict[str, Row]:
    """Every row of the table, in its order."""
    from ttr.kernels.delta import chunk_delta_rule, reference_delta_rule
    from ttr.kernels.gated_delta import chunk_gated_delta_rule, reference_gated_delta_rule
    from ttr.kernels.gla import chunk_gla, reference_gla
    from ttr.kernels.ssd import chunk_simple_gla, chunk_ssd, reference_simple_gla, reference_ssd

    qkvg = lambda fn: lambda **x: fn(x["q"], x["k"], x["v"], x["g"])  # noqa: E731
    qkvb = lambda fn: lambda **x: fn(x["q"], x["k"], x["v"], x["beta"])  # noqa: E731
    qkvgb = lambda fn: lambda **x: fn(x["q"], x["k"], x["v"], x["g"], x["beta"])  # noqa: E731
    ssd = lambda fn: lambda **x: fn(x["x"], x["dt"], x["A"], x["B"], x["C"])  # noqa: E731
    return {
        "gated_delta": Row(qkvgb(chunk_gated_delta_rule), _fla("gated_delta"), delta_inputs(True),
                           qkvgb(reference_gated_delta_rule)),
        "delta": Row(qkvb(chunk_delta_rule), _fla("delta"), delta_inputs(False), qkvb(reference_delta_rule)),
        "gla": Row(qkvg(chunk_gla), _fla("gla"), gla_inputs, qkvg(reference_gla)),
        "simple_gla": Row(qkvg(chunk_simple_gla), _fla("simple_gla"), simple_gla_inputs, qkvg(reference_simple_gla)),
        "ssd": Row(ssd(chunk_ssd), None, ssd_inputs, ssd(reference_ssd)),
    }


def _bench(fn, x, do, backward: bool) -> float:
    from triton.testing import do_bench

    leaves = [t for t in x.values() if t.requires_grad]
    if not backward:
        with torch.no_grad():
            return do_bench(lambda: fn(**x), warmup=25, rep=100, return_mode="median")

    def step():
        fn(**x)[0].backward(do)
    return do_bench(step, warmup=25, rep=100, grad_to_none=leaves, return_mode="median")


def _profile_row(row: Row, B: int, T: int, device, iters: int) -> tuple[float, float, list]:
    """(kernel ms per fwd+bwd, host ms per call, [(kernel name, launches per call, ms per call)])."""
    import time

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    x = row.make_inputs(B, T, HEADS, HEAD_DIM, torch.bfloat16, device)
    leaves = [t.requires_grad_(True) for t in x.values() if t.is_floating_point()]
    do = torch.randn(B, T, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)

    def step():
        for t in leaves:
            t.grad = None
        row.ttr(**x)[0].backward(do)

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
    kernels = [(e.key, e.count / iters, e.self_device_time_total / iters / 1e3) for e in p.key_averages()
               if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    kernels.sort(key=lambda k: -k[2])
    return sum(k[2] for k in kernels), host, kernels


def profile(ops: list[str], seqlens: list[int], device=None, iters: int = 10) -> str:
    """Per-kernel GPU time (ms per fwd+bwd) and host ms per call of ttr's rows, as markdown."""
    device = torch.device(device or "cuda")
    table = rows()
    lines = []
    for name in ops:
        for T in seqlens:
            B = max(1, TOKENS // T)
            total, host, kernels = _profile_row(table[name], B, T, device, iters)
            block = [f"{name} {B} x {T}: kernels {total:.3f} ms per fwd+bwd, host {host:.3f} ms per call", "",
                     "| kernel | launches per call | ms per call |", "|---|---|---|"]
            block += [f"| {k[:60]} | {n:g} | {ms:.3f} |" for k, n, ms in kernels] + [""]
            print("\n".join(block), flush=True)
            lines += block
    return "\n".join(lines)


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item() if torch.isfinite(a).all() else float("inf")


def relative_error(row: Row, device, B=1, T=1024, H=4, D=HEAD_DIM) -> float:
    """Worst relative RMS error of the output and every gradient, bf16 ttr vs float64 oracle."""
    x = row.make_inputs(B, T, H, D, torch.bfloat16, device)
    do = torch.randn(B, T, H, D, device=device)
    results = []
    for fn, cast in ((row.ttr, lambda t: t), (row.reference, lambda t: t.double())):
        xi = {n: cast(t).detach().requires_grad_(t.is_floating_point()) for n, t in x.items()}
        o = fn(**xi)[0]
        o.backward(do.to(o.dtype))
        results.append([o.detach()] + [xi[n].grad for n in xi if xi[n].grad is not None])
    return max(_rel(a, b) for a, b in zip(*results))


def _sdpa(B, T, H, D, device):
    q, k, v = (torch.randn(B, H, T, D, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    fn = lambda **x: (F.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=True), None)
    return fn, {"q": q, "k": k, "v": v}, torch.randn(B, H, T, D, device=device, dtype=torch.bfloat16)


def _cell(cells: dict, label: str, i: int) -> str:
    return f"{cells[label][i]:.3f}" if label in cells else "n/a"


def run(ops: list[str], seqlens: list[int], with_fla: bool = True, fla_note: str | None = None) -> str:
    """The table; ``fla_note`` (from ``bench_utils.lift_fla_guard``) ends it when fla ran unguarded."""
    import triton

    device = torch.device("cuda")
    lines = [
        f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}, "
        f"bf16, H={HEADS}, K=V={HEAD_DIM}, {TOKENS} tokens per batch, median ms (do_bench)",
        "",
        "| op | B x T | ttr fwd | fla fwd | sdpa fwd | ttr fwd+bwd | fla fwd+bwd | sdpa fwd+bwd | ttr rel. err |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    table = rows()
    for name in ops:
        row = table[name]
        err = relative_error(row, device)
        for T in seqlens:
            B = max(1, TOKENS // T)
            x = row.make_inputs(B, T, HEADS, HEAD_DIM, torch.bfloat16, device)
            for t in x.values():
                t.requires_grad_(True)
            do = torch.randn(B, T, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
            cells = {}
            impls = [("ttr", row.ttr)] + ([("fla", row.fla)] if with_fla and row.fla is not None else [])
            for label, fn in impls:
                try:
                    cells[label] = (_bench(fn, x, do, False), _bench(fn, x, do, True))
                except Exception as e:  # an unavailable or failing baseline must not hide ttr's numbers
                    print(f"{name} {label} B={B} T={T}: {type(e).__name__}: {e}", file=sys.stderr)
            sfn, sx, sdo = _sdpa(B, T, HEADS, HEAD_DIM, device)
            cells["sdpa"] = (_bench(sfn, sx, sdo, False), _bench(sfn, sx, sdo, True))
            row_cells = [_cell(cells, label, i) for i in (0, 1) for label in ("ttr", "fla", "sdpa")]
            lines.append(f"| {name} | {B} x {T} | " + " | ".join(row_cells) + f" | {err:.1e} |")
            print(lines[-1], flush=True)
    if fla_note:
        lines += ["", fla_note]
    return "\n".join(lines)


def _stage_inputs(make_inputs, B: int, T: int, device):
    """bf16 inputs of the benchmark's shape, an output gradient, the scale and the chunk plan."""
    from ttr.kernels.common.index import prepare_chunks

    x = make_inputs(B, T, HEADS, HEAD_DIM, torch.bfloat16, device)
    return x, torch.randn_like(x["v"]), HEAD_DIM**-0.5, prepare_chunks(None, B, T, device=device)


def delta_stage_calls(B: int, T: int, gated: bool, device) -> dict[str, Callable]:
    """One closure per stage of the (gated) delta rule's forward and backward, on bf16 inputs."""
    from ttr.kernels.common.cumsum import chunk_local_cumsum
    from ttr.kernels.common.output import output_bwd_dqk, output_bwd_dv, output_fwd
    from ttr.kernels.common.state import state_bwd, state_fwd
    from ttr.kernels.common.wy import wy_bwd, wy_fwd

    x, do, scale, plan = _stage_inputs(delta_inputs(gated), B, T, device)
    q, k, v, beta, g = x["q"], x["k"], x["v"], x["beta"], x.get("g")
    gc = chunk_local_cumsum(g, plan) if gated else None
    w, u, Ai = wy_fwd(k, v, beta, plan, g=gc)
    h, vn, _ = state_fwd(k, u, plan, w=w, g=gc)
    dvl = output_bwd_dv(q, k, do, plan, scale=scale, g=gc)
    dh, _, dv2 = state_bwd(q, k, do, dvl, plan, scale=scale, w=w, g=gc)
    dq, dk, dw, dg = output_bwd_dqk(q, k, vn, h, dh, do, plan, scale=scale, g=gc, dv=dv2)
    calls = {
        "wy_fwd": lambda: wy_fwd(k, v, beta, plan, g=gc),
        "wy_fwd_reuse": lambda: wy_fwd(k, v, beta, plan, g=gc, Ai=Ai),
        "state_fwd": lambda: state_fwd(k, u, plan, w=w, g=gc),
        "output_fwd": lambda: output_fwd(q, k, vn, h, plan, scale=scale, g=gc),
        "output_bwd_dv": lambda: output_bwd_dv(q, k, do, plan, scale=scale, g=gc),
        "state_bwd": lambda: state_bwd(q, k, do, dvl, plan, scale=scale, w=w, g=gc),
        "output_bwd_dqk": lambda: output_bwd_dqk(q, k, vn, h, dh, do, plan, scale=scale, g=gc, dv=dv2),
        "wy_bwd": lambda: wy_bwd(k, v, beta, Ai, dw, dv2, plan, g=gc, dk=dk, dg=dg),
    }
    if gated:
        calls["cumsum"] = lambda: chunk_local_cumsum(g, plan)
    return calls


def gla_stage_calls(B: int, T: int, device) -> dict[str, Callable]:
    """One closure per stage of chunk_gla's forward and backward, on bf16 inputs."""
    from ttr.kernels.common import intra_vector_gate as vg
    from ttr.kernels.common.cumsum import chunk_local_cumsum
    from ttr.kernels.common.state import state_bwd, state_fwd

    x, do, scale, plan = _stage_inputs(gla_inputs, B, T, device)
    q, k, v, g = x["q"], x["k"], x["v"], x["g"]
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
        "vector_gate_bwd_dqkg": lambda: vg.vector_gate_bwd_dqkg(q, k, v, gk, h, dh, do, dqi, dki, plan, scale=scale),
    }


def simple_gla_stage_calls(B: int, T: int, device) -> dict[str, Callable]:
    """One closure per stage of chunk_simple_gla's forward and backward, on bf16 inputs."""
    from ttr.kernels.common.cumsum import chunk_local_cumsum
    from ttr.kernels.common.output import output_bwd_dqk, output_bwd_dv, output_fwd
    from ttr.kernels.common.state import state_bwd, state_fwd

    x, do, scale, plan = _stage_inputs(simple_gla_inputs, B, T, device)
    q, k, v, g = x["q"], x["k"], x["v"], x["g"]
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


STAGE_CALLS = {
    "gated_delta": lambda B, T, device: delta_stage_calls(B, T, True, device),
    "delta": lambda B, T, device: delta_stage_calls(B, T, False, device),
    "gla": gla_stage_calls,
    "simple_gla": simple_gla_stage_calls,
}

# Launch alternatives per op and stage (overrides of ``index.TUNING``) that ``--stages --sweep`` times.
SWEEPS = {
    "gated_delta": {
        "wy_bwd": [dict(BK=bk, BV=bv, num_warps=nw) for bk, bv in ((32, 32), (32, 64), (64, 64), (64, 128),
                   (128, 64), (128, 128)) for nw in (4, 8)],
    },
    "gla": {
        "vector_gate_scores": [dict(BK=bk, num_warps=nw, num_stages=ns) for bk in (32, 64) for nw in (2, 4, 8)
                               for ns in (1, 2, 3)],
        "vector_gate_intra_bwd": [dict(BK=bk, num_warps=nw, num_stages=ns) for bk in (32, 64) for nw in (4, 8)
                                  for ns in (1, 2)],
        # the sequential state pass (two_level=False) against the two-level one's tiles
        "state_fwd": [dict(two_level=False)],
        "state_bwd": [dict(two_level=False)],
        "state_fwd_scan": [dict(BK=bk, BV=bv, num_warps=nw, num_stages=ns) for bk, bv in ((16, 32), (32, 32),
                           (32, 64), (64, 64)) for nw in (2, 4) for ns in (2, 4)],
        "state_bwd_scan": [dict(BK=bk, BV=bv, num_warps=4, num_stages=ns) for bk, bv in ((16, 32), (32, 32),
                           (32, 64)) for ns in (2, 4)],
    },
    "simple_gla": {
        # BK 32 is left out: an illegal memory access on Hopper (Triton 3.6), not reproduced by the interpreter
        "output_bwd_dqk": [dict(BK=bk, num_warps=nw, num_stages=ns) for bk in (64, 128) for nw in (4, 8)
                           for ns in (1, 2, 3)],
        "output_fwd": [dict(BV=bv, num_warps=nw, num_stages=ns) for bv in (64, 128) for nw in (4, 8)
                       for ns in (2, 3)],
        "output_bwd_dv": [dict(num_warps=nw, num_stages=ns) for nw in (2, 4, 8) for ns in (1, 2, 3)],
        "state_fwd": [dict(two_level=False), dict(two_level=True)],
        "state_bwd": [dict(two_level=False), dict(two_level=True)],
    },
}


def profile_stages(ops: list[str], shapes: list[tuple[int, int]], sweep: bool) -> str:
    """Median ms per stage at the heuristic launch parameters, and (``sweep``) per alternative."""
    from ttr.scripts.bench_utils import time_stages

    device = torch.device("cuda")
    out = []
    for name in ops:
        for B, T in shapes:
            out += time_stages(STAGE_CALLS[name](B, T, device), f"{name} {B}x{T}",
                               SWEEPS.get(name) if sweep else None)
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from ttr.scripts.bench_utils import LIFT_FLA_GUARD_HELP, lift_fla_guard

    names = list(rows())
    parser = argparse.ArgumentParser(prog="ttr bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default=None, help=f"comma-separated rows (default: all of {','.join(names)})")
    parser.add_argument("--seqlens", default=",".join(map(str, SEQLENS)))
    parser.add_argument("--no-fla", action="store_true", help="skip the fla columns")
    parser.add_argument("--lift-fla-guard", action="store_true", help=LIFT_FLA_GUARD_HELP)
    parser.add_argument("--out", default=None, help="also write the table to this file")
    parser.add_argument("--stages", action="store_true",
                        help=f"time each engine stage instead ({', '.join(STAGE_CALLS)})")
    parser.add_argument("--sweep", action="store_true", help="with --stages: also time launch alternatives")
    parser.add_argument("--profile", action="store_true", help="per-kernel GPU time and host time of ttr's rows")
    args = parser.parse_args(argv)
    allowed = list(STAGE_CALLS) if args.stages else names
    ops = args.ops.split(",") if args.ops else allowed
    unknown = [o for o in ops if o not in allowed]
    if unknown:
        parser.error(f"--ops: unknown {unknown}; expected some of {allowed}")
    seqlens = [int(t) for t in args.seqlens.split(",")]
    if not torch.cuda.is_available():
        print("ttr bench needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.stages:
        table = profile_stages(ops, [(max(1, TOKENS // t), t) for t in seqlens], args.sweep)
    elif args.profile:
        table = profile(ops, seqlens)
    else:
        note = lift_fla_guard() if args.lift_fla_guard and not args.no_fla else None
        table = run(ops, seqlens, with_fla=not args.no_fla, fla_note=note)
        print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
