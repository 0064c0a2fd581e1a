"""Tokenizers: a sentencepiece BPE trained by ttr (cached), or any Hugging Face tokenizer.

The trained model treats text as raw bytes of code and prose: identity normalisation, no
whitespace collapsing, no dummy prefix, byte fallback (every string encodes), newline as its own
piece, digits split. ``<unk>=0, <s>=1, </s>=2, <pad>=3``. ``save_hf`` writes an equivalent
``tokenizers`` BPE (same ids, checked token-for-token in the tests) as a
``PreTrainedTokenizerFast`` so ``AutoTokenizer.from_pretrained`` loads it offline.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Iterable
from pathlib import Path

SPECIAL = {"unk": 0, "bos": 1, "eos": 2, "pad": 3}
USER_SYMBOLS = ["\n"]


def default_cache_dir() -> Path:
    return Path(os.environ.get("TTR_CACHE_DIR") or Path.home() / ".cache" / "ttr")


class SentencePieceTokenizer:
    """Wraps a sentencepiece model held as bytes (so it pickles into worker processes)."""

    def __init__(self, model_proto: bytes):
        self.model_proto = model_proto
        self._sp = None
        sp = self.sp
        self.vocab_size = sp.get_piece_size()
        self.bos_id, self.eos_id, self.pad_id = sp.bos_id(), sp.eos_id(), sp.pad_id()

    @property
    def sp(self):
        if self._sp is None:
            import sentencepiece as spm

            self._sp = spm.SentencePieceProcessor(model_proto=self.model_proto)
        return self._sp

    def __getstate__(self):
        return {"model_proto": self.model_proto}

    def __setstate__(self, state):
        self.__init__(state["model_proto"])

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(ids)

    def hf_backend(self):
        """The same BPE as a ``tokenizers.Tokenizer`` (merges ranked by the merged piece's id)."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

        sp = self.sp
        pieces = [sp.id_to_piece(i) for i in range(self.vocab_size)]
        vocab = {p: i for i, p in enumerate(pieces)}
        special = [i for i in range(self.vocab_size) if sp.is_control(i) or sp.is_unknown(i)]
        ranked = []
        for i, piece in enumerate(pieces):
            if i in special or sp.is_byte(i) or piece in USER_SYMBOLS:
                continue
            for cut in range(1, len(piece)):
                left, right = piece[:cut], piece[cut:]
                if left in vocab and right in vocab:
                    ranked.append((i, vocab[left], vocab[right], left, right))
        merges = [(left, right) for *_, left, right in sorted(ranked)]
        tok = Tokenizer(
            models.BPE(vocab=vocab, merges=merges, unk_token=pieces[SPECIAL["unk"]], byte_fallback=True, fuse_unk=True)
        )
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
        tok.add_special_tokens([AddedToken(pieces[i], special=True, normalized=False) for i in special])
        tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in USER_SYMBOLS])
        return tok

    def save_hf(self, out_dir: str | Path) -> None:
        from transformers import PreTrainedTokenizerFast

        sp = self.sp
        fast = PreTrainedTokenizerFast(
            tokenizer_object=self.hf_backend(),
            unk_token=sp.id_to_piece(sp.unk_id()),
            bos_token=sp.id_to_piece(self.bos_id),
            eos_token=sp.id_to_piece(self.eos_id),
            pad_token=sp.id_to_piece(self.pad_id),
            clean_up_tokenization_spaces=False,
        )
        fast.save_pretrained(str(out_dir))
        (Path(out_dir) / "ttr_tokenizer.model").write_bytes(self.model_proto)


class HFTokenizer:
    """Any tokenizer ``AutoTokenizer.from_pretrained`` loads; documents get BOS/EOS from it."""

    def __init__(self, path: str):
        self.path = path
        self._tok = None
        tok = self.tok
        self.vocab_size = len(tok)
        eos = tok.eos_token_id
        if eos is None:
            raise ValueError(f"tokenizer.path {path!r}: the tokenizer has no eos token to separate documents")
        self.eos_id = eos
        self.bos_id = tok.bos_token_id if tok.bos_token_id is not None else eos
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else eos

    @property
    def tok(self):
        if self._tok is None:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(self.path)
        return self._tok

    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.tok(texts, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def save_hf(self, out_dir: str | Path) -> None:
        self.tok.save_pretrained(str(out_dir))


def train_sentencepiece(texts: Iterable[str], vocab_size: int) -> bytes:
    """Train the BPE described in the module docstring; returns the serialised model."""
    import sentencepiece as spm

    if vocab_size < 300:
        raise ValueError(f"vocab_size must be >= 300 (256 byte pieces + specials + merges), got {vocab_size}")
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=out,
        vocab_size=vocab_size,
        model_type="bpe",
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,
        byte_fallback=True,
        split_digits=True,
        user_defined_symbols=USER_SYMBOLS,
        max_sentence_length=1 << 24,
        hard_vocab_limit=False,
        unk_id=SPECIAL["unk"],
        bos_id=SPECIAL["bos"],
        eos_id=SPECIAL["eos"],
        pad_id=SPECIAL["pad"],
        num_threads=max(1, min(8, os.cpu_count() or 1)),
        minloglevel=2,
    )
    return out.getvalue()


def load_tokenizer(path: str, *, texts=None, fingerprint: str = "", vocab_size: int = 8192, cache_dir: str = ""):
    """``path`` given: a sentencepiece ``.model`` or an HF tokenizer. Otherwise train a BPE on
    ``texts`` (a zero-argument callable returning an iterable of strings) and cache it under
    ``cache_dir`` keyed by ``fingerprint`` (which must identify the training text)."""
    if path:
        if path.endswith(".model"):
            if not Path(path).is_file():
                raise ValueError(f"tokenizer.path {path!r} does not exist")
            return SentencePieceTokenizer(Path(path).read_bytes())
        return HFTokenizer(path)
    if texts is None or not fingerprint:
        raise ValueError("tokenizer.path is empty, so texts and fingerprint are needed to train one")
    key = hashlib.sha256(f"{fingerprint}|bpe|{vocab_size}|v1".encode()).hexdigest()[:16]
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    model_path = cache / "tokenizers" / f"spm-{key}.model"
    if model_path.is_file():
        return SentencePieceTokenizer(model_path.read_bytes())
    proto = train_sentencepiece(texts(), vocab_size)
    model_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = model_path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(proto)
    os.replace(tmp, model_path)
    return SentencePieceTokenizer(proto)
