"""``ttr train [CONFIG.toml] [--resume[=auto] | --resume-from CKPT | --overwrite] [--nproc N]
[--section.key=value ...]``.

Without a config it runs the embedded default (``configs/default.toml`` on CPU,
``configs/default_gpu.toml`` when CUDA is available). ``--nproc N`` runs N processes of
``python -m ttr.train`` under torch's elastic agent (what ``torchrun --standalone --nproc_per_node N``
starts), the agent in this process: FSDP2 full shard on GPUs (the trainer builds accelerate's FSDP
plugin itself, so no accelerate config file is needed), DDP over gloo on CPU.

Exit status: 0 when the run finished, 128 + the signal number when SIGTERM (143) or SIGINT (130)
stopped it after saving a checkpoint, 1 when it could not continue (non-finite steps), 2 for an
error in the command, config, data or run directory.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import torch

from ttr.errors import DEBUG_HELP

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
OWN_FLAGS = ("--nproc", "--resume", "--resume-from")  # `--flag=value` forms that are not config keys


def default_config_path() -> Path:
    return CONFIG_DIR / ("default_gpu.toml" if torch.cuda.is_available() else "default.toml")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ttr train",
        description="Train a model. Any config key can be overridden with --section.key=value "
        "(e.g. --train.max_steps=100 --optim.lr=1e-3).",
        epilog="Exit status: 0 finished; 143 / 130 stopped by SIGTERM / SIGINT after saving a checkpoint; "
        "1 could not continue; 2 error in the command, config, data or run directory. " + DEBUG_HELP,
    )
    parser.add_argument("config", nargs="?", help="TOML recipe (default: the embedded default run)")
    parser.add_argument(
        "--resume", nargs="?", choices=("latest", "auto"), metavar="auto",
        help="continue the run in run_dir from its newest checkpoint that loads (an error when there is none); "
        "--resume=auto starts the run instead when there is no checkpoint (for requeued jobs)",
    )  # fmt: skip
    parser.add_argument("--resume-from", metavar="CKPT",
                        help="continue from this checkpoint of run_dir (a path or a step_NNNNNNNN name)")
    parser.add_argument("--overwrite", action="store_true", help="delete an existing run_dir and start again")
    parser.add_argument("--nproc", type=int, default=0, help="launch N processes with accelerate (one per GPU)")
    return parser


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    overrides = [a for a in argv if a.startswith("--") and "=" in a and a.split("=", 1)[0] not in OWN_FLAGS]
    return [a for a in argv if a not in overrides], overrides


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The flags and the config overrides of ``argv``."""
    rest, overrides = split_overrides(argv)
    # a bare --resume must not take the config path after it as its value
    bare = [i for i, a in enumerate(rest) if a == "--resume" and rest[i + 1 : i + 2] not in (["auto"], ["latest"])]
    return build_parser().parse_args(["--resume=latest" if i in bare else a for i, a in enumerate(rest)]), overrides


def launch_command(nproc: int, argv: list[str]) -> list[str]:
    """The equivalent ``torchrun`` command line of ``ttr train --nproc N``: a single-node job with a
    free rendezvous port (``--standalone``), one process per GPU (the Accelerator in each rank reads
    the rank and world size torchrun sets; on CPU it runs DDP over gloo)."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "-m", "ttr.train", *argv]


def launch(nproc: int, argv: list[str]) -> int:
    """Run ``launch_command`` with torch's elastic agent in this process and return the job's exit
    status: a failed rank ends the job with that rank's status (its error already printed in one
    line by the rank itself) instead of a launcher's status 1 and its traceback; SIGTERM / SIGINT
    to this process reach every rank, which save and exit, and the job exits 143 / 130. A launcher
    in a child process would pass on neither the status nor the signal."""
    cmd = launch_command(nproc, argv)
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if os.environ.get("TTR_DEBUG") != "1":
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(parse_args(cmd[3:]))  # torchrun's main without its error banner: cmd[3:] follows `-m torch.distributed.run`
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        if failure.exitcode >= 0:
            return failure.exitcode
        name = signal.Signals(-failure.exitcode).name
        print(f"ttr train: rank {rank} was killed by {name}", file=sys.stderr)
        return 128 - failure.exitcode
    except SignalException as err:  # the agent passed the signal on; the ranks have saved and exited
        return 128 + err.sigval
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, overrides = parse_args(argv)
    if args.nproc and "LOCAL_RANK" not in os.environ:
        child = [a for a in argv if not a.startswith("--nproc=")]
        if "--nproc" in child:
            i = child.index("--nproc")
            child = child[:i] + child[i + 2 :]
        return launch(args.nproc, child)

    from ttr.kernels.common.index import chunk_states

    from .config import load_config
    from .trainer import Trainer

    chunk_states()  # a bad TTR_CHUNK_STATES fails here, not at the first step
    cfg = load_config(args.config or default_config_path(), overrides)
    record = Trainer(cfg, resume=args.resume or False, resume_from=args.resume_from, overwrite=args.overwrite).run()
    if record.get("stopped_by"):
        signum = signal.Signals[record["stopped_by"]]
        if os.environ.get("RANK", "0") == "0":
            print(f"ttr train: stopped by {record['stopped_by']} at step {record['step']} after saving a checkpoint; "
                  f"continue with --resume (exit status {128 + signum})", file=sys.stderr)
        return 128 + signum
    return 0
