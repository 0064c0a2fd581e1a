"""Shared by the kernel tests: the device, the backend fixture and the relative RMS error."""

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64; a non-finite ``a`` fails (NaN never passes)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert torch.isfinite(a).all(), "non-finite values"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# On a machine without CUDA, tests/conftest.py turns the Triton interpreter on, so "triton"
# runs everywhere.
@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    """Runs a test once per kernel backend (``TTR_KERNEL_BACKEND``)."""
    monkeypatch.setenv("TTR_KERNEL_BACKEND", request.param)
    return request.param
