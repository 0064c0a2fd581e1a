"""Document sources: the embedded corpus, local files, pre-tokenised shards, HF datasets.

Map-style sources (everything but HF) expose ``sizes`` (documents per group: a file, a shard)
and ``get(doc_id)`` (text, or a token array for shards), so the trainer can compute a
deterministic order from the seed and resume at any document. HF datasets are streamed.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

import numpy as np

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst")
SUFFIXES = TEXT_SUFFIXES + (".jsonl", ".parquet", ".bin")


class MapSource:
    kind = "text"  # or "tokens"
    sizes: np.ndarray

    def __len__(self) -> int:
        return int(self.sizes.sum())

    def locate(self, doc_id: int) -> tuple[int, int]:
        starts = np.concatenate([[0], np.cumsum(self.sizes)])
        group = int(np.searchsorted(starts, doc_id, side="right") - 1)
        return group, int(doc_id - starts[group])


class EmbeddedSource(MapSource):
    """The running Python's standard-library source (tests excluded) plus ``pydoc_data.topics``."""

    def __init__(self):
        root = Path(sysconfig.get_paths()["stdlib"])
        skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
        self.files = [str(p) for p in sorted(root.rglob("*.py")) if not skip & set(p.relative_to(root).parts)]
        from pydoc_data import topics

        self.topic_keys = sorted(topics.topics)
        self.sizes = np.array([len(self.files) + len(self.topic_keys)], dtype=np.int64)

    def get(self, doc_id: int) -> str:
        if doc_id < len(self.files):
            return Path(self.files[doc_id]).read_text(encoding="utf-8", errors="replace")
        from pydoc_data import topics

        return topics.topics[self.topic_keys[doc_id - len(self.files)]]

    def fingerprint(self) -> str:
        return f"embedded|{sys.version}|{len(self.files)}|{len(self.topic_keys)}"


class LocalSource(MapSource):
    """Local ``.txt/.md/.py/.rst`` (one document per file), ``.jsonl`` (one per line, field
    ``text_key``) and ``.parquet`` (one per row, column ``text_key``) files or folders of them."""

    def __init__(self, path: str, text_key: str = "text"):
        root = Path(path)
        if root.is_dir():
            files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
        elif root.is_file():
            files = [root]
        else:
            raise ValueError(f"data.source {path!r} is neither a file nor a folder")
        if not files:
            raise ValueError(f"data.source {path!r} holds no {', '.join(SUFFIXES)} files")
        if any(p.suffix == ".bin" for p in files):
            raise ValueError(f"data.source {path!r} mixes token shards (.bin) with text; give the shard folder alone")
        self.files = [str(p) for p in files]
        self.text_key = text_key
        self.offsets: dict[int, np.ndarray] = {}
        sizes = []
        for i, p in enumerate(files):
            if p.suffix == ".jsonl":
                self.offsets[i] = _line_offsets(p)
                sizes.append(len(self.offsets[i]))
            elif p.suffix == ".parquet":
                import pyarrow.parquet as pq

                sizes.append(pq.ParquetFile(p).metadata.num_rows)
            else:
                sizes.append(1)
        self.sizes = np.array(sizes, dtype=np.int64)
        self._cache: tuple[int, list] | None = None

    def __getstate__(self):
        return {**self.__dict__, "_cache": None}

    def get(self, doc_id: int) -> str:
        group, row = self.locate(doc_id)
        path = Path(self.files[group])
        if path.suffix == ".jsonl":
            with path.open("rb") as f:
                f.seek(int(self.offsets[group][row]))
                record = json.loads(f.readline())
            if self.text_key not in record:
                raise ValueError(f"{path}: line {row + 1} has no field data.text_key={self.text_key!r}")
            return record[self.text_key]
        if path.suffix == ".parquet":
            if self._cache is None or self._cache[0] != group:
                import pyarrow.parquet as pq

                table = pq.read_table(path, columns=[self.text_key])
                self._cache = (group, table.column(self.text_key).to_pylist())
            return self._cache[1][row]
        return path.read_text(encoding="utf-8", errors="replace")

    def fingerprint(self) -> str:
        stats = [(f, Path(f).stat().st_size, Path(f).stat().st_mtime_ns) for f in self.files]
        return f"local|{self.text_key}|{stats}"


def _line_offsets(path: Path) -> np.ndarray:
    offsets, pos = [], 0
    with path.open("rb") as f:
        for line in f:
            if line.strip():
                offsets.append(pos)
            pos += len(line)
    return np.array(offsets, dtype=np.int64)


class ShardSource(MapSource):
    """Token shards written by ``scripts/prepare_data.py``: ``NNNNN.bin`` (uint16/uint32 tokens,
    documents without BOS/EOS) with ``NNNNN.idx.npy`` (document start offsets, plus the end) and a
    ``meta.json`` naming the dtype and the tokenizer."""

    kind = "tokens"

    def __init__(self, path: str):
        root = Path(path)
        meta_path = root / "meta.json"
        if not meta_path.is_file():
            raise ValueError(f"data.source {path!r}: no meta.json (write shards with scripts/prepare_data.py)")
        self.meta = json.loads(meta_path.read_text())
        self.dtype = np.dtype(self.meta["dtype"])
        self.files = [str(p) for p in sorted(root.glob("*.bin"))]
        if not self.files:
            raise ValueError(f"data.source {path!r}: no .bin shards")
        self.index = [np.load(f[: -len(".bin")] + ".idx.npy") for f in self.files]
        self.sizes = np.array([len(ix) - 1 for ix in self.index], dtype=np.int64)
        self._maps: dict[int, np.ndarray] = {}

    def __getstate__(self):
        return {**self.__dict__, "_maps": {}}

    def get(self, doc_id: int) -> np.ndarray:
        group, row = self.locate(doc_id)
        if group not in self._maps:
            self._maps[group] = np.memmap(self.files[group], dtype=self.dtype, mode="r")
        lo, hi = self.index[group][row], self.index[group][row + 1]
        return np.asarray(self._maps[group][lo:hi], dtype=np.int64)

    def fingerprint(self) -> str:
        return f"shards|{self.meta}|{self.files}"


def is_shard_dir(path: str) -> bool:
    return Path(path, "meta.json").is_file()


def open_source(spec: str, text_key: str = "text") -> MapSource | None:
    """A map-style source for ``spec``, or ``None`` for ``hf:`` (streamed, see data.HFDocStream)."""
    if spec == "embedded":
        return EmbeddedSource()
    if spec.startswith("hf:"):
        return None
    if not spec:
        raise ValueError("data.source is empty; use 'embedded', a local path or 'hf:<dataset>'")
    if is_shard_dir(spec):
        return ShardSource(spec)
    return LocalSource(spec, text_key)
