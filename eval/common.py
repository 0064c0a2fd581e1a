"""Shared helpers for ``ttr.eval``: loading a checkpoint, dtypes, devices, training context."""

from __future__ import annotations

import os

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Config attributes that hold the context a model was trained with, in the order checked:
# ``train_seq_len`` is what ``ttr train`` records (max_position_embeddings may be larger than the
# sequences actually trained on), the others are the usual Hugging Face names.
CONTEXT_ATTRS = ("train_seq_len", "max_position_embeddings", "n_positions", "n_ctx")


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map ``"float32" | "bfloat16" | "float16"`` (or a torch dtype) to a torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` picks CUDA when present, else CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def training_context(config, max_length: int | None = None) -> int:
    """The context length the model was trained with: ``max_length`` when given, else the config's.

    There is deliberately no default (lm-eval falls back to 2048, which silently truncates or
    over-extends a model trained on another length).
    """
    if max_length is not None:
        if int(max_length) < 1:
            raise ValueError(f"max_length: expected a positive integer, got {max_length}")
        return int(max_length)
    for attr in CONTEXT_ATTRS:
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(
        f"max_length: the model config has none of {CONTEXT_ATTRS}; pass the training context explicitly"
    )


def load_checkpoint(path: str | os.PathLike, *, dtype: str | torch.dtype = "float32", device=None):
    """Load ``(model, tokenizer)`` from a ``save_pretrained`` folder (``ttr export`` output)."""
    import transformers

    import ttr  # noqa: F401  (registers the ttr classes with the Auto factories)

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint: expected a save_pretrained directory, got {path!r}")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=parse_dtype(dtype))
    model.to(resolve_device(device)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return model, tokenizer
