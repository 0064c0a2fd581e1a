"""Model FLOPs, MFU, and the metric sinks (JSONL always, wandb when installed, a progress bar).

FLOPs per trained token are forward + backward = 3 x forward, the forward being ``2 * in * out``
for every ``nn.Linear`` (projections, gates, MLP, the LM head) plus each layer's sequence mixing,
which its mixer class counts (``flops_per_token`` of ``ttr.models.layers.LAYER_TYPES``: the
chunkwise form for the linear mixers, causal or windowed QK^T and PV for attention, the only
term quadratic in T). Embedding lookups, short convolutions, norms and element-wise gates are not
counted. MFU = achieved FLOPs / (devices x the dense bf16 peak of the GPU); the peak is looked up
by device name (``TTR_PEAK_TFLOPS`` overrides).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from ttr.models.layers import LAYER_TYPES

# dense bf16 tensor-core peak (no sparsity), TFLOP/s, from the vendors' data sheets
PEAK_BF16_TFLOPS = [
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H200", 989.5),
    ("H100", 989.5),
    ("GH200", 989.5),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("A10G", 70.0),
    ("RTX 4090", 165.2),
]


def mixer_flops_per_token(layer_type: str, config, seq_len: int) -> float:
    """Forward FLOPs per token of the sequence-mixing part of one layer (linear layers excluded)."""
    if layer_type not in LAYER_TYPES:
        raise ValueError(f"layer_type: expected one of {sorted(LAYER_TYPES)}, got {layer_type!r}")
    return LAYER_TYPES[layer_type].flops_per_token(config, seq_len)


def linear_params(model: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def train_flops_per_token(model: torch.nn.Module, config, seq_len: int) -> float:
    forward = 2.0 * linear_params(model)
    forward += sum(mixer_flops_per_token(t, config, seq_len) for t in config.layer_types)
    return 3.0 * forward


def peak_flops(device: torch.device) -> float | None:
    env = os.environ.get("TTR_PEAK_TFLOPS")
    if env:
        return float(env) * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops * 1e12
    return None


def peak_memory_gib(device: torch.device) -> float | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return None


class MetricsSink:
    """Rank 0's outlets. JSONL is always written; wandb if importable and not switched off."""

    def __init__(self, run_dir: Path, cfg, *, enabled: bool, total_steps: int, start_step: int):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.wandb = None
        self.bar = None
        if not enabled:
            return
        if cfg.log.wandb != "off":
            self.wandb = _start_wandb(run_dir, cfg)
        if cfg.log.progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, dynamic_ncols=True, unit="step")

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {"time": round(time.time(), 3), **record}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record.get("step"))

    def progress(self, steps: int, postfix: dict) -> None:
        if self.bar is not None:
            self.bar.update(steps)
            self.bar.set_postfix(postfix, refresh=False)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def _start_wandb(run_dir: Path, cfg):
    try:
        import wandb
    except ImportError:
        if cfg.log.wandb in ("online", "offline"):
            raise ValueError(f"log.wandb={cfg.log.wandb!r} but wandb is not installed") from None
        return None
    mode = cfg.log.wandb
    if mode == "auto":
        mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    id_file = run_dir / "wandb_id.txt"
    run_id = id_file.read_text().strip() if id_file.is_file() else wandb.util.generate_id()
    id_file.write_text(run_id)
    return wandb.init(
        project=cfg.log.wandb_project, id=run_id, resume="allow", mode=mode, dir=str(run_dir),
        config=cfg.to_dict(), name=run_dir.name,
    )
