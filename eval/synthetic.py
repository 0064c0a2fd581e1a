"""Shared machinery for the synthetic benchmarks (MQAR, state tracking): small models, a training
loop that scores only labelled positions, accuracy, state sizes, and a process pool for sweeps."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from functools import partial

import torch
import torch.nn.functional as F

from ttr.models.layers import LAYER_TYPES
from ttr.optim import build_optimizer, lr_multiplier, set_lr

MIXERS = tuple(LAYER_TYPES)
# The schedule's length in steps when only the time budget bounds training: the budget always ends
# the run first, and the schedule's position then follows the clock alone.
CLOCK_STEPS = 2**62


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
    if LAYER_TYPES[mixer].is_attention:
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
    return sum(LAYER_TYPES[kind].state_size(config, seq_len) for kind in config.layer_types)


def labelled_logits(model, input_ids: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100):
    """Logits at the positions whose label is not ``ignore_index`` only: ``(logits [M, V], targets [M])``.

    Runs the decoder body once and the output projection on the M labelled rows, so a batch of
    long sequences never materialises ``[B, T, V]`` logits.
    """
    hidden = model.base_model(input_ids=input_ids, use_cache=False).last_hidden_state
    mask = labels != ignore_index
    logits = model.get_output_embeddings()(hidden[mask])
    return logits.float(), labels[mask]


def train(
    model,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    *,
    steps: int | None,
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

    The optimiser and the schedule are ``ttr.optim``'s (the parameter groups of ``ttr train``, a
    linear warm-up over ``warmup_fraction`` of the steps, then cosine decay to zero). With
    ``max_seconds`` the schedule's position is the larger of the steps taken and the same fraction
    of ``steps`` as of the time budget spent (counted from the end of the first step): the schedule
    then completes, and training stops, when the budget runs out, so a sweep of many jobs finishes
    on time whatever the throughput; ``steps=None`` trains on the clock alone. ``log(step, loss)``
    is called every ``log_every`` steps.
    """
    if steps is None:
        if max_seconds is None:
            raise ValueError("steps: None trains on the clock alone and needs max_seconds")
        steps = CLOCK_STEPS
    if steps < 1:
        raise ValueError(f"steps: expected >= 1, got {steps}")
    if not lr > 0:
        raise ValueError(f"lr: expected > 0, got {lr}")
    if max_seconds is not None and not max_seconds > 0:
        raise ValueError(f"max_seconds: expected > 0, got {max_seconds}")
    device = next(model.parameters()).device
    opt = build_optimizer(model, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98))
    warmup_steps = int(warmup_fraction * steps)
    model.train()
    losses = []
    start = None  # the clock starts after the first step: compilation and autotuning stay out of the budget
    for step in range(steps):
        position = step
        if max_seconds is not None and start is not None:
            position = max(step, int(steps * (time.perf_counter() - start) / max_seconds))
            if position >= steps:
                break
        set_lr(opt, lr * lr_multiplier(position, max_steps=steps, warmup_steps=warmup_steps))
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
        if log is not None and (step % log_every == 0 or step + 1 == steps):
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


def _kept(fn: Callable[[dict], dict], job: dict) -> dict:
    """``fn(job)``, or the job with its ``error`` when it raises; either way appended to the sweep's
    ``jobs.jsonl`` at once, so a sweep cut short keeps every job that finished."""
    try:
        result = fn(job)
    except Exception as e:  # noqa: BLE001 - one failed job is reported, the others keep their results
        result = {**job, "error": f"{type(e).__name__}: {e}"}
    with open(os.path.join(job["output"], "jobs.jsonl"), "a") as f:
        f.write(json.dumps(result, default=str) + "\n")
    return result


def run_sweep(fn: Callable[[dict], dict], jobs: list[dict], workers: int, output: str) -> tuple[list, list]:
    """Run every job of a sweep (``run_jobs``) with its index and ``output`` folder filled in; returns
    ``(results, failed)``, a failed job being the job plus its ``error``."""
    if not jobs:
        raise ValueError("jobs: the sweep is empty")
    os.makedirs(output, exist_ok=True)
    jobs = [{**job, "index": i, "output": output} for i, job in enumerate(jobs)]
    done = run_jobs(partial(_kept, fn), jobs, min(workers, len(jobs)))
    return [r for r in done if "error" not in r], [r for r in done if "error" in r]


def failure_lines(failed: list[dict]) -> list[str]:
    return [f"- FAILED {r['label']} lr={r['lr']}: {r['error']}" for r in failed]
