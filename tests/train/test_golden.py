"""Golden training curve: the real model (one block of every mixer) trained for 30 steps on the
CPU with a fixed seed must reproduce the per-step losses stored in ``golden_losses.json`` to
1e-3, so any change to initialisation, layers, kernels' torch backend, loss, optimiser or
schedule shows up here and has to be re-blessed on purpose:

    TTR_BLESS=1 TRITON_INTERPRET=1 python -m pytest tests/train/test_golden.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ttr.train.config import config_from_dict
from ttr.train.trainer import Trainer

from .conftest import tiny_config

GOLDEN = Path(__file__).with_name("golden_losses.json")
STEPS = 30
LAYER_TYPES = ["gated_deltanet", "delta_net", "gla", "mamba2", "swa", "attn"]


def test_losses_match_golden(corpus_dir, cache_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "torch")
    overrides = {"hidden_size": 32, "num_hidden_layers": len(LAYER_TYPES), "layer_types": LAYER_TYPES,
                 "num_heads": 2, "intermediate_size": 64, "mamba_head_dim": 16, "mamba_state_size": 16,
                 "window_size": 8}
    table = tiny_config(corpus_dir, cache_dir, tmp_path / "run", model={"overrides": overrides},
                        train={"max_steps": STEPS}, optim={"lr": 3e-3, "warmup_steps": 3})
    trainer = Trainer(config_from_dict(table))
    trainer.run()
    losses = [round(r["loss"], 6) for r in trainer.history]
    assert len(losses) == STEPS
    if os.environ.get("TTR_BLESS"):
        GOLDEN.write_text(json.dumps({"steps": STEPS, "layer_types": LAYER_TYPES, "losses": losses}, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())["losses"]
    assert losses == pytest.approx(golden, abs=1e-3)
    assert losses[-1] < losses[0]
