"""One GPU shared by pytest-xdist workers: tests marked ``whole_gpu`` (training peaks near the GPU's
memory, timings) run alone on it, every other GPU test beside the others.

A readers-writer lock on files, across processes: a shared test passes a turnstile and then holds
the main lock shared; a whole-GPU test holds the turnstile while it waits for the main lock
exclusively, so no new shared test starts meanwhile and the wait is at most the tests already
running. Locks are per visible GPU set (``CUDA_VISIBLE_DEVICES``), so workers spread over GPUs
(``TTR_TEST_GPUS``) only wait for their own GPU's tests.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile


def lock_paths() -> tuple[str, str]:
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "all").replace(",", "-") or "none"
    stem = os.path.join(tempfile.gettempdir(), f"ttr-gpu-tests-{os.getuid()}-{gpus}")
    return stem + ".turnstile", stem + ".lock"


@contextlib.contextmanager
def gpu_share(exclusive: bool):
    """Hold this process's share of the GPU: alone (``exclusive``) or beside other shared holders."""
    turnstile_path, main_path = lock_paths()
    with open(turnstile_path, "a") as turnstile, open(main_path, "a") as main:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(main, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            if not exclusive:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(main, fcntl.LOCK_UN)
            if exclusive:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
