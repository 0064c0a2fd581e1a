"""The GPU tests' share of one GPU under pytest-xdist (``gpu_share``): shared holders run together,
a whole-GPU holder alone, and a waiting whole-GPU test keeps new shared tests from starting."""

import fcntl
import tempfile
import threading
import time

import pytest
from gpu_share import gpu_share, lock_paths


@pytest.fixture
def locks(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    return lock_paths()


def free(path: str, mode: int) -> bool:
    """Whether a new holder could take ``path`` in ``mode`` now (a fresh open: flock treats it as
    another holder, in this process too)."""
    with open(path, "a") as f:
        try:
            fcntl.flock(f, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


def wait_until(check, seconds=10.0):
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < seconds, "timed out"
        time.sleep(0.01)


def test_lock_files_are_per_visible_gpu_set(locks, monkeypatch, tmp_path):
    assert all(p.startswith(str(tmp_path)) and "-3." in p for p in locks)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert lock_paths() != locks and "-0-1." in lock_paths()[1]


def test_shared_holders_run_together_and_a_whole_gpu_holder_alone(locks):
    turnstile, main = locks
    with gpu_share(exclusive=False):
        assert free(main, fcntl.LOCK_SH) and not free(main, fcntl.LOCK_EX)
        assert free(turnstile, fcntl.LOCK_EX)  # passed through, not held
    with gpu_share(exclusive=True):
        assert not free(main, fcntl.LOCK_SH) and not free(turnstile, fcntl.LOCK_EX)
    assert free(main, fcntl.LOCK_EX) and free(turnstile, fcntl.LOCK_EX)


def test_waiting_whole_gpu_test_goes_before_new_shared_ones(locks):
    turnstile, main = locks
    order, release_first = [], threading.Event()

    def holder(name, exclusive, release=None):
        with gpu_share(exclusive=exclusive):
            order.append(name)
            if release is not None:
                release.wait(10)

    first = threading.Thread(target=holder, args=("shared 1", False, release_first))
    first.start()
    wait_until(lambda: order == ["shared 1"])
    whole = threading.Thread(target=holder, args=("whole", True))
    whole.start()
    wait_until(lambda: not free(turnstile, fcntl.LOCK_EX))  # the whole-GPU test waits at the main lock
    second = threading.Thread(target=holder, args=("shared 2", False))
    second.start()
    time.sleep(0.2)
    assert order == ["shared 1"]  # neither starts while the first shared test runs
    release_first.set()
    for t in (first, whole, second):
        t.join(10)
    assert order == ["shared 1", "whole", "shared 2"]
