"""The trainer with the real TTRForCausalLM: exact resume through the CLI, export, FLOP count."""

import json

import pytest
import torch

from ttr.__main__ import main as ttr_main
from ttr.train.metrics import mixer_flops_per_token, train_flops_per_token

from .conftest import tiny_config


def _overrides(table, prefix=""):
    out = []
    for key, value in table.items():
        if isinstance(value, dict) and key != "overrides":
            out += _overrides(value, f"{prefix}{key}.")
        elif isinstance(value, dict):
            out += [f"--{prefix}{key}.{k}={json.dumps(v)}" for k, v in value.items()]
        else:
            out.append(f"--{prefix}{key}={json.dumps(value)}")
    return out


def train_main(argv):
    return ttr_main(["train", *argv])


def export_main(argv):
    return ttr_main(["export", *argv])


def _losses(run_dir):
    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_reproduces_uninterrupted_run(corpus_dir, cache_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = tmp_path / "empty.toml"
    config.write_text("")

    def args(run_dir, steps, export):
        table = tiny_config(corpus_dir, cache_dir, run_dir, optim={"schedule": "constant"},
                            train={"max_steps": steps, "export_at_end": export},
                            log={"val_every": 10, "val_batches": 1})
        return [str(config), *_overrides(table)]

    assert train_main(args(tmp_path / "a", 20, False)) == 0
    assert train_main(args(tmp_path / "b", 10, False)) == 0
    assert train_main(args(tmp_path / "b", 20, True)) == 2  # exists: needs --resume
    assert train_main([*args(tmp_path / "b", 20, True), "--resume"]) == 0
    straight, resumed = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert len(straight) == 20 and resumed == straight
    assert sum(straight[-5:]) < sum(straight[:5])

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import ttr  # noqa: F401

    run = tmp_path / "b"
    assert export_main([str(run), str(tmp_path / "exported")]) == 0
    at_end = AutoModelForCausalLM.from_pretrained(str(run / "export"))
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"))
    for (name, p), q in zip(at_end.state_dict().items(), exported.state_dict().values()):
        assert torch.equal(p, q), name
    # the training context travels with the export: lm-eval's max_length comes from it
    seq_len = json.loads((run / "run_config.json").read_text())["train"]["seq_len"]
    assert exported.config.train_seq_len == seq_len
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "exported"))
    ids = tok("alpha beta gamma\n", return_tensors="pt")["input_ids"]
    out = exported.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 5)
    assert export_main([str(tmp_path), str(tmp_path / "x")]) == 2
    capsys.readouterr()
    assert export_main([str(run), str(tmp_path / "exported")]) == 2  # never over an earlier export
    assert "already exists and is not empty; pass --overwrite" in capsys.readouterr().err
    latest = sorted((run / "checkpoints").iterdir())[-1]
    (latest / "rng_rank0.pt").write_bytes(b"")
    assert export_main([str(run), str(tmp_path / "exported"), "--overwrite"]) == 0
    assert f"ttr export: skipping checkpoint {latest}: rng_rank0.pt has 0 bytes" in capsys.readouterr().err
    assert export_main([str(run), str(tmp_path / "y"), "--checkpoint", str(latest)]) == 2
    assert capsys.readouterr().err.startswith(f"ttr export: error: --checkpoint {str(latest)!r} cannot be used")


def test_flop_formulas():
    from ttr.models.presets import get_preset

    cfg = get_preset("gated_deltanet_h1-debug", vocab_size=512, window_size=16)
    gdn, swa = (mixer_flops_per_token(t, cfg, 256) for t in ("gated_deltanet", "swa"))
    h, k, v = cfg.num_heads, cfg.head_dim, cfg.value_head_dim
    assert gdn == h * (6 * 64 * k + 4 * 64 * v + 6 * k * v)
    assert mixer_flops_per_token("gated_deltanet", cfg, 4096) == gdn  # no quadratic term
    keys = (16 * 17 / 2 + (256 - 16) * 16) / 256
    assert swa == 4 * cfg.attn_num_heads * cfg.attn_head_dim * keys
    full = get_preset("transformer-debug", vocab_size=512)
    assert mixer_flops_per_token("attn", full, 1024) == 4 * full.attn_num_heads * full.attn_head_dim * 1025 / 2

    linear = torch.nn.Module()
    linear.a, linear.b = torch.nn.Linear(8, 4), torch.nn.Linear(4, 2, bias=False)
    assert train_flops_per_token(linear, cfg, 256) == 3 * (2 * (32 + 8) + gdn + swa)
    with pytest.raises(ValueError, match="layer_type"):
        mixer_flops_per_token("lstm", cfg, 16)


def test_activation_checkpointing_gives_the_same_steps(corpus_dir, cache_dir, tmp_path):
    from ttr.train.config import config_from_dict
    from ttr.train.trainer import Trainer

    losses = []
    for ac in (False, True):
        table = tiny_config(corpus_dir, cache_dir, tmp_path / f"ac{ac}", train={"max_steps": 3,
                                                                               "activation_checkpointing": ac})
        trainer = Trainer(config_from_dict(table))
        trainer.run()
        # transformers renamed gradient to activation checkpointing in 5.2x; the trainer takes either
        on = getattr(trainer.inner, "is_activation_checkpointing", None)
        assert (trainer.inner.is_gradient_checkpointing if on is None else on) == ac
        losses.append([r["loss"] for r in trainer.history])
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
