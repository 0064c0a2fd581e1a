"""On a GPU: bf16 autocast over fp32 master weights, Triton kernels, MFU and peak memory reported."""

import pytest
import torch

from ttr.train.config import config_from_dict
from ttr.train.trainer import Trainer

from .conftest import tiny_config


@pytest.mark.gpu
def test_bf16_training_on_gpu(corpus_dir, cache_dir, tmp_path):
    table = tiny_config(corpus_dir, cache_dir, tmp_path / "gpu",
                        model={"overrides": {"hidden_size": 256, "num_hidden_layers": 2, "num_heads": 2}},
                        train={"max_steps": 30, "seq_len": 256, "micro_batch_size": 4, "export_at_end": True},
                        optim={"lr": 3e-3, "warmup_steps": 5}, log={"every": 10, "val_every": 30})
    trainer = Trainer(config_from_dict(table))
    record = trainer.run()
    losses = [r["loss"] for r in trainer.history]
    assert sum(losses[-5:]) < sum(losses[:5])
    assert trainer.acc.mixed_precision == "bf16"
    assert all(p.dtype == torch.float32 for p in trainer.inner.parameters())
    assert record["peak_mem_gib"] > 0 and record["tokens_per_s"] > 0 and "val_loss" in record
    if "H200" in torch.cuda.get_device_name() or "H100" in torch.cuda.get_device_name():
        assert 0 < record["mfu"] < 1
