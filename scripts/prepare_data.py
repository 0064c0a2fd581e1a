"""Pre-tokenise a corpus into memory-mapped token shards for big runs.

    python -m ttr.scripts.prepare_data SOURCE OUT --tokenizer PATH [--text-key text]
        [--shard-tokens 100000000] [--workers 4]

SOURCE is anything ``data.source`` accepts except shards ("embedded", a local file/folder,
"hf:<name>"). OUT gets ``00000.bin`` ... (uint16 tokens when the vocabulary fits, else
uint32; documents without BOS/EOS, which the loader adds), ``00000.idx.npy`` (document start
offsets plus the end) and ``meta.json``. Train on it with ``data.source = OUT`` and the same
``tokenizer.path``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from ttr.train.data import Encoder
from ttr.train.sources import open_source
from ttr.train.tokenizer import load_tokenizer


def _documents(spec: str, text_key: str, hf_config: str, hf_split: str):
    source = open_source(spec, text_key)
    if source is not None:
        if source.kind != "text":
            raise ValueError(f"SOURCE {spec!r} is already tokenised")
        return source, range(len(source))
    try:
        import datasets
    except ImportError as err:
        raise ValueError("SOURCE 'hf:...' needs the `datasets` package") from err
    ds = datasets.load_dataset(spec[3:], hf_config or None, split=hf_split, streaming=True)
    return None, (row[text_key] for row in ds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prepare_data", description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("out")
    parser.add_argument("--tokenizer", required=True, help="sentencepiece .model or HF tokenizer folder/name")
    parser.add_argument("--text-key", default="text")
    parser.add_argument("--hf-config", default="")
    parser.add_argument("--hf-split", default="train")
    parser.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (about)")
    parser.add_argument("--workers", type=int, default=0, help="tokenisation processes")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.shard_tokens < 1:
        raise ValueError(f"--shard-tokens must be >= 1, got {args.shard_tokens}")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"OUT {str(out)!r} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(args.tokenizer)
    dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
    source, items = _documents(args.source, args.text_key, args.hf_config, args.hf_split)
    encoder = Encoder(source, tok, args.workers)
    shard, parts, offsets, total_docs, total_tokens = 0, [], [0], 0, 0

    def flush():
        nonlocal shard, parts, offsets
        if len(offsets) > 1:
            np.concatenate(parts).astype(dtype).tofile(out / f"{shard:05d}.bin")
            np.save(out / f"{shard:05d}.idx.npy", np.array(offsets, dtype=np.int64))
            shard, parts, offsets = shard + 1, [], [0]

    try:
        for doc in encoder.map(iter(items)):
            body = doc[1:-1]  # the loader adds BOS/EOS
            parts.append(body)
            offsets.append(offsets[-1] + len(body))
            total_docs, total_tokens = total_docs + 1, total_tokens + len(body)
            if offsets[-1] >= args.shard_tokens:
                flush()
        flush()
    finally:
        encoder.close()
    meta = {"dtype": np.dtype(dtype).name, "tokenizer": args.tokenizer, "vocab_size": tok.vocab_size,
            "documents": total_docs, "tokens": total_tokens, "shards": shard, "source": args.source}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    print(f"wrote {total_tokens} tokens of {total_docs} documents in {shard} shards to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
