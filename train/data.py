"""Document order, tokenisation in worker processes, packing and the resumable batch stream.

Order: each epoch permutes the groups (files, shards) and the documents inside each group with
``numpy.random.default_rng([seed, epoch])``; validation documents are left out; rank ``r`` of
``W`` takes every ``W``-th document of that order. The stream position of a rank is
``(epoch, index, offset)``: the next token is token ``offset`` of the rank's ``index``-th
document of ``epoch``. It is saved with every checkpoint, so a resumed run continues on exactly
the next batch.

Packing: documents become ``[BOS] tokens [EOS]`` and are laid end to end into ``rows`` rows of
``seq_len`` tokens (a document longer than the rest of a row continues on the next row). A
micro-batch is one packed sequence ``[1, rows * seq_len]`` with ``cu_seqlens`` at every
document start and every row start, so no state, convolution or attention crosses either.
``labels`` equal ``input_ids`` except ``-100`` at each segment start: the model shifts labels
inside, so the ``-100`` stops the last token of one segment from being trained to predict the
first token of the next.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import torch

VAL_SEED = 0x7E57  # the validation split depends on the source only, not on the run seed


def epoch_order(sizes: np.ndarray, seed: int, epoch: int, exclude: np.ndarray) -> np.ndarray:
    rng = np.random.default_rng([seed, epoch])
    starts = np.concatenate([[0], np.cumsum(sizes)])
    parts = [starts[g] + rng.permutation(int(sizes[g])) for g in rng.permutation(len(sizes))]
    order = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return order[~np.isin(order, exclude)] if len(exclude) else order


def validation_ids(num_docs: int, val_docs: int) -> np.ndarray:
    if val_docs == 0:
        return np.zeros(0, dtype=np.int64)
    if val_docs * 2 > num_docs:
        raise ValueError(f"data.val_docs={val_docs} would hold out more than half of the {num_docs} documents")
    return np.sort(np.random.default_rng(VAL_SEED).permutation(num_docs)[:val_docs])


# ---- tokenisation workers -------------------------------------------------------------------

_WORKER: dict = {}


def _worker_init(source, tokenizer) -> None:
    # The main process handles Ctrl-C and SIGTERM (it saves a checkpoint, then shuts the workers
    # down): a worker must neither print a KeyboardInterrupt traceback nor die from a signal sent
    # to the whole process group, which would leave its chunk unanswered.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # ... so it must leave by itself when the main process is killed outright (SIGKILL, OOM)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    _WORKER["source"], _WORKER["tokenizer"] = source, tokenizer


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _encode_items(items: list, source=None, tok=None) -> list[np.ndarray]:
    """Items are document ids (looked up in the source) or texts; returns BOS + tokens + EOS.
    In a worker process the source and tokenizer come from the pool initialiser."""
    if tok is None:
        source, tok = _WORKER["source"], _WORKER["tokenizer"]
    out = []
    for item in items:
        doc = source.get(int(item)) if isinstance(item, (int, np.integer)) else item
        ids = np.asarray(doc, dtype=np.int64) if not isinstance(doc, str) else np.asarray(tok.encode(doc), np.int64)
        out.append(np.concatenate([[tok.bos_id], ids, [tok.eos_id]]).astype(np.int64))
    return out


class Encoder:
    """Maps an iterator of items to token arrays, in order, with ``num_workers`` processes and a
    bounded look-ahead (0 workers: in this process).

    A ``ProcessPoolExecutor`` rather than a ``multiprocessing.Pool``: a worker that dies (killed,
    out of memory) raises ``BrokenProcessPool`` here instead of leaving its task unanswered, and
    shutting down waits for the chunks in flight instead of signalling the workers (which ignore
    signals, see ``_worker_init``)."""

    def __init__(self, source, tokenizer, num_workers: int, chunk: int = 8):
        self.num_workers, self.chunk = num_workers, chunk
        self.source, self.tokenizer = source, tokenizer
        self.pool = None
        if num_workers > 0:
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # HF tokenizers after fork
            # fork like torch's DataLoader (the workers only tokenise; spawn would re-import torch
            # and transformers in each worker, seconds of start-up), spawn where fork is missing
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            self.pool = ProcessPoolExecutor(num_workers, mp_context=ctx, initializer=_worker_init,
                                            initargs=(source, tokenizer))

    def map(self, items: Iterator) -> Iterator[np.ndarray]:
        if self.pool is None:
            for item in items:
                yield _encode_items([item], self.source, self.tokenizer)[0]
            return
        pending: deque = deque()
        items = iter(items)
        exhausted = False
        while True:
            while not exhausted and len(pending) < 4 * self.num_workers:
                batch = [x for _, x in zip(range(self.chunk), items)]
                exhausted = len(batch) < self.chunk
                if batch:
                    pending.append(self.pool.submit(_encode_items, batch))
            if not pending:
                return
            yield from pending.popleft().result()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None


# ---- document streams (one per rank) --------------------------------------------------------


class MapDocStream:
    """Documents of a map-style source for one rank, from position ``(epoch, index)`` on."""

    def __init__(self, source, encoder: Encoder, seed: int, rank: int, world: int, exclude: np.ndarray):
        self.source, self.encoder = source, encoder
        self.seed, self.rank, self.world, self.exclude = seed, rank, world, exclude

    def docs(self, epoch: int, index: int) -> Iterator[tuple[int, int, np.ndarray]]:
        while True:
            order = epoch_order(self.source.sizes, self.seed, epoch, self.exclude)[self.rank :: self.world]
            if len(order) == 0:
                raise ValueError(f"rank {self.rank} of {self.world} gets no documents: the source is too small")
            ids = (int(d) for d in order[index:])
            for i, tokens in enumerate(self.encoder.map(ids), start=index):
                yield epoch, i, tokens
            epoch, index = epoch + 1, 0


class HFDocStream:
    """A streamed Hugging Face dataset: the first ``val_docs`` documents are held out, the rest
    shuffled (buffer, seed + epoch), split by rank, and skipped to ``index`` on resume."""

    def __init__(self, name: str, config: str, split: str, text_key: str, encoder: Encoder, seed: int,
                 rank: int, world: int, val_docs: int, shuffle_buffer: int):
        self.args = (name, config or None, split)
        self.text_key, self.encoder, self.seed = text_key, encoder, seed
        self.rank, self.world, self.val_docs, self.shuffle_buffer = rank, world, val_docs, shuffle_buffer

    def dataset(self):
        try:
            import datasets
        except ImportError as err:
            raise ValueError("data.source 'hf:...' needs the `datasets` package (pip install ttr[data])") from err
        name, config, split = self.args
        return datasets.load_dataset(name, config, split=split, streaming=True)

    def texts(self, ds) -> Iterator[str]:
        for row in ds:
            if self.text_key not in row:
                raise ValueError(f"data.text_key={self.text_key!r} is not a column; columns: {sorted(row)}")
            yield row[self.text_key]

    def validation_texts(self) -> list[str]:
        return list(self.texts(self.dataset().take(self.val_docs)))

    def docs(self, epoch: int, index: int) -> Iterator[tuple[int, int, np.ndarray]]:
        from datasets.distributed import split_dataset_by_node

        while True:
            ds = self.dataset().skip(self.val_docs).shuffle(seed=self.seed, buffer_size=self.shuffle_buffer)
            ds.set_epoch(epoch)
            ds = split_dataset_by_node(ds, rank=self.rank, world_size=self.world).skip(index)
            n = index
            for n, tokens in enumerate(self.encoder.map(self.texts(ds)), start=index):
                yield epoch, n, tokens
            if n == index:
                raise ValueError(f"rank {self.rank}: the dataset {self.args[0]!r} yields no documents")
            epoch, index = epoch + 1, 0


# ---- packing ---------------------------------------------------------------------------------


def pack(next_doc, current, used: int, rows: int, seq_len: int):
    """Lay documents into ``rows * seq_len`` tokens, starting with token ``used`` of ``current``
    (a ``(epoch, index, tokens)`` triple, or None) and calling ``next_doc()`` for more. Returns
    (tokens, segment starts, the last document touched, how many of its tokens are used)."""
    total = rows * seq_len
    tokens = np.empty(total, dtype=np.int64)
    starts: list[int] = []
    pos = 0
    while pos < total:
        if current is None or used == len(current[2]):
            current, used = next_doc(), 0
        take = min(len(current[2]) - used, seq_len - pos % seq_len)
        if pos % seq_len == 0 or used == 0:
            starts.append(pos)
        tokens[pos : pos + take] = current[2][used : used + take]
        pos, used = pos + take, used + take
    return tokens, starts, current, used


def make_batch(tokens: np.ndarray, starts: list[int]) -> dict:
    ids = torch.from_numpy(tokens).unsqueeze(0)
    labels = ids.clone()
    labels[0, starts] = -100
    cu = torch.tensor(starts + [len(tokens)], dtype=torch.int32)
    return {"input_ids": ids, "labels": labels, "cu_seqlens": cu, "num_targets": int((labels[0, 1:] != -100).sum())}


class BatchStream:
    """Infinite micro-batches for one rank; ``state()`` is the exact position after the last one:
    ``offset`` tokens of document ``index`` of ``epoch`` are used (``offset`` may equal the
    document's length, then the next batch starts on the following document)."""

    def __init__(self, doc_stream, rows: int, seq_len: int, state: dict | None = None):
        self.doc_stream, self.rows, self.seq_len = doc_stream, rows, seq_len
        self._state = dict(state or {"epoch": 0, "index": 0, "offset": 0})
        self._docs = None
        self._current, self._used = None, 0

    def state(self) -> dict:
        return dict(self._state)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self._docs is None:
            self._docs = self.doc_stream.docs(self._state["epoch"], self._state["index"])
            if self._state["offset"]:
                self._current, self._used = next(self._docs), self._state["offset"]
        tokens, starts, self._current, self._used = pack(
            lambda: next(self._docs), self._current, self._used, self.rows, self.seq_len
        )
        epoch, index, _ = self._current
        self._state = {"epoch": epoch, "index": index, "offset": self._used}
        return make_batch(tokens, starts)


def validation_batches(token_docs: list[np.ndarray], rows: int, seq_len: int, num_batches: int) -> list[dict]:
    """Fixed packed batches from the held-out documents (cycled if they are short)."""
    if not token_docs or num_batches == 0:
        return []

    def cycle():
        while True:
            for i, doc in enumerate(token_docs):
                yield 0, i, doc

    docs, current, used, out = cycle(), None, 0, []
    for _ in range(num_batches):
        tokens, starts, current, used = pack(lambda: next(docs), current, used, rows, seq_len)
        out.append(make_batch(tokens, starts))
    return out
