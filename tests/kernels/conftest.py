"""Shared by the kernel tests: the device, the backend fixture, the relative RMS error and the inputs
of the chunk ops."""

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64; a non-finite ``a`` fails (NaN never passes)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert torch.isfinite(a).all(), "non-finite values"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def op_leaves(op, T, H=2, D=32, device="cpu", dtype=torch.float32):
    """The inputs of chunk op ``op`` (or of ``recurrent_<op>``) for T tokens (B = 1) as leaves: x, B,
    C, q, k, v in dtype; the gates, dt, A and beta in fp32."""
    gen = torch.Generator(device=device).manual_seed(0)
    rand = lambda *s: torch.rand(*s, device=device, generator=gen)  # noqa: E731
    randn = lambda *s: torch.randn(*s, device=device, generator=gen).to(dtype)  # noqa: E731
    base = op.removeprefix("recurrent_")
    if base == "ssd":
        out = dict(x=randn(1, T, H, D), dt=rand(1, T, H) * 0.5 + 0.05, A=-rand(H) - 0.5, B=randn(1, T, 1, D),
                   C=randn(1, T, 1, D))
    else:
        k = torch.nn.functional.normalize(torch.randn(1, T, H, D, device=device, generator=gen), dim=-1)
        out = dict(q=randn(1, T, H, D), k=k.to(dtype), v=randn(1, T, H, D))
        if base == "gla":
            out["g"] = -rand(1, T, H, D) * 0.05
        elif base in ("simple_gla", "gated_delta"):
            out["g"] = -rand(1, T, H) * 0.05
        if base in ("delta", "gated_delta"):
            out["beta"] = rand(1, T, H)
    return {n: t.requires_grad_() for n, t in out.items()}


# On a machine without CUDA, tests/conftest.py turns the Triton interpreter on, so "triton"
# runs everywhere.
@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    """Runs a test once per kernel backend (``TTR_KERNEL_BACKEND``)."""
    monkeypatch.setenv("TTR_KERNEL_BACKEND", request.param)
    return request.param
