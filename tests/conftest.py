"""Test configuration: markers, Triton interpreter on machines without CUDA, seeding, and GPU
tests' share of one GPU under pytest-xdist."""

import os
import sys
from pathlib import Path

# Spread pytest-xdist workers over GPUs: with TTR_TEST_GPUS=0,1,2,3 worker gwI sees only the GPU
# ids[I % len(ids)]. Set before torch reads CUDA_VISIBLE_DEVICES (its first CUDA call below).
if os.environ.get("TTR_TEST_GPUS") and os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):
    _ids = os.environ["TTR_TEST_GPUS"].split(",")
    os.environ["CUDA_VISIBLE_DEVICES"] = _ids[int(os.environ["PYTEST_XDIST_WORKER"][2:]) % len(_ids)]

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton decides at import/decoration time whether @triton.jit functions are interpreted, so the
# variable must be set before triton is imported (transformers imports it through torch._dynamo).
# tests/ is deliberately not a package: pytest then imports this file before `ttr` itself.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# interpreter_bounds.py and gpu_share.py lie beside this file (on sys.path, as pytest imports this
# file from here)
import interpreter_bounds  # noqa: E402
from gpu_share import gpu_share  # noqa: E402

import ttr  # noqa: E402  (after TRITON_INTERPRET is decided)
from ttr.kernels.utils import interpreter_active  # noqa: E402

# Under the interpreter every kernel's loads and stores are checked against its tensor arguments.
if interpreter_active():
    interpreter_bounds.install()

# The repository root is the `ttr` package. pytest's package setup imports a rootdir
# `__init__.py` under the checkout directory's name ("main", "repo", ...), which would load a
# second copy of every module and register the model classes twice with transformers' Auto
# classes; point that name at the one real package instead.
sys.modules.setdefault(Path(ttr.__file__).resolve().parent.name, ttr)

# Tiny shapes: one thread is faster than two here (oversubscription on a 2-core CI machine).
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _gpu_share(request):
    """A GPU test holds its share of the GPU while it runs (``gpu_share``: alone if marked
    ``whole_gpu``) and hands its cached memory back to the driver after, for a whole-GPU test in
    another worker."""
    if request.node.get_closest_marker("gpu") is None or not torch.cuda.is_available():
        yield
        return
    with gpu_share(exclusive=request.node.get_closest_marker("whole_gpu") is not None):
        try:
            yield
        finally:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
