"""AdamW parameter groups and learning-rate schedules: the one optimiser set-up of ttr.

``ttr train`` and the synthetic benchmarks of ``ttr eval`` (MQAR, state tracking) both build their
optimiser here. It sits at the top of the package, importing only torch, because ``train`` and
``eval`` may not import each other.

Weight decay applies to matrices only: not to norms' weights, biases, embeddings' neighbours of
the same rank (any parameter with fewer than 2 dims), and not to the decay/time-step parameters
``A_log`` and ``dt_bias`` of Mamba2 / Gated DeltaNet, which parametrise gates rather than
features (as in mamba_ssm and fla, which mark them ``_no_weight_decay``).
"""

from __future__ import annotations

import math

import torch

NO_DECAY_NAMES = ("A_log", "dt_bias", "D")


def no_decay(name: str, param: torch.Tensor) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return param.ndim < 2 or leaf in NO_DECAY_NAMES or "norm" in name.lower() or getattr(param, "_no_weight_decay", False)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, plain = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (plain if no_decay(name, param) else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float, betas=(0.9, 0.95), eps: float = 1e-8,
                    fused: bool | None = None) -> torch.optim.AdamW:
    groups = param_groups(model, weight_decay)
    if not groups:
        raise ValueError("model has no trainable parameters")
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, fused=fused)


def lr_multiplier(step: int, *, max_steps: int, schedule: str = "cosine", warmup_steps: int = 0,
                  min_lr_ratio: float = 0.0, decay_fraction: float = 0.2) -> float:
    """Multiplier of the peak lr for optimizer step ``step`` (0-based).

    Linear warmup from 1/(warmup+1) to 1 over ``warmup_steps``, then
    cosine: ``min + (1 - min) * (1 + cos(pi * p)) / 2`` with p the post-warmup progress in [0, 1];
    wsd (warmup-stable-decay, Hu et al. 2024, arXiv:2404.06395): 1 until the last
    ``decay_fraction`` of the steps, then linear down to ``min_lr_ratio``;
    constant: 1.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        span = max(1, max_steps - warmup_steps - 1)
        p = min(1.0, (step - warmup_steps) / span)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))
    if schedule == "wsd":
        decay_steps = max(1, round(decay_fraction * max_steps))
        decay_start = max(warmup_steps, max_steps - decay_steps)
        if step < decay_start:
            return 1.0
        p = min(1.0, (step - decay_start + 1) / max(1, max_steps - decay_start))
        return 1.0 - (1.0 - min_lr_ratio) * p
    raise ValueError(f"schedule must be one of cosine, wsd, constant; got {schedule!r}")


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
