"""``ttr train`` through the command line on the stand-in model: exit status after a stop signal,
signals during the save, the end-of-run summary and loss curve, one-line errors."""

import json
import os
import signal
import sys

import pytest

import ttr.train.trainer as trainer_module
from ttr.__main__ import main
from ttr.train.checkpoint import checkpoint_dirs, verify_checkpoint

from .conftest import standin_factory, tiny_config
from .test_real_model import _overrides


def _train(tmp_path, table, *extra):
    config = tmp_path / "empty.toml"
    config.write_text("")
    table["optim"]["schedule"] = "constant"
    return main(["train", str(config), *_overrides(table), *extra])


def _losses(run_dir):
    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _signal_at(call_no, *signums):
    def hook(call):
        if call == call_no:
            for s in signums:
                os.kill(os.getpid(), s)

    return hook


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_saves_and_exits_with_its_status(corpus_dir, cache_dir, tmp_path, monkeypatch, capsys, signum):
    table = tiny_config(corpus_dir, cache_dir, tmp_path / "r", train={"max_steps": 8})
    monkeypatch.setattr(trainer_module, "build_model", standin_factory(on_call=_signal_at(3, signum)))
    assert _train(tmp_path, table) == 128 + signum
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"ttr train: stopped by {signal.Signals(signum).name} at step 3 after saving")
    assert [p.name for p in checkpoint_dirs(tmp_path / "r")] == ["step_00000003"]


def test_signals_during_the_save_do_not_lose_it(corpus_dir, cache_dir, tmp_path, monkeypatch, capsys):
    table = lambda d: tiny_config(corpus_dir, cache_dir, tmp_path / d, train={"max_steps": 6})  # noqa: E731
    monkeypatch.setattr(trainer_module, "build_model", standin_factory())
    assert _train(tmp_path, table("a")) == 0
    real_save = trainer_module.save_checkpoint

    def save_under_fire(*args, **kwargs):  # three more signals while the checkpoint is written
        for _ in range(3):
            os.kill(os.getpid(), signal.SIGTERM)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "save_checkpoint", save_under_fire)
    monkeypatch.setattr(trainer_module, "build_model", standin_factory(on_call=_signal_at(2, signal.SIGTERM)))
    assert _train(tmp_path, table("b")) == 143
    assert "still stopping, after the checkpoint" in capsys.readouterr().out
    ckpt = checkpoint_dirs(tmp_path / "b")[-1]
    assert ckpt.name == "step_00000002" and verify_checkpoint(ckpt) is None
    monkeypatch.setattr(trainer_module, "save_checkpoint", real_save)
    monkeypatch.setattr(trainer_module, "build_model", standin_factory())
    assert _train(tmp_path, table("b"), "--resume") == 0
    assert _losses(tmp_path / "b") == _losses(tmp_path / "a")


def test_two_signals_still_save_and_a_third_stops_at_once(corpus_dir, cache_dir, tmp_path, monkeypatch, capsys):
    table = tiny_config(corpus_dir, cache_dir, tmp_path / "r", train={"max_steps": 8})
    monkeypatch.setattr(trainer_module, "build_model",
                        standin_factory(on_call=_signal_at(3, signal.SIGTERM, signal.SIGTERM)))
    assert _train(tmp_path, table) == 143
    assert [p.name for p in checkpoint_dirs(tmp_path / "r")] == ["step_00000003"]
    capsys.readouterr()
    monkeypatch.setattr(trainer_module, "build_model", standin_factory(on_call=_signal_at(2, *[signal.SIGINT] * 3)))
    assert _train(tmp_path, table, "--resume") == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("ttr train: third stop signal (SIGINT): stopped during step 5 without saving it; the last "
                       f"checkpoint is {checkpoint_dirs(tmp_path / 'r')[-1]}")
    assert [p.name for p in checkpoint_dirs(tmp_path / "r")] == ["step_00000003"]


def test_summary_and_loss_curve(corpus_dir, cache_dir, tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(trainer_module, "build_model", standin_factory())
    table = tiny_config(corpus_dir, cache_dir, tmp_path / "r", train={"max_steps": 4},
                        log={"val_every": 2, "val_batches": 1})
    assert _train(tmp_path, table) == 0
    out = capsys.readouterr().out.splitlines()
    records = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert out[-4].startswith("finished at step 4/4: 4 step(s) and 256 tokens in ")
    assert out[-3] == f"train loss {records[-1]['loss']:.4f} (step 4), validation loss {records[-1]['val_loss']:.4f} (step 4)"
    assert out[-2:] == [f"checkpoint: {tmp_path / 'r' / 'checkpoints' / 'step_00000004'}",
                        f"loss curve: {tmp_path / 'r' / 'loss.png'}"]
    assert (tmp_path / "r" / "loss.png").read_bytes()[:4] == b"\x89PNG"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    table["train"]["max_steps"] = 5
    assert _train(tmp_path, table, "--resume") == 0
    out = capsys.readouterr().out
    assert "matplotlib is not installed (pip install 'ttr[eval]'): no loss curve image" in out
    assert "loss curve:" not in out


def test_one_line_errors_and_debug(corpus_dir, cache_dir, tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nmax_steps = 3\n")
    assert main(["train", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"config file {str(bad)!r} is not valid TOML" in err
    with pytest.raises(ValueError, match="not valid TOML"):
        main(["train", str(bad), "--debug"])
    with pytest.raises(SystemExit):  # argparse's usage error
        main(["train", "--resume=sometimes"])
    table = tiny_config(corpus_dir, cache_dir, tmp_path / "r", train={"max_steps": 1})
    assert _train(tmp_path, table) == 0
    ckpt = checkpoint_dirs(tmp_path / "r")[-1]
    (ckpt / "trainer_state.json").write_text("{not json")
    capsys.readouterr()
    assert _train(tmp_path, table, f"--resume-from={ckpt}") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot resume from {ckpt}: trainer_state.json has 9 bytes" in err
    (ckpt / "manifest.json").unlink()  # as written before manifests: the JSON itself is checked
    assert _train(tmp_path, table, f"--resume-from={ckpt}") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{ckpt / 'trainer_state.json'} is not valid JSON" in err


def test_bad_chunk_states_is_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    """A bad ``TTR_CHUNK_STATES`` stops ``ttr train`` before it reads the config or touches a run
    directory, in one line naming the variable."""
    monkeypatch.setenv("TTR_CHUNK_STATES", "always")
    missing = tmp_path / "no_such.toml"
    assert main(["train", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "TTR_CHUNK_STATES must be one of" in err and "'always'" in err
    assert list(tmp_path.iterdir()) == []
