"""Perplexity of a causal LM on local text/jsonl/parquet files or a Hugging Face dataset.

Every document is tokenised without special tokens and prefixed with one start token (BOS, or EOS
when the tokenizer has no BOS), so each of its tokens is predicted. Totals over the corpus:

* token perplexity ``exp(NLL / tokens)``;
* word perplexity ``exp(NLL / words)`` (words: whitespace-separated, as lm-eval counts them);
* byte perplexity ``exp(NLL / bytes)`` and bits per byte ``NLL / bytes / ln 2`` (UTF-8 bytes);

so word/byte numbers compare across tokenizers. ``mode="document"`` scores each document in one
pass (whatever its length: recurrent models need no window); ``mode="window"`` scores it with a
sliding window of ``window`` tokens advancing by ``stride``: every token is scored once, with at
least ``window - stride`` tokens of context except at the start.

:func:`extrapolation_sweep` concatenates documents (separated by the start token) into sequences
of ``factor`` times the training context and reports the mean loss in position buckets, to show
whether loss keeps falling (or blows up) beyond the length the model was trained on.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
from collections.abc import Iterator

import torch
import torch.nn.functional as F

LOGITS_CHUNK = 4096  # positions per output-projection chunk: bounds the [T, V] logits in memory


def read_documents(
    data: str,
    *,
    text_field: str = "text",
    split: str = "test",
    hf_config: str | None = None,
    max_documents: int | None = None,
) -> list[str]:
    """Documents from a file, a directory of files, a glob, or a Hugging Face dataset name.

    ``.txt``/``.md``: one document per file. ``.jsonl``/``.json``: one per line, ``text_field``.
    ``.parquet``: one per row, column ``text_field``. Anything that is not a local path is loaded
    with ``datasets.load_dataset(data, hf_config, split=split)`` (streaming).
    """
    if max_documents is not None and max_documents < 1:
        raise ValueError(f"max_documents: expected >= 1, got {max_documents}")
    if os.path.isdir(data):
        paths = sorted(
            p for p in glob.glob(os.path.join(data, "**", "*"), recursive=True) if os.path.isfile(p)
        )
    elif os.path.isfile(data):
        paths = [data]
    elif glob.has_magic(data):
        paths = sorted(glob.glob(data))
        if not paths:
            raise ValueError(f"data: no files match {data!r}")
    else:
        return _hf_documents(data, text_field, split, hf_config, max_documents)
    docs: list[str] = []
    for path in paths:
        docs.extend(_file_documents(path, text_field))
        if max_documents is not None and len(docs) >= max_documents:
            break
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise ValueError(f"data: no non-empty documents in {data!r}")
    return docs[:max_documents]


def _file_documents(path: str, text_field: str) -> list[str]:
    ext = os.path.splitext(path)[1].lower()
    if ext in (".txt", ".md", ".text"):
        with open(path, encoding="utf-8") as f:
            return [f.read()]
    if ext in (".jsonl", ".json"):
        docs = []
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                row = json.loads(line)
                if text_field not in row:
                    raise ValueError(f"text_field: {path}:{i + 1} has no field {text_field!r}")
                docs.append(row[text_field])
        return docs
    if ext == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path, columns=[text_field])
        return table.column(text_field).to_pylist()
    raise ValueError(
        f"data: unsupported file type {ext!r} ({path}); expected .txt, .md, .jsonl, .json or .parquet"
    )


def _hf_documents(name, text_field, split, hf_config, max_documents) -> list[str]:
    import datasets

    stream = datasets.load_dataset(name, hf_config, split=split, streaming=True)
    docs = []
    for row in stream:
        if text_field not in row:
            raise ValueError(f"text_field: dataset {name!r} has no column {text_field!r}")
        if row[text_field].strip():
            docs.append(row[text_field])
        if max_documents is not None and len(docs) >= max_documents:
            break
    if not docs:
        raise ValueError(f"data: dataset {name!r} split {split!r} has no non-empty documents")
    return docs


def start_token(tokenizer) -> int:
    token = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if token is None:
        raise ValueError("tokenizer: needs a BOS or EOS token to start documents with")
    return token


@torch.no_grad()
def token_nll(model, input_ids: torch.Tensor) -> torch.Tensor:
    """NLL (fp32, nats) of tokens ``1 .. T-1`` given their prefixes; ``input_ids`` is ``[B, T]``.

    The decoder body runs once; the output projection runs in chunks of positions, so long
    sequences never hold ``[T, V]`` logits at once. Returns ``[B, T - 1]``.
    """
    hidden = model.base_model(input_ids=input_ids, use_cache=False).last_hidden_state[:, :-1]
    head = model.get_output_embeddings()
    targets = input_ids[:, 1:]
    out = torch.empty(targets.shape, dtype=torch.float32, device=input_ids.device)
    for s in range(0, targets.shape[1], LOGITS_CHUNK):
        logits = head(hidden[:, s : s + LOGITS_CHUNK]).float()
        out[:, s : s + LOGITS_CHUNK] = F.cross_entropy(
            logits.transpose(1, 2), targets[:, s : s + LOGITS_CHUNK], reduction="none"
        )
    return out


def _windows(n_tokens: int, window: int, stride: int) -> Iterator[tuple[int, int, int]]:
    """``(begin, end, first_scored)`` over ``ids[0 .. n_tokens]`` (``ids[0]`` is the start token):
    the model reads ``ids[begin:end]`` and scores targets ``first_scored .. end - 1``."""
    scored_to = 1
    begin = 0
    while scored_to < n_tokens:
        end = min(begin + window, n_tokens)
        yield begin, end, scored_to
        scored_to = end
        begin = max(0, end - (window - stride))


def _document_nll(model, ids: list[int], mode: str, window: int | None, stride: int | None, device) -> float:
    if mode == "document":
        return token_nll(model, torch.tensor([ids], device=device)).double().sum().item()
    total = 0.0
    for begin, end, first in _windows(len(ids), window, stride):
        nll = token_nll(model, torch.tensor([ids[begin:end]], device=device))[0]
        # nll[j] scores ids[begin + j + 1]
        total += nll[first - begin - 1 :].double().sum().item()
    return total


def perplexity(
    model,
    tokenizer,
    documents: list[str],
    *,
    mode: str = "document",
    window: int | None = None,
    stride: int | None = None,
) -> dict:
    """Token/word/byte perplexity and bits per byte of ``documents`` (see the module docstring)."""
    if mode not in ("document", "window"):
        raise ValueError(f"mode: expected 'document' or 'window', got {mode!r}")
    if mode == "window":
        if window is None or window < 2:
            raise ValueError(f"window: expected an integer >= 2 with mode='window', got {window}")
        stride = window // 2 if stride is None else stride
        if not 1 <= stride <= window - 1:
            raise ValueError(f"stride: expected 1 <= stride <= window - 1 = {window - 1}, got {stride}")
    if not documents:
        raise ValueError("documents: empty")
    device = next(model.parameters()).device
    model.eval()
    bos = start_token(tokenizer)
    nll = 0.0
    tokens = words = n_bytes = 0
    for doc in documents:
        ids = [bos, *tokenizer(doc, add_special_tokens=False).input_ids]
        if len(ids) < 2:
            continue
        nll += _document_nll(model, ids, mode, window, stride, device)
        tokens += len(ids) - 1
        words += len(re.split(r"\s+", doc.strip()))
        n_bytes += len(doc.encode("utf-8"))
    if tokens == 0:
        raise ValueError("documents: no document has any token")
    return {
        "mode": mode,
        "window": window,
        "stride": stride,
        "documents": len(documents),
        "tokens": tokens,
        "words": words,
        "bytes": n_bytes,
        "nll": nll,
        "token_perplexity": math.exp(nll / tokens),
        "word_perplexity": math.exp(nll / words),
        "byte_perplexity": math.exp(nll / n_bytes),
        "bits_per_byte": nll / n_bytes / math.log(2),
    }


@torch.no_grad()
def extrapolation_sweep(
    model,
    tokenizer,
    documents: list[str],
    *,
    context: int,
    factor: int = 4,
    buckets: int | None = None,
    max_sequences: int = 16,
    batch_size: int = 1,
) -> dict:
    """Mean loss by position bucket over sequences of ``factor * context`` tokens.

    Buckets are equal-width (``buckets`` of them, default ``4 * factor``, so the training context
    falls on a bucket edge). Needs documents holding at least one full sequence of tokens.
    """
    if context < 2 or factor < 1:
        raise ValueError(f"context/factor: expected context >= 2 and factor >= 1, got {context}, {factor}")
    length = context * factor
    buckets = 4 * factor if buckets is None else buckets
    if not 1 <= buckets <= length:
        raise ValueError(f"buckets: expected 1 .. {length}, got {buckets}")
    bos = start_token(tokenizer)
    stream: list[int] = []
    sequences = []
    for doc in documents:
        stream += [bos, *tokenizer(doc, add_special_tokens=False).input_ids]
        while len(stream) >= length + 1 and len(sequences) < max_sequences:
            sequences.append(stream[: length + 1])
            stream = stream[length + 1 :]
        if len(sequences) >= max_sequences:
            break
    if not sequences:
        raise ValueError(f"documents: fewer than {length + 1} tokens in all; cannot build one sequence")
    device = next(model.parameters()).device
    model.eval()
    total = torch.zeros(length, dtype=torch.float64, device=device)
    for i in range(0, len(sequences), batch_size):
        ids = torch.tensor(sequences[i : i + batch_size], device=device)
        total += token_nll(model, ids).double().sum(0)
    per_position = total / len(sequences)
    edges = [round(b * length / buckets) for b in range(buckets + 1)]
    return {
        "context": context,
        "length": length,
        "sequences": len(sequences),
        "bucket_start": edges[:-1],
        "bucket_end": edges[1:],
        "loss": [per_position[a:b].mean().item() for a, b in zip(edges[:-1], edges[1:])],
    }


def plot_sweep(sweeps: dict[str, dict], path: str) -> None:
    """Loss against position (bucket centres) for one or more labelled sweeps; PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, sweep in sweeps.items():
        centres = [(a + b) / 2 for a, b in zip(sweep["bucket_start"], sweep["bucket_end"])]
        ax.plot(centres, sweep["loss"], marker=".", label=label)
        ax.axvline(sweep["context"], color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("position (tokens); dashed: training context")
    ax.set_ylabel("mean loss (nats)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
