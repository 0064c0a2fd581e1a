import json
import os
import signal

import numpy as np
import pytest
import torch

from ttr.train.data import (
    BatchStream,
    Encoder,
    HFDocStream,
    MapDocStream,
    epoch_order,
    make_batch,
    pack,
    validation_ids,
)
from ttr.train.sources import LocalSource, ShardSource, open_source


class CharTok:
    """Byte tokenizer: enough to check data plumbing without training one."""

    vocab_size, bos_id, eos_id, pad_id = 260, 256, 257, 258

    def encode(self, text):
        return list(text.encode())


def docs_iter(lengths):
    for i, n in enumerate(lengths):
        yield 0, i, np.arange(100 * i, 100 * i + n)


def test_pack_boundaries_and_labels():
    it = docs_iter([5, 12, 3, 40])
    tokens, starts, last, used = pack(lambda: next(it), None, 0, rows=2, seq_len=10)
    # row 0: doc0 (5) + doc1[:5]; row 1: doc1[5:12] (7) + doc2[:3]
    assert starts == [0, 5, 10, 17]
    assert tokens.tolist()[:7] == [0, 1, 2, 3, 4, 100, 101]
    assert last[1] == 2 and used == 3
    batch = make_batch(tokens, starts)
    assert batch["cu_seqlens"].tolist() == [0, 5, 10, 17, 20]
    assert batch["input_ids"].shape == (1, 20)
    assert (batch["labels"][0, starts] == -100).all()
    assert batch["num_targets"] == 20 - 4
    tokens2, starts2, last2, used2 = pack(lambda: next(it), last, used, rows=1, seq_len=10)
    assert starts2 == [0] and tokens2.tolist() == list(range(300, 310)) and used2 == 10


def test_order_deterministic_and_sharded():
    sizes = np.array([5, 3, 7])
    held = validation_ids(15, 3)
    a, b = epoch_order(sizes, 4, 0, held), epoch_order(sizes, 4, 0, held)
    assert np.array_equal(a, b) and not np.array_equal(a, epoch_order(sizes, 4, 1, held))
    assert sorted(a.tolist()) == sorted(set(range(15)) - set(held.tolist()))
    shards = [a[r::3] for r in range(3)]
    assert sorted(np.concatenate(shards).tolist()) == sorted(a.tolist())
    with pytest.raises(ValueError, match="val_docs"):
        validation_ids(10, 6)


def _stream(corpus_dir, state=None, rank=0, world=1, workers=0):
    source = LocalSource(str(corpus_dir))
    enc = Encoder(source, CharTok(), workers)
    docs = MapDocStream(source, enc, seed=3, rank=rank, world=world, exclude=validation_ids(len(source), 4))
    return BatchStream(docs, rows=2, seq_len=64, state=state), enc


def test_resume_position_is_exact(corpus_dir):
    stream, _ = _stream(corpus_dir)
    first = [next(stream) for _ in range(7)]
    state = stream.state()
    rest = []
    while stream.state()["epoch"] == 0 or len(rest) < 5:  # run into the second epoch
        rest.append(next(stream))
    assert stream.state()["epoch"] == 1 and len(rest) > 20
    resumed, _ = _stream(corpus_dir, state=json.loads(json.dumps(state)))
    for want in rest:
        got = next(resumed)
        assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["cu_seqlens"], want["cu_seqlens"])
    assert not torch.equal(first[0]["input_ids"], rest[0]["input_ids"])


def test_worker_processes_match_in_process(corpus_dir):
    a, _ = _stream(corpus_dir)
    b, enc = _stream(corpus_dir, workers=2)
    try:
        for _ in range(5):
            assert torch.equal(next(a)["input_ids"], next(b)["input_ids"])
    finally:
        enc.close()


def test_ranks_read_disjoint_documents(corpus_dir):
    seen = []
    for rank in range(2):
        stream, _ = _stream(corpus_dir, rank=rank, world=2)
        batch = next(stream)
        ids = batch["input_ids"][0].tolist()
        seen.append({ids[s + 1 : s + 8].__repr__() for s in batch["cu_seqlens"][:-1].tolist() if ids[s] == 256})
    assert seen[0] and seen[1] and not seen[0] & seen[1]


def test_local_formats(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n\n{"text": "two"}\n')
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")

    pq.write_table(pa.table({"text": ["three", "four", "five"]}), tmp_path / "b.parquet")
    (tmp_path / "c.txt").write_text("six")
    src = open_source(str(tmp_path))
    assert src.sizes.tolist() == [2, 3, 1]
    assert [src.get(i) for i in range(6)] == ["one", "two", "three", "four", "five", "six"]
    bad = LocalSource(str(tmp_path / "a.jsonl"), text_key="body")
    with pytest.raises(ValueError, match="text_key"):
        bad.get(0)
    with pytest.raises(ValueError, match="neither a file nor a folder"):
        open_source(str(tmp_path / "missing"))


def test_prepared_shards(tmp_path, corpus_dir):
    from ttr.scripts.prepare_data import main as prepare
    from ttr.train.tokenizer import load_tokenizer

    out = tmp_path / "shards"
    src = LocalSource(str(corpus_dir))
    tok = load_tokenizer("", texts=lambda: (src.get(i) for i in range(len(src))), fingerprint=src.fingerprint(),
                         vocab_size=320, cache_dir=str(tmp_path / "cache"))
    model_file = tmp_path / "tok.model"
    model_file.write_bytes(tok.model_proto)
    assert prepare([str(corpus_dir), str(out), "--tokenizer", str(model_file), "--shard-tokens", "2000"]) == 0
    shards = ShardSource(str(out))
    assert len(shards) == len(src) and len(shards.files) > 1
    for i in (0, 17, len(src) - 1):
        assert shards.get(i).tolist() == tok.encode(src.get(i))
    assert shards.dtype == np.uint16


def test_hf_streaming(tmp_path):
    pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * 3}) + "\n" for i in range(30)))
    enc = Encoder(None, CharTok(), 0)

    def stream(state=None):
        docs = HFDocStream(str(folder), "", "train", "text", enc, seed=0, rank=0, world=1, val_docs=3,
                           shuffle_buffer=8)
        return docs, BatchStream(docs, rows=1, seq_len=32, state=state)

    docs, s = stream()
    assert [t.startswith("document ") for t in docs.validation_texts()] == [True] * 3
    for _ in range(5):
        next(s)
    state = s.state()
    want = [next(s)["input_ids"] for _ in range(4)]
    _, resumed = stream(state)
    assert all(torch.equal(next(resumed)["input_ids"], w) for w in want)


def test_tokenizer_workers_ignore_signals_the_main_process_handles():
    """Ctrl-C reaches the whole process group: the workers must not print a traceback or die
    (a dead worker would leave its chunk unanswered)."""
    enc = Encoder(None, CharTok(), num_workers=1)
    try:
        assert [len(t) for t in enc.map(iter(["ab", "cde"]))] == [4, 5]
        (worker,) = enc.pool._processes.values()
        for s in (signal.SIGINT, signal.SIGTERM):
            os.kill(worker.pid, s)
        assert [len(t) for t in enc.map(iter(["x" * 10]))] == [12]
        assert worker.is_alive()
    finally:
        enc.close()
    assert not worker.is_alive()
