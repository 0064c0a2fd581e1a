"""On a GPU: bf16 autocast over fp32 master weights, Triton kernels, MFU and peak memory reported."""

import pytest
import torch

from ttr.train.checkpoint import checkpoint_dirs
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


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_fsdp_resume(corpus_dir, cache_dir, tmp_path):
    """FSDP2 on 2 GPUs: 5 steps, sharded checkpoint, resume to 10; the losses are those of an
    uninterrupted 10-step run (1e-3: bf16 GEMMs need not reduce in the same order across runs)."""
    import json
    import os
    import subprocess
    import sys

    from .test_real_model import _overrides

    config = tmp_path / "empty.toml"
    config.write_text("")

    def run(run_dir, steps, *extra):
        table = tiny_config(corpus_dir, cache_dir, run_dir, optim={"schedule": "constant", "lr": 3e-3},
                            model={"overrides": {"hidden_size": 256, "num_hidden_layers": 2, "num_heads": 2}},
                            train={"max_steps": steps, "distributed": "fsdp", "seq_len": 256,
                                   "micro_batch_size": 4})
        cmd = [sys.executable, "-m", "ttr", "train", "--nproc", "2", str(config), *_overrides(table), *extra]
        done = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]

    straight = run(tmp_path / "straight", 10)
    assert len(straight) == 10
    run(tmp_path / "resumed", 5)
    assert [d.name for d in checkpoint_dirs(tmp_path / "resumed")], "no checkpoint after 5 steps"
    resumed = run(tmp_path / "resumed", 10, "--resume")
    assert resumed[:5] == straight[:5]
    assert resumed == pytest.approx(straight, rel=1e-3)
