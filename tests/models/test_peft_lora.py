"""PEFT LoRA with the target modules README.md documents for each family trains a step: every
documented module is wrapped, only the adapters train, and their gradients reach each one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer

import ttr

from .test_models import FAMILIES, VOCAB, make_model


def documented_targets() -> dict[str, list[str]]:
    """The rows ``| `family` | `module`, ... |`` of README.md's LoRA table."""
    readme = (Path(ttr.__file__).parent / "README.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(\w+)` \| (`\w+`(?:, `\w+`)*) \|$", readme, flags=re.M)
    return {family: re.findall(r"`(\w+)`", cells) for family, cells in rows}


def test_readme_documents_every_family():
    assert sorted(documented_targets()) == sorted(FAMILIES)


# peft asks transformers for the deprecated is_gradient_checkpointing
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
@pytest.mark.parametrize("family", FAMILIES)
def test_lora_with_documented_targets_trains_a_step(family):
    targets = documented_targets()[family]
    model = get_peft_model(
        make_model(family).train(),
        LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM"),
    )
    wrapped = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    assert wrapped == set(targets)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n, _ in trainable)
    opt = torch.optim.AdamW([p for _, p in trainable], lr=1e-2)
    ids = torch.randint(0, VOCAB, (2, 12))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    for name, p in trainable:
        if ".lora_B." in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    opt.step()
    assert model(input_ids=ids, labels=ids).loss < loss
