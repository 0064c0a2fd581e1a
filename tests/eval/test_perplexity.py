"""Perplexity: readers, document and sliding-window scoring and the extrapolation sweep, checked
against a direct computation with the model's full logits."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ttr.eval.cli import main
from ttr.eval.perplexity import _windows, extrapolation_sweep, perplexity, read_documents

from .tiny import CORPUS, make_checkpoint

DOCS = [CORPUS[0] + " " + CORPUS[1], CORPUS[2], "é ü — " + CORPUS[3] * 3]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ppl") / "ckpt"
    model, tokenizer = make_checkpoint(path, context=16)
    return path, model, tokenizer


def _direct_nll(model, ids, context_of):
    """NLL of ids[1:], token t scored from ids[context_of(t) : t] with one forward per token."""
    total = 0.0
    for t in range(1, len(ids)):
        x = torch.tensor([ids[context_of(t) : t]])
        with torch.no_grad():
            logp = torch.log_softmax(model(x).logits[0, -1].double(), -1)
        total -= logp[ids[t]].item()
    return total


def _ids(tokenizer, doc):
    return [tokenizer.bos_token_id, *tokenizer(doc, add_special_tokens=False).input_ids]


def test_document_mode_matches_direct(ckpt):
    _, model, tokenizer = ckpt
    got = perplexity(model, tokenizer, DOCS)
    nll = sum(_direct_nll(model, _ids(tokenizer, d), lambda t: 0) for d in DOCS)
    tokens = sum(len(_ids(tokenizer, d)) - 1 for d in DOCS)
    words = sum(len(d.split()) for d in DOCS)
    n_bytes = sum(len(d.encode()) for d in DOCS)
    assert got["tokens"] == tokens and got["words"] == words and got["bytes"] == n_bytes
    assert got["nll"] == pytest.approx(nll, rel=1e-5)
    assert got["token_perplexity"] == pytest.approx(math.exp(nll / tokens), rel=1e-5)
    assert got["word_perplexity"] == pytest.approx(math.exp(nll / words), rel=1e-5)
    assert got["byte_perplexity"] == pytest.approx(math.exp(nll / n_bytes), rel=1e-5)
    assert got["bits_per_byte"] == pytest.approx(nll / n_bytes / math.log(2), rel=1e-5)


@pytest.mark.parametrize("window,stride", [(8, 4), (8, 7), (5, 1)])
def test_window_mode_matches_direct(ckpt, window, stride):
    _, model, tokenizer = ckpt
    doc = DOCS[0]
    ids = _ids(tokenizer, doc)
    assert len(ids) > 3 * window
    # token t is read inside the window that scores it: the first window [0, W), then windows
    # ending stride tokens further, each starting W - stride tokens before the last one's end
    starts = {}
    for begin, end, first in _windows(len(ids), window, stride):
        for t in range(first, end):
            starts[t] = begin
    assert sorted(starts) == list(range(1, len(ids)))
    assert all(t - starts[t] >= min(t, window - stride) and t - starts[t] < window for t in starts)
    got = perplexity(model, tokenizer, [doc], mode="window", window=window, stride=stride)
    assert got["nll"] == pytest.approx(_direct_nll(model, ids, starts.__getitem__), rel=1e-5)
    whole = perplexity(model, tokenizer, [doc])
    assert got["nll"] != pytest.approx(whole["nll"], rel=1e-6)  # the window does cut context


def test_window_validation(ckpt):
    _, model, tokenizer = ckpt
    with pytest.raises(ValueError, match="stride"):
        perplexity(model, tokenizer, DOCS, mode="window", window=8, stride=8)
    with pytest.raises(ValueError, match="window"):
        perplexity(model, tokenizer, DOCS, mode="window")
    with pytest.raises(ValueError, match="mode"):
        perplexity(model, tokenizer, DOCS, mode="rolling")


def test_extrapolation_sweep_matches_direct(ckpt):
    _, model, tokenizer = ckpt
    sweep = extrapolation_sweep(model, tokenizer, DOCS * 4, context=16, factor=3, buckets=6, max_sequences=2)
    stream = [t for d in DOCS * 4 for t in _ids(tokenizer, d)]
    seqs = [stream[:49], stream[49:98]]
    assert sweep["sequences"] == 2 and sweep["length"] == 48 and sweep["bucket_end"][-1] == 48
    with torch.no_grad():
        logits = model(torch.tensor(seqs)).logits.double()
    nll = -torch.log_softmax(logits[:, :-1], -1).gather(-1, torch.tensor(seqs)[:, 1:, None])[..., 0]
    expected = nll.mean(0).view(6, 8).mean(1)
    assert sweep["loss"] == pytest.approx(expected.tolist(), rel=1e-5)


def test_readers(tmp_path):
    (tmp_path / "a.txt").write_text("first document")
    (tmp_path / "b.jsonl").write_text(
        json.dumps({"content": "second"}) + "\n\n" + json.dumps({"content": "third"}) + "\n"
    )
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["fourth", "fifth", ""]}), tmp_path / "c.parquet")
    assert read_documents(str(tmp_path / "b.jsonl"), text_field="content") == ["second", "third"]
    assert read_documents(str(tmp_path / "c.parquet"), text_field="content") == ["fourth", "fifth"]
    assert read_documents(str(tmp_path / "*.txt")) == ["first document"]
    with pytest.raises(ValueError, match="text_field"):
        read_documents(str(tmp_path / "b.jsonl"))
    with pytest.raises(ValueError, match="max_documents"):
        read_documents(str(tmp_path / "a.txt"), max_documents=0)


def test_cli_ppl_with_sweep(ckpt, tmp_path, capsys):
    path, model, tokenizer = ckpt
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS * 3))
    out = tmp_path / "out"
    assert main(["ppl", str(path), str(data), "--sweep-factor", "2", "--output", str(out)]) == 0
    result = json.loads((out / "perplexity.json").read_text())
    assert result["token_perplexity"] == pytest.approx(
        perplexity(model, tokenizer, DOCS * 3)["token_perplexity"], rel=1e-5
    )
    assert result["sweep"]["context"] == 16 and result["sweep"]["length"] == 32
    assert (out / "extrapolation.png").stat().st_size > 0
    assert "bits/byte" in capsys.readouterr().out
