"""The recall benchmark script builds every job and writes its report (tiny, clock-bounded run)."""

import json

from ttr.eval import state_tracking as st
from ttr.scripts import bench_mqar


def tiny_args(out) -> list[str]:
    """Every job of the script at a size that runs in seconds on the CPU."""
    return [
        "--output", str(out), "--jobs", "1", "--max-minutes", "0.002", "--mixers", "attn", "--mqar-lrs", "1e-3",
        "--batch-size", "4", "--d-model", "16", "--vocab-size", "64", "--train-configs", "16:2:8",
        "--test-configs", "16:2:4", "--parity-train-max", "6", "--parity-eval-lengths", "6,8", "--parity-lrs", "3e-3",
        "--parity-seeds", "0", "--device", "cpu",
    ]


def test_bench_mqar_runs_every_variant(tmp_path):
    out = tmp_path / "recall"
    rc = bench_mqar.main(tiny_args(out))
    assert rc == 0
    results = json.loads((out / "recall.json").read_text())
    labels = {r["label"] for r in results if r["kind"] == "state"}
    assert labels == {label for label, _, _ in st.VARIANTS}
    report = (out / "recall.md").read_text()
    assert "MQAR attn" in report and "parity mamba2 a(-1,1)" in report


def test_bench_mqar_records_a_failed_job(tmp_path, monkeypatch):
    """One job that raises is reported (exit 1, FAILED line, error in the JSON); the others keep
    their results, and every finished job is in jobs.jsonl."""
    from ttr.eval import mqar

    def boom(job):
        raise RuntimeError("injected")

    monkeypatch.setattr(mqar, "run_job", boom)
    out = tmp_path / "recall"
    rc = bench_mqar.main(tiny_args(out))
    assert rc == 1
    results = json.loads((out / "recall.json").read_text())
    errors = [r for r in results if "error" in r]
    assert len(errors) == 1 and "injected" in errors[0]["error"]
    assert len([r for r in results if r["kind"] == "state" and "error" not in r]) == len(st.VARIANTS)
    assert "FAILED attn d=16 lr=0.001: RuntimeError: injected" in (out / "recall.md").read_text()
    lines = (out / "jobs.jsonl").read_text().splitlines()
    assert len(lines) == 1 + len(st.VARIANTS)


def test_bench_mqar_attention_positions_and_parity_subset(tmp_path):
    """--attn-positions rope,nope gives one attention model of each (NoPE is the default, unlabelled);
    --parity-variants picks variants whose names hold commas."""
    out = tmp_path / "recall"
    args = tiny_args(out) + ["--attn-positions", "rope,nope", "--parity-variants", "delta_net beta(0,2),mamba2 a(-1,1)"]
    assert bench_mqar.main(args) == 0
    results = json.loads((out / "recall.json").read_text())
    assert {r["label"] for r in results if r["kind"] == "mqar"} == {"attn d=16", "attn d=16 rope_theta=10000.0"}
    assert {r["label"] for r in results if r["kind"] == "state"} == {"delta_net beta(0,2)", "mamba2 a(-1,1)"}
    assert all("config_mean" in r for r in results if r["kind"] == "mqar")


def test_bench_mqar_variant_adds_a_model(tmp_path, capsys):
    """--variant MIXER:KEY=VALUE,... adds a model with those config fields (here a wider key head
    at a narrower value head); a malformed one is an error naming --variant."""
    import pytest

    out = tmp_path / "recall"
    args = tiny_args(out) + ["--only", "mqar", "--variant", "delta_net:head_dim=32,expand_v=0.25"]
    assert bench_mqar.main(args) == 0
    results = {r["label"]: r for r in json.loads((out / "recall.json").read_text())}
    assert set(results) == {"attn d=16", "delta_net d=16 expand_v=0.25 head_dim=32"}
    # two layers of one 32 x 8 state
    assert results["delta_net d=16 expand_v=0.25 head_dim=32"]["state_size"] == 2 * 32 * 8
    # without --variant the default ones of the mixers that run; "none" runs none
    args = tiny_args(out) + ["--only", "mqar", "--mixers", "attn,delta_net", "--max-minutes", "0.001"]
    assert bench_mqar.main(args) == 0
    labels = {r["label"] for r in json.loads((out / "recall.json").read_text())}
    assert labels == {"attn d=16", "delta_net d=16", "delta_net d=16 expand_v=0.5 head_dim=256"}
    assert bench_mqar.main(args + ["--variant", "none"]) == 0
    labels = {r["label"] for r in json.loads((out / "recall.json").read_text())}
    assert labels == {"attn d=16", "delta_net d=16"}
    for bad in ("lstm:head_dim=8", "delta_net", "delta_net:head_dim"):
        with pytest.raises(SystemExit):
            bench_mqar.main(tiny_args(out) + ["--variant", bad])
        assert "--variant" in capsys.readouterr().err


def test_bench_mqar_parity_weight_decay_sweep(tmp_path):
    """--parity-weight-decays runs every variant and lr at each weight decay; the table and the
    target check keep one best-lr row per weight decay."""
    out = tmp_path / "recall"
    args = tiny_args(out) + [
        "--only", "parity", "--parity-variants", "delta_net beta(0,2)", "--parity-lrs", "1e-3,3e-3",
        "--parity-weight-decays", "0,0.1",
    ]  # fmt: skip
    assert bench_mqar.main(args) == 0
    results = json.loads((out / "recall.json").read_text())
    assert sorted((r["lr"], r["weight_decay"]) for r in results) == [(1e-3, 0.0), (1e-3, 0.1), (3e-3, 0.0), (3e-3, 0.1)]
    report = (out / "recall.md").read_text()
    assert "| weight decay |" in report
    assert "parity delta_net beta(0,2) wd=0:" in report and "parity delta_net beta(0,2) wd=0.1:" in report


def test_bench_mqar_parity_seed_sweep(tmp_path):
    """--parity-seeds runs every variant and lr at each seed (--parity-layers / --parity-mlp shape
    the model); the check names the best run and how many seeds solve parity."""
    out = tmp_path / "recall"
    args = tiny_args(out) + ["--only", "parity", "--parity-variants", "delta_net beta(0,2)", "--parity-seeds", "0,1,2",
                             "--parity-layers", "1", "--parity-mlp", "0"]  # fmt: skip
    assert bench_mqar.main(args) == 0
    results = json.loads((out / "recall.json").read_text())
    assert sorted(r["seed"] for r in results) == [0, 1, 2]
    assert {(r["num_layers"], r["intermediate_size"]) for r in results} == {(1, 0)}
    report = (out / "recall.md").read_text()
    assert "parity delta_net beta(0,2) wd=0.1: best run (lr 0.003, seed " in report
    assert "of 3 seeds solve it" in report


def test_bench_mqar_parity_model_per_family(tmp_path):
    """Without --parity-layers / --parity-mlp each family gets its parity model of PARITY_SHAPES;
    the flags override it for every family, one at a time."""
    out = tmp_path / "recall"
    base = tiny_args(out) + ["--only", "parity", "--parity-variants", "delta_net beta(0,2),mamba2 a(-1,1)"]
    assert bench_mqar.main(base) == 0
    shapes = {r["mixer"]: (r["num_layers"], r["intermediate_size"]) for r in json.loads((out / "recall.json").read_text())}
    assert shapes == {m: st.PARITY_SHAPES[m] for m in ("delta_net", "mamba2")}
    assert bench_mqar.main(base + ["--parity-mlp", "32"]) == 0
    shapes = {r["mixer"]: (r["num_layers"], r["intermediate_size"]) for r in json.loads((out / "recall.json").read_text())}
    assert shapes == {"delta_net": (st.PARITY_SHAPES["delta_net"][0], 32), "mamba2": (st.PARITY_SHAPES["mamba2"][0], 32)}


def test_bench_mqar_rejects_bad_parity_sweeps(tmp_path, capsys):
    """A negative weight decay, a non-positive lr or length, or a non-number is a usage error
    naming the flag."""
    import pytest

    out = tmp_path / "recall"
    for flag, value in (
        ("--parity-weight-decays", "0,-0.1"),
        ("--parity-lrs", "0"),
        ("--parity-lrs", "3e-3,x"),
        ("--mqar-lrs", "-1"),
        ("--parity-eval-lengths", "40,0"),
        ("--parity-seeds", "0,-1"),
        ("--parity-layers", "0"),
        ("--parity-mlp", "-1"),
    ):
        with pytest.raises(SystemExit):
            bench_mqar.main(tiny_args(out) + [flag, value])
        assert flag in capsys.readouterr().err
