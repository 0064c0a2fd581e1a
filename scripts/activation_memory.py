"""Activation memory a preset keeps for the backward, per op, per layer and per token, and the
training peak it predicts; with ``--cuda``, the peak measured on the GPU.

    python -m ttr.scripts.activation_memory PRESET [--tokens N] [--batch 8] [--seq-len 4096]
    python -m ttr.scripts.activation_memory PRESET --cuda [--batch 8] [--seq-len 4096] [--steps 2]

Ledger (default, CPU): one block of every layer type in the preset runs its forward on ``N`` and
on ``2N`` packed tokens (two documents of whole 64-token chunks, so that what a kernel keeps per
chunk counts per token) of input that requires grad, as the model's residual stream does, under
autocast: fp16 on the CPU (bf16's bytes; the Triton interpreter cannot load bf16), with the Triton
kernels under the interpreter (the script sets ``TTR_KERNEL_BACKEND=triton`` and starts itself
again with ``TRITON_INTERPRET=1`` when that is unset). ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor the graph keeps; each
distinct storage is counted once, whole (a saved view keeps its whole base storage alive), under
the source line that saved it first (the layer's line, and the kernel's ``save_for_backward``
when a custom autograd function saved it). Parameters are left out; autocast's cast copies of
the weights do not grow with the tokens, so the two lengths split every line's bytes into a
per-token part and a fixed part. ``head`` is the final norm with the fused linear cross-entropy.

Prediction at ``batch x seq-len`` tokens: the per-token bytes of every layer times the tokens,
the fixed parts, and 16 bytes per parameter (fp32 weights, fp32 grads, AdamW's two fp32
moments). It counts every gradient as resident next to every activation, an upper bound on what
the backward holds at once, and leaves out the allocator's fragmentation and the kernels'
transient buffers.

``--cuda``: the ledger on the GPU in bf16, then the real thing: the whole preset in fp32 with bf16
autocast and fused AdamW, ``--steps`` training steps on ``[1, batch * seq-len]`` packed tokens
(``cu_seqlens`` every ``seq-len``), ``torch.cuda.max_memory_allocated`` after each step.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent  # the ttr package
SELF = Path(__file__).resolve()
GiB = 2**30


def _site() -> str:
    """``layer line | kernel line`` of the innermost frames of ttr's models/ and kernels/."""
    layer = kernel = None
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename).resolve()
        if path == SELF or ROOT not in path.parents:
            continue
        rel = path.relative_to(ROOT).as_posix()
        where = f"{rel}:{frame.lineno} {(frame.line or '').strip()[:60]}"
        if kernel is None and rel.startswith("kernels/"):
            kernel = where
        if rel.startswith("models/") and rel != "models/ops.py":
            layer = where
            break
    return " | ".join(s for s in (layer, kernel) if s) or "?"


class Ledger:
    """The storages saved for the backward inside ``with ledger:``, each once, by first saver."""

    def __init__(self, exclude: set[int]):
        self.exclude = exclude
        self.kept: list[torch.Tensor] = []
        self.entries: dict[int, tuple[str, int]] = {}  # storage pointer -> (site, bytes)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in self.exclude and ptr not in self.entries:
            self.entries[ptr] = (_site(), storage.nbytes())
            self.kept.append(t)  # the storage stays alive, so its address is not reused meanwhile
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    def by_site(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for site, nbytes in self.entries.values():
            out[site] += nbytes
        return out


def _autocast(device: str):
    return torch.autocast(device, dtype=torch.bfloat16 if device == "cuda" else torch.float16)


def saved_per_site(run, params, tokens: int) -> dict[str, tuple[float, int]]:
    """site -> (bytes per token, fixed bytes) that ``run(n)``'s forward keeps for the backward,
    from ``n = tokens`` and ``n = 2 * tokens``; ``params``' storages are left out."""
    exclude = {p.untyped_storage().data_ptr() for p in params}
    sizes = []
    for n in (tokens, 2 * tokens):
        with Ledger(exclude) as ledger:
            out = run(n)
        sizes.append(ledger.by_site())
        del out, ledger
    sites = sorted(set(sizes[0]) | set(sizes[1]))
    return {s: ((sizes[1].get(s, 0) - sizes[0].get(s, 0)) / tokens,
                2 * sizes[0].get(s, 0) - sizes[1].get(s, 0)) for s in sites}


def block_ledger(config, layer_idx: int, tokens: int, device: str) -> dict[str, tuple[float, int]]:
    """``saved_per_site`` of block ``layer_idx`` on packed tokens (two documents) of input that
    requires grad, as the residual stream does."""
    from transformers import initialization as init

    from ttr.models.modeling import TTRBlock

    block = TTRBlock(config, layer_idx)
    # the mixers' decays and time steps, which nn.Module leaves uninitialised; the kernels then see
    # the values they see in training
    block.apply(lambda m: m.init_mixer_weights(init) if hasattr(m, "init_mixer_weights") else None)
    block = block.to(device)

    def run(n):
        x = torch.randn(1, n, config.hidden_size, device=device, requires_grad=True)
        cu = torch.tensor([0, n // 2, n], dtype=torch.int32, device=device)
        pos = torch.cat([torch.arange(n // 2), torch.arange(n - n // 2)]).to(device)[None]
        with _autocast(device):
            return block(x, cu_seqlens=cu, position_ids=pos)

    return saved_per_site(run, block.parameters(), tokens)


def head_ledger(config, tokens: int, device: str) -> dict[str, tuple[float, int]]:
    """``saved_per_site`` of the final norm and the fused linear cross-entropy."""
    from ttr.models.modeling import LMHead
    from ttr.models.modules import RMSNorm

    norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps).to(device)
    head = LMHead(config.hidden_size, config.vocab_size, bias=False).to(device)

    def run(n):
        x = torch.randn(1, n, config.hidden_size, device=device, requires_grad=True)
        targets = torch.randint(0, config.vocab_size, (n,), device=device)
        with _autocast(device):
            return head(norm(x).reshape(n, -1), targets=targets, reduction="sum")

    return saved_per_site(run, [*norm.parameters(), *head.parameters()], tokens)


def _table(name: str, count: int, rows: dict[str, tuple[float, int]]) -> tuple[float, int]:
    per_token = sum(r[0] for r in rows.values())
    fixed = sum(r[1] for r in rows.values())
    print(f"\n== {name} (x{count}): {per_token:,.0f} bytes/token, fixed {fixed / 2**20:,.1f} MiB")
    for site, (b, f) in sorted(rows.items(), key=lambda kv: -kv[1][0]):
        if abs(b) >= 1 or f:
            print(f"  {b:>9,.0f} B/tok  {f / 2**20:>7.1f} MiB  {site}")
    return per_token, fixed


def report(preset: str, tokens: int, batch: int, seq_len: int, device: str) -> dict:
    """Print the per-op tables and the prediction; return the numbers."""
    from ttr.models.modeling import TTRForCausalLM
    from ttr.models.presets import get_preset

    config = get_preset(preset)
    torch.manual_seed(0)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in TTRForCausalLM(config).parameters())
    types = list(config.layer_types)
    per_layer, total_tok, total_fixed = {}, 0.0, 0
    for kind in dict.fromkeys(types):
        per_token, fixed = _table(kind, types.count(kind), block_ledger(config, types.index(kind), tokens, device))
        per_layer[kind] = per_token
        total_tok += per_token * types.count(kind)
        total_fixed += fixed * types.count(kind)
    per_token, fixed = _table("head", 1, head_ledger(config, tokens, device))
    total_tok += per_token
    total_fixed += fixed
    act = total_tok * batch * seq_len
    peak = act + total_fixed + 16 * n_params
    print(f"\n{preset}: {n_params / 1e9:.3f}B parameters, {len(types)} layers ("
          + ", ".join(f"{k} x{types.count(k)}: {v:,.0f} B/token" for k, v in per_layer.items())
          + f"); {total_tok:,.0f} bytes per token over all layers and the head")
    print(f"at {batch} x {seq_len}: activations {act / GiB:.1f} GiB + fixed {total_fixed / GiB:.1f} GiB + "
          f"weights, grads, AdamW {16 * n_params / GiB:.1f} GiB = predicted peak {peak / GiB:.1f} GiB")
    return {"per_layer": per_layer, "per_token": total_tok, "predicted_peak_gib": peak / GiB}


def train_step_peak(preset: str, batch: int, seq_len: int, steps: int = 2) -> list[float]:
    """``torch.cuda.max_memory_allocated`` (GiB) after each of ``steps`` training steps of the whole
    preset: fp32 weights, bf16 autocast, fused AdamW, ``[1, batch * seq_len]`` packed tokens with a
    document every ``seq_len``, gradients set to None after each step (as ``ttr train`` does)."""
    from ttr.models.modeling import TTRForCausalLM
    from ttr.models.presets import get_preset

    device = "cuda"
    torch.manual_seed(0)
    model = TTRForCausalLM(get_preset(preset)).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    n = batch * seq_len
    cu = torch.arange(0, n + 1, seq_len, dtype=torch.int32, device=device)
    ids = torch.randint(0, model.config.vocab_size, (1, n), device=device)
    torch.cuda.reset_peak_memory_stats()
    peaks = []
    for step in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, cu_seqlens=cu, num_items_in_batch=n, use_cache=False,
                         return_logits=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() / GiB)
        print(f"{preset} step {step + 1} at {batch} x {seq_len}: loss {loss.item():.3f}, max_memory_allocated "
              f"{peaks[-1]:.2f} GiB, max_memory_reserved {torch.cuda.max_memory_reserved() / GiB:.2f} GiB")
    return peaks


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("preset")
    ap.add_argument("--tokens", type=int, default=128,
                    help="ledger length N (also runs 2N), a multiple of 128: two documents of whole chunks")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--cuda", action="store_true", help="ledger in bf16 on the GPU, then --steps training steps")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args(argv)
    if args.tokens <= 0 or args.tokens % 128:
        # each document must be whole 64-token chunks at both lengths, or what a kernel keeps per
        # chunk (SSD's C B^T) lands in the fixed part
        ap.error(f"--tokens must be a positive multiple of 128, got {args.tokens}")
    if args.cuda:
        if not torch.cuda.is_available():
            raise SystemExit("--cuda needs a CUDA device")
        report(args.preset, args.tokens, args.batch, args.seq_len, "cuda")
        train_step_peak(args.preset, args.batch, args.seq_len, args.steps)
        return
    # The Triton kernels' own saved tensors are what is measured, not the torch forms'. Triton
    # decides at its import (which ``import ttr`` does) whether kernels are interpreted, so a
    # process without the interpreter starts over with it.
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        env = dict(os.environ, TRITON_INTERPRET="1")
        os.execve(sys.executable, [sys.executable, "-m", "ttr.scripts.activation_memory", *sys.argv[1:]], env)
    os.environ["TTR_KERNEL_BACKEND"] = "triton"
    # the interpreter evaluates masked-off lanes too; their overflows are noise
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.")
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    report(args.preset, args.tokens, args.batch, args.seq_len, "cpu")


if __name__ == "__main__":
    main()
