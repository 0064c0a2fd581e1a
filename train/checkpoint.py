"""Atomic, resumable checkpoints.

Layout: ``RUN_DIR/checkpoints/step_00000100/`` holding the model and optimizer state as a
``torch.distributed.checkpoint`` (sharded under FSDP2: every rank writes its shards; a plain
single-process save otherwise), ``trainer_state.json`` (step, tokens, every rank's data position,
non-finite counters, the config) and ``rng_rank{R}.pt`` (python, numpy, torch and CUDA RNG
states of each rank). Everything is written into ``.tmp-step_...`` and renamed when complete, so
a crash never leaves a half checkpoint under a real name; older ones beyond ``keep_last`` are
deleted after the rename.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch

STEP_DIR = re.compile(r"^step_(\d{8})$")


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(run_dir: Path) -> Path | None:
    dirs = checkpoint_dirs(run_dir)
    return dirs[-1] if dirs else None


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _dcp():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    return dcp, get_state_dict, set_state_dict


def save_checkpoint(run_dir: Path, step: int, model, optimizer, trainer_state: dict, *, rank: int,
                    barrier, keep_last: int) -> Path:
    """Collective: every rank calls it. ``barrier`` synchronises ranks (a no-op on one)."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step:08d}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    dcp, get_state_dict, _ = _dcp()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
    if rank == 0:
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
    barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in checkpoint_dirs(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def load_checkpoint(path: Path, model, optimizer, *, rank: int) -> dict:
    """Restore model, optimizer and this rank's RNG in place; returns the trainer state."""
    dcp, get_state_dict, set_state_dict = _dcp()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng_file = Path(path) / f"rng_rank{rank}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return json.loads((Path(path) / "trainer_state.json").read_text())


def load_model_weights(path: Path, model) -> None:
    """Load only the model part of a checkpoint into an unsharded ``model`` (used by export)."""
    dcp, _, _ = _dcp()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {"model": get_model_state_dict(model)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
