"""The loop on a stand-in model (fast): resume, signals, non-finite steps, accumulation, checkpoints."""

import json
import math
import os
import signal

import pytest
import torch

from ttr.train.checkpoint import checkpoint_dirs, latest_checkpoint
from ttr.train.config import config_from_dict
from ttr.train.trainer import Trainer, TrainingStopped

from .conftest import standin_factory, tiny_config


def _run(table, factory=None, **kwargs):
    trainer = Trainer(config_from_dict(table), model_factory=factory or standin_factory(), **kwargs)
    record = trainer.run()
    return trainer, record


def _losses(trainer):
    return [r["loss"] for r in trainer.history]


def test_sigterm_saves_and_resume_is_exact(corpus_dir, cache_dir, tmp_path):
    base = dict(train={"max_steps": 20}, data={"num_workers": 1})
    straight, _ = _run(tiny_config(corpus_dir, cache_dir, tmp_path / "a", **base))

    def kill_at_10(call):
        if call == 10:
            os.kill(os.getpid(), signal.SIGTERM)

    first, record = _run(tiny_config(corpus_dir, cache_dir, tmp_path / "b", **base), standin_factory(on_call=kill_at_10))
    assert record["stopped_by"] == "SIGTERM" and record["step"] == 10
    assert [p.name for p in checkpoint_dirs(tmp_path / "b")] == ["step_00000010"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))
    second, _ = _run(tiny_config(corpus_dir, cache_dir, tmp_path / "b", **base), resume=True)
    assert len(_losses(first)) == 10 and len(_losses(second)) == 10
    assert _losses(first) + _losses(second) == _losses(straight)
    assert _losses(straight)[-1] < _losses(straight)[0]


def test_run_dir_is_not_overwritten(corpus_dir, cache_dir, tmp_path):
    table = tiny_config(corpus_dir, cache_dir, tmp_path / "r", train={"max_steps": 2})
    _run(table)
    with pytest.raises(FileExistsError, match="--resume.*--overwrite"):
        _run(table)
    trainer, record = _run(table, overwrite=True)
    assert record["step"] == 2 and len(trainer.history) == 2
    trainer, _ = _run(table, resume=True)  # already at max_steps: nothing to do
    assert trainer.history == []


def test_nonfinite_steps_skipped_then_stop(corpus_dir, cache_dir, tmp_path):
    trainer, _ = _run(tiny_config(corpus_dir, cache_dir, tmp_path / "n", train={"max_steps": 5}),
                      standin_factory(nan_at={3}))
    assert [r["skipped"] for r in trainer.history] == [False, False, True, False, False]
    assert trainer.nonfinite_total == 1 and trainer.nonfinite_streak == 0
    lines = [json.loads(x) for x in (tmp_path / "n" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4, 5] and lines[2]["skipped"]
    table = tiny_config(corpus_dir, cache_dir, tmp_path / "m", train={"max_steps": 9, "max_nonfinite": 3})
    with pytest.raises(TrainingStopped, match="3 non-finite steps in a row"):
        _run(table, standin_factory(nan_at={2, 4, 5, 6}))


def test_accumulation_matches_one_big_batch(corpus_dir, cache_dir, tmp_path):
    big, _ = _run(tiny_config(corpus_dir, cache_dir, tmp_path / "big", train={"micro_batch_size": 4}))
    acc, _ = _run(tiny_config(corpus_dir, cache_dir, tmp_path / "acc",
                              train={"micro_batch_size": 2, "batch_tokens": 128}))
    assert acc.accum == 2 and big.accum == 1
    assert _losses(acc) == pytest.approx(_losses(big), rel=1e-5, abs=1e-6)
    with pytest.raises(ValueError, match="batch_tokens=100 must be a multiple"):
        _run(tiny_config(corpus_dir, cache_dir, tmp_path / "bad", train={"batch_tokens": 100}))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="fsdp.*needs CUDA"):
            _run(tiny_config(corpus_dir, cache_dir, tmp_path / "fsdp", train={"distributed": "fsdp"}))


def test_checkpoints_keep_last_and_ignore_partial(corpus_dir, cache_dir, tmp_path):
    table = tiny_config(corpus_dir, cache_dir, tmp_path / "k", checkpoint={"every": 2, "keep_last": 2},
                        log={"val_every": 3, "val_batches": 2})
    trainer, record = _run(table)
    assert [p.name for p in checkpoint_dirs(tmp_path / "k")] == ["step_00000004", "step_00000006"]
    assert "val_loss" in record and record["val_ppl"] > 1
    partial = tmp_path / "k" / "checkpoints" / ".tmp-step_00000008"
    partial.mkdir()
    assert latest_checkpoint(tmp_path / "k").name == "step_00000006"
    state = json.loads((latest_checkpoint(tmp_path / "k") / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["world_size"] == 1 and set(state["data"][0]) == {"epoch", "index", "offset"}


def test_hf_and_shard_sources_through_the_loop(corpus_dir, cache_dir, tmp_path):
    pytest.importorskip("datasets")
    from ttr.scripts.prepare_data import main as prepare
    from ttr.train.sources import LocalSource
    from ttr.train.tokenizer import load_tokenizer

    src = LocalSource(str(corpus_dir))
    tok = load_tokenizer("", texts=lambda: (src.get(i) for i in range(len(src))), fingerprint=src.fingerprint(),
                         vocab_size=320, cache_dir=str(cache_dir))
    model_file = tmp_path / "tok.model"
    model_file.write_bytes(tok.model_proto)
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"text": src.get(i)}) + "\n" for i in range(len(src))))
    assert prepare([str(corpus_dir), str(tmp_path / "shards"), "--tokenizer", str(model_file)]) == 0
    for name, source in (("hf", f"hf:{folder}"), ("shards", str(tmp_path / "shards"))):
        table = tiny_config(corpus_dir, cache_dir, tmp_path / f"run-{name}", train={"max_steps": 3},
                            data={"source": source}, tokenizer={"path": str(model_file)},
                            log={"val_every": 3, "val_batches": 1})
        trainer, record = _run(table)
        assert record["step"] == 3 and math.isfinite(record["loss"]) and "val_loss" in record
    with pytest.raises(ValueError, match="needs tokenizer.path"):
        _run(tiny_config(corpus_dir, cache_dir, tmp_path / "x", data={"source": f"hf:{folder}"}))
