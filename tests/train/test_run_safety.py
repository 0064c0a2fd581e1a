"""Run-directory safety on the stand-in model (fast): the lock, checkpoint manifests and the
fallback past a damaged checkpoint, resume modes, metrics after a kill, a failed start."""

import json
import os
import socket
import subprocess
import sys

import pytest

from ttr.errors import TTRError
from ttr.train.checkpoint import MANIFEST, checkpoint_dirs, verify_checkpoint
from ttr.train.config import config_from_dict
from ttr.train.lock import RunDirInUse, RunLock
from ttr.train.trainer import Trainer

from .conftest import standin_factory, tiny_config


def _run(table, factory=None, **kwargs):
    table["optim"]["schedule"] = "constant"  # runs of different lengths share their first steps
    trainer = Trainer(config_from_dict(table), model_factory=factory or standin_factory(), **kwargs)
    return trainer, trainer.run()


def _losses(trainer):
    return [r["loss"] for r in trainer.history]


def _steps(run_dir):
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_second_run_is_refused_while_the_first_runs(corpus_dir, cache_dir, tmp_path):
    table = tiny_config(corpus_dir, cache_dir, tmp_path / "r", train={"max_steps": 6})
    refusals = []

    def second_run(call):
        if call == 3:
            for kwargs in ({"overwrite": True}, {"resume": True}, {}):
                with pytest.raises(RunDirInUse) as err:
                    _run(table, **kwargs)
                refusals.append(str(err.value))

    first, record = _run(table, standin_factory(on_call=second_run))
    assert record["step"] == 6 and len(refusals) == 3
    assert all(f"host {socket.gethostname()}, pid {os.getpid()}" in r for r in refusals)
    assert _steps(tmp_path / "r") == [1, 2, 3, 4, 5, 6]  # the refused runs wrote nothing
    assert not (tmp_path / "r" / ".lock").exists()  # released at the end
    _run(table, resume=True)  # and the directory is free again


def test_stale_lock_is_taken_over_and_a_live_one_blocks(tmp_path):
    lock_file = tmp_path / ".lock"
    lock_file.write_text(json.dumps({"host": socket.gethostname(), "pid": _dead_pid(), "started": "earlier"}))
    lock = RunLock(tmp_path)
    assert "stale lock" in lock.acquire()[0] and json.loads(lock_file.read_text())["pid"] == os.getpid()
    lock.release()
    assert not lock_file.exists()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for host, pid in ((socket.gethostname(), sleeper.pid), ("other-host", _dead_pid())):
            lock_file.write_text(json.dumps({"host": host, "pid": pid, "started": "earlier"}))
            with pytest.raises(RunDirInUse, match=f"host {host}, pid {pid}"):
                RunLock(tmp_path).acquire()
            RunLock(tmp_path).release()  # not ours: left alone
            assert lock_file.exists()
    finally:
        sleeper.kill()
        sleeper.wait()
    lock_file.write_text(json.dumps({"host": socket.gethostname(), "pid": sleeper.pid}))
    assert RunLock(tmp_path).acquire()  # its holder is gone


def _damage(ckpt, how):
    if how == "truncate":
        shard = next(ckpt.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:100])
    else:  # same size, other bytes: only the checksum sees it
        state = ckpt / "trainer_state.json"
        text = state.read_text()
        state.write_text(text.replace('"step": 6', '"step": 9'))


@pytest.mark.parametrize("how", ["truncate", "rewrite"])
def test_damaged_latest_checkpoint_is_skipped_and_resume_stays_exact(corpus_dir, cache_dir, tmp_path, capsys, how):
    def table(run_dir, steps):
        return tiny_config(corpus_dir, cache_dir, run_dir, train={"max_steps": steps},
                           checkpoint={"every": 2, "keep_last": 3})

    straight, _ = _run(table(tmp_path / "a", 8))
    _run(table(tmp_path / "b", 6))
    latest = tmp_path / "b" / "checkpoints" / "step_00000006"
    assert verify_checkpoint(latest) is None and "sha256" in (latest / MANIFEST).read_text()
    _damage(latest, how)
    reason = verify_checkpoint(latest)
    assert reason and ("100 bytes" in reason if how == "truncate" else "sha256" in reason)
    capsys.readouterr()
    resumed, _ = _run(table(tmp_path / "b", 8), resume=True)
    out = capsys.readouterr()
    assert f"skipping checkpoint {latest}: {reason}" in out.err
    assert "resuming from" in out.err and "step_00000004" in out.err
    assert _losses(resumed) == _losses(straight)[4:]
    assert _steps(tmp_path / "b") == list(range(1, 9))
    names = sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir())
    assert names == ["step_00000004", "step_00000006", "step_00000006.bad", "step_00000008"]


def test_resume_from_a_named_checkpoint(corpus_dir, cache_dir, tmp_path):
    table = tiny_config(corpus_dir, cache_dir, tmp_path / "r", train={"max_steps": 6},
                        checkpoint={"every": 2, "keep_last": 3})
    straight, _ = _run(table)
    resumed, _ = _run(table, resume_from="step_00000002")
    assert _losses(resumed) == _losses(straight)[2:]
    assert _steps(tmp_path / "r") == [1, 2, 3, 4, 5, 6]
    names = sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir())
    assert "step_00000004.unused" in names and "step_00000006" in names  # never deleted
    with pytest.raises(TTRError, match="no such checkpoint folder"):
        _run(table, resume_from="step_00000003")
    with pytest.raises(TTRError, match="not a checkpoint of this run"):
        _run(table, resume_from=str(tmp_path))
    _damage(tmp_path / "r" / "checkpoints" / "step_00000006", "truncate")
    with pytest.raises(TTRError, match="cannot resume from .*step_00000006: __0_0.distcp has 100 bytes"):
        _run(table, resume_from=str(tmp_path / "r" / "checkpoints" / "step_00000006"))


def test_resume_modes(corpus_dir, cache_dir, tmp_path, capsys):
    run_dir = tmp_path / "r"
    table = tiny_config(corpus_dir, cache_dir, run_dir, train={"max_steps": 3})
    with pytest.raises(TTRError, match="--resume: no checkpoint .*--resume=auto"):
        _run(table, resume=True)
    assert not run_dir.exists()  # nothing left behind
    first, _ = _run(table, resume="auto")  # nothing to resume: starts
    assert "starting from step 0" in capsys.readouterr().err and len(first.history) == 3
    again, _ = _run(tiny_config(corpus_dir, cache_dir, run_dir, train={"max_steps": 5}), resume="auto")
    assert [r["step"] for r in again.history] == [4, 5]
    for ckpt in checkpoint_dirs(run_dir):
        _damage(ckpt, "truncate")
    with pytest.raises(TTRError, match="no checkpoint in .* can be resumed"):
        _run(table, resume="auto")  # never a silent restart over a run that had checkpoints
    with pytest.raises(ValueError, match="resume"):
        Trainer(config_from_dict(table), resume="newest")


def test_metrics_are_trimmed_after_a_hard_kill(corpus_dir, cache_dir, tmp_path):
    """A kill after steps were logged but before their checkpoint: the resumed run logs them again,
    once."""
    table = tiny_config(corpus_dir, cache_dir, tmp_path / "r", train={"max_steps": 6},
                        checkpoint={"every": 4, "keep_last": 2})
    straight, _ = _run(table)
    for ckpt in checkpoint_dirs(tmp_path / "r")[1:]:  # as if killed before step 6's checkpoint
        import shutil

        shutil.rmtree(ckpt)
    with (tmp_path / "r" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 7, "lo')  # a line cut short by the kill
    resumed, _ = _run(table, resume=True)
    assert _losses(resumed) == _losses(straight)[4:]
    assert _steps(tmp_path / "r") == [1, 2, 3, 4, 5, 6]


def test_config_changes_are_listed_and_a_model_change_refused(corpus_dir, cache_dir, tmp_path, capsys):
    table = tiny_config(corpus_dir, cache_dir, tmp_path / "r", train={"max_steps": 2})
    _run(table)
    capsys.readouterr()
    _run(tiny_config(corpus_dir, cache_dir, tmp_path / "r", train={"max_steps": 3}, optim={"lr": 5e-3}), resume=True)
    assert "config changed since that checkpoint: optim.lr: 0.01 -> 0.005; train.max_steps: 2 -> 3" in (
        capsys.readouterr().err)
    with pytest.raises(TTRError, match=r"does not fit it \(embed.weight is \[320, 16\] in the checkpoint and "
                                       r"\[320, 24\] in the model\)") as err:
        _run(table, standin_factory(width=24), resume=True)
    assert "\n" not in str(err.value)


def test_a_failed_start_leaves_no_run_directory(corpus_dir, cache_dir, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    run_dir = tmp_path / "r"
    with pytest.raises(ValueError, match="holds no documents"):
        _run(tiny_config(corpus_dir, cache_dir, run_dir, data={"source": str(empty)}))
    assert not run_dir.exists()
    blank = tmp_path / "blank"
    blank.mkdir()
    (blank / "a.txt").write_text("")
    (blank / "b.txt").write_text("")
    with pytest.raises(ValueError, match="no text to train a tokenizer on"):
        _run(tiny_config(corpus_dir, cache_dir, run_dir, data={"source": str(blank), "val_docs": 0},
                         tokenizer={"cache_dir": str(tmp_path / "tok")}))
    assert not run_dir.exists()
    trainer, record = _run(tiny_config(corpus_dir, cache_dir, run_dir, train={"max_steps": 1}))  # no --overwrite
    assert record["step"] == 1
    own = tmp_path / "mine"
    own.mkdir()
    (own / "notes.txt").write_text("keep me")
    with pytest.raises(TTRError, match="does not look like a ttr run directory"):
        _run(tiny_config(corpus_dir, cache_dir, own), overwrite=True)
    assert (own / "notes.txt").read_text() == "keep me"
