"""Rotary position embedding: both backends against the float64 oracle (output and x's gradient),
strided input and per-row positions, the rotation's invariants (norms, relative positions), the
angle tables, bad input; the GPU cases in bf16 at an attention layer's shape."""

import math

import pytest
import torch

from ttr.kernels.rotary import reference_rotary, rope_tables, rotary

from .conftest import DEVICE, rel_rms


def check(x, cos, sin, tol):
    """rotary against reference_rotary in float64: y and dx (x's dtype and shape)."""
    dy = torch.randn(x.shape, device=x.device, dtype=torch.float64)
    outs = []
    for upcast, fn in ((False, rotary), (True, reference_rotary)):
        leaf = (x.detach().double() if upcast else x.detach().clone()).requires_grad_()
        tabs = (cos.double(), sin.double()) if upcast else (cos, sin)
        y = fn(leaf, *tabs)
        outs.append((y, torch.autograd.grad(y, leaf, dy.to(y.dtype))[0]))
    (y, dx), (y_ref, dx_ref) = outs
    assert y.dtype == x.dtype and y.shape == x.shape and y.is_contiguous()
    assert dx.dtype == x.dtype and dx.shape == x.shape
    assert rel_rms(y, y_ref) < tol
    assert rel_rms(dx, dx_ref) < tol


def positions(b, t, per_row):
    """[B, T] positions that differ per row (packed documents restart), or [1, T]."""
    if not per_row:
        return torch.arange(t, device=DEVICE)[None]
    return torch.stack([torch.arange(t, device=DEVICE) % (3 + i) + 100 * i for i in range(b)])


@pytest.mark.parametrize("shape", [(2, 7, 3, 8), (1, 5, 2, 12), (3, 4, 1, 2)])
@pytest.mark.parametrize("per_row", [False, True])
def test_rotary(backend, shape, per_row):
    b, t, h, d = shape
    cos, sin = rope_tables(positions(b, t, per_row), d, 10000.0)
    check(torch.randn(shape, device=DEVICE), cos, sin, 1e-6)


def test_rotary_strided_input(backend):
    """x as a transposed view ([B, H, T, D] memory read as [B, T, H, D]) and as a column slice."""
    b, t, h, d = 2, 6, 3, 8
    cos, sin = rope_tables(positions(b, t, True), d, 500.0)
    check(torch.randn(b, h, t, d, device=DEVICE).transpose(1, 2), cos, sin, 1e-6)
    wide = torch.randn(b, t, 2 * h * d, device=DEVICE)
    check(wide[..., h * d:].unflatten(-1, (h, d)), cos, sin, 1e-6)


def test_rotary_half_inputs(backend):
    cos, sin = rope_tables(positions(2, 33, False), 16, 10000.0)
    for dtype in (torch.float16, torch.bfloat16):
        check(torch.randn(2, 33, 4, 16, device=DEVICE, dtype=dtype), cos, sin, 1e-2)


def test_rotary_float64_gradcheck():
    x = torch.randn(2, 3, 2, 4, dtype=torch.float64, requires_grad=True)
    cos, sin = rope_tables(positions(2, 3, True).cpu(), 4, 100.0, torch.float64)
    assert torch.autograd.gradcheck(lambda x: rotary(x, cos, sin), (x,))


def test_rotary_invariants(backend):
    """A rotation keeps every head vector's norm, and <R(p) q, R(p') k> depends on p - p' only."""
    d, shift = 16, 37
    q, k = torch.randn(2, 1, 5, 1, d, device=DEVICE).unbind(0)
    pos = torch.tensor([[3, 11, 40, 41, 90]], device=DEVICE)
    rot = {s: rope_tables(pos + s, d, 10000.0) for s in (0, shift)}
    rq, rk = rotary(q, *rot[0]), rotary(k, *rot[0])
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1), rtol=1e-5, atol=1e-6)
    scores = torch.einsum("bthd,bshd->ts", rq, rk)
    shifted = torch.einsum("bthd,bshd->ts", rotary(q, *rot[shift]), rotary(k, *rot[shift]))
    torch.testing.assert_close(shifted, scores, rtol=1e-4, atol=1e-4)
    # position 0 is the identity
    zero = rope_tables(torch.zeros(1, 5, dtype=torch.long, device=DEVICE), d, 10000.0)
    torch.testing.assert_close(rotary(q, *zero), q)


def test_rope_tables_formula():
    pos = torch.tensor([[0, 1, 7]])
    cos, sin = rope_tables(pos, 6, 10000.0, torch.float64)
    assert cos.shape == sin.shape == (1, 3, 3) and cos.dtype == torch.float64
    for j, p in enumerate((0, 1, 7)):
        for i in range(3):
            a = p * 10000.0 ** (-2 * i / 6)
            assert math.isclose(cos[0, j, i].item(), math.cos(a), abs_tol=1e-12)
            assert math.isclose(sin[0, j, i].item(), math.sin(a), abs_tol=1e-12)


def test_rotary_bad_inputs():
    x = torch.randn(2, 3, 4, 8)
    cos, sin = rope_tables(torch.arange(3)[None], 8, 10000.0)
    with pytest.raises(ValueError, match="x"):
        rotary(torch.randn(3, 4, 8), cos, sin)
    with pytest.raises(ValueError, match="even"):
        rotary(torch.randn(2, 3, 4, 7), cos, sin)
    with pytest.raises(ValueError, match="cos"):
        rotary(x, cos[:, :2], sin)
    with pytest.raises(ValueError, match="cos"):
        rotary(x, torch.cat([cos] * 3), sin)
    with pytest.raises(TypeError, match="sin"):
        rotary(x, cos, sin.half())
    with pytest.raises(TypeError, match="x"):
        rotary(x.long(), cos, sin)
    with pytest.raises(ValueError, match="position_ids"):
        rope_tables(torch.arange(3), 8, 10000.0)
    with pytest.raises(TypeError, match="position_ids"):
        rope_tables(torch.ones(1, 3), 8, 10000.0)
    with pytest.raises(ValueError, match="dim"):
        rope_tables(torch.arange(3)[None], 7, 10000.0)
    with pytest.raises(ValueError, match="theta"):
        rope_tables(torch.arange(3)[None], 8, 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_rotary(monkeypatch, dtype):
    """An attention layer's q at the 1.3B presets' shape (B = 2, T = 4096, H = 16, D = 128), plain
    and with per-row positions, and a transposed view."""
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    b, t, h, d = 2, 4096, 16, 128
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for per_row in (False, True):
        pos = positions(b, t, per_row).cuda()
        cos, sin = rope_tables(pos, d, 10000.0)
        check(torch.randn(b, t, h, d, device="cuda", dtype=dtype), cos, sin, tol)
    check(torch.randn(b, h, t, d, device="cuda", dtype=dtype).transpose(1, 2), cos, sin, tol)
