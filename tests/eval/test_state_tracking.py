"""State-tracking generators against independent evaluations, and a small ``ttr eval state`` run."""

from __future__ import annotations

import json
import random

import pytest

from ttr.errors import TTRError
from ttr.eval import state_tracking as st
from ttr.eval.cli import main

SYMBOLS = {st.PLUS: "+", st.MINUS: "-", st.TIMES: "*", st.OPEN: "(", st.CLOSE: ")"}


def _render(tokens):
    return "".join(SYMBOLS.get(t, str(t)) for t in tokens)


def test_parity_labels():
    rng = random.Random(0)
    for n in (1, 2, 7, 40):
        bits, labels = st.parity_example(n, rng)
        assert len(bits) == n and set(bits) <= {0, 1}
        assert labels == [sum(bits[: i + 1]) % 2 for i in range(n)]


def test_modular_arithmetic_left_to_right():
    rng = random.Random(1)
    for n in (1, 3, 9, 41, 40):
        tokens, labels = st.modular_example(n, rng)
        assert len(tokens) == (n if n % 2 else n - 1)
        assert all(0 <= t < st.MOD for t in tokens[::2]) and all(t in st.OPS for t in tokens[1::2])
        value = tokens[0]
        assert labels[0] == value
        for i in range(1, len(tokens), 2):
            # evaluate the prefix left to right with Python's own arithmetic
            value = eval(f"({value}){SYMBOLS[tokens[i]]}{tokens[i + 1]}") % st.MOD
            assert labels[i] == -100 and labels[i + 1] == value


def test_modular_arithmetic_brackets_matches_python_eval():
    rng = random.Random(2)
    lengths = []
    for n in (2, 5, 12, 40, 100):
        for _ in range(20):
            tokens, labels = st.brackets_example(n, rng)
            assert tokens[-1] == st.EQUALS and len(tokens) <= n
            assert labels[:-1] == [-100] * (len(tokens) - 1)
            assert labels[-1] == eval(_render(tokens[:-1])) % st.MOD
            lengths.append(len(tokens))
    assert max(lengths) > 60  # long expressions are actually produced
    assert any(st.OPEN in st.brackets_example(30, rng)[0] for _ in range(5))


def test_batches_pad_and_final_only():
    rng = random.Random(3)
    x, y = st.make_batch("parity", [3, 6], rng)
    assert x.shape == (2, 6) and (x[0, 3:] == st.PAD).all() and (y[0, 3:] == -100).all()
    x, y = st.make_batch("modular_arithmetic", [9, 9], rng, final_only=True)
    assert ((y != -100).sum(1) == 1).all() and (y[:, -1] != -100).all()
    with pytest.raises(ValueError, match="task"):
        st.make_batch("dyck", [3], rng)


def test_cli_state_run(tmp_path):
    out = tmp_path / "state"
    rc = main(
        [
            "state",
            "--task",
            "parity,modular_arithmetic_brackets",
            "--variants",
            "delta_net beta(0,2)",
            "--d-model",
            "16",
            "--intermediate-size",
            "0",
            "--lrs",
            "1e-2",
            "--steps",
            "3",
            "--batch-size",
            "4",
            "--train-max",
            "8",
            "--eval-lengths",
            "8,16",
            "--eval-examples",
            "8",
            "--device",
            "cpu",
            "--output",
            str(out),
        ]
    )
    assert rc == 0
    results = json.loads((out / "state_tracking.json").read_text())
    assert {(r["task"], r["label"]) for r in results} == {
        ("parity", "delta_net beta(0,2)"),
        ("modular_arithmetic_brackets", "delta_net beta(0,2)"),
    }
    assert all(set(r["per_length"]) == {"8", "16"} for r in results)
    assert "delta_net beta(0,2)" in (out / "state_tracking.md").read_text()


def test_weight_decay_reaches_the_optimizer(monkeypatch):
    """The job's weight decay is what ``train`` gets; a negative one is refused by name."""
    seen = {}

    def fake_train(model, batches, **kw):
        seen.update(kw)
        return [0.0]

    monkeypatch.setattr(st, "train", fake_train)
    job = st.make_job("parity", "delta_net beta(0,2)", 1e-3, weight_decay=0.0, d_model=16, intermediate_size=0,
                      steps=1, train_max=4, eval_lengths=(4,), eval_examples=2, device="cpu")  # fmt: skip
    r = st.run_job(job)
    assert seen["weight_decay"] == 0.0 and seen["lr"] == 1e-3 and r["weight_decay"] == 0.0
    with pytest.raises(ValueError, match="weight_decay"):
        st.make_job("parity", "delta_net beta(0,2)", 1e-3, weight_decay=-0.1)


def test_cli_state_rejects_bad_sweeps(capsys):
    """A negative weight decay or a non-positive lr is a usage error naming its flag."""
    for flag, value in (("--weight-decays", "0,-0.1"), ("--lrs", "1e-3,0")):
        with pytest.raises(SystemExit):
            main(["state", flag, value])
        assert f"argument {flag}" in capsys.readouterr().err


def _parity(label, neg):
    return st.run_job(
        dict(
            task="parity",
            label=label,
            mixer="delta_net",
            overrides={"allow_neg_eigval": neg},
            lr=3e-3,
            seed=0,
            d_model=32,
            num_layers=1,
            intermediate_size=64,
            num_heads=1,
            steps=400,
            batch_size=32,
            train_min=2,
            train_max=16,
            eval_lengths=[16, 32],
            eval_examples=256,
            eval_batch_size=256,
            device="cpu",
        )
    )


def test_delta_rule_with_negative_eigenvalues_learns_parity():
    # Grazzi et al.: beta in (0, 2) lets I - beta k k^T reflect, which is what parity needs
    r = _parity("delta_net beta(0,2)", True)
    assert r["per_length"][16] >= 0.95 and r["per_length"][32] >= 0.8, r["per_length"]


@pytest.mark.slow
def test_delta_rule_with_positive_eigenvalues_stays_near_chance():
    r = _parity("delta_net beta(0,1)", False)
    assert max(r["per_length"].values()) < 0.65, r["per_length"]


def _result(label, lr, seed, per_length, wd=0.1):
    return dict(task="parity", label=label, lr=lr, seed=seed, weight_decay=wd, train_max=40, steps=10,
                chance=0.5, per_length=per_length, num_layers=1, intermediate_size=0)  # fmt: skip


def test_best_run_over_seeds_and_seeds_solved():
    """The score is the best run over lrs and seeds (Deletang et al.); a seed solves the task when
    its best-lr run holds >= SOLVED at every length beyond training (L = 40 is not beyond)."""
    label = "delta_net beta(0,2)"
    results = [
        _result(label, 1e-3, 0, {40: 1.0, 128: 0.70, 256: 0.60}),
        _result(label, 3e-3, 0, {40: 1.0, 128: 1.00, 256: 0.995}),  # seed 0 solves it at its best lr
        _result(label, 1e-3, 1, {40: 0.5, 128: 1.00, 256: 1.00}),  # solves beyond training, not at 40
        _result(label, 3e-3, 1, {40: 1.0, 128: 0.99, 256: 0.98}),  # seed 1's best lr: does not solve
        _result(label, 3e-3, 2, {40: 1.0, 128: 0.60, 256: 0.50}),
        _result(label, 3e-3, 0, {40: 1.0, 128: 1.0, 256: 1.0}, wd=0.0),  # another weight decay: own row
    ]
    best = st.best_by_label(results)
    assert best[("parity", label, 0.1)] is results[1]
    assert best[("parity", label, 0.0)] is results[5]
    solved = st.seeds_solved(results)
    assert solved == {("parity", label, 0.1): (1, 3), ("parity", label, 0.0): (1, 1)}
    # results read back from JSON have string lengths
    loaded = json.loads(json.dumps(results))
    assert st.seeds_solved(loaded) == solved
    table = st.markdown_table(results)
    assert "| blocks | MLP |" in table and "| best seed | seeds solved |" in table and "| 0 | 1/3 |" in table


def test_cli_state_runs_every_seed(tmp_path, capsys):
    """--seeds runs each variant and lr at every seed; a negative seed is a usage error."""
    out = tmp_path / "state"
    args = ["state", "--variants", "delta_net beta(0,2)", "--d-model", "16", "--intermediate-size", "0",
            "--lrs", "1e-2", "--steps", "2", "--batch-size", "4", "--train-max", "6", "--eval-lengths", "6,8",
            "--eval-examples", "4", "--device", "cpu", "--output", str(out)]  # fmt: skip
    assert main(args + ["--seeds", "0,3"]) == 0
    results = json.loads((out / "state_tracking.json").read_text())
    assert sorted(r["seed"] for r in results) == [0, 3]
    assert "/2 |" in (out / "state_tracking.md").read_text()
    with pytest.raises(SystemExit):
        main(args + ["--seeds", "0,-1"])
    assert "argument --seeds" in capsys.readouterr().err


def test_model_shape_per_task_and_family(capsys):
    """Parity gets one block without an MLP for the delta rules and two blocks with one for
    Mamba2; other tasks two blocks with an MLP; explicit sizes win, and bad ones are refused."""
    shape = lambda job: (job["num_layers"], job["intermediate_size"])  # noqa: E731
    assert shape(st.make_job("parity", "gated_deltanet beta(0,2)", 1e-3)) == (1, 0)
    assert shape(st.make_job("parity", "delta_net beta(0,1)", 1e-3)) == (1, 0)
    assert shape(st.make_job("parity", "mamba2 a(-1,1)", 1e-3)) == (2, 128)
    assert shape(st.make_job("modular_arithmetic", "delta_net beta(0,2)", 1e-3)) == st.DEFAULT_SHAPE
    assert shape(st.make_job("parity", "delta_net beta(0,2)", 1e-3, num_layers=3, intermediate_size=64)) == (3, 64)
    with pytest.raises(ValueError, match="num_layers"):
        st.make_job("parity", "delta_net beta(0,2)", 1e-3, num_layers=0)
    with pytest.raises(TTRError, match="num_layers"):
        main(["state", "--num-layers", "0"])


def test_parity_sweep_checks_every_variant(tmp_path):
    """The report of a parity sweep checks the negative-eigenvalue variants for 1.0 beyond training
    and the others for chance, per weight decay, with the seeds that solve it; --steps 0 trains on
    the clock alone."""
    out = tmp_path / "state"
    args = ["state", "--variants", "delta_net beta(0,1);delta_net beta(0,2)", "--d-model", "16", "--steps", "0",
            "--max-minutes", "0.001", "--lrs", "3e-3", "--weight-decays", "0,0.1", "--batch-size", "4",
            "--train-max", "6", "--eval-lengths", "6,8", "--eval-examples", "4", "--device", "cpu", "--output", str(out)]
    assert main(args) == 0
    report = (out / "state_tracking.md").read_text()
    for wd in ("0", "0.1"):
        assert f"- parity delta_net beta(0,2) wd={wd}: best run (lr 0.003, seed 0) min acc beyond training " in report
        assert f"- parity delta_net beta(0,1) wd={wd}: best run max acc beyond training " in report
    assert "of 1 seeds solve it" in report
    with pytest.raises(TTRError, match="steps"):
        main(["state", "--steps", "0"])
