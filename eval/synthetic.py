"""Shared machinery for the synthetic benchmarks (MQAR, state tracking): small models, a training
loop that scores only labelled positions, accuracy, state sizes, and a process pool for sweeps."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor

import torch
import torch.nn.functional as F

MIXERS = ("gated_deltanet", "delta_net", "gla", "mamba2", "attn", "swa")


def build_model(
    mixer: str,
    *,
    vocab_size: int,
    d_model: int,
    num_layers: int = 2,
    intermediate_size: int = 0,
    num_heads: int = 1,
    context: int = 1024,
    **overrides,
):
    """A ``TTRForCausalLM`` with ``num_layers`` blocks of ``mixer`` (each: short conv + mixer, plus
    an MLP only when ``intermediate_size > 0``). ``overrides`` are further ``TTRConfig`` fields."""
    from ttr.models import TTRConfig, TTRForCausalLM

    if mixer not in MIXERS:
        raise ValueError(f"mixer: expected one of {MIXERS}, got {mixer!r}")
    fields = dict(
        vocab_size=vocab_size,
        hidden_size=d_model,
        num_hidden_layers=num_layers,
        layer_types=[mixer] * num_layers,
        intermediate_size=intermediate_size,
        num_heads=num_heads,
        max_position_embeddings=context,
        window_size=context,
        fuse_cross_entropy=False,
        use_cache=False,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if mixer in ("attn", "swa"):
        # the conv of "short conv, then the mixer" (attention layers have none by default), and no
        # position encoding, as Zoology's attention baselines (max_position_embeddings=0): the conv
        # gives order, and lookups by content then hold at lengths beyond training (RoPE does not)
        fields["attn_short_conv"] = True
        fields["rope_theta"] = None
    if mixer == "mamba2":
        # keep Mamba2's head dim within the hidden width of small models
        fields["mamba_head_dim"] = min(64, 2 * d_model)
    fields.update(overrides)
    return TTRForCausalLM(TTRConfig(**fields))


def state_size(config, seq_len: int) -> int:
    """Recurrent-state elements summed over layers (KV-cache elements at ``seq_len`` for attention)."""
    total = 0
    for kind in config.layer_types:
        if kind in ("gla", "delta_net", "gated_deltanet"):
            total += config.num_heads * config.head_dim * config.value_head_dim
        elif kind == "mamba2":
            total += config.mamba_num_heads * config.mamba_state_size * config.mamba_head_dim
        elif kind in ("attn", "swa"):
            span = seq_len if kind == "attn" else min(seq_len, config.window_size)
            total += 2 * span * config.attn_num_kv_heads * config.attn_head_dim
        else:
            raise ValueError(f"config.layer_types: unknown mixer {kind!r}")
    return total


def labelled_logits(model, input_ids: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100):
    """Logits at the positions whose label is not ``ignore_index`` only: ``(logits [M, V], targets [M])``.

    Runs the decoder body once and the output projection on the M labelled rows, so a batch of
    long sequences never materialises ``[B, T, V]`` logits.
    """
    hidden = model.base_model(input_ids=input_ids, use_cache=False).last_hidden_state
    mask = labels != ignore_index
    logits = model.get_output_embeddings()(hidden[mask])
    return logits.float(), labels[mask]


def cosine_lr(progress: float, warmup: float) -> float:
    """Linear warm-up over the first ``warmup`` fraction of training, then cosine decay to zero;
    a multiplier of the peak learning rate at ``progress`` in [0, 1]."""
    if progress < warmup:
        return max(progress / warmup, 1e-3)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (progress - warmup) / max(1e-9, 1.0 - warmup))))


def train(
    model,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    *,
    steps: int,
    lr: float,
    max_seconds: float | None = None,
    weight_decay: float = 0.1,
    warmup_fraction: float = 0.1,
    grad_clip: float = 1.0,
    amp_dtype: torch.dtype | None = None,
    log: Callable[[int, float], None] | None = None,
    log_every: int = 100,
) -> list[float]:
    """AdamW on cross-entropy at labelled positions; returns the loss of every step taken.

    Training progress is ``step / steps``, or with ``max_seconds`` the larger of that and the
    fraction of the time budget spent: the schedule then completes (and training stops) when
    the budget runs out (counted from the end of the first step), so a sweep of many jobs finishes
    on time whatever the throughput.
    ``log(step, loss)`` is called every ``log_every`` steps.
    """
    if steps < 1:
        raise ValueError(f"steps: expected >= 1, got {steps}")
    if not lr > 0:
        raise ValueError(f"lr: expected > 0, got {lr}")
    if max_seconds is not None and not max_seconds > 0:
        raise ValueError(f"max_seconds: expected > 0, got {max_seconds}")
    device = next(model.parameters()).device
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.98),
    )
    model.train()
    losses = []
    start = None  # the clock starts after the first step: compilation and autotuning stay out of the budget
    for step in range(steps):
        progress = step / steps
        if max_seconds is not None and start is not None:
            progress = max(progress, (time.perf_counter() - start) / max_seconds)
            if progress >= 1.0:
                break
        for group in opt.param_groups:
            group["lr"] = lr * cosine_lr(progress, warmup_fraction)
        inputs, labels = next(batches)
        inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            logits, targets = labelled_logits(model, inputs, labels)
        loss = F.cross_entropy(logits, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        losses.append(loss.detach())
        if start is None:
            start = time.perf_counter()
        if log is not None and (step % log_every == 0 or step == steps - 1):
            log(step, loss.item())
    model.eval()
    return torch.stack(losses).float().tolist()


@torch.no_grad()
def accuracy(
    model,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    batch_size: int = 256,
    amp_dtype: torch.dtype | None = None,
) -> float:
    """Fraction of labelled positions where the argmax prediction equals the label."""
    device = next(model.parameters()).device
    model.eval()
    correct = total = 0
    for i in range(0, inputs.shape[0], batch_size):
        x = inputs[i : i + batch_size].to(device)
        y = labels[i : i + batch_size].to(device)
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            logits, targets = labelled_logits(model, x, y)
        correct += (logits.argmax(-1) == targets).sum().item()
        total += targets.numel()
    if total == 0:
        raise ValueError("labels: no labelled positions to score")
    return correct / total


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def job_device(index: int, device: str | None) -> str:
    """Spread jobs over the visible GPUs round-robin; ``device`` given explicitly wins."""
    if device is not None:
        return device
    if torch.cuda.is_available():
        return f"cuda:{index % torch.cuda.device_count()}"
    return "cpu"


def run_jobs(fn: Callable[[dict], dict], jobs: list[dict], workers: int) -> list[dict]:
    """Run ``fn(job)`` for every job, in ``workers`` spawned processes when ``workers > 1``.

    Tiny models leave a GPU mostly idle, so several jobs per GPU finish a sweep sooner.
    """
    if workers < 1:
        raise ValueError(f"workers: expected >= 1, got {workers}")
    if workers == 1 or len(jobs) == 1:
        return [fn(job) for job in jobs]
    import multiprocessing as mp

    threads = max(1, (os.cpu_count() or 1) // workers)
    with ProcessPoolExecutor(
        max_workers=workers,
        mp_context=mp.get_context("spawn"),
        initializer=torch.set_num_threads,
        initargs=(threads,),
    ) as pool:
        return list(pool.map(fn, jobs))
