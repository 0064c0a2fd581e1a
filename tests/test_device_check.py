"""scripts/device_check.sh on the CPU: its time limit interrupts pytest itself, so the log keeps
pytest's summary and the exit status says the limit was reached; a bad limit is refused in one line."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TESTS = '''
import time

import pytest


@pytest.mark.gpu
def test_quick():
    pass


@pytest.mark.gpu
def test_slow():
    time.sleep(120)
'''


def _run(tmp_path, *args, **env):
    env = {**os.environ, "OUT": str(tmp_path / "out"), **env}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return subprocess.run(["bash", "scripts/device_check.sh", *args], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=90)


def test_time_limit_keeps_pytest_summary(tmp_path):
    (tmp_path / "test_fake_gpu.py").write_text(TESTS)
    start = time.monotonic()
    done = _run(tmp_path, "tests", str(tmp_path / "test_fake_gpu.py"), "-v", "-W", "ignore",
                "--rootdir", str(tmp_path), "-p", "no:xdist", TIME_LIMIT="12")
    assert time.monotonic() - start < 60
    assert done.returncode == 124, done.stdout + done.stderr
    log = (tmp_path / "out" / "gpu_tests.log").read_text()
    # -v reaches pytest (the script's -q is left out), and the interrupted run still ends with its summary
    assert "test_fake_gpu.py::test_quick PASSED" in log, log
    assert "KeyboardInterrupt" in log and "1 passed" in log, log


def test_bad_time_limit_is_one_line(tmp_path):
    done = _run(tmp_path, "tests", TIME_LIMIT="10m")
    assert done.returncode == 2
    assert done.stderr.strip() == "device_check.sh: TIME_LIMIT must be a whole number of seconds, got '10m'"
