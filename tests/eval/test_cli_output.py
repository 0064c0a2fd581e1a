"""``ttr eval`` as a user meets it: where results go, one-line errors, offline lm-eval tasks (the
network is never touched: the Hub's failure is simulated), progress of the synthetic sweeps."""

from __future__ import annotations

import functools
import json
import os
import pickle
import socket
import time

import pytest

from ttr.__main__ import main
from ttr.errors import TTRError
from ttr.eval import hub
from ttr.eval.progress import SweepProgress, tracked, train_logging

from .tiny import make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "run" / "export"
    make_checkpoint(path, context=16)
    return path


def test_results_go_under_the_model_folder(ckpt, tmp_path, capsys):
    data = tmp_path / "docs.txt"
    data.write_text("the cat sat on the mat and the dog sat on the log\n")
    for given in (ckpt, ckpt.parent):  # the export folder, or the run directory holding it
        assert main(["eval", "ppl", str(given), str(data)]) == 0
    written = sorted((ckpt / "eval").iterdir())
    assert len(written) == 2 and all(p.name.startswith("ppl-") for p in written)  # the second did not overwrite
    assert json.loads((written[0] / "perplexity.json").read_text())["documents"] == 1
    assert f"wrote {written[-1] / 'perplexity.json'}" in capsys.readouterr().out


def test_eval_errors_are_one_line(ckpt, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    data = tmp_path / "docs.txt"
    data.write_text("one two three\n")
    cases = [
        (["eval", "ppl", str(tmp_path / "nope"), str(data)], "does not exist: give a `ttr export` folder"),
        (["eval", "ppl", str(tmp_path), str(data)], "has no config.json"),
        (["eval", "ppl", str(ckpt), str(data), "--output", str(blocker / "out")], "cannot write results to"),
        (["eval", "ppl", str(ckpt), str(tmp_path / "missing.jsonl")], "missing.jsonl"),
        (["eval", "mqar", "--mixer", "lstm"], "--mixer: unknown ['lstm']"),
        (["eval", "state", "--num-layers", "0"], "num_layers"),
    ]
    for argv, expected in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("ttr eval: error: ") and expected in err, (argv, err)
    assert not (ckpt / "eval").exists() or all(any(p.iterdir()) for p in (ckpt / "eval").iterdir())
    with pytest.raises(TTRError, match="has no config.json"):
        main(["eval", "ppl", str(tmp_path), str(data), "--debug"])


def _local_task(root, dataset_path: str):
    (root / "remote.yaml").write_text(
        f"task: ttr_remote\ndataset_path: {dataset_path}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{q}}"\ndoc_to_choice: "{{c}}"\ndoc_to_target: "{{a}}"\nmetric_list:\n  - metric: acc\n'
    )


def test_lm_offline_says_what_to_do(ckpt, tmp_path, monkeypatch, capsys):
    pytest.importorskip("lm_eval")
    import datasets

    from ttr.eval import lm_harness

    # lm-eval's own task index takes seconds to build; the tasks here are the local ones
    monkeypatch.setattr(lm_harness, "TaskManager", functools.partial(lm_harness.TaskManager, include_defaults=False))

    def unreachable(path, *args, **kwargs):  # what datasets raises offline, without its retries
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    _local_task(tasks, "someone/remote_dataset")
    argv = ["eval", "lm", str(ckpt), "--tasks", "ttr_remote", "--include-path", str(tasks), "--dtype", "float32"]
    assert main(argv) == 2
    err = capsys.readouterr().err  # after the progress bar of the model's loading
    assert "Traceback" not in err
    err = err.splitlines()[-1]
    assert "a task's dataset cannot be downloaded (Couldn't reach 'someone/remote_dataset' on the Hub" in err
    assert "HF_DATASETS_OFFLINE=1" in err and "--include-path DIR" in err
    assert not (ckpt / "eval").exists() or not any(p.name.startswith("lm-") for p in (ckpt / "eval").iterdir())
    assert main([*argv[:4], "no_such_task", *argv[5:]]) == 2
    assert "tasks: unknown ['no_such_task']" in capsys.readouterr().err


def test_hub_check_goes_offline_without_waiting(monkeypatch):
    for var in hub.OFFLINE_VARS + hub.PROXY_VARS:
        monkeypatch.setenv(var, "")  # so that the test restores their absence
        monkeypatch.delenv(var)
    calls = []

    def refuse(address, timeout):
        calls.append((address, timeout))
        raise OSError("Name or service not known")

    monkeypatch.setattr(socket, "create_connection", refuse)
    assert "not reachable" in hub.offline_if_unreachable()
    assert calls == [(("huggingface.co", 443), 3.0)]
    assert os.environ["HF_HUB_OFFLINE"] == os.environ["HF_DATASETS_OFFLINE"] == "1"
    assert hub.offline_if_unreachable() is None and len(calls) == 1  # the user's (or our) choice stands
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")
    assert hub.offline_if_unreachable() is None and len(calls) == 1
    err = RuntimeError("wrapped")
    err.__cause__ = ConnectionError("down")
    assert hub.is_offline_error(err) and not hub.is_offline_error(ValueError("bad"))


def _wait(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the progress thread did not take the update"
        time.sleep(0.01)


def _fake_job(job):
    log = train_logging(job, job["steps"])
    for step in range(job["stop_at"]):
        log["log"](step, 0.0) if step % log["log_every"] == 0 or step == job["steps"] - 1 else None
    return job["index"]


def test_sweep_progress_counts_steps_and_estimates_the_total(capsys):
    jobs = [{"index": 0, "steps": 200, "stop_at": 200}, {"index": 1, "steps": 200, "stop_at": 120},
            {"index": 2, "steps": 300, "stop_at": 300}]
    with SweepProgress(jobs, "sweep") as progress:
        first = progress.wrap(_fake_job)(jobs[0])
        progress.queue.put((1, 50, 200))  # mid-way through the second job: the third is guessed
        _wait(lambda: progress.done.get(1) == 50)
        assert progress.bar.total == 600 and progress.bar.n == 250
        rest = [progress.wrap(_fake_job)(job) for job in jobs[1:]]
    assert [first, *rest] == [0, 1, 2]
    # the second job stopped early (a time budget): its total is what it ran
    assert progress.totals == {0: 200, 1: 119, 2: 300} and progress.bar.n == 619 and progress.finished == 3
    assert "sweep" in capsys.readouterr().err
    assert train_logging(jobs[0], 10) == {}  # no bar listening


def test_progress_wrapper_crosses_a_process_boundary():
    jobs = [{"index": i} for i in range(2)]
    with SweepProgress(jobs, "sweep", workers=2) as progress:
        wrapped = pickle.loads(pickle.dumps(progress.wrap(_fake_job)))
        assert isinstance(wrapped, functools.partial) and wrapped.func is tracked
        wrapped.args[1].put((0, 3, 10))  # the queue proxy reaches the bar
        _wait(lambda: progress.done.get(0) == 3)
