"""One run per run directory: a lock file ``RUN_DIR/.lock`` naming its holder.

Two trainers writing one run directory interleave their checkpoints and metrics, so a second
``ttr train`` (with or without ``--overwrite``) is refused while the first is alive. The file is
created with ``O_EXCL`` (atomic, also on NFS v3+) and holds ``{"host", "pid", "start_ticks",
"started"}``. A lock whose process is gone on this host is stale and taken over; a lock from another
host cannot be checked from here, so it blocks until removed by hand. Under several processes
only rank 0 takes the lock: the run is one job however many processes it has.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from ttr.errors import TTRError

LOCK_NAME = ".lock"


class RunDirInUse(TTRError):
    """Another live ``ttr train`` holds the run directory."""


def _start_ticks(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot (Linux), to tell a reused pid from the
    holder; None where /proc is not available."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22 of proc(5), counted after the command


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


class RunLock:
    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_NAME
        self.held = False

    def holder(self) -> dict | None:
        """The holder recorded in the lock file, ``{}`` when it cannot be read, None when there is
        no lock."""
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}

    def _stale(self, info: dict) -> bool:
        if info.get("host") != socket.gethostname() or not isinstance(info.get("pid"), int):
            return False
        if not _alive(info["pid"]):
            return True
        start = _start_ticks(info["pid"])
        return start is not None and info.get("start_ticks") not in (None, start)

    def acquire(self) -> list[str]:
        """Take the lock or raise :class:`RunDirInUse` naming the holder; returns notes (a stale
        lock taken over)."""
        notes = []
        for _ in range(3):
            me = {"host": socket.gethostname(), "pid": os.getpid(), "start_ticks": _start_ticks(os.getpid()),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S")}
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                info = self.holder()
                if info is None:  # released in between
                    continue
                if not info:  # being written by its holder right now, or damaged
                    time.sleep(0.2)
                    info = self.holder()
                if info and self._stale(info):
                    notes.append(f"removed a stale lock of pid {info['pid']} (no longer running) from {self.path}")
                    self.path.unlink(missing_ok=True)
                    continue
                who = (f"host {info.get('host')}, pid {info.get('pid')}, since {info.get('started')}" if info
                       else "an unreadable lock file")
                raise RunDirInUse(
                    f"run directory {str(self.path.parent)!r} is in use by another ttr train ({who}); wait for it "
                    f"to finish or stop it, or delete {str(self.path)!r} if that run is gone"
                ) from None
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(me))
            self.held = True
            return notes
        raise RunDirInUse(f"could not take the lock {str(self.path)!r}: it keeps changing hands")

    def release(self) -> None:
        if self.held:
            info = self.holder()
            if info and info.get("pid") == os.getpid() and info.get("host") == socket.gethostname():
                self.path.unlink(missing_ok=True)
            self.held = False
