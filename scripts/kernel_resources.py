"""Registers, spills and shared memory of every Triton kernel an op launches, without a GPU.

The ops run once, forward and backward, at a short length (``--seqlen``, B = 2) and each preset
shape of ``ttr bench`` under the Triton interpreter, in a child process (``TRITON_INTERPRET`` must
be set before Triton is imported), which records each launch: the kernel, its argument types,
constexprs, warps and pipeline stages. ``conv`` is the short convs at the 1.3B presets' conv shapes
(read as column blocks of their projections, as the layers train), in a batch and packed. Ops
without a delta rule run twice, once on each state pass (sequential and two-level), so both paths'
kernels are listed. This process then compiles
every distinct launch with the installed Triton for the target (default sm_90a, Hopper) and reads
the machine code's resource use with the ``cuobjdump`` that Triton ships. Each argument is
compiled as Triton's launcher specializes it on a GPU (``_specialize``: pointers 16-byte aligned and
ints divisible by 16 marked, ints equal to 1 as constants), at the interpreter run's values:

- ``regs``: registers per thread (255 is the most a thread can have);
- ``stack``: bytes of per-thread local memory, which for Triton code means spilled registers;
- ``smem``: shared memory per program (bytes);
- ``loop``: for the kernel's hottest loop (the one with the most instructions), its instructions
  per thread, ``LDL``/``STL`` (local-memory loads and stores: spill traffic on every iteration),
  ``GMMA`` (Hopper's warpgroup matrix instructions, which need 4 warps) and ``HMMA`` (the older
  per-warp matrix instructions, a slower path on Hopper).

Launch parameters are those chosen for batches that fill the GPU: the interpreter's device has
one "SM", so choices that shrink a tile when B*H is small (the sequential state pass's BV) keep
their large-batch value. A kernel behind ``triton.autotune`` is compiled with each config the GPU
would try (the interpreter runs one fixed small config instead). The numbers are the compiler's, not a timing: a spilling kernel can
still be the fastest measured launch. Use them to choose what to time (``ttr bench --stages
--sweep``) and to see what a kernel change does to register pressure before a GPU is at hand.

    python -m ttr.scripts.kernel_resources --ops ssd --out resources.md
    python -m ttr.scripts.kernel_resources --ops gated_delta --tuning '{"wy_bwd": {"num_warps": 8}}'

``--tuning`` captures under launch overrides (``index.TUNING``: stage -> launch parameters, as
``bench_model --tuning`` and ``ttr bench --stages --sweep`` take them), so a launch the defaults do
not choose can be compiled and read before it is timed.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

# the captured launches: (module, kernel name, signature, constexprs, options) -> number of launches
_LAUNCHES: dict[tuple, int] = {}

_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64", "int32": "i32",
           "int64": "i64", "int8": "i8", "uint8": "u8", "bool": "i1"}
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def _arg_type(value) -> str | None:
    """Triton's signature type of a launch argument (None: a None argument, passed as a constexpr)."""
    import torch

    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[str(value.dtype).removeprefix("torch.")]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    if value is None:
        return None
    raise TypeError(f"launch argument of type {type(value).__name__}")


def _specialize(value) -> tuple[str | None, bool]:
    """``(type, divisible)`` of a launch argument as Triton's launcher specializes it on a GPU: a
    pointer 16-byte aligned or an int divisible by 16 is marked ``divisible`` (the compiler then
    vectorizes loads and drops index arithmetic), an int equal to 1 becomes the constant 1 (type
    None, as a constexpr). Compiling without these marks gives another kernel than the GPU runs
    (more registers, spills and instructions). Where this Triton has no native specializer, the
    argument's plain type and no mark."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:
        return _arg_type(value), False
    kind, attr = native_specialize_impl(BaseBackend, value, False, True, True)[:2]
    if kind == "constexpr":
        return None, False
    return _arg_type(value), attr == "D"


def _record(self, *args, grid, warmup, **kwargs):
    """``InterpretedFunction.run`` with the launch recorded before it runs."""
    import triton.language as tl

    options = {k: kwargs.pop(k) for k in _OPTIONS if k in kwargs}
    params = inspect.signature(self.fn)
    bound = params.bind(*args, **kwargs)
    bound.apply_defaults()
    plain = set(self.kwargs.get("do_not_specialize") or ())  # names or positions, as triton.jit takes them
    signature, constexprs, divisible = {}, {}, []
    for i, (name, param) in enumerate(params.parameters.items()):
        value = bound.arguments[name]
        # annotations are strings in modules with postponed evaluation
        constexpr = param.annotation is tl.constexpr or "constexpr" in str(param.annotation)
        if constexpr:
            kind, div = None, False
        elif name in plain or i in plain:
            kind, div = _arg_type(value), False
        else:
            kind, div = _specialize(value)
        signature[name] = kind or "constexpr"
        if kind is None:
            constexprs[name] = value
        elif div:
            divisible.append(name)
    key = (self.fn.__module__, self.fn.__name__, json.dumps(signature), json.dumps(constexprs, sort_keys=True),
           json.dumps(options, sort_keys=True), json.dumps(divisible))
    _LAUNCHES[key] = _LAUNCHES.get(key, 0) + 1
    return _record.original(self, *args, grid=grid, warmup=warmup, **kwargs, **options)


def _recorded(label: str) -> list[dict]:
    """The launches recorded since the last call, as rows of ``label``."""
    out = [dict(shape=label, module=module, kernel=name, signature=json.loads(sig), constexprs=json.loads(const),
                options=json.loads(opts), divisible=json.loads(div), launches=count)
           for (module, name, sig, const, opts, div), count in _LAUNCHES.items()]
    _LAUNCHES.clear()
    return out


def capture_convs() -> list[dict]:
    """The short convs' launches (forward and backward) at the 1.3B presets' conv shapes
    (``bench_fused.preset_convs``: x a column block of the projection it is read from), in a batch
    and packed, with the GPU's launch parameters: the conv's launchers pick small blocks under the
    interpreter, so they are made to take their GPU branch here, with walks of 256 tokens (a
    runtime argument, which the GPU sizes from its SM count)."""
    from unittest import mock

    import torch

    from ttr.kernels import conv, conv_backward
    from ttr.kernels.common.index import TUNING
    from ttr.scripts.bench_fused import preset_convs
    from ttr.scripts.bench_utils import tuning_override

    out = []
    gpu = lambda: False  # noqa: E731
    with (mock.patch.object(conv, "interpreter_active", gpu),
          mock.patch.object(conv_backward, "interpreter_active", gpu),
          tuning_override({**TUNING, "conv_bwd": {**TUNING.get("conv_bwd", {}), "SEG": 256}})):
        for name, d, l2, bias, width in preset_convs():
            for packed in (False, True):
                torch.manual_seed(0)
                # the length does not change the compiled kernels (16 and 32 keep T divisible by 16,
                # as the presets' lengths are) and the interpreter's time grows with it
                b, t = (1, 32) if packed else (2, 16)
                x = torch.randn(b, t, width, dtype=torch.bfloat16)[..., :d].requires_grad_()
                weight = torch.randn(d, 4) / 2
                cu = torch.tensor([0, 7, t], dtype=torch.int32) if packed else None
                y, _ = conv.causal_conv1d(x, weight, torch.zeros(d) if bias else None, activation="silu",
                                          cu_seqlens=cu, l2_group=l2 or None)
                y.backward(torch.randn_like(y))
                out += _recorded(f"conv {name}" + (f" (L2 norm per {l2})" if l2 else "") + (" packed" if packed else ""))
    return out


def capture(ops: list[str] | None, presets: list[str] | None, shapes: str, seqlen: int,
            tuning: dict | None = None, unread: list | None = None) -> list[dict]:
    """Run in the interpreter process: the launches of each op's forward and backward (``conv``: the
    short convs, ``capture_convs``), on the Triton backend; with ``tuning`` (stage -> launch
    parameters, ``{}`` the built-in choices) ``index.TUNING`` holds exactly that meanwhile, as under
    ``bench_model --tuning``, and ``unread`` (a list) takes the overridden stages no launch read.
    The interpreter's launch is recorded inside this call only."""
    import triton.runtime.interpreter as interpreter

    from ttr.kernels.common.index import reading_stages
    from ttr.kernels.utils import backend_override
    from ttr.scripts.bench_utils import tuning_override

    _record.original = interpreter.InterpretedFunction.run
    interpreter.InterpretedFunction.run = _record
    try:
        overrides = tuning_override(tuning) if tuning is not None else contextlib.nullcontext()
        with backend_override("triton"), overrides, reading_stages() as read:  # the Triton kernels on CPU tensors
            out = capture_convs() if ops is None or "conv" in ops else []
            ops = [o for o in ops if o != "conv"] if ops is not None else None
            out += _capture_ops(ops, presets, shapes, seqlen) if ops != [] else []
        if unread is not None:
            unread += sorted(set(tuning or {}) - read)
        return out
    finally:
        interpreter.InterpretedFunction.run = _record.original
        _LAUNCHES.clear()


def _capture_ops(ops, presets, shapes: str, seqlen: int) -> list[dict]:
    """The launches of ``ttr bench``'s ops at their shapes (``capture``)."""
    import torch

    from ttr.kernels.common import index
    from ttr.scripts import bench_kernels

    rows = bench_kernels.rows()
    out = []
    for shape, _, _ in bench_kernels.plan(shapes, ops, presets, [seqlen], seqlen):
        row = rows[shape.op]
        paths = [None] if shape.op in ("delta", "gated_delta", "swa", "attn") else [False, True]
        for two_level in paths:
            saved = {k: dict(index.TUNING.get(k, {})) for k in ("state_fwd", "state_bwd")}
            if two_level is not None:
                for stage in saved:
                    index.TUNING[stage] = {**saved[stage], "two_level": two_level}
            try:
                torch.manual_seed(0)
                # B = 2: a batch or sequence count of 1 would compile as the constant 1, which a
                # GPU run's batch is not
                x, do = bench_kernels._inputs(row, 2, seqlen, shape, torch.device("cpu"), dtype=torch.bfloat16)
                row.ttr(**x).backward(do)
            finally:
                for stage, cfg in saved.items():
                    index.TUNING[stage] = cfg
            out += _recorded(f"{shape.op} {shape.label()}")
    return out


def _jit_function(module: str, name: str):
    """The kernel's ``JITFunction`` (unwrapping ``triton.autotune`` and ``triton.heuristics``) and
    its ``Autotuner`` (None without autotune)."""
    import importlib

    fn = getattr(importlib.import_module(module), name)
    tuner = None
    while not hasattr(fn, "src"):
        if tuner is None and hasattr(fn, "configs"):
            tuner = fn
        fn = fn.fn
    return fn, tuner


def _variants(launch: dict) -> list[tuple[str, dict]]:
    """What to compile for a launch: the launch itself, or for an autotuned kernel each config the
    GPU would try (the interpreter ran a small fixed one)."""
    _, tuner = _jit_function(launch["module"], launch["kernel"])
    if tuner is None:
        return [("", launch)]
    configs = list(tuner.configs)
    if getattr(tuner, "early_config_prune", None):
        configs = tuner.early_config_prune(configs, launch["constexprs"])
    out = []
    for i, c in enumerate(configs):
        options = {"num_warps": c.num_warps, "num_stages": c.num_stages}
        out.append((f" (autotune config {i})", {**launch, "constexprs": {**launch["constexprs"], **c.kwargs},
                                                  "options": options}))
    return out


def _tool(name: str) -> str:
    import triton.backends.nvidia as nvidia

    path = os.path.join(os.path.dirname(nvidia.__file__), "bin", name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: this Triton install ships no {name}")
    return path


def hottest_loop(sass: str) -> dict:
    """The loop with the most instructions (a backward branch and its target delimit it) and what
    it issues per iteration; zeros for a kernel without loops."""
    instrs = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            instrs.append((int(m.group(1), 16), m.group(2)))
    best: list[str] = []
    for addr, text in instrs:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in instrs if int(m.group(1), 16) <= a <= addr]
            if len(body) > len(best):
                best = body
    count = lambda op: sum(1 for t in best if re.search(rf"\b{op}\b", t))  # noqa: E731
    return dict(loop_instructions=len(best), loop_ldl=count("LDL"), loop_stl=count("STL"), loop_gmma=count("HGMMA"),
                loop_hmma=count("HMMA"))


def compile_launch(launch: dict, arch: int) -> dict:
    """Compile one captured launch for ``sm_<arch>`` and read its resource use."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    # the launcher's marks (``_specialize``); launches captured before they were recorded have none
    names = list(launch["signature"])
    attrs = {(names.index(n),): CUDABackend.parse_attr("D") for n in launch.get("divisible", [])}
    src = ASTSource(fn=_jit_function(launch["module"], launch["kernel"])[0], signature=launch["signature"],
                    constexprs=launch["constexprs"], attrs=attrs)
    options = {"num_warps": 4, "num_stages": 3, **launch["options"]}
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", path], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", path], capture_output=True, text=True,
                              check=True).stdout
    found = dict(re.findall(r"\b(REG|STACK):(\d+)", usage))
    return dict(regs=int(found["REG"]), stack=int(found["STACK"]), smem=int(kernel.metadata.shared),
                warps=options["num_warps"], stages=options["num_stages"], **hottest_loop(sass))


COLUMNS = [("warps", "warps"), ("stages", "stages"), ("regs", "regs"), ("stack B", "stack"), ("smem B", "smem"),
           ("loop instr.", "loop_instructions"), ("loop LDL", "loop_ldl"), ("loop STL", "loop_stl"),
           ("loop GMMA", "loop_gmma"), ("loop HMMA", "loop_hmma")]
_KEY_CONSTEXPRS = ("BT", "BK", "BV", "BD", "BM", "BN", "BM1", "BN1", "BM2", "BN2", "BP", "BR")


def report(launches: list[dict], arch: int) -> tuple[str, list[dict]]:
    """The table (one row per distinct launch) and its rows."""
    rows, seen = [], set()
    for launch in launches:
        key = (launch["module"], launch["kernel"], json.dumps(launch["signature"]),
               json.dumps(launch["constexprs"], sort_keys=True), json.dumps(launch["options"], sort_keys=True),
               json.dumps(launch.get("divisible", [])))
        if key in seen:
            continue
        seen.add(key)
        for tag, variant in _variants(launch):
            const = variant["constexprs"]
            tiles = " ".join(f"{k}={const[k]}" for k in _KEY_CONSTEXPRS if k in const)
            row = dict(shape=launch["shape"], kernel=launch["kernel"] + tag, tiles=tiles)
            try:
                row.update(compile_launch(variant, arch))
            except Exception as e:  # one kernel that does not compile leaves the others' rows
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            rows.append(row)
    lines = ["| shape | kernel | tiles | " + " | ".join(c for c, _ in COLUMNS) + " |",
             "|---|---|---|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [r.get("error", "")] + [""] * (len(COLUMNS) - 1) if "error" in r else [
            f"**{r[k]}**" if k == "stack" and r[k] else str(r[k]) for _, k in COLUMNS]
        lines.append(f"| {r['shape']} | {r['kernel']} | {r['tiles']} | " + " | ".join(cells) + " |")
    return "\n".join(lines), rows


def _capture_in_child(ops, presets, shapes, seqlen, tuning=None) -> tuple[list[dict], list[str]]:
    """``capture`` in a child process under the interpreter: the launches and the unread stages."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "TTR_KERNEL_BACKEND": "triton"}
    code = ("import json, sys; from ttr.scripts.kernel_resources import capture; unread = []; "
            "launches = capture(*json.loads(sys.argv[1]), unread=unread); "
            "print(json.dumps({'launches': launches, 'unread': unread}))")
    args = json.dumps([ops, presets, shapes, seqlen, tuning])
    done = subprocess.run([sys.executable, "-c", code, args], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError("the interpreter run failed: " + (done.stderr.strip().splitlines() or ["?"])[-1])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["launches"], result["unread"]


def main(argv: list[str] | None = None) -> int:
    from ttr.scripts.bench_kernels import SHAPE_SETS, parse_selection, rows

    parser = argparse.ArgumentParser(prog="python -m ttr.scripts.kernel_resources",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default=None,
                        help=f"comma-separated ops (default: all of {','.join(rows())},conv; conv: the short convs)")
    parser.add_argument("--presets", default=None, help="comma-separated presets whose shapes to use")
    parser.add_argument("--shapes", default="preset", choices=SHAPE_SETS)
    parser.add_argument("--seqlen", type=int, default=128,
                        help="tokens of the interpreter run (default 128: two chunks); tiles do not depend on it")
    parser.add_argument("--arch", type=int, default=90, help="compute capability to compile for (default 90)")
    parser.add_argument("--launches", default=None,
                        help="read the captured launches from this JSON file if it exists, else capture and "
                             "write them there (one capture, compiled by several Triton installs)")
    parser.add_argument("--tuning", default=None, metavar="JSON",
                        help="launch overrides for index.TUNING during the capture, an object of stage name -> "
                             "launch parameters (e.g. '{\"wy_bwd\": {\"num_warps\": 8}}'), as ttr bench --stages "
                             "--sweep times them")
    parser.add_argument("--out", default=None, help="also write the table to this file")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    ops, presets = parse_selection(parser, args.ops, args.presets, [*rows(), "conv"])
    if args.seqlen < 1:
        parser.error("--seqlen must be positive")
    tuning = None
    if args.tuning is not None:
        from ttr.scripts.bench_utils import launch_overrides

        try:
            tuning = launch_overrides(json.loads(args.tuning))
        except json.JSONDecodeError as e:
            parser.error(f"--tuning: not JSON ({e.msg} at character {e.pos})")
        except ValueError as e:
            parser.error(f"--tuning: {e}")
        if args.launches and os.path.exists(args.launches):
            parser.error(f"--tuning applies to a capture, but --launches {args.launches} exists and would be read")
    from ttr.kernels.utils import interpreter_active

    if interpreter_active():
        print("kernel_resources: compiles for the GPU, so it runs without TRITON_INTERPRET (it starts the "
              "interpreter run itself)", file=sys.stderr)
        return 2
    try:
        _tool("cuobjdump")
        if args.launches and os.path.exists(args.launches):
            with open(args.launches) as f:
                launches = json.load(f)
        else:
            launches, unread = _capture_in_child(ops, presets, args.shapes, args.seqlen, tuning)
            if unread:
                print(f"kernel_resources: --tuning: no launch read {', '.join(unread)} (a misspelt stage, or one "
                      "of ops not selected)", file=sys.stderr)
            if args.launches:
                with open(args.launches, "w") as f:
                    json.dump(launches, f)
    except (OSError, RuntimeError, ValueError) as e:
        print(f"kernel_resources: {e}", file=sys.stderr)
        return 2
    import triton

    table, data = report(launches, args.arch)
    table = f"Triton {triton.__version__}, compute capability {args.arch}\n\n{table}"
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "arch": args.arch, "rows": data}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
