"""SwiGLU's product ``silu(gate) * up``: both backends against the float64 oracle (output and both
gradients), low-precision inputs, bad input; the GPU case in bf16."""

import pytest
import torch

from ttr.kernels.swiglu import reference_swiglu, swiglu

from .conftest import DEVICE, rel_rms


def check(gate, up, tol):
    dy = torch.randn(gate.shape, device=gate.device, dtype=torch.float64)
    outs = []
    for upcast, fn in ((False, swiglu), (True, reference_swiglu)):
        leaves = [(t.detach().double() if upcast else t.detach().clone()).requires_grad_() for t in (gate, up)]
        y = fn(*leaves)
        outs.append((y, torch.autograd.grad(y, leaves, dy.to(y.dtype))))
    (y, grads), (y_ref, grads_ref) = outs
    assert y.dtype == gate.dtype and y.shape == gate.shape
    assert rel_rms(y, y_ref) < tol
    for name, g, r in zip(("gate", "up"), grads, grads_ref):
        assert g.dtype == gate.dtype and g.shape == gate.shape
        assert rel_rms(g, r) < tol, name


@pytest.mark.parametrize("shape", [(1,), (3, 700), (2, 5, 2049), (0, 4)])
def test_swiglu(backend, shape):
    if 0 in shape:
        g = torch.randn(*shape, device=DEVICE, requires_grad=True)
        y = swiglu(g, torch.randn(*shape, device=DEVICE))
        assert y.shape == g.shape
        return
    check(4 * torch.randn(*shape, device=DEVICE), torch.randn(*shape, device=DEVICE), 1e-6)


def test_swiglu_half_inputs(backend):
    g, u = (torch.randn(7, 300, device=DEVICE, dtype=torch.float16) for _ in range(2))
    check(g, u, 2e-3)


def test_swiglu_float64_gradcheck():
    g = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    u = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu, (g, u))


def test_swiglu_bad_inputs():
    g = torch.randn(3, 8)
    with pytest.raises(ValueError, match="up"):
        swiglu(g, torch.randn(3, 7))
    with pytest.raises(TypeError, match="up"):
        swiglu(g, torch.randn(3, 8, dtype=torch.float16))
    with pytest.raises(TypeError, match="gate"):
        swiglu(torch.randint(0, 3, (3, 8)), g)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_swiglu(monkeypatch, dtype):
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    g, u = (torch.randn(4096, 5632, device="cuda", dtype=dtype) for _ in range(2))
    check(g, u, 1e-2 if dtype == torch.bfloat16 else 1e-5)
