"""Launch ``ttr train`` on one or several nodes through ``accelerate launch``.

    python -m ttr.scripts.launch [--nodes N] [--node-rank R] [--master-addr HOST] [--master-port P]
        [--gpus-per-node G] [--dry-run] -- CONFIG.toml [--section.key=value ...]

Under SLURM the node count, rank and master address default to ``SLURM_NNODES``,
``SLURM_NODEID`` and the first host of ``SLURM_JOB_NODELIST`` (run one copy per node, e.g.
``srun --ntasks-per-node=1 python -m ttr.scripts.launch -- configs/gated_deltanet-1.3b.toml``).
FSDP2 is chosen by the trainer (``train.distributed = "auto"``) whenever there is more than one
GPU in total.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def first_slurm_host(nodelist: str) -> str:
    """``gpu[03-05,07],cpu1`` -> ``gpu03``."""
    head = nodelist.split(",")[0]
    if "[" not in head:
        return head
    prefix, rest = head.split("[", 1)
    return prefix + rest.split("-")[0].split(",")[0].rstrip("]")


def build_command(args, train_argv: list[str]) -> list[str]:
    gpus = args.gpus_per_node
    if gpus < 1:
        raise ValueError(f"--gpus-per-node must be >= 1, got {gpus}")
    if args.nodes < 1 or not 0 <= args.node_rank < args.nodes:
        raise ValueError(f"need --nodes >= 1 and 0 <= --node-rank < --nodes, got {args.nodes}, {args.node_rank}")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(gpus * args.nodes),
           "--num_machines", str(args.nodes), "--machine_rank", str(args.node_rank)]
    if gpus * args.nodes > 1:
        cmd.append("--multi_gpu")
    if args.nodes > 1:
        if not args.master_addr:
            raise ValueError("--master-addr is needed with several nodes (or run under SLURM)")
        cmd += ["--main_process_ip", args.master_addr, "--main_process_port", str(args.master_port)]
    return cmd + ["-m", "ttr.train", *train_argv]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    train_argv = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    env = os.environ
    parser = argparse.ArgumentParser(prog="launch", description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=int(env.get("SLURM_NNODES", 1)))
    parser.add_argument("--node-rank", type=int, default=int(env.get("SLURM_NODEID", 0)))
    parser.add_argument("--master-addr", default=first_slurm_host(env["SLURM_JOB_NODELIST"])
                        if "SLURM_JOB_NODELIST" in env else "")
    parser.add_argument("--master-port", type=int, default=29500)
    parser.add_argument("--gpus-per-node", type=int, default=0, help="default: all visible GPUs")
    parser.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    args = parser.parse_args(own)
    if not args.gpus_per_node:
        import torch

        args.gpus_per_node = max(1, torch.cuda.device_count())
    cmd = build_command(args, train_argv)
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
