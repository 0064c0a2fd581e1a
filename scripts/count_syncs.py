"""Host synchronisations in one training step on a GPU: the calls that make the host wait for it.

    python -m ttr.scripts.count_syncs [--preset gated_deltanet_h2-340m | --recipe configs/x.toml]
        [--micro-batch 8] [--seq-len 2048] [--doc-len 600] [--unpacked] [--cu-seqlens cpu|gpu]
        [--sites 12]

The step is the trainer's: ``micro-batch`` rows of ``seq-len`` tokens packed into one
``[1, rows * seq_len]`` sequence whose ``cu_seqlens`` (documents of random length around
``--doc-len``, cut at every row start) come from the data loader on the CPU (``--cu-seqlens gpu``
moves them to the GPU first, as a caller outside the trainer may), or with ``--unpacked`` a plain
``[rows, seq_len]`` batch; bf16 autocast over fp32 weights, the fused loss summed and divided by
the number of targets, backward, gradient clipping and the AdamW step. A first step compiles and
autotunes, which synchronises; the second runs under ``torch.cuda.set_sync_debug_mode("warn")``,
where every synchronising call warns once. Prints the count per phase and the call sites that
synchronise most.
"""

from __future__ import annotations

import argparse
import collections
import sys
import warnings

import torch

from ttr.models import TTRForCausalLM, get_preset
from ttr.optim import build_optimizer

SYNC_WARNING = "synchronizing CUDA operation"


def _config(args):
    if not args.recipe:
        return get_preset(args.preset), args.micro_batch, args.seq_len
    from ttr.train.config import load_config

    cfg = load_config(args.recipe)
    overrides = dict(cfg.model.overrides)
    overrides.setdefault("vocab_size", 32000)
    return get_preset(cfg.model.preset, **overrides), cfg.train.micro_batch_size, cfg.train.seq_len


def _batch(rows: int, seq_len: int, doc_len: int, vocab: int, packed: bool, cu_device: str):
    """Token ids on the GPU and, packed, the document offsets (int32) on ``cu_device``."""
    ids = torch.randint(0, vocab, (rows, seq_len), device="cuda")
    if not packed:
        return ids, None
    gen = torch.Generator().manual_seed(0)
    starts = set(range(0, rows * seq_len, seq_len))
    pos = 0
    while pos < rows * seq_len:
        pos += int(torch.randint(doc_len // 2, 2 * doc_len, (1,), generator=gen))
        starts.add(min(pos, rows * seq_len))
    cu = torch.tensor(sorted(starts | {rows * seq_len}), dtype=torch.int32)
    return ids.view(1, -1), cu.to("cuda" if cu_device == "gpu" else "cpu")


def _phases(model, optimizer, ids, cu):
    """The step as (name, callable) phases, run in order."""
    state = {}

    def forward():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            state["loss"] = model(ids, labels=ids, cu_seqlens=cu, num_items_in_batch=float(ids.numel()),
                                  return_logits=False).loss

    def optimize():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return [("forward", forward), ("backward", lambda: state["loss"].backward()), ("optimizer", optimize)]


def _count(phases):
    """Synchronising calls per phase and per call site."""
    counts, sites = collections.Counter(), collections.Counter()
    for name, run in phases:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
        hits = [w for w in caught if SYNC_WARNING in str(w.message)]
        counts[name] += len(hits)
        sites.update(f"{w.filename}:{w.lineno}" for w in hits)
    return counts, sites


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="count_syncs", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gated_deltanet_h2-340m")
    parser.add_argument("--recipe", help="a TOML recipe: its model, micro-batch and sequence length")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--doc-len", type=int, default=600, help="typical document length (packed batches)")
    parser.add_argument("--unpacked", action="store_true", help="a plain [rows, seq_len] batch")
    parser.add_argument("--cu-seqlens", choices=("cpu", "gpu"), default="cpu",
                        help="where the offsets reach the model: the data loader's CPU tensor, or moved to the GPU")
    parser.add_argument("--sites", type=int, default=12, help="how many call sites to list")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        raise SystemExit("count_syncs needs a CUDA GPU: host synchronisations only exist there")
    torch.manual_seed(0)
    config, rows, seq_len = _config(args)
    model = TTRForCausalLM(config).cuda().train()
    optimizer = build_optimizer(model, lr=1e-4, weight_decay=0.1)
    ids, cu = _batch(rows, seq_len, args.doc_len, config.vocab_size, not args.unpacked, args.cu_seqlens)
    for _, run in _phases(model, optimizer, ids, cu):  # compile and autotune
        run()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        counts, sites = _count(_phases(model, optimizer, ids, cu))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    layout = "unpacked" if args.unpacked else f"packed, {cu.numel() - 1} documents, cu_seqlens on the {args.cu_seqlens}"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.recipe or args.preset}: "
          f"{rows} x {seq_len} tokens ({layout})")
    print("| phase | host syncs |")
    print("|---|---|")
    for name in ("forward", "backward", "optimizer"):
        print(f"| {name} | {counts[name]} |")
    print(f"| step | {sum(counts.values())} |")
    for site, n in sites.most_common(args.sites):
        print(f"{n:6d}  {site}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
