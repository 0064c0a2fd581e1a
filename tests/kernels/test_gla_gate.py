"""GLA's forget gate from its logits (``gla_gate``): both backends against the float64 torch
expression (value and gradient), with and without the clamp, low-precision logits, bad input; the
GPU case in bf16."""

import pytest
import torch

from ttr.kernels.gla.gate import gla_gate, reference_gla_gate

from .conftest import DEVICE, rel_rms


def check(z, normalizer, clamp_min, tol):
    dg = torch.randn(z.shape, device=z.device, dtype=torch.float64)
    zz = z.detach().clone().requires_grad_()
    g = gla_gate(zz, normalizer, clamp_min)
    (dz,) = torch.autograd.grad(g, zz, dg.float())
    zr = z.detach().double().requires_grad_()
    g_ref = reference_gla_gate(zr, normalizer, clamp_min)
    (dz_ref,) = torch.autograd.grad(g_ref, zr, dg)
    assert g.dtype == torch.float32 and g.shape == z.shape
    assert dz.dtype == z.dtype
    assert rel_rms(g, g_ref) < tol
    assert rel_rms(dz, dz_ref) < tol


@pytest.mark.parametrize("clamp_min", [None, -0.3])
@pytest.mark.parametrize("shape", [(1,), (3, 700), (2, 5, 4, 2049)])
def test_gla_gate(backend, shape, clamp_min):
    # logits of both signs and large magnitude: the log-sigmoid's two branches and the clamp
    check(8 * torch.randn(*shape, device=DEVICE), 16.0, clamp_min, 1e-6)


def test_gla_gate_half_logits(backend):
    check((4 * torch.randn(7, 300, device=DEVICE)).to(torch.bfloat16), 5.0, -0.1, 1e-2)


def test_gla_gate_empty(backend):
    z = torch.randn(0, 4, device=DEVICE, requires_grad=True)
    assert gla_gate(z).shape == (0, 4)


def test_gla_gate_bad_inputs():
    with pytest.raises(ValueError, match="normalizer"):
        gla_gate(torch.randn(3), 0.0)
    with pytest.raises(ValueError, match="clamp_min"):
        gla_gate(torch.randn(3), 16.0, 0.5)
    with pytest.raises(TypeError, match="z"):
        gla_gate(torch.randint(0, 3, (3,)))


@pytest.mark.gpu
def test_gpu_gla_gate(monkeypatch):
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    z = (4 * torch.randn(8, 4096, 16 * 64, device="cuda")).to(torch.bfloat16)
    check(z, 16.0, None, 1e-2)
    check(z, 16.0, -0.2, 1e-2)
