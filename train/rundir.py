"""The run directory across starts: claiming it, choosing what to resume, tidying after a resume.

Rank 0 does all of this (the other ranks wait for its answer):

* :func:`claim` takes the lock (``lock.py``) and applies the start mode: a fresh start needs an
  empty or missing directory, ``overwrite`` empties it, a resume lists the checkpoints to try,
  newest first (or the one named by ``resume_from``).
* after a checkpoint has loaded, :func:`after_resume` puts checkpoints that were skipped or are
  newer than it aside (renamed, never deleted: they are the user's data, and ``--resume`` must not
  pick them up again) and trims ``metrics.jsonl`` to the resumed step, so that a step killed
  after its metrics were written but before its checkpoint does not appear twice.
* :func:`config_changes` lists what differs from the config the run was started with.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ttr.errors import TTRError

from .checkpoint import STEP_DIR, checkpoint_dirs
from .lock import LOCK_NAME, RunLock

RESUME_MODES = ("latest", "auto")
RUN_FILES = ("run_config.json", "checkpoints", "metrics.jsonl")  # what marks a ttr run directory


@dataclass
class Claim:
    """What rank 0 found: ``created`` when this start made the directory's content (so a failed
    setup removes it again), the checkpoints to try in order, and notes to print."""

    created: bool
    candidates: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _content(run_dir: Path) -> list[Path]:
    return [p for p in run_dir.iterdir() if p.name != LOCK_NAME] if run_dir.is_dir() else []


def _remove(paths: list[Path]) -> None:
    for p in paths:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def resolve_checkpoint(run_dir: Path, name: str) -> Path:
    """``--resume-from``: a checkpoint folder of this run, by path or by its ``step_NNNNNNNN`` name."""
    root = (run_dir / "checkpoints").resolve()
    path = Path(name)
    if not path.exists() and (root / name).exists():
        path = root / name
    if not path.is_dir():
        raise TTRError(f"--resume-from {name!r}: no such checkpoint folder (checkpoints are in {str(root)!r})")
    path = path.resolve()
    if path.parent != root or not STEP_DIR.match(path.name):
        raise TTRError(f"--resume-from {name!r} is not a checkpoint of this run: expected {str(root)}/step_NNNNNNNN")
    return path


def claim(run_dir: Path, lock: RunLock, *, resume: str | None, resume_from: str | None, overwrite: bool) -> Claim:
    """Lock ``run_dir`` and prepare it for the start mode; raises a one-line error otherwise
    (and then leaves no directory it created)."""
    existed = run_dir.is_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        return _claim(run_dir, existed, lock, resume=resume, resume_from=resume_from, overwrite=overwrite)
    except BaseException:
        if not existed and lock.held:  # never when another run holds it: it may have just made it
            lock.release()
            shutil.rmtree(run_dir, ignore_errors=True)
        raise


def _claim(run_dir: Path, existed: bool, lock: RunLock, *, resume, resume_from, overwrite) -> Claim:
    notes = lock.acquire()
    content = _content(run_dir)
    if overwrite:
        if content and not any((run_dir / name).exists() for name in RUN_FILES):
            raise TTRError(
                f"--overwrite: {str(run_dir)!r} does not look like a ttr run directory (none of "
                f"{', '.join(RUN_FILES)}); refusing to delete what is in it"
            )
        _remove(content)
        return Claim(created=True, notes=notes + ([f"removed the previous content of {run_dir}"] if content else []))
    if not resume and not resume_from:
        if content:
            raise FileExistsError(
                f"run directory {str(run_dir)!r} already exists and is not empty; pass --resume to continue it "
                "or --overwrite to replace it"
            )
        return Claim(created=True, notes=notes)
    _remove([p for p in (run_dir / "checkpoints").glob(".tmp-step_*")])  # saves cut short by a kill
    if resume_from:
        return Claim(created=False, candidates=[str(resolve_checkpoint(run_dir, resume_from))], notes=notes)
    found = [str(p) for p in reversed(checkpoint_dirs(run_dir))]
    if not found and resume != "auto":
        where = run_dir / "checkpoints" if existed else run_dir
        raise TTRError(
            f"--resume: no checkpoint in {str(where)!r} to continue from; start without --resume, or use "
            "--resume=auto to resume when there is one and start otherwise"
        )
    if not found:
        notes.append(f"no checkpoint in {run_dir}: starting from step 0 (--resume=auto)")
    return Claim(created=not content, candidates=found, notes=notes)


def remove_created(run_dir: Path, lock: RunLock) -> None:
    """Undo a failed first start: remove what it wrote (the lock last), so that a plain rerun is
    not refused as 'already exists'."""
    _remove(_content(run_dir))
    lock.release()
    if not any(run_dir.iterdir()):
        run_dir.rmdir()


def _set_aside(path: Path, tag: str) -> Path:
    target = path.with_name(f"{path.name}.{tag}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.{tag}{n}")
    path.rename(target)
    return target


def after_resume(run_dir: Path, bad: list[str], step: int) -> list[str]:
    """Put the checkpoints named in ``bad`` and those newer than ``step`` (the step resumed) aside
    and trim the metrics to ``step``; returns notes saying what was done."""
    notes = []
    for p in checkpoint_dirs(run_dir):
        if p.name in bad:
            notes.append(f"renamed the damaged checkpoint {p.name} to {_set_aside(p, 'bad').name}")
        elif int(STEP_DIR.match(p.name).group(1)) > step:
            notes.append(f"renamed {p.name}, newer than the step resumed, to {_set_aside(p, 'unused').name}")
    dropped = trim_metrics(run_dir / "metrics.jsonl", step)
    if dropped:
        notes.append(f"metrics.jsonl: dropped {dropped} record(s) after step {step}, written before the run stopped")
    return notes


def trim_metrics(path: Path, step: int) -> int:
    """Keep the records of ``path`` up to ``step`` (and drop a line cut short by a kill); returns
    how many lines were dropped. The file is replaced atomically."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            dropped += 1
            continue
        if isinstance(record, dict) and record.get("step", 0) <= step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(x + "\n" for x in kept))
        os.replace(tmp, path)
    return dropped


def _flatten(table: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(before: dict, now: dict) -> list[str]:
    """``key: old -> new`` for every config key that differs (``unset`` where a side lacks it)."""
    a, b = _flatten(before), _flatten(now)
    show = lambda d, k: repr(d[k]) if k in d else "unset"  # noqa: E731
    return [f"{k}: {show(a, k)} -> {show(b, k)}" for k in sorted(set(a) | set(b)) if a.get(k, a) != b.get(k, a)]
