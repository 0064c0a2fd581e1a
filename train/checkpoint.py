"""Atomic, verifiable, resumable checkpoints.

Layout: ``RUN_DIR/checkpoints/step_00000100/`` holding the model and optimizer state as a
``torch.distributed.checkpoint`` (sharded under FSDP2: every rank writes its shards; a plain
single-process save otherwise), ``trainer_state.json`` (step, tokens, every rank's data position,
non-finite counters, the config), ``rng_rank{R}.pt`` (python, numpy, torch and CUDA RNG states of
each rank) and, written last, ``manifest.json``: the size and sha256 of every other file.
Everything is written into ``.tmp-step_...`` and renamed when complete, so a crash never leaves a
half checkpoint under a real name; the manifest also finds one damaged later (a truncated copy, a
full disk) before it is loaded. Older ones beyond ``keep_last`` are deleted after the rename.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch

STEP_DIR = re.compile(r"^step_(\d{8})$")
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"


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


# ---- manifest -------------------------------------------------------------------------------


def _files(path: Path) -> list[str]:
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file() and p.name != MANIFEST)


def digest(path: Path) -> dict:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return {"size": path.stat().st_size, "sha256": h.hexdigest()}


def _write_json(path: Path, data: dict) -> None:
    """Write ``path`` whole or not at all (temp file, fsync, rename)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(data, indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def verify_checkpoint(path: Path, *, part: tuple[int, int] = (0, 1)) -> str | None:
    """None when the checkpoint at ``path`` is complete and intact, else the reason it is not.

    Sizes are checked for every file; the sha256 of files ``part[0]::part[1]`` only, so that the
    ranks of a job can share the reading. Checkpoints written before manifests existed are
    accepted when their ``trainer_state.json`` reads (the rename already made them complete).
    """
    path = Path(path)
    if not path.is_dir():
        return "not a directory"
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        if not (path / ".metadata").is_file():
            return f"incomplete: no {MANIFEST} and no .metadata"
        files = None
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{MANIFEST} is unreadable ({type(err).__name__})"
    if files is not None:
        for name in sorted(files):
            f = path / name
            if not f.is_file():
                return f"{name} is missing"
            if f.stat().st_size != files[name]["size"]:
                return f"{name} has {f.stat().st_size} bytes, {files[name]['size']} were written"
        for name in sorted(files)[part[0] :: part[1]]:
            if digest(path / name)["sha256"] != files[name]["sha256"]:
                return f"{name} does not match its sha256 in {MANIFEST}"
    try:
        read_trainer_state(path)
    except ValueError as err:
        return str(err)
    return None


def read_trainer_state(path: Path) -> dict:
    f = Path(path) / TRAINER_STATE
    try:
        state = json.loads(f.read_text())
    except FileNotFoundError:
        raise ValueError(f"{f} is missing") from None
    except (OSError, ValueError) as err:
        raise ValueError(f"{f} is not valid JSON ({err})") from None
    missing = [k for k in ("step", "tokens", "world_size", "data") if k not in state]
    if missing:
        raise ValueError(f"{f} lacks {', '.join(missing)}")
    return state


def saved_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the model tensors stored in the checkpoint at ``path``."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {k[len("model.") :]: tuple(v.size) for k, v in meta.items() if k.startswith("model.") and hasattr(v, "size")}


def shape_mismatch(path: Path, model) -> str | None:
    """None when the checkpoint's model tensors have the names and shapes of ``model``'s, else the
    first difference in words."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    saved = saved_shapes(path)
    now = {k: tuple(v.shape) for k, v in get_model_state_dict(model).items()}
    for name in sorted(set(saved) | set(now)):
        if name not in now:
            return f"the checkpoint has {name} {list(saved[name])}, the model has no such tensor"
        if name not in saved:
            return f"the model has {name} {list(now[name])}, the checkpoint has no such tensor"
        if saved[name] != now[name]:
            return f"{name} is {list(saved[name])} in the checkpoint and {list(now[name])} in the model"
    return None


# ---- save / load ----------------------------------------------------------------------------


def save_checkpoint(run_dir: Path, step: int, model, optimizer, trainer_state: dict, *, rank: int, world: int = 1,
                    barrier, gather=lambda x: [x], keep_last: int) -> Path:
    """Collective: every rank calls it. ``barrier`` synchronises ranks and ``gather(obj)`` returns
    every rank's ``obj`` in rank order (both trivial on one process)."""
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
        _write_json(tmp / TRAINER_STATE, trainer_state)
    barrier()
    names = _files(tmp)  # every rank hashes its share of the files, rank 0 writes the manifest
    parts = gather({name: digest(tmp / name) for name in names[rank::world]})
    if rank == 0:
        _write_json(tmp / MANIFEST, {"step": step, "files": {k: v for part in parts for k, v in part.items()}})
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
    return read_trainer_state(path)


def load_model_weights(path: Path, model) -> None:
    """Load only the model part of a checkpoint into an unsharded ``model`` (used by export)."""
    dcp, _, _ = _dcp()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {"model": get_model_state_dict(model)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
