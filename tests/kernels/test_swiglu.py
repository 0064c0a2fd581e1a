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


def test_swiglu_strided_inputs(backend):
    """Column blocks of a wider tensor are read in place; leading dims that are not one run of rows
    (a transpose) and a last dim without unit stride are copied first: the same results, the
    gradient reaching the wider tensor's columns."""
    wide = 4 * torch.randn(2, 5, 300, device=DEVICE)
    dy = torch.randn(5, 2, 130, device=DEVICE, dtype=torch.float64)
    views = (lambda t: (t[..., :130], t[..., 150:280]),
             lambda t: (t[..., :130].transpose(0, 1), t[..., 150:280].transpose(0, 1)),
             lambda t: (t[:, :, :260:2], t[:, :, 1:260:2]))
    for view in views:
        outs = []
        for upcast, fn in ((False, swiglu), (True, reference_swiglu)):
            leaf = (wide.double() if upcast else wide.clone()).requires_grad_()
            y = fn(*view(leaf))
            d = dy if y.shape == dy.shape else dy.transpose(0, 1)
            outs.append((y, torch.autograd.grad(y, leaf, d.to(y.dtype))[0]))
        (y, g), (y_ref, g_ref) = outs
        assert rel_rms(y, y_ref) < 1e-6 and rel_rms(g, g_ref) < 1e-6


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
    with pytest.raises(ValueError, match="even last dim"):
        swiglu_linear(torch.randn(3, 9), None, torch.randn(5, 4))
    with pytest.raises(ValueError, match="gate's last dim / 2"):
        swiglu_linear(g, None, torch.randn(5, 8))


def check_halves(gu, w, b):
    """swiglu_linear of gate and up as the two halves of gu (read in place) against the same op on
    the halves as tensors of their own: the same bits, and gu's gradient one tensor holding theirs."""
    i = gu.shape[-1] // 2
    dout = torch.randn(*gu.shape[:-1], w.shape[0], device=gu.device, dtype=gu.dtype)
    outs = []
    for joined in (True, False):
        leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (gu, w, b)]
        if joined:
            args = (leaves[0], None)
        else:
            leaves[:1] = [leaves[0][..., :i].detach().clone().requires_grad_(),
                          leaves[0][..., i:].detach().clone().requires_grad_()]
            args = tuple(leaves[:2])
        used = [t for t in leaves if t is not None]
        y = swiglu_linear(*args, *leaves[-2:])
        grads = torch.autograd.grad(y, used, dout)
        outs.append((y, torch.cat(grads[:2], -1) if not joined else grads[0], grads[-2 if b is not None else -1:]))
    (y, dgu, rest), (y_ref, dgu_ref, rest_ref) = outs
    assert dgu.shape == gu.shape
    for a, r in zip((y, dgu, *rest), (y_ref, dgu_ref, *rest_ref)):
        assert torch.equal(a, r)


@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_linear_halves_are_the_pair(backend, bias):
    wide = torch.randn(3, 70, 2 * 96 + 24, device=DEVICE)
    gu = wide[..., 8:8 + 2 * 96]  # a column block of a wider product, read in place
    check_halves(gu, torch.randn(40, 96, device=DEVICE) / 10, torch.randn(40, device=DEVICE) if bias else None)


def test_swiglu_linear_halves_keep_no_product(backend):
    gu = torch.randn(4, 32, 96, device=DEVICE, requires_grad=True)
    w = torch.randn(16, 48, device=DEVICE, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        swiglu_linear(gu, None, w).sum().backward()
    assert sorted(saved) == sorted([gu.numel(), w.numel()])
    assert gu.grad is not None and gu.grad.shape == gu.shape


@pytest.mark.gpu
def test_gpu_swiglu_linear(monkeypatch):
    """bf16 activations at an MLP's shape under autocast, fp32 weight: against float64."""
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    g, u = (torch.randn(2048, 5632, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(2048, 5632, device="cuda") / 75
    check_linear(g, u, w, None, 1e-2, autocast=torch.bfloat16)


@pytest.mark.gpu
def test_gpu_swiglu_linear_halves(monkeypatch):
    """bf16 at an MLP's shape, gate and up as the halves of one product: the bits of the pair."""
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    gu = torch.randn(2048, 2 * 5632, device="cuda", dtype=torch.bfloat16)
    check_halves(gu, (torch.randn(2048, 5632, device="cuda") / 75).bfloat16(), None)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_swiglu(monkeypatch, dtype):
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    g, u = (torch.randn(4096, 5632, device="cuda", dtype=dtype) for _ in range(2))
    check(g, u, 1e-2 if dtype == torch.bfloat16 else 1e-5)
