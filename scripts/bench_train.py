"""End-to-end training throughput: ttr's Gated DeltaNet 1.3B next to fla 0.6.0's model of the
same shape, both driven by ttr's training loop (``ttr.train.trainer.Trainer``).

    python -m ttr.scripts.bench_train [--models ttr,fla] [--steps 15] [--window 5]
        [--micro-batch 8] [--seq-len 4096] [--recipe configs/gated_deltanet-1.3b.toml] [--json OUT]

Same for both: the recipe's optimiser (AdamW, fp32 master weights, bf16 autocast), packed
batches of ``micro-batch x seq-len`` tokens from the embedded corpus with ``cu_seqlens`` (B = 8,
T = 4096 by default), vocab 32000, no activation checkpointing, no compile, no checkpoints. The
first ``steps - window`` steps warm up (Triton compilation, autotuning); tokens/s is measured
over the last ``window`` steps. MFU uses ttr's per-mixer FLOP count (``ttr.train.metrics``)
of each model against the GPU's dense bf16 peak. fla is imported only when asked for; on Hopper
with Triton < 3.7.1 fla 0.6.0 refuses the gated backward (fla issue #640), which
``--lift-fla-guard`` lets it run, for timing only (the output then says so).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

from ttr.scripts.bench_utils import LIFT_FLA_GUARD_HELP, lift_fla_guard
from ttr.train.cli import CONFIG_DIR
from ttr.train.config import load_config
from ttr.train.metrics import peak_flops, train_flops_per_token
from ttr.train.trainer import Trainer


class NoCheckpointTrainer(Trainer):
    def save(self):
        return None


class FlaAdapter(torch.nn.Module):
    """fla's ``GatedDeltaNetForCausalLM`` called the way the trainer calls ttr's model: packed
    ``[1, B*T]`` input with ``cu_seqlens``, loss = summed token loss / ``num_items_in_batch``
    (fla 0.6.0 implements the same convention)."""

    def __init__(self, ttr_config):
        super().__init__()
        import fla  # noqa: F401  (registers fla's classes)
        from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

        c = ttr_config
        self.config_fla = GatedDeltaNetConfig(
            hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers, num_heads=c.num_heads,
            head_dim=c.head_dim, expand_v=c.expand_v, conv_size=c.conv_size, use_short_conv=c.use_short_conv,
            intermediate_size=c.intermediate_size, vocab_size=c.vocab_size, norm_eps=c.rms_norm_eps,
            tie_word_embeddings=c.tie_word_embeddings, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
            max_position_embeddings=c.max_position_embeddings, use_cache=False,
        )
        self.model = GatedDeltaNetForCausalLM(self.config_fla)
        self.config = None  # the bench computes MFU itself

    def forward(self, input_ids, labels, cu_seqlens, num_items_in_batch, use_cache=False, return_logits=None):
        # the trainer passes ttr's Packing; fla takes the offsets tensor
        return self.model(input_ids=input_ids, labels=labels, cu_seqlens=cu_seqlens.cu_seqlens, use_cache=False,
                          num_items_in_batch=num_items_in_batch)


def bench(name: str, args) -> dict:
    overrides = [
        f"--run_dir={args.run_root}/{name}", "--data.source=embedded", f"--tokenizer.path={args.tokenizer}",
        "--model.overrides.vocab_size=32000", f"--train.micro_batch_size={args.micro_batch}",
        f"--train.seq_len={args.seq_len}", "--train.batch_tokens=0", f"--train.max_steps={args.steps}",
        "--optim.warmup_steps=2", "--train.export_at_end=false", "--train.precision=bf16",
        f"--log.every={args.window}", "--log.val_every=0", "--log.wandb=off", "--data.val_docs=0",
    ]
    cfg = load_config(args.recipe, overrides)
    shapes = {}

    def factory(cfg_, tokenizer):
        from ttr.train.trainer import build_model

        model = build_model(cfg_, tokenizer)
        shapes["config"] = model.config
        if name == "fla":
            model = FlaAdapter(model.config)
        shapes["fpt"] = train_flops_per_token(model, shapes["config"], cfg_.train.seq_len)
        return model

    trainer = NoCheckpointTrainer(cfg, overwrite=True, model_factory=factory)
    record = trainer.run()
    tps = record["tokens_per_s"]
    peak = peak_flops(trainer.acc.device)
    result = {
        "model": name, "params": trainer.num_params, "tokens_per_s": tps, "loss": record["loss"],
        "mfu": shapes["fpt"] * tps / peak if peak else None, "peak_mem_gib": record.get("peak_mem_gib"),
        "flops_per_token": shapes["fpt"], "micro_batch": args.micro_batch, "seq_len": args.seq_len,
    }
    del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_train", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="ttr,fla")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--recipe", default=str(CONFIG_DIR / "gated_deltanet-1.3b.toml"))
    parser.add_argument("--run-root", default="runs/bench_train")
    parser.add_argument("--tokenizer", default="", help="tokenizer path (default: train the embedded BPE)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--lift-fla-guard", action="store_true", help=LIFT_FLA_GUARD_HELP)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.steps <= args.window or args.window < 1 or args.steps % args.window:
        raise ValueError(f"--steps ({args.steps}) must be a multiple of --window ({args.window}) and larger")
    models = args.models.split(",")
    unknown = set(models) - {"ttr", "fla"}
    if unknown:
        raise ValueError(f"--models takes ttr and/or fla, got {sorted(unknown)}")
    note = lift_fla_guard() if args.lift_fla_guard and "fla" in models else None
    results = [bench(m, args) for m in models]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"\n{device}, torch {torch.__version__}, B={args.micro_batch}, T={args.seq_len}, bf16 autocast, "
          f"fp32 master weights, AdamW, last {args.window} of {args.steps} steps")
    print("| model | params | tokens/s | MFU | peak GiB | loss |")
    print("|---|---|---|---|---|---|")
    for r in results:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "n/a"
        print(f"| {r['model']} | {r['params'] / 1e9:.3f}B | {r['tokens_per_s']:,.0f} | {mfu} | {mem} | "
              f"{r['loss']:.3f} |")
    if note:
        print(note)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
