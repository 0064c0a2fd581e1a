"""MQAR: generator properties and a tiny run of ``ttr eval mqar`` that learns above chance."""

from __future__ import annotations

import json

import pytest
import torch

from ttr.errors import TTRError
from ttr.eval.cli import main
from ttr.eval.mqar import TEST_CONFIGS, TRAIN_CONFIGS, MixtureBatches, generate_mqar, parse_configs
from ttr.eval.synthetic import state_size


@pytest.mark.parametrize("seq_len,num_kv", [(64, 4), (256, 64), (1024, 256), (32, 8)])
def test_generator_properties(seq_len, num_kv):
    vocab = 8192
    x, y = generate_mqar(50, seq_len, num_kv, vocab_size=vocab, seed=3)
    assert x.shape == y.shape == (50, seq_len) and x.dtype == y.dtype == torch.long
    assert 0 <= x.min() and x.max() < vocab
    half = vocab // 2
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        keys, values = row_x[0 : 2 * num_kv : 2], row_x[1 : 2 * num_kv : 2]
        assert all(1 <= k < half for k in keys) and len(set(keys)) == num_kv
        assert all(half <= v < vocab for v in values)
        binding = dict(zip(keys, values))
        queries = [t for t, label in enumerate(row_y) if label != -100]
        # labels only at queries, one query per key, each query after the context and labelled with its value
        assert len(queries) == num_kv
        assert all(t >= 2 * num_kv and (t - 2 * num_kv) % 2 == 0 for t in queries)
        assert sorted(row_x[t] for t in queries) == sorted(keys)
        assert all(row_y[t] == binding[row_x[t]] for t in queries)
    assert (y[:, : 2 * num_kv] == -100).all()


def test_gaps_follow_a_power_law_and_seeds_reproduce():
    x, y = generate_mqar(2000, 256, 4, seed=0)
    gaps = ((y != -100).nonzero()[:, 1] - 8) // 2
    # p(g) ~ g^-0.99: short gaps dominate, long gaps still occur
    assert (gaps < 10).float().mean() > 0.4 and (gaps > 60).any()
    x2, y2 = generate_mqar(2000, 256, 4, seed=0)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, generate_mqar(2000, 256, 4, seed=1)[0])


def test_protocol_configs_and_validation():
    assert [(c.seq_len, c.num_kv_pairs) for c in TRAIN_CONFIGS] == [
        (64, 4),
        (128, 8),
        (256, 16),
        (256, 32),
        (256, 64),
    ]
    assert (TEST_CONFIGS[0].seq_len, TEST_CONFIGS[0].num_kv_pairs) == (64, 4)
    assert [(c.seq_len, c.num_kv_pairs) for c in TEST_CONFIGS[-2:]] == [(512, 128), (1024, 256)]
    assert parse_configs("16:2:10,32:4:20")[1].num_examples == 20
    with pytest.raises(ValueError, match="configs"):
        parse_configs("16:2")
    with pytest.raises(ValueError, match="num_kv_pairs"):
        generate_mqar(4, 16, 5)
    with pytest.raises(ValueError, match="vocab_size"):
        generate_mqar(4, 64, 10, vocab_size=16)


def test_mixture_batches_cover_each_config_once_per_epoch():
    data = [generate_mqar(8, 16, 2, vocab_size=64, seed=0), generate_mqar(12, 32, 4, vocab_size=64, seed=1)]
    batches = MixtureBatches(data, batch_size=4, seed=0)
    assert batches.batches_per_epoch() == 5
    seen = [next(batches) for _ in range(5)]
    assert sorted(x.shape[1] for x, _ in seen) == [16, 16, 32, 32, 32]
    rows = {tuple(r) for x, _ in seen for r in x.tolist()}
    assert len(rows) == 20  # every example exactly once


def test_state_size_by_mixer():
    from ttr.models import TTRConfig

    cfg = TTRConfig(hidden_size=128, num_hidden_layers=2, layer_types=["gated_deltanet", "attn"], num_heads=2)
    assert state_size(cfg, 512) == 2 * 64 * 64 + 2 * 512 * 128


def test_tiny_mqar_run_learns_above_chance(tmp_path):
    out = tmp_path / "mqar"
    rc = main(
        [
            "mqar",
            "--mixer",
            "gated_deltanet",
            "--d-model",
            "32",
            "--lrs",
            "1e-2",
            "--steps",
            # 250 steps sat on the copy-a-context-value plateau (~0.4) for some inits; 600 pass
            # the recall transition for 4 of 5 seeds tried (seed 0, the default, reaches 0.99)
            "600",
            "--batch-size",
            "32",
            "--vocab-size",
            "32",
            "--train-configs",
            "16:2:4000,16:4:4000",
            "--test-configs",
            "16:2:256,16:4:256",
            "--device",
            "cpu",
            "--output",
            str(out),
        ]
    )
    assert rc == 0
    (result,) = json.loads((out / "mqar.json").read_text())
    # chance is 1/16 (value half of a 32-token vocabulary); copying a random context value gives
    # 1/2 and 1/4; recall is needed to go well beyond
    assert result["accuracy"] > 0.5, result
    assert (out / "mqar.png").stat().st_size > 0 and "gated_deltanet" in (out / "mqar.md").read_text()


def tiny_mqar(out) -> list[str]:
    """A sweep of ``ttr eval mqar`` that trains each job for a moment on the clock alone."""
    return ["mqar", "--mixer", "attn", "--d-model", "16", "--lrs", "1e-3", "--epochs", "0", "--max-minutes", "0.001",
            "--batch-size", "4", "--vocab-size", "64", "--train-configs", "16:2:8", "--test-configs", "16:2:4",
            "--device", "cpu", "--output", str(out)]  # fmt: skip


def test_variants_add_models_and_the_report_checks_references(tmp_path):
    """--variant MIXER:KEY=VALUE,... adds a model with those config fields (values in the one override
    grammar: JSON null, TOML numbers); the report checks each mixer's best run against its reference."""
    out = tmp_path / "mqar"
    args = tiny_mqar(out) + ["--variant", "attn:rope_theta=10000.0", "--variant", "delta_net:head_dim=32,expand_v=0.25",
                             "--set", "rope_theta=null"]  # fmt: skip
    assert main(args) == 0
    results = {r["label"]: r for r in json.loads((out / "mqar.json").read_text())}
    assert set(results) == {"attn d=16 rope_theta=None", "attn d=16 rope_theta=10000.0",
                            "delta_net d=16 expand_v=0.25 head_dim=32 rope_theta=None"}
    assert results["delta_net d=16 expand_v=0.25 head_dim=32 rope_theta=None"]["state_size"] == 2 * 32 * 8
    report = (out / "mqar.md").read_text()
    assert "- MQAR attn d=16 rope_theta=None: pooled " in report and "(reference >= 1.0)" in report


def test_a_failed_job_is_reported_and_the_others_kept(tmp_path, monkeypatch):
    """A job that raises is reported (exit 1, FAILED line, error in the JSON); every finished job is
    in jobs.jsonl."""
    from ttr.eval import mqar

    real = mqar.run_job
    monkeypatch.setattr(mqar, "run_job", lambda job: real(job) if job["lr"] < 2e-3 else 1 / 0)
    out = tmp_path / "mqar"
    assert main(tiny_mqar(out) + ["--lrs", "1e-3,3e-3"]) == 1
    results = json.loads((out / "mqar.json").read_text())
    assert sorted("error" in r for r in results) == [False, True]
    assert "- FAILED attn d=16 lr=0.003: ZeroDivisionError" in (out / "mqar.md").read_text()
    assert len((out / "jobs.jsonl").read_text().splitlines()) == 2


def test_mqar_rejects_bad_sweeps(tmp_path, capsys):
    """A malformed variant is a usage error naming --variant; no steps and no clock is refused."""
    for bad in ("lstm:head_dim=8", "delta_net", "delta_net:head_dim"):
        with pytest.raises(SystemExit):
            main(tiny_mqar(tmp_path) + ["--variant", bad])
        assert "--variant" in capsys.readouterr().err
    with pytest.raises(TTRError, match="epochs"):
        main(["mqar", "--epochs", "0"])
