"""``ttr train [CONFIG.toml] [--resume | --overwrite] [--nproc N] [--section.key=value ...]``.

Without a config it runs the embedded default (``configs/default.toml`` on CPU,
``configs/default_gpu.toml`` when CUDA is available). ``--nproc N`` re-launches itself through
``accelerate launch --num_processes N -m ttr.train`` (FSDP2 on GPUs; on CPU through
``torch.distributed.run``, DDP over gloo).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def default_config_path() -> Path:
    return CONFIG_DIR / ("default_gpu.toml" if torch.cuda.is_available() else "default.toml")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ttr train",
        description="Train a model. Any config key can be overridden with --section.key=value "
        "(e.g. --train.max_steps=100 --optim.lr=1e-3).",
    )
    parser.add_argument("config", nargs="?", help="TOML recipe (default: the embedded default run)")
    parser.add_argument("--resume", action="store_true", help="continue the run in run_dir from its last checkpoint")
    parser.add_argument("--overwrite", action="store_true", help="delete an existing run_dir and start again")
    parser.add_argument("--nproc", type=int, default=0, help="launch N processes with accelerate (one per GPU)")
    return parser


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    overrides = [a for a in argv if a.startswith("--") and "=" in a and not a.startswith("--nproc=")]
    return [a for a in argv if a not in overrides], overrides


def launch_command(nproc: int, argv: list[str]) -> list[str]:
    """``accelerate launch --multi_gpu`` on GPUs; on CPU ``torch.distributed.run`` (accelerate's
    launcher refuses ``--cpu`` with several processes; the Accelerator then runs DDP over gloo)."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if torch.cuda.is_available():
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(nproc)]
        cmd += ["--multi_gpu"] if nproc > 1 else []
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    return cmd + ["-m", "ttr.train", *argv]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest, overrides = split_overrides(argv)
    args = build_parser().parse_args(rest)
    if args.nproc and "LOCAL_RANK" not in os.environ:
        child = [a for a in argv if not a.startswith("--nproc=")]
        if "--nproc" in child:
            i = child.index("--nproc")
            child = child[:i] + child[i + 2 :]
        return subprocess.call(launch_command(args.nproc, child))

    from .config import load_config
    from .trainer import Trainer, TrainingStopped

    try:
        cfg = load_config(args.config or default_config_path(), overrides)
        record = Trainer(cfg, resume=args.resume, overwrite=args.overwrite).run()
    except (ValueError, TypeError, FileExistsError) as err:
        print(f"ttr train: error: {err}", file=sys.stderr)
        return 2
    except TrainingStopped as err:
        print(f"ttr train: {err}", file=sys.stderr)
        return 1
    if record.get("stopped_by"):
        print(f"ttr train: stopped by {record['stopped_by']} at step {record['step']} (checkpoint saved)")
    return 0
