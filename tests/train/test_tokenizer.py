import pytest

from ttr.train.sources import LocalSource
from ttr.train.tokenizer import SentencePieceTokenizer, load_tokenizer

TRICKY = "def f(x):\n\treturn  x + 12345  # é ü 😀\n\n   trailing  "


def _train(corpus_dir, cache_dir):
    src = LocalSource(str(corpus_dir))
    return src, load_tokenizer("", texts=lambda: (src.get(i) for i in range(len(src))),
                               fingerprint=src.fingerprint(), vocab_size=320, cache_dir=str(cache_dir))


def test_trained_and_cached(corpus_dir, cache_dir):
    src, tok = _train(corpus_dir, cache_dir)
    assert tok.vocab_size == 320 and (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 3)
    assert tok.decode(tok.encode(TRICKY)) == TRICKY  # byte fallback, whitespace kept
    assert len(tok.encode(src.get(0))) < len(src.get(0).encode()) / 1.3  # merges learned

    def boom():
        raise AssertionError("a cached tokenizer must not be retrained")

    again = load_tokenizer("", texts=boom, fingerprint=src.fingerprint(), vocab_size=320, cache_dir=str(cache_dir))
    assert again.model_proto == tok.model_proto
    assert len(list((cache_dir / "tokenizers").glob("*.model"))) == 1


def test_hf_tokenizer_matches_sentencepiece(corpus_dir, cache_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    src, tok = _train(corpus_dir, cache_dir)
    backend = tok.hf_backend()
    texts = [src.get(i) for i in range(len(src))] + [TRICKY]
    for text in texts:
        assert backend.encode(text).ids == tok.encode(text)
    tok.save_hf(tmp_path / "hf")
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert hf(TRICKY, add_special_tokens=False)["input_ids"] == tok.encode(TRICKY)
    assert hf.decode(tok.encode(TRICKY)) == TRICKY
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (1, 2, 3)
    as_hf = load_tokenizer(str(tmp_path / "hf"))  # any HF tokenizer folder works as tokenizer.path
    assert as_hf.encode(TRICKY) == tok.encode(TRICKY) and (as_hf.bos_id, as_hf.eos_id) == (1, 2)
    assert as_hf.vocab_size == tok.vocab_size
    reloaded = load_tokenizer(str(tmp_path / "hf" / "ttr_tokenizer.model"))
    assert isinstance(reloaded, SentencePieceTokenizer) and reloaded.encode(TRICKY) == tok.encode(TRICKY)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="vocab_size must be >= 300"):
        load_tokenizer("", texts=lambda: ["a"], fingerprint="x", vocab_size=100, cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(str(tmp_path / "none.model"))
    with pytest.raises(ValueError, match="texts and fingerprint"):
        load_tokenizer("")
