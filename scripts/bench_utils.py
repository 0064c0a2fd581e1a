"""Helpers shared by the benchmark scripts: timing (CUDA events, median of repeats), peak memory,
a time budget, the environment a table was measured in, per-stage sweeps, GPU time per kernel and
per kind of work (``torch.profiler``), and the opt-in switch that lets fla 0.6.0 run on Hopper with
an older Triton."""

from __future__ import annotations

import contextlib
import json
import re
import statistics
import sys
import time
import types

import torch


def time_ms(fn, reps, warmup, device=None):
    """Median ms of ``reps`` calls of ``fn`` after ``warmup`` calls: CUDA events on a GPU, the host
    clock on a CPU ``device`` (where the scripts only check that their code paths run)."""
    on_cpu = torch.device(device).type == "cpu" if device is not None else not torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    times = []
    if on_cpu:
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def gpu_ms(fn, calls: int = 20, sleep_cycles: int = 100_000_000, max_sleep_cycles: int = 2**36) -> float:
    """The GPU's own ms per call of ``fn``, without the host's launch time: ``calls`` calls are queued
    behind a GPU sleep, so the events around them time their kernels back to back. Where the host
    had not queued them all before the sleep ended (the start event had already run), the sleep is
    doubled and the calls timed again, up to ``max_sleep_cycles`` (then RuntimeError: a call that
    waits for the GPU, or a host slower than the GPU)."""
    fn()
    torch.cuda.synchronize()
    while True:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(sleep_cycles)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        ahead = not start.query()  # the GPU still slept when the last call was queued
        torch.cuda.synchronize()
        if ahead:
            return start.elapsed_time(end) / calls
        if sleep_cycles > max_sleep_cycles:  # 2**36: about half a minute of sleep and still behind
            raise RuntimeError("gpu_ms: the host never got ahead of the GPU")
        sleep_cycles *= 2


def error_text(e: BaseException, limit: int = 300) -> str:
    """An exception as one line for a benchmark's row: its type and the first line of its message."""
    message = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {message}"[:limit]


def peak_mib(fn):
    """MiB that ``fn`` allocates above what was allocated before it (None without CUDA)."""
    if not torch.cuda.is_available():
        fn()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def kernel_times(prof, calls: int = 1) -> list[tuple[str, float, float]]:
    """``[(kernel, launches per call, ms per call)]`` of a ``torch.profiler`` run over ``calls``
    calls (CUDA kernels, memcpys and memsets), longest first."""
    kernels = [(e.key, e.count / calls, e.self_device_time_total / calls / 1e3) for e in prof.key_averages()
               if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    return sorted(kernels, key=lambda k: -k[2])


# The ATen ops that run a matrix product, and where their operands sit among the inputs' 2-D
# shapes when there are more than two (mm: a, b, then an output; addmm / addmm_: c, a, b; a 1-D
# bias does not count).
PRODUCT_OPS = {"aten::mm": 0, "aten::addmm": 1, "aten::addmm_": 1}


def product_shapes(prof, on_gpu: bool) -> list[dict]:
    """The matrix products of a ``torch.profiler`` run recorded with ``record_shapes``, by op and
    ``M x K x N``: calls, ms (the op's own GPU time, or host time on a CPU) and TFLOP/s, longest
    first. A product that adds into its output (``addmm_``) counts as its own op: it also reads
    the output."""
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key not in PRODUCT_OPS:
            continue
        shapes = [s for s in e.input_shapes if isinstance(s, list) and len(s) == 2]
        first = PRODUCT_OPS[e.key] if len(shapes) > 2 else 0
        if len(shapes) < first + 2:
            continue
        (m, k), (_, n) = shapes[first], shapes[first + 1]
        us = e.self_device_time_total if on_gpu else e.self_cpu_time_total
        if us <= 0:
            continue
        rows.append({"op": e.key.removeprefix("aten::"), "m": m, "k": k, "n": n, "calls": e.count, "ms": us / 1e3,
                     "tflops": 2 * m * k * n * e.count / (us * 1e-6) / 1e12})
    return sorted(rows, key=lambda r: -r["ms"])


# Triton kernels by the module that defines them (ttr.kernels.*, and the references' fla.* and
# mamba_ssm.*): the first pattern the module's name matches; the rest of those modules are the
# sequence mixers' chunkwise ops.
TRITON_KINDS = (("norm", "norm"), ("conv", "short conv"), ("cross_entropy|loss", "loss"),
                ("swiglu|activation", "MLP activation"), ("attention|attn", "attention"))
# Other kernels by their own name (cuBLAS, PyTorch's ATen kernels, SDPA's flash kernels).
KERNEL_KINDS = (("gemm|nvjet|xmma|cutlass|cublas|wgmma|splitk", "matmul"), ("flash|fmha|attention", "attention"),
                ("multi_tensor|adam", "optimizer"), ("memcpy|memset|copy|catarray", "copies and casts"),
                ("", "PyTorch elementwise and reductions"))


def triton_kernel_kinds(prefixes=("ttr.kernels", "fla.", "mamba_ssm.")) -> dict[str, str]:
    """The Triton kernels of the loaded modules under ``prefixes``, by name: ``{name: kind}``,
    the kind from ``TRITON_KINDS`` ("mixer op" where no pattern matches), prefixed by its library."""
    kinds = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(prefixes):
            continue
        for obj in list(vars(module).values()):
            kernel = _kernel_function(obj)
            if kernel is not None:
                kind = next((k for pattern, k in TRITON_KINDS if re.search(pattern, name)), "mixer op")
                kinds[kernel.__name__] = f"{name.split('.')[0]} {kind}"
    return kinds


def _kernel_function(obj):
    """The Python function inside a Triton kernel object (``triton.jit``'s, the interpreter's, an
    autotuner's or a heuristics wrapper's: each keeps what it wraps in ``.fn``), else None."""
    wrapped = False
    while hasattr(obj, "fn") and not isinstance(obj, types.FunctionType):
        obj, wrapped = obj.fn, True
    return obj if wrapped and isinstance(obj, types.FunctionType) else None


def kernel_kind(kernel: str, triton_kinds: dict[str, str]) -> str:
    """What a kernel of a training step does: its entry in ``triton_kinds``, else the first
    ``KERNEL_KINDS`` pattern its name matches."""
    if kernel in triton_kinds:
        return triton_kinds[kernel]
    return next(kind for pattern, kind in KERNEL_KINDS if re.search(pattern, kernel, re.IGNORECASE))


def step_breakdown(kernels: list[tuple[str, float, float]], step_ms: float, triton_kinds: dict[str, str]) -> list:
    """``[(kind, ms per step, share of the step)]`` from ``kernel_times`` of one step, longest
    first, and last the step's time no kernel ran in (the GPU waiting on the host; kernels of one
    stream do not overlap)."""
    totals: dict[str, float] = {}
    for name, _, ms in kernels:
        kind = kernel_kind(name, triton_kinds)
        totals[kind] = totals.get(kind, 0.0) + ms
    rows = sorted(totals.items(), key=lambda kv: -kv[1])
    rows.append(("no kernel running", max(step_ms - sum(totals.values()), 0.0)))
    return [(kind, ms, ms / step_ms if step_ms else 0.0) for kind, ms in rows]


class Deadline:
    """A wall-clock budget in seconds (None: none). A benchmark checks it before each measurement
    and reports the measurements it did not start, so a run cut by its budget still writes its
    table."""

    def __init__(self, seconds: float | None):
        self.end = None if seconds is None else time.monotonic() + seconds

    def expired(self) -> bool:
        return self.end is not None and time.monotonic() > self.end


def environment(device) -> dict:
    """Versions and device of a run, for the header of a table and its JSON."""
    import importlib.metadata as md
    import platform

    import triton

    import ttr

    env = {"device": torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu",
           "python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "ttr": ttr.__version__}
    for name in ("transformers", "flash-linear-attention"):
        try:
            env[name] = md.version(name)
        except md.PackageNotFoundError:
            env[name] = None
    return env


def describe_environment(env: dict) -> str:
    fla = env.get("flash-linear-attention")
    return (f"{env['device']}, torch {env['torch']}, Triton {env['triton']}, transformers {env['transformers']}, "
            f"fla {fla or 'not installed'}, ttr {env['ttr']}")


class Stages(dict):
    """Stage closures by name, as ``time_stages`` takes them, with ``off_path``: the names timed beside
    the op's own stages that the op does not run at this shape (an alternative to one of them), left
    out of the printed total."""

    off_path: frozenset = frozenset()


def chunk_state_choices(parser, value: str | None) -> list[str]:
    """``--chunk-states`` (comma-separated ``TTR_CHUNK_STATES`` values) as a list, empty for None; an
    unknown or repeated choice is a parser error that names the flag."""
    from ttr.kernels.common.index import CHUNK_STATES

    choices = [c.strip().lower() for c in value.split(",")] if value else []
    bad = [c for c in choices if c not in CHUNK_STATES]
    if bad:
        parser.error(f"--chunk-states: unknown {bad}; expected some of {list(CHUNK_STATES)}")
    if len(set(choices)) < len(choices):
        parser.error(f"--chunk-states: a choice given twice in {value!r}")
    return choices


def launch_overrides(alt) -> dict:
    """``alt`` (parsed JSON) checked as ``index.TUNING``'s form: an object of stage name -> object
    of launch parameters (``{}``: the built-in defaults). ValueError names what is wrong."""
    if not isinstance(alt, dict) or not all(isinstance(v, dict) for v in alt.values()):
        raise ValueError(f"expected an object of stage name -> object of launch parameters, got {json.dumps(alt)}")
    return alt


@contextlib.contextmanager
def tuning_override(overrides: dict):
    """``index.TUNING`` holding exactly ``overrides`` (stage -> launch parameters) inside the block,
    its contents as they were afterwards."""
    from ttr.kernels.common.index import TUNING

    before = {k: dict(v) for k, v in TUNING.items()}
    TUNING.clear()
    TUNING.update({k: dict(v) for k, v in overrides.items()})
    try:
        yield
    finally:
        TUNING.clear()
        TUNING.update(before)


def time_stages(calls: dict, label: str, sweep: dict | None = None, top: int = 5,
                aliases: dict | None = None) -> list[str]:
    """Median ms of every stage closure in ``calls`` and, with ``sweep`` (stage -> list of launch
    overrides for ``index.TUNING``), of each alternative, fastest first: the ``top`` fastest, or every
    one with ``top=0``. A swept tuning name that is not a call of its own is timed through the call
    ``aliases`` names for it. The total leaves out the ``off_path`` names of a ``Stages``. Prints and
    returns the lines."""
    import sys

    from triton.testing import do_bench

    from ttr.kernels.common.index import TUNING

    def bench(fn):
        return do_bench(fn, warmup=10, rep=50, return_mode="median")

    times = {n: bench(fn) for n, fn in calls.items()}
    off = [n for n in times if n in getattr(calls, "off_path", ())]
    total = sum(t for n, t in times.items() if n not in off)
    lines = [f"stages {label}: " + ", ".join(f"{n} {t:.3f}" for n, t in times.items())
             + f"; total {total:.3f}" + (f" (without {', '.join(off)})" if off else "")]
    print(lines[-1], flush=True)
    for stage, options in (sweep or {}).items():
        call = stage if stage in calls else (aliases or {})[stage]
        results = []
        for cfg in options:
            try:
                with tuning_override({**TUNING, stage: cfg}):
                    results.append((bench(calls[call]), cfg))
            except Exception as e:  # a configuration that does not fit is skipped
                print(f"  {stage} {cfg}: {type(e).__name__}", file=sys.stderr)
        results.sort(key=lambda r: r[0])
        lines.append(f"  sweep {stage} {label}: default {times[call]:.3f}; "
                     + "; ".join(f"{t:.3f} {c}" for t, c in (results[:top] if top else results)))
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


def lift_fla_guard() -> str | None:
    """Set fla 0.6.0's private ``TRITON_ABOVE_3_7_1`` flag, which it checks before running a gated
    backward on Hopper; returns the note that every table timed this way must carry, or None where
    fla does not import (its cells then carry the import error)."""
    try:
        import fla.ops.common.chunk_o as chunk_o
    except Exception:
        return None

    chunk_o.TRITON_ABOVE_3_7_1 = True
    return FLA_GUARD_NOTE


def fla_guard_note(lifted: bool) -> str | None:
    """The line a table with fla columns carries about fla's Hopper guard: the timing-only note when
    it was lifted; where it holds (fla's own test: a Hopper GPU and 3.4 <= Triton < 3.7.1), that fla's
    gated backward cells are missing and how to time them; else None."""
    if lifted:
        return FLA_GUARD_NOTE
    try:
        import fla.ops.common.chunk_o as chunk_o
    except Exception:  # fla missing, or failing to import: its cells already say so
        return None
    if chunk_o.IS_NVIDIA_HOPPER and chunk_o.TRITON_ABOVE_3_4_0 and not chunk_o.TRITON_ABOVE_3_7_1:
        return ("fla: fla 0.6.0 refuses its gated backward on Hopper with Triton < 3.7.1 (fla issue #640), so those "
                "fla cells are empty; --lift-fla-guard runs it anyway, for timing only.")
    return None
