"""End-to-end model benchmark (GPU): training throughput against fla, and recurrent decoding.

1. Training: tokens/s of forward + backward + AdamW step for ``--preset`` (default
   ``gated_deltanet-1.3b``: hidden 2048, 24 layers, 16 heads of 128, vocab 32000) at
   ``--batch`` x ``--seq-len`` (8 x 4096), fp32 master weights under bf16 autocast, no
   activation checkpointing, and peak memory; then fla 0.6.0's ``GatedDeltaNetForCausalLM`` of
   the same shape in the same process (fla imported lazily; a failure becomes a row with the error).
   On Hopper with Triton < 3.7.1 fla refuses its gated backward (fla issue #640); ``--lift-fla-guard``
   lets it run for timing only, and the output then says so.
2. Decoding: bf16 weights, a ``--prompt-len`` (1024) token prompt prefilled with the chunk
   kernels, then ``--gen-len`` tokens decoded one at a time with the recurrent kernels at batch 1
   and 64: tokens/s and allocated memory after 1/4, 1/2 and all of the generated tokens (constant
   for recurrent layers: the state does not grow with the generated length).

Usage: ``python -m ttr.scripts.bench_model [--steps 10] [--no-fla] [--out table.md]``.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from ttr.scripts.bench_utils import LIFT_FLA_GUARD_HELP, lift_fla_guard

GIB = 2**30


def _sync() -> None:
    torch.cuda.synchronize()


def _reset() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def build_ttr(preset: str):
    from ttr.models import TTRForCausalLM, get_preset

    return TTRForCausalLM(get_preset(preset))


def build_fla(ttr_config):
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

    cfg = GatedDeltaNetConfig(
        hidden_size=ttr_config.hidden_size,
        num_hidden_layers=ttr_config.num_hidden_layers,
        num_heads=ttr_config.num_heads,
        head_dim=ttr_config.head_dim,
        expand_v=ttr_config.expand_v,
        intermediate_size=ttr_config.intermediate_size,
        vocab_size=ttr_config.vocab_size,
        conv_size=ttr_config.conv_size,
    )
    return GatedDeltaNetForCausalLM(cfg)


def train_throughput(model, vocab: int, batch: int, seq_len: int, steps: int, warmup: int) -> dict:
    model = model.cuda().train()
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    ids = torch.randint(0, vocab, (batch, seq_len), device="cuda")
    elapsed, losses = 0.0, []
    for step in range(warmup + steps):
        _sync()
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync()
        if step >= warmup:
            elapsed += time.perf_counter() - start
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated() / GIB
    del model, opt, ids
    _reset()
    return {
        "params": params,
        "tokens_per_s": batch * seq_len * steps / elapsed,
        "peak_gib": peak,
        "loss_first_last": (losses[0], losses[-1]),
    }


@torch.no_grad()
def decode_throughput(model, vocab: int, batch: int, prompt_len: int, gen_len: int) -> dict:
    prompt = torch.randint(0, vocab, (batch, prompt_len), device="cuda")
    out = model(prompt, use_cache=True, logits_to_keep=1)
    cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    marks = {gen_len // 4, gen_len // 2, gen_len}
    memory = {}
    _sync()
    start = time.perf_counter()
    for i in range(1, gen_len + 1):
        out = model(token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        if i in marks:
            memory[i] = torch.cuda.memory_allocated() / GIB
    _sync()
    elapsed = time.perf_counter() - start
    return {"tokens_per_s": batch * gen_len / elapsed, "memory_gib": memory}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gated_deltanet-1.3b")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-fla", action="store_true", help="skip the fla comparison row")
    parser.add_argument("--lift-fla-guard", action="store_true", help=LIFT_FLA_GUARD_HELP)
    parser.add_argument("--no-train", action="store_true", help="skip the training rows")
    parser.add_argument("--no-decode", action="store_true", help="skip the decoding rows")
    parser.add_argument("--decode-batches", default="1,64")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--gen-len", type=int, default=512)
    parser.add_argument("--out", help="also write the tables (markdown) to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("bench_model needs a CUDA GPU")

    import triton

    import ttr
    from ttr.models import get_preset

    lines = [
        f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}, "
        f"ttr {ttr.__version__}; preset {args.preset}",
        "",
    ]
    cfg = get_preset(args.preset)
    printed = 0
    if not args.no_train:
        lines += [
            f"Training, B={args.batch} T={args.seq_len}, bf16 autocast, fp32 master weights, AdamW, "
            f"{args.steps} timed steps after {args.warmup} warm-up",
            "",
            "| model | params | tokens/s | peak GiB | loss first -> last |",
            "|---|---|---|---|---|",
        ]
        rows = [("ttr " + args.preset, lambda: build_ttr(args.preset))]
        note = lift_fla_guard() if args.lift_fla_guard and not args.no_fla else None
        if not args.no_fla:
            rows.append(("fla 0.6.0 GatedDeltaNetForCausalLM", lambda: build_fla(cfg)))
        for name, build in rows:
            torch.manual_seed(0)
            try:
                r = train_throughput(
                    build(), cfg.vocab_size, args.batch, args.seq_len, args.steps, args.warmup
                )
            except Exception as exc:  # a failed row is reported, not fatal (e.g. fla not installed)
                _reset()
                lines.append(f"| {name} | - | error: {type(exc).__name__}: {str(exc)[:200]} | - | - |")
                continue
            first, last = r["loss_first_last"]
            lines.append(
                f"| {name} | {r['params'] / 1e9:.3f}B | {r['tokens_per_s'] / 1e3:.1f}K | {r['peak_gib']:.1f} | "
                f"{first:.3f} -> {last:.3f} |"
            )
        if note:
            lines += ["", note]
        print("\n".join(lines), flush=True)
        printed = len(lines)
    if not args.no_decode:
        torch.manual_seed(0)
        model = build_ttr(args.preset).to(device="cuda", dtype=torch.bfloat16).eval()
        q = sorted({args.gen_len // 4, args.gen_len // 2, args.gen_len})
        lines += [
            "",
            f"Decoding, bf16 weights, {args.prompt_len}-token prompt, {args.gen_len} generated tokens "
            "(recurrent kernels); allocated GiB after the given number of generated tokens",
            "",
            "| batch | tokens/s | " + " | ".join(f"GiB @ {n}" for n in q) + " |",
            "|---|---|" + "---|" * len(q),
        ]
        for batch in (int(b) for b in args.decode_batches.split(",")):
            r = decode_throughput(model, cfg.vocab_size, batch, args.prompt_len, args.gen_len)
            mem = " | ".join(f"{r['memory_gib'][n]:.3f}" for n in q)
            lines.append(f"| {batch} | {r['tokens_per_s']:.1f} | {mem} |")
    print("\n".join(lines[printed:]))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
