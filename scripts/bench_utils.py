"""Helpers shared by the benchmark scripts: timing (CUDA events, median of repeats), peak memory,
per-stage sweeps, and the opt-in switch that lets fla 0.6.0 run on Hopper with an older Triton."""

from __future__ import annotations

import statistics

import torch


def time_ms(fn, reps, warmup):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_mib(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def time_stages(calls: dict, label: str, sweep: dict | None = None, top: int = 5) -> list[str]:
    """Median ms of every stage closure in ``calls`` and, with ``sweep`` (stage -> list of launch
    overrides for ``index.TUNING``), of each alternative, fastest first. Prints and returns the lines."""
    import sys

    from triton.testing import do_bench

    from ttr.kernels.common.index import TUNING

    def bench(fn):
        return do_bench(fn, warmup=10, rep=50, return_mode="median")

    times = {n: bench(fn) for n, fn in calls.items()}
    lines = [f"stages {label}: " + ", ".join(f"{n} {t:.3f}" for n, t in times.items())
             + f"; total {sum(times.values()):.3f}"]
    print(lines[-1], flush=True)
    for stage, options in (sweep or {}).items():
        results = []
        for cfg in options:
            TUNING[stage] = cfg
            try:
                results.append((bench(calls[stage]), cfg))
            except Exception as e:  # a configuration that does not fit is skipped
                print(f"  {stage} {cfg}: {type(e).__name__}", file=sys.stderr)
            finally:
                TUNING.pop(stage, None)
        results.sort(key=lambda r: r[0])
        lines.append(f"  sweep {stage} {label}: default {times[stage]:.3f}; "
                     + "; ".join(f"{t:.3f} {c}" for t, c in results[:top]))
        print(lines[-1], flush=True)
    return lines


FLA_GUARD_NOTE = (
    "fla: fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 forced True (--lift-fla-guard), so that fla 0.6.0 runs its "
    "gated backward on Hopper with Triton < 3.7.1; fla issue #640 says its results are wrong there: timing only."
)
LIFT_FLA_GUARD_HELP = (
    "let fla 0.6.0 run the gated backward it refuses on Hopper with Triton < 3.7.1 (fla issue #640: wrong "
    "results there, so for timing only; the output says so)"
)


def lift_fla_guard() -> str:
    """Set fla 0.6.0's private ``TRITON_ABOVE_3_7_1`` flag, which it checks before running a gated
    backward on Hopper; returns the note that every table timed this way must carry."""
    import fla.ops.common.chunk_o as chunk_o

    chunk_o.TRITON_ABOVE_3_7_1 = True
    return FLA_GUARD_NOTE
