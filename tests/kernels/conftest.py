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


def fenced(t: torch.Tensor, pad: int = 256) -> torch.Tensor:
    """A leaf copy of t inside a buffer of NaN: a kernel that reads past t's ends, even where it
    then discards what it read, turns some result non-finite (and may fault on a GPU where the
    address is not mapped)."""
    buf = torch.full((t.numel() + 2 * pad,), float("nan"), device=t.device, dtype=t.dtype)
    buf[pad : pad + t.numel()] = t.reshape(-1)
    return buf[pad : pad + t.numel()].view(t.shape).requires_grad_()
