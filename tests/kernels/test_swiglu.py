"""SwiGLU's product ``silu(gate) * up``, and ``swiglu_linear`` (the product and the projection after
it): both backends against the float64 oracle (output and every gradient), low-precision inputs,
bad input; the GPU cases in bf16."""

import pytest
import torch

from ttr.kernels.swiglu import reference_swiglu, swiglu, swiglu_linear

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


def check_linear(gate, up, weight, bias, tol, autocast=None):
    """swiglu_linear against ``F.linear(reference_swiglu(gate, up), weight, bias)`` in float64:
    the output and the gradients of gate, up, weight and bias (each in its input's dtype)."""
    dout = torch.randn(*gate.shape[:-1], weight.shape[0], device=gate.device, dtype=torch.float64)
    outs = []
    for upcast in (False, True):
        leaves = [None if t is None else (t.detach().double() if upcast else t.detach().clone()).requires_grad_()
                  for t in (gate, up, weight, bias)]
        if upcast:
            y = torch.nn.functional.linear(reference_swiglu(*leaves[:2]), *leaves[2:])
        else:
            with torch.autocast(gate.device.type, dtype=autocast, enabled=autocast is not None):
                y = swiglu_linear(*leaves)
        used = [t for t in leaves if t is not None]
        outs.append((y, torch.autograd.grad(y, used, dout.to(y.dtype)), used))
    (y, grads, used), (y_ref, grads_ref, _) = outs
    assert y.dtype == (autocast or gate.dtype) and y.shape == dout.shape
    assert rel_rms(y, y_ref) < tol
    for g, r, t in zip(grads, grads_ref, used):
        assert g.dtype == t.dtype and g.shape == t.shape
        assert rel_rms(g, r) < tol


@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_linear(backend, bias):
    g, u = 4 * torch.randn(3, 70, 96, device=DEVICE), torch.randn(3, 70, 96, device=DEVICE)
    w = torch.randn(40, 96, device=DEVICE) / 10
    check_linear(g, u, w, torch.randn(40, device=DEVICE) if bias else None, 1e-6)


def test_swiglu_linear_under_autocast(backend):
    """bf16 activations, fp32 weight and bias (a mixed-precision MLP): the output in bf16, the
    weight's and bias's gradients in fp32."""
    g, u = (torch.randn(2, 50, 64, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(24, 64, device=DEVICE) / 8
    check_linear(g, u, w, torch.randn(24, device=DEVICE), 2e-2, autocast=torch.bfloat16)


def test_swiglu_linear_keeps_no_product(backend):
    """What the backward keeps is gate, up and the weight: not the ``[tokens, I]`` product."""
    g, u = (torch.randn(4, 32, 48, device=DEVICE, requires_grad=True) for _ in range(2))
    w = torch.randn(16, 48, device=DEVICE, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        swiglu_linear(g, u, w).sum().backward()
    assert sorted(saved) == sorted([g.numel(), u.numel(), w.numel()])
    assert all(t.grad is not None for t in (g, u, w))


def test_swiglu_linear_float64_gradcheck():
    g, u = (torch.randn(3, 6, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu_linear, (g, u, w, b))


def test_swiglu_linear_bad_inputs():
    g, u = torch.randn(3, 8), torch.randn(3, 8)
    with pytest.raises(ValueError, match="weight"):
        swiglu_linear(g, u, torch.randn(5, 7))
    with pytest.raises(ValueError, match="bias"):
        swiglu_linear(g, u, torch.randn(5, 8), torch.randn(4))
    with pytest.raises(ValueError, match="up"):
        swiglu_linear(g, torch.randn(3, 7), torch.randn(5, 8))


@pytest.mark.gpu
def test_gpu_swiglu_linear(monkeypatch):
    """bf16 activations at an MLP's shape under autocast, fp32 weight: against float64."""
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    g, u = (torch.randn(2048, 5632, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(2048, 5632, device="cuda") / 75
    check_linear(g, u, w, None, 1e-2, autocast=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_swiglu(monkeypatch, dtype):
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    g, u = (torch.randn(4096, 5632, device="cuda", dtype=dtype) for _ in range(2))
    check(g, u, 1e-2 if dtype == torch.bfloat16 else 1e-5)
