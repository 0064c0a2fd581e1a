"""Kernel benchmark: ttr vs fla 0.6.0 vs SDPA causal, forward and forward+backward (GPU).

One process, bf16, H = 16, K = V = 128, 16384 tokens per batch (B x T with T in 2048 ... 16384);
median ms from ``triton.testing.do_bench``; plus ttr's relative RMS error against the float64
per-token oracle at a small size (worst of the output and every input gradient).

Rows are pluggable: ``ROWS[name] = Row(ttr_fn, fla_fn, make_inputs, reference_fn)``. An op
owner registers rows in a module of its own, named ``ttr.scripts.bench_rows_<op>`` (imported
automatically) or passed with ``--module``. ``fla_fn`` is None-able; it gets the same inputs.
Usage: ``ttr bench [--ops delta,gated_delta] [--seqlens 2048,4096] [--out table.md]``.
``--profile`` prints instead the CUDA kernels of ttr's fwd+bwd per row (``torch.profiler``, ms per
iteration) and the host time of one call: a row whose host time approaches its kernel time is
timed as the host, not the GPU (``do_bench`` measures from the first launch).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
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


ROWS: dict[str, Row] = {}


def _delta_inputs(gated: bool):
    def make(B, T, H, D, dtype, device):
        x = {
            "q": torch.randn(B, T, H, D, device=device, dtype=dtype),
            "k": F.normalize(torch.randn(B, T, H, D, device=device), dim=-1).to(dtype),
            "v": torch.randn(B, T, H, D, device=device, dtype=dtype),
            "beta": torch.rand(B, T, H, device=device).to(dtype),
        }
        if gated:
            x["g"] = F.logsigmoid(torch.randn(B, T, H, device=device) + 2.0)
        return x
    return make


def _fla(name: str):
    def call(**x):
        import fla.ops.common.chunk_o as chunk_o

        # fla 0.6.0 refuses its gated backward on Hopper with Triton < 3.7.1 (its issue #640);
        # for timing only, the guard is lifted (the table says so).
        chunk_o.TRITON_ABOVE_3_7_1 = True
        if name == "delta":
            from fla.ops.delta_rule import chunk_delta_rule
            return chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"])
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        return chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"])
    return call


def _register_delta_rows():
    from ttr.kernels.delta import chunk_delta_rule, reference_delta_rule
    from ttr.kernels.gated_delta import chunk_gated_delta_rule, reference_gated_delta_rule

    ROWS["gated_delta"] = Row(lambda **x: chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"]),
                              _fla("gated_delta"), _delta_inputs(True),
                              lambda **x: reference_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"]))
    ROWS["delta"] = Row(lambda **x: chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"]), _fla("delta"),
                        _delta_inputs(False), lambda **x: reference_delta_rule(x["q"], x["k"], x["v"], x["beta"]))


def _load_row_modules(extra: list[str]) -> None:
    import ttr.scripts as pkg

    names = [m.name for m in pkgutil.iter_modules(pkg.__path__) if m.name.startswith("bench_rows_")]
    for name in [f"ttr.scripts.{n}" for n in names] + extra:
        importlib.import_module(name)


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
    lines = []
    for name in ops:
        for T in seqlens:
            B = max(1, TOKENS // T)
            total, host, kernels = _profile_row(ROWS[name], B, T, device, iters)
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


def run(ops: list[str], seqlens: list[int], with_fla: bool = True) -> str:
    import triton

    device = torch.device("cuda")
    lines = [
        f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}, "
        f"bf16, H={HEADS}, K=V={HEAD_DIM}, {TOKENS} tokens per batch, median ms (do_bench)",
        "",
        "| op | B x T | ttr fwd | fla fwd | sdpa fwd | ttr fwd+bwd | fla fwd+bwd | sdpa fwd+bwd | ttr rel. err |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ops:
        row = ROWS[name]
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
    lines += ["", "fla: fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 forced True (timing only; fla issue #640)."]
    return "\n".join(lines)


SWEEP = {
    "wy_bwd": [dict(BK=bk, BV=bv, num_warps=nw) for bk, bv in ((32, 32), (32, 64), (64, 64), (64, 128), (128, 64),
               (128, 128)) for nw in (4, 8)],
}


def stage_calls(B: int, T: int, gated: bool, device) -> dict[str, Callable]:
    """One closure per engine stage, on bf16 inputs of the benchmark's shape (for --stages)."""
    from ttr.kernels.common.cumsum import chunk_local_cumsum
    from ttr.kernels.common.index import prepare_chunks
    from ttr.kernels.common.output import output_bwd_dqk, output_bwd_dv, output_fwd
    from ttr.kernels.common.state import state_bwd, state_fwd
    from ttr.kernels.common.wy import wy_bwd, wy_fwd

    x = _delta_inputs(gated)(B, T, HEADS, HEAD_DIM, torch.bfloat16, device)
    q, k, v, beta, g = x["q"], x["k"], x["v"], x["beta"], x.get("g")
    do = torch.randn_like(v)
    scale = HEAD_DIM ** -0.5
    plan = prepare_chunks(None, B, T, device=device)
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


def profile_stages(shapes: list[tuple[int, int]], sweep: bool) -> str:
    """Median ms per stage at the heuristic launch parameters, and (``sweep``) per alternative."""
    from ttr.scripts.bench_utils import time_stages

    device = torch.device("cuda")
    out = []
    for gated in (True, False):
        for B, T in shapes:
            out += time_stages(stage_calls(B, T, gated, device), f"gated={gated} {B}x{T}",
                               SWEEP if sweep and gated else None)
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ttr bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default=None, help="comma-separated row names (default: all registered)")
    parser.add_argument("--seqlens", default=",".join(map(str, SEQLENS)))
    parser.add_argument("--module", action="append", default=[], help="extra module that registers rows")
    parser.add_argument("--no-fla", action="store_true", help="skip the fla columns")
    parser.add_argument("--out", default=None, help="also write the table to this file")
    parser.add_argument("--stages", action="store_true", help="time each engine stage instead (delta rules)")
    parser.add_argument("--sweep", action="store_true", help="with --stages: also time launch alternatives")
    parser.add_argument("--profile", action="store_true", help="per-kernel GPU time and host time of ttr's rows")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("ttr bench needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.stages:
        shapes = [(max(1, TOKENS // int(t)), int(t)) for t in args.seqlens.split(",")]
        report = profile_stages(shapes, args.sweep)
        if args.out:
            with open(args.out, "w") as f:
                f.write(report + "\n")
        return 0
    _register_delta_rows()
    _load_row_modules(args.module)
    ops = args.ops.split(",") if args.ops else list(ROWS)
    unknown = [o for o in ops if o not in ROWS]
    if unknown:
        parser.error(f"unknown ops {unknown}; registered: {sorted(ROWS)}")
    seqlens = [int(t) for t in args.seqlens.split(",")]
    if args.profile:
        table = profile(ops, seqlens)
    else:
        table = run(ops, seqlens, with_fla=not args.no_fla)
        print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
