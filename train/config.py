"""Run configuration: TOML recipes plus ``--section.key=value`` command-line overrides.

A recipe has the sections below (every key optional; defaults in the dataclasses). Unknown
sections or keys are errors that list the valid ones, so a typo never silently does nothing.

    run_dir = "runs/my-run"          # top-level keys: run_dir, seed
    [model]      preset, init_from, overrides (a table passed to get_preset)
    [data]       source, text_key, hf_config, hf_split, val_source, val_docs, num_workers, ...
    [tokenizer]  path, vocab_size, cache_dir, train_docs
    [optim]      lr, betas, eps, weight_decay, grad_clip, schedule, warmup_steps, min_lr_ratio, decay_fraction
    [train]      max_steps, seq_len, micro_batch_size, batch_tokens, precision, distributed, ...
    [checkpoint] every, keep_last
    [log]        every, val_every, val_batches, wandb, wandb_project, progress
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ttr.overrides import parse_assignment

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

SCHEDULES = ("cosine", "wsd", "constant")
PRECISIONS = ("auto", "bf16", "fp32")
DISTRIBUTED = ("auto", "fsdp", "ddp", "none")
WANDB_MODES = ("auto", "off", "online", "offline")


@dataclass
class ModelSection:
    preset: str = "gated_deltanet-debug"  # a name from ttr.models.presets.list_presets()
    init_from: str = ""  # optional save_pretrained folder to start from instead of a fresh init
    overrides: dict = field(default_factory=dict)  # TTRConfig fields passed to get_preset


@dataclass
class DataSection:
    # "embedded" (stdlib source + pydoc topics), a local file or folder (.txt/.jsonl/.parquet,
    # or the .bin shards written by scripts/prepare_data.py), or "hf:<dataset name or path>".
    source: str = "embedded"
    text_key: str = "text"
    hf_config: str = ""
    hf_split: str = "train"
    shuffle_buffer: int = 10000  # HF streaming shuffle buffer (documents)
    val_source: str = ""  # held-out data; empty: hold out val_docs documents of `source`
    val_docs: int = 16
    num_workers: int = 1  # tokenisation worker processes (0 = in the main process)


@dataclass
class TokenizerSection:
    path: str = ""  # HF tokenizer folder/name or a sentencepiece .model; empty: train one on the data
    vocab_size: int = 8192  # pieces of the sentencepiece BPE trained when path is empty
    cache_dir: str = ""  # where trained tokenizers are cached ($TTR_CACHE_DIR or ~/.cache/ttr)
    train_docs: int = 20000  # documents (at most) the sentencepiece model is trained on


@dataclass
class OptimSection:
    lr: float = 3e-4
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping (the norm is still measured)
    schedule: str = "cosine"  # cosine | wsd | constant, all after a linear warmup
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # final lr / peak lr
    decay_fraction: float = 0.2  # wsd: the last fraction of steps that decays


@dataclass
class TrainSection:
    max_steps: int = 1000
    seq_len: int = 2048
    micro_batch_size: int = 8  # rows of seq_len per forward (packed into one [1, rows*seq_len] sequence)
    batch_tokens: int = 0  # global tokens per optimizer step; 0 = one micro-batch per rank
    precision: str = "auto"  # bf16 autocast with fp32 master weights on GPU, fp32 on CPU
    distributed: str = "auto"  # fsdp (FSDP2 full shard) when several GPUs, ddp, or none
    activation_checkpointing: bool = False
    compile: bool = False
    max_nonfinite: int = 5  # stop after this many non-finite steps in a row
    cpu_threads: int = 0  # torch intra-op threads on CPU runs; 0 = torch's default
    export_at_end: bool = True


@dataclass
class CheckpointSection:
    every: int = 500  # steps; 0 = only at the end (and on SIGTERM/SIGINT)
    keep_last: int = 3


@dataclass
class LogSection:
    every: int = 10
    val_every: int = 200  # 0 disables validation
    val_batches: int = 4
    wandb: str = "auto"  # auto: when installed; offline without WANDB_API_KEY
    wandb_project: str = "ttr"
    progress: bool = True


@dataclass
class RunConfig:
    run_dir: str = ""  # empty: runs/<preset>-<timestamp>
    seed: int = 0
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    log: LogSection = field(default_factory=LogSection)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _coerce(where: str, default: Any, value: Any) -> Any:
    """Check ``value`` against the type of the field's default (ints are accepted for floats)."""
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(default, str):
        ok = isinstance(value, str)
    elif isinstance(default, list):
        ok = isinstance(value, list)
    elif isinstance(default, dict):
        ok = isinstance(value, dict)
    else:  # pragma: no cover - every field has one of the types above
        ok = True
    if not ok:
        raise TypeError(f"config key {where} expects {type(default).__name__}, got {value!r}")
    return value


def _apply(obj: Any, table: dict, prefix: str) -> None:
    names = [f.name for f in dataclasses.fields(obj)]
    for key, value in table.items():
        where = f"{prefix}{key}"
        if key not in names:
            raise ValueError(f"unknown config key {where!r}; valid keys here: {', '.join(names)}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise TypeError(f"config key {where} is a section; expected a table, got {value!r}")
            _apply(current, value, f"{where}.")
        elif isinstance(current, dict):
            setattr(obj, key, {**current, **_coerce(where, current, value)})
        else:
            setattr(obj, key, _coerce(where, current, value))


def _validate(cfg: RunConfig) -> None:
    choices = [
        ("optim.schedule", cfg.optim.schedule, SCHEDULES),
        ("train.precision", cfg.train.precision, PRECISIONS),
        ("train.distributed", cfg.train.distributed, DISTRIBUTED),
        ("log.wandb", cfg.log.wandb, WANDB_MODES),
    ]
    for name, value, allowed in choices:
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    positive = [
        ("train.max_steps", cfg.train.max_steps),
        ("train.seq_len", cfg.train.seq_len),
        ("train.micro_batch_size", cfg.train.micro_batch_size),
        ("train.max_nonfinite", cfg.train.max_nonfinite),
        ("checkpoint.keep_last", cfg.checkpoint.keep_last),
        ("log.every", cfg.log.every),
        ("tokenizer.vocab_size", cfg.tokenizer.vocab_size),
    ]
    for name, value in positive:
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    nonneg = [
        ("train.batch_tokens", cfg.train.batch_tokens),
        ("train.cpu_threads", cfg.train.cpu_threads),
        ("optim.warmup_steps", cfg.optim.warmup_steps),
        ("optim.weight_decay", cfg.optim.weight_decay),
        ("optim.grad_clip", cfg.optim.grad_clip),
        ("checkpoint.every", cfg.checkpoint.every),
        ("log.val_every", cfg.log.val_every),
        ("log.val_batches", cfg.log.val_batches),
        ("data.val_docs", cfg.data.val_docs),
        ("data.num_workers", cfg.data.num_workers),
    ]
    for name, value in nonneg:
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if cfg.optim.lr <= 0:
        raise ValueError(f"optim.lr must be > 0, got {cfg.optim.lr}")
    if not 0 <= cfg.optim.min_lr_ratio <= 1:
        raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {cfg.optim.min_lr_ratio}")
    if not 0 < cfg.optim.decay_fraction <= 1:
        raise ValueError(f"optim.decay_fraction must be in (0, 1], got {cfg.optim.decay_fraction}")
    if len(cfg.optim.betas) != 2 or not all(0 <= b < 1 for b in cfg.optim.betas):
        raise ValueError(f"optim.betas must be two numbers in [0, 1), got {cfg.optim.betas}")


def parse_override(arg: str) -> tuple[list[str], Any]:
    """``--train.max_steps=20`` -> (["train", "max_steps"], 20); the value in ``ttr.overrides``'
    grammar (TOML, else JSON, else the bare string)."""
    if not arg.startswith("--") or "=" not in arg:
        raise ValueError(f"override {arg!r} must look like --section.key=value")
    key, value = parse_assignment(arg[2:])
    return key.split("."), value


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """Build a :class:`RunConfig` from an optional TOML file and ``--a.b=value`` overrides."""
    table: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {str(path)!r} does not exist")
        try:
            with path.open("rb") as f:
                table = tomllib.load(f)
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"config file {str(path)!r} is not valid TOML: {err}") from None
    for arg in overrides:
        keys, value = parse_override(arg)
        node = table
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {arg!r}: {k!r} is not a section")
        node[keys[-1]] = value
    cfg = RunConfig()
    _apply(cfg, table, "")
    _validate(cfg)
    return cfg


def config_from_dict(table: dict) -> RunConfig:
    cfg = RunConfig()
    _apply(cfg, table, "")
    _validate(cfg)
    return cfg
