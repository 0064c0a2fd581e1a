"""Benchmark sliding-window and full causal attention on one GPU.

Rows (bf16, H heads of D, ``tokens`` per batch, so B = tokens / T):
  swa   ttr Triton kernel | SDPA with an explicit boolean band mask | flex_attention (compiled)
        with a sliding-window block mask (built once, outside the timing)
  full  ttr Triton kernel (window None) | SDPA is_causal (flash backend)
Columns: median ms of the forward and of forward+backward, and the peak memory of one
forward+backward above the inputs (MiB). A backend that fails prints its row with the error and
the run goes on.

    python -m ttr.scripts.bench_attention                # the table of docs/benchmarks.md
    python -m ttr.scripts.bench_attention --seqlens 4096 --window 1024 --reps 10
    python -m ttr.scripts.bench_attention --configs      # each autotune candidate of each kernel alone
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F

from ttr.kernels.attention import attention
from ttr.scripts.bench_utils import peak_mib, time_ms


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--tokens", type=int, default=16384, help="tokens per batch (B = tokens // T)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
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
        o, lse = flash.attention_fwd(q, k, v, None, b, t, win, scale)
        delta = (o.float() * do.float()).sum(-1).t().contiguous()
        consts = dict(HQ=h, G=1, D=d, BD=triton.next_power_of_2(d), GH=flash.GROUP_HEADS, VARLEN=False)
        for name, kernel, configs in kernels:
            for c in configs:
                m = c.kwargs
                if name == "fwd":
                    grid = triton.cdiv(t, m["BM"]) * b * h
                    xs = (q, k, v, torch.empty_like(q), torch.empty_like(lse), None, b * t, t, win, scale * flash.LOG2E,
                          b * h)
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


def measure(forward, inputs, reps, warmup):
    """(fwd ms, fwd+bwd ms, peak MiB) of ``forward(*inputs)``."""
    do = torch.randn_like(forward(*inputs))

    def fwd():
        with torch.no_grad():
            forward(*inputs)

    def fwd_bwd():
        torch.autograd.grad(forward(*inputs), inputs, do)

    fwd_bwd()  # compile / autotune before any timing
    return time_ms(fwd, reps, warmup), time_ms(fwd_bwd, reps, warmup), peak_mib(fwd_bwd)


def backends(kind, t, window, scale):
    """(name, layout, build) per row; ``build()`` returns the forward (built inside the row's try,
    so a missing flex_attention or an OOM on the mask becomes that row's error). Layout "bthd" is
    ttr's ``[B, T, H, D]``, "bhtd" torch's ``[B, H, T, D]``."""
    if kind == "full":
        return [
            ("ttr", "bthd", lambda: lambda q, k, v: attention(q, k, v, scale=scale)),
            ("sdpa causal (flash)", "bhtd", lambda: sdpa_flash_causal(scale)),
        ]
    return [
        ("ttr", "bthd", lambda: lambda q, k, v: attention(q, k, v, window=window, scale=scale)),
        ("sdpa + mask", "bhtd", lambda: sdpa_masked(t, window, scale)),
        ("flex_attention", "bhtd", lambda: flex_swa(t, window, scale)),
    ]


def sdpa_flash_causal(scale):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def forward(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    return forward


def sdpa_masked(t, window, scale):
    o_t = torch.arange(t, device="cuda")
    diff = o_t[:, None] - o_t[None, :]
    mask = (diff >= 0) & (diff < window)
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def flex_swa(t, window, scale):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def band(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    block_mask = create_block_mask(band, B=None, H=None, Q_LEN=t, KV_LEN=t, device="cuda")
    # one compile per (T, grad mode): keep dynamo from falling back to eager after 8 of them
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, 64)
    compiled = torch.compile(flex_attention)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask, scale=scale)


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention needs a CUDA GPU")
    import triton

    dtype = getattr(torch, args.dtype)
    if args.configs:
        time_configs(args, dtype)
        return 0
    h, d = args.heads, args.head_dim
    scale = d**-0.5
    print(f"# attention: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"commit {commit()}, {args.dtype}, H={h}, D={d}, {args.tokens} tokens/batch, window {args.window}, "
          f"median of {args.reps}")
    print("| mask | T | B | backend | fwd ms | fwd+bwd ms | peak MiB |")
    print("|---|---|---|---|---|---|---|")
    for kind in ("swa", "full"):
        for t in args.seqlens:
            b = max(1, args.tokens // t)
            for name, layout, build in backends(kind, t, args.window, scale):
                row = f"| {kind} | {t} | {b} | {name} |"
                inputs = None
                try:
                    shape = (b, t, h, d) if layout == "bthd" else (b, h, t, d)
                    inputs = [torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3)]
                    fwd, fwd_bwd, mem = measure(build(), inputs, args.reps, args.warmup)
                    print(f"{row} {fwd:.3f} | {fwd_bwd:.3f} | {mem:.0f} |", flush=True)
                except Exception as err:  # report the failing backend and keep going
                    msg = f"{type(err).__name__}: {err}".splitlines()[0][:160]
                    print(f"{row} error | {msg} | |", flush=True)
                del inputs
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
