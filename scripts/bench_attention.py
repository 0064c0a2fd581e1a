"""Benchmark causal and sliding-window attention on one GPU: ttr's kernel, the dispatched op, and
every fused kernel of torch that computes the same function.

Cases: full causal and window ``--window``, plain batches (B = tokens / T) and packed documents
(one row of ``tokens``: documents of exponential random lengths, mean ``--doc-mean``, fixed
seed, cut at every T as ``ttr train`` packs them), at each ``--seqlens`` T; then the presets'
attention shapes (``models/presets.py``: 1.3B 16 heads and 340M 8 heads of 128, 8 rows of 4096
packed, full for ``transformer``, window 2048 for the SWA hybrids). bf16 by default.
Rows per case (median ms of the forward and of forward+backward, waiting for each call; the
kernels' own fwd+bwd time, ``gpu_ms``; peak MiB above the inputs):
  ttr               the Triton kernel (what TTR_ATTENTION=triton runs)
  auto -> <path>    ``ttr.kernels.attention.attention`` as dispatched (``dispatch.ROUTES``)
  varlen            ``torch.nn.attention.varlen.varlen_attn`` (where the installed torch has it)
  sdpa <backend>    SDPA restricted to one backend: ``is_causal`` for full plain batches, else the
                    cheapest mask it accepts (a dense boolean [T, T] band / block-diagonal mask)
  sdpa <backend> (views)  full plain batches: the same on [B, H, T, D] views of [B, T, H, D] tensors
  flex_attention    compiled, with a block mask built outside the timing (``--flex``; compiles
                    once per shape and grad mode, so it is opt-in)
A row that cannot run says ``n/a: <reason>`` and the run goes on. The end prints, per case, the
fastest exact path against the fastest SDPA backend and the ``ROUTES`` / ``SDPA_BACKENDS`` the
measurements call for; ``--json`` writes every row.

    python -m ttr.scripts.bench_attention --json attention.json
    python -m ttr.scripts.bench_attention --seqlens 4096 --window 1024 --reps 10 --no-presets
    python -m ttr.scripts.bench_attention --configs      # each autotune candidate of each kernel alone
    python -m ttr.scripts.bench_attention --layouts packed --reps 10
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F

from ttr.kernels.attention import attention, dispatch, flash
from ttr.kernels.common.index import prepare_packing
from ttr.scripts.bench_utils import gpu_ms, peak_mib, time_ms

# the presets' attention layers at their training shapes: (name, heads, head dim, window, rows, T)
PRESET_SHAPES = [
    ("transformer-1.3b", 16, 128, None, 8, 4096),
    ("gated_deltanet_h1/h2-1.3b", 16, 128, 2048, 8, 4096),
    ("transformer-340m", 8, 128, None, 8, 4096),
    ("gated_deltanet_h1/h2-340m", 8, 128, 2048, 8, 4096),
]
# the tests run the script's rows on the CPU (tiny shapes, stand-in timers)
DEVICE = "cuda"
SDPA_NAMES = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--tokens", type=int, default=16384, help="tokens per batch (B = tokens // T)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (GQA); default: --heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--doc-mean", type=int, default=1024, help="mean document length of the packed cases")
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layouts", nargs="+", choices=["plain", "packed"], default=["plain", "packed"],
                   help="the cases' layouts (the presets' shapes are packed)")
    p.add_argument("--no-presets", action="store_true", help="leave out the presets' shapes")
    p.add_argument("--flex", action="store_true", help="add compiled flex_attention rows")
    p.add_argument("--json", type=Path, default=None, help="write every row here")
    p.add_argument("--configs", action="store_true",
                   help="time each autotune config of the forward and backward kernels alone (window rows)")
    return p.parse_args(argv)


def time_configs(args, dtype) -> None:
    """Every autotune candidate of the two attention kernels (forward; backward = dK/dV and dQ
    programs in one launch), launched alone with that config on the sliding-window rows (one
    sequence length per ``--seqlens``): which config wins and by how much."""
    import triton

    from ttr.kernels.attention import flash

    h, d = args.heads, args.head_dim
    wide = triton.next_power_of_2(d) > 128
    kernels = [
        ("fwd", flash.attn_fwd_kernel, flash.FWD_CONFIGS_WIDE if wide else flash.FWD_CONFIGS),
        ("bwd", flash.attn_bwd_kernel, flash.BWD_CONFIGS_WIDE if wide else flash.BWD_CONFIGS),
    ]
    print("| T | B | kernel | tiles | warps | stages | ms |")
    print("|---|---|---|---|---|---|---|")
    for t in args.seqlens:
        b = max(1, args.tokens // t)
        q, k, v, do = (torch.randn(b * t, h, d, device="cuda", dtype=dtype) for _ in range(4))
        win, scale = min(args.window, t), d**-0.5
        o, lse = flash.attention_fwd(q, k, v, flash.SequencePlan(None, b, t, None), win, scale)
        delta = (o.float() * do.float()).sum(-1).t().contiguous()
        consts = dict(HQ=h, G=1, D=d, BD=triton.next_power_of_2(d), GH=flash.GROUP_HEADS, NP=16, VARLEN=False,
                      COMPACT=False)
        for name, kernel, configs in kernels:
            for c in configs:
                m = c.kwargs
                if name == "fwd":
                    grid = triton.cdiv(t, m["BM"]) * b * h
                    xs = (q, k, v, torch.empty_like(q), torch.empty_like(lse), None, b * t, t, win, scale * flash.LOG2E,
                          b)
                    tiles = f"{m['BM']} x {m['BN']}"
                else:
                    grid = (triton.cdiv(t, m["BN1"]) + triton.cdiv(t, m["BM2"])) * b * h
                    xs = (q, k, v, do, lse, delta, *(torch.empty_like(q) for _ in range(3)), None, b * t, t, win,
                          scale * flash.LOG2E, scale, b)
                    tiles = f"dK/dV {m['BM1']} x {m['BN1']}, dQ {m['BM2']} x {m['BN2']}"

                # the jitted kernel under its autotuner (the bare kernel under the interpreter)
                base = kernel.fn if isinstance(kernel, triton.runtime.Autotuner) else kernel

                def launch(base=base, grid=grid, xs=xs, consts=consts, c=c):
                    base[(grid,)](*xs, **consts, **c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)

                try:
                    ms = f"{time_ms(launch, args.reps, args.warmup):.3f}"
                except Exception as err:  # a config that does not fit this GPU
                    ms = f"error: {type(err).__name__}"
                print(f"| {t} | {b} | {name} | {tiles} | {c.num_warps} | {c.num_stages} | {ms} |", flush=True)


def measure(forward, inputs, layout, reps, warmup):
    """(fwd ms, fwd+bwd ms, fwd+bwd GPU ms or None, peak MiB, whether the output is contiguous in ttr's
    ``[B, T, H, D]``, so a layer's reshape to ``[B, T, H * D]`` copies nothing) of
    ``forward(*inputs)``. The wall-clock columns wait for each call, so they include the host's
    time before the first kernel; the GPU column (``gpu_ms``) is the kernels' own time, what a
    training step whose host runs ahead of the GPU pays (None where the host never got ahead)."""
    out = forward(*inputs)
    contiguous = (out if layout == "bthd" else out.transpose(1, 2)).is_contiguous()
    do = torch.randn_like(out)

    def fwd():
        with torch.no_grad():
            forward(*inputs)

    def fwd_bwd():
        torch.autograd.grad(forward(*inputs), inputs, do)

    fwd_bwd()  # compile / autotune before any timing
    try:  # a second of sleep at most: a call that waits for the GPU never lets the host ahead
        gpu = gpu_ms(fwd_bwd, calls=reps, max_sleep_cycles=2**31) if DEVICE == "cuda" else time_ms(fwd_bwd, reps, warmup)
    except RuntimeError:
        gpu = None
    return time_ms(fwd, reps, warmup), time_ms(fwd_bwd, reps, warmup), gpu, peak_mib(fwd_bwd), contiguous


def packed_bounds(tokens: int, row: int, mean: int, seed: int = 0) -> list[int]:
    """Document starts and the end of ``tokens`` packed in rows of ``row`` (``train/data.pack``
    cuts a document at every row end), lengths exponential with mean ``mean``, at least 1."""
    g = torch.Generator().manual_seed(seed)
    bounds, pos = [0], 0
    while pos < tokens:
        length = max(1, int(torch.empty(1).exponential_(1.0 / mean, generator=g)))
        while length > 0 and pos < tokens:
            take = min(length, row - pos % row, tokens - pos)
            pos, length = pos + take, length - take
            bounds.append(pos)
    return bounds


def band_mask(t, window, bounds, device):
    """Dense boolean mask SDPA accepts: causal band, block-diagonal over documents when packed."""
    o_t = torch.arange(t, device=device)
    diff = o_t[:, None] - o_t[None, :]
    mask = diff >= 0
    if window is not None:
        mask &= diff < window
    if bounds is not None:
        doc = torch.bucketize(o_t, torch.tensor(bounds[1:], device=device), right=True)
        mask &= doc[:, None] == doc[None, :]
    return mask


def sdpa_row(backend, full_plain, t, window, bounds, scale, gqa):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = getattr(SDPBackend, SDPA_NAMES[backend])
    mask = None if full_plain else band_mask(t, window, bounds, DEVICE)

    def forward(q, k, v):
        with sdpa_kernel(chosen):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=full_plain, scale=scale,
                                                  enable_gqa=gqa)

    return forward


def transposed(forward):
    """``forward`` of ``[B, H, T, D]`` tensors called on ``[B, T, H, D]`` ones through views."""
    return lambda q, k, v: forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def flex_row(t, window, bounds, scale, gqa):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc = None
    if bounds is not None:
        o_t = torch.arange(t, device=DEVICE)
        doc = torch.bucketize(o_t, torch.tensor(bounds[1:], device=DEVICE), right=True)

    def allowed(b, h, q_idx, kv_idx):
        keep = q_idx >= kv_idx
        if window is not None:
            keep = keep & (q_idx - kv_idx < window)
        if doc is not None:
            keep = keep & (doc[q_idx] == doc[kv_idx])
        return keep

    block_mask = create_block_mask(allowed, B=None, H=None, Q_LEN=t, KV_LEN=t, device=DEVICE)
    # one compile per (shape, grad mode): keep dynamo from falling back to eager after 8 of them
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, 64)
    compiled = torch.compile(flex_attention)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)


def rows_of_case(args, window, bounds, t, hq, hkv, d):
    """(name, layout, build) per row of a case of ``t`` tokens per row (all of them when packed); ``build()`` returns the forward, inside the row's try, so a
    missing API or an out-of-memory mask becomes that row's ``n/a``. Layout "bthd" is ttr's
    ``[B, T, H, D]``, "bhtd" SDPA's ``[B, H, T, D]``."""
    scale, gqa = d**-0.5, hq != hkv
    cu = None if bounds is None else torch.tensor(bounds, device=DEVICE, dtype=torch.int32)
    # ttr's ops take the packing resolved once (as a model's forward passes it), so no call copies
    # the bounds to the host
    packing = None if cu is None else prepare_packing(cu, t, device=cu.device)
    max_len = t if bounds is None else max(e - s for s, e in zip(bounds[:-1], bounds[1:]))
    full_plain = bounds is None and (window is None or window >= t)

    def varlen():
        api = dispatch.varlen_api()
        if api is None:
            raise RuntimeError("torch.nn.attention.varlen.varlen_attn is not in this torch")
        if not (window is None or window >= max_len or api.window):
            raise RuntimeError("this torch's varlen_attn has no window_size")
        if gqa and not api.gqa:
            raise RuntimeError("this torch's varlen_attn has no enable_gqa")
        return lambda q, k, v: dispatch.varlen_causal(q, k, v, cu, max_len, window, scale)

    def auto():
        return lambda q, k, v: attention(q, k, v, window=window, scale=scale, cu_seqlens=packing)

    rows = [
        ("ttr", "bthd", lambda: lambda q, k, v: flash.triton_attention(q, k, v, window=window, scale=scale,
                                                                        cu_seqlens=packing)),
        ("auto", "bthd", auto),
        ("varlen", "bthd", varlen),
    ]
    for backend in SDPA_NAMES:
        rows.append((f"sdpa {backend}" + ("" if full_plain else " + mask"), "bhtd",
                     lambda backend=backend: sdpa_row(backend, full_plain, t, window, bounds, scale, gqa)))
    if full_plain:
        # SDPA on [B, H, T, D] views of ttr's [B, T, H, D] tensors: what a model whose projections
        # give [B, T, H, D] passes it (ttr's dispatch, HF Llama); the rows above time contiguous inputs
        for backend in SDPA_NAMES:
            rows.append((f"sdpa {backend} (views)", "bthd",
                         lambda backend=backend: transposed(sdpa_row(backend, True, t, window, bounds, scale, gqa))))
    if args.flex:
        rows.append(("flex_attention", "bhtd", lambda: flex_row(t, window, bounds, scale, gqa)))
    return rows


def auto_path(window, bounds, max_len, hq, hkv, d, dtype) -> str:
    q = torch.empty(1, 1, hq, d, device=DEVICE, dtype=dtype)
    k = torch.empty(1, 1, hkv, d, device=DEVICE, dtype=dtype)
    return dispatch.choose_path(q, k, window=window, scale=d**-0.5, packed=bounds is not None, max_len=max_len)


def run_case(args, results, label, window, packed, b, t, hq, hkv, d, dtype):
    """Time every row of one case; append a dict per row to ``results`` and print it."""
    tokens = b * t
    bounds = packed_bounds(tokens, t, args.doc_mean) if packed else None
    shape_b = 1 if packed else b
    shape_t = tokens if packed else t
    max_len = t if bounds is None else max(e - s for s, e in zip(bounds[:-1], bounds[1:]))
    full = window is None or window >= max_len
    case = {"case": label, "mask": "full" if window is None else f"window {window}",
            "layout": "packed" if packed else "plain", "T": t, "B": b, "Hq": hq, "Hkv": hkv, "D": d,
            "docs": None if bounds is None else len(bounds) - 1, "route": ["full" if full else "window",
                                                                            "packed" if packed else "plain"]}
    for name, layout, build in rows_of_case(args, window, bounds, shape_t, hq, hkv, d):
        if name == "auto":
            name = f"auto -> {auto_path(window, bounds, max_len, hq, hkv, d, dtype)}"
        row = dict(case, row=name)
        inputs = None
        try:
            dims = [(shape_b, shape_t, h, d) if layout == "bthd" else (shape_b, h, shape_t, d) for h in (hq, hkv, hkv)]
            inputs = [torch.randn(s, device=DEVICE, dtype=dtype, requires_grad=True) for s in dims]
            fwd, fwd_bwd, gpu, mem, contiguous = measure(build(), inputs, layout, args.reps, args.warmup)
            row.update(fwd_ms=round(fwd, 4), fwd_bwd_ms=round(fwd_bwd, 4), peak_mib=round(mem), out_contiguous=contiguous)
            if gpu is not None:
                row["gpu_fwd_bwd_ms"] = round(gpu, 4)
            gpu_cell = "host-bound" if gpu is None else f"{gpu:.3f}"
            cells = f"{fwd:.3f} | {fwd_bwd:.3f} | {gpu_cell} | {mem:.0f} | {'yes' if contiguous else 'no'}"
        except Exception as err:  # report the backend that cannot run this case and keep going
            reason = f"{type(err).__name__}: {err}".splitlines()[0][:140].replace("|", "/")
            row["na"] = reason
            cells = f"n/a: {reason} | | | |"
        del inputs
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        results.append(row)
        docs = "" if case["docs"] is None else f" ({case['docs']} docs)"
        print(f"| {label} | {case['mask']} | {case['layout']}{docs} | {t} | {b} | {name} | {cells} |", flush=True)


def summarise(results, key="fwd_bwd_ms") -> None:
    """Per case: the fastest exact path (ttr, varlen, SDPA is_causal) and the fastest SDPA backend
    (masked ones included), and auto against that; then the routes the measurements call for. By
    ``key``: the wall clock per call, or ``gpu_fwd_bwd_ms``, the kernels' own time."""
    inf = float("inf")
    cases: dict = {}
    for r in results:
        if key in r:
            cases.setdefault((r["case"], r["mask"], r["layout"], r["T"], tuple(r["route"])), []).append(r)
    what = "GPU" if key.startswith("gpu") else "wall"
    print(f"\nBy {what} time (fwd+bwd ms):")
    print("| case | mask | layout | T | fastest path | auto | best SDPA | auto / best SDPA |")
    print("|---|---|---|---|---|---|---|---|")
    wins: dict = {}
    sdpa_totals: dict = {}
    for (label, mask, layout, t, kind), rows in cases.items():
        by = {r["row"]: r[key] for r in rows}
        auto = next((ms for name, ms in by.items() if name.startswith("auto")), None)
        sdpa = {name: ms for name, ms in by.items() if name.startswith("sdpa")}
        exact = {"triton": by.get("ttr"), "varlen": by.get("varlen")}
        causal = {name: ms for name, ms in sdpa.items() if "mask" not in name}
        if causal:
            exact["sdpa"] = min(causal.values())
            for name, ms in causal.items():
                sdpa_totals[name] = sdpa_totals.get(name, 0.0) + ms
        exact = {p: ms for p, ms in exact.items() if ms is not None}
        if not exact:
            continue
        best = min(exact, key=exact.get)
        best_sdpa = min(sdpa.values()) if sdpa else None
        wins.setdefault(kind, []).append(exact)
        ratio = "" if auto is None or best_sdpa is None else f"{auto / best_sdpa:.2f}"
        print(f"| {label} | {mask} | {layout} | {t} | {best} {exact[best]:.3f} | "
              f"{'' if auto is None else f'{auto:.3f}'} | {'' if best_sdpa is None else f'{best_sdpa:.3f}'} | {ratio} |")
    print(f"\nROUTES the {what} times call for (a fused path leads only where it beats triton at every shape):")
    for kind, shapes in wins.items():
        fused = [p for p in ("sdpa", "varlen") if all(s.get(p, inf) < s.get("triton", inf) for s in shapes)]
        fused.sort(key=lambda p: sum(s[p] for s in shapes))
        print(f"  {kind}: {tuple(fused + ['triton'])}   (now {dispatch.ROUTES.get(kind)})")
    order = sorted(sdpa_totals, key=sdpa_totals.get)
    print(f"SDPA_BACKENDS, fastest first over the full causal plain cases: {order}")


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv=None) -> int:
    args = parse_args(argv)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_attention needs a CUDA GPU")
    import triton

    dtype = getattr(torch, args.dtype)
    if args.configs:
        time_configs(args, dtype)
        return 0
    hq, d = args.heads, args.head_dim
    hkv = args.kv_heads or hq
    api = dispatch.varlen_api()
    env = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, "torch": torch.__version__, "triton": triton.__version__,
           "commit": commit(), "dtype": args.dtype, "reps": args.reps,
           "varlen_attn": None if api is None else {"window": api.window, "gqa": api.gqa, "scale": api.scale},
           "routes": {"/".join(k): list(v) for k, v in dispatch.ROUTES.items()},
           "sdpa_backends": [b.name for b in dispatch.SDPA_BACKENDS]}
    print(f"# attention: {env['gpu']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}, "
          f"{args.dtype}, median of {args.reps}; varlen_attn: {env['varlen_attn']}")
    print("| case | mask | layout | T | B | row | fwd ms | fwd+bwd ms | fwd+bwd GPU ms | peak MiB | out contiguous |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    results: list = []
    for packed in [layout == "packed" for layout in args.layouts]:
        for window in (None, args.window):
            for t in args.seqlens:
                run_case(args, results, f"H{hq}/{hkv} D{d}", window, packed, max(1, args.tokens // t), t, hq, hkv, d,
                         dtype)
    if not args.no_presets:
        for label, h, dim, window, rows, t in PRESET_SHAPES:
            run_case(args, results, label, window, True, rows, t, h, h, dim, dtype)
    summarise(results)
    summarise(results, key="gpu_fwd_bwd_ms")
    if args.json is not None:
        args.json.write_text(json.dumps({"env": env, "rows": results}, indent=1))
        print(f"rows written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
