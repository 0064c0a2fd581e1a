"""RMSNorm, gated RMSNorm and L2 norm: every backend against the float64 oracle (outputs, dx, dz, dweight).

Odd D, leading dims of any rank, mixed dtypes (fp32 weight with lower-precision x). The "triton"
backend runs the Triton kernels (interpreter on CPU, fp32).
"""

import pytest
import torch
import torch.nn.functional as F

from ttr.kernels.norm import (
    gated_rms_norm,
    l2_norm,
    reference_gated_rms_norm,
    reference_l2_norm,
    reference_rms_norm,
    rms_norm,
)

from .conftest import DEVICE, rel_rms

TOL = 1e-5
def run(fn, args, dy, upcast, **kw):
    leaves = [(a.detach().double() if upcast else a.detach().clone()).requires_grad_() for a in args]
    y = fn(*leaves, **kw)
    grads = torch.autograd.grad(y, leaves, dy.to(y.dtype))
    return y, grads


def check(fn, ref, args, tol=TOL, **kw):
    dy = torch.randn(args[0].shape, device=args[0].device, dtype=torch.float64)
    y, grads = run(fn, args, dy, upcast=False, **kw)
    y_ref, grads_ref = run(ref, args, dy, upcast=True, **kw)
    assert y.dtype == args[0].dtype and y.shape == args[0].shape
    assert rel_rms(y, y_ref) < tol, f"y: {rel_rms(y, y_ref)}"
    for i, (g, r, a) in enumerate(zip(grads, grads_ref, args)):
        assert g.dtype == a.dtype and g.shape == a.shape
        assert torch.isfinite(g).all()
        assert rel_rms(g, r) < tol, f"grad {i}: {rel_rms(g, r)}"


@pytest.mark.parametrize("shape", [(48,), (3, 100), (2, 5, 48), (2, 3, 4, 33), (1, 3), (2, 512)])
def test_rms_norm(backend, shape):
    x = torch.randn(*shape, device=DEVICE)
    w = 1 + 0.1 * torch.randn(shape[-1], device=DEVICE)
    check(rms_norm, reference_rms_norm, (x, w), eps=1e-5)


@pytest.mark.parametrize("shape", [(48,), (3, 100), (2, 5, 48), (2, 3, 4, 33), (1, 3), (2, 512)])
def test_gated_rms_norm(backend, shape):
    x = torch.randn(*shape, device=DEVICE)
    z = 2 * torch.randn(*shape, device=DEVICE)
    w = 1 + 0.1 * torch.randn(shape[-1], device=DEVICE)
    check(gated_rms_norm, reference_gated_rms_norm, (x, z, w), eps=1e-6)


def test_many_rows_weight_grad(backend):
    """More row blocks (4 rows of 1000) than backward programs: each program reduces several."""
    x = torch.randn(37, 1000, device=DEVICE)
    z = torch.randn(37, 1000, device=DEVICE)
    w = torch.randn(1000, device=DEVICE)
    check(gated_rms_norm, reference_gated_rms_norm, (x, z, w))


def test_matches_torch_rms_norm():
    x = torch.randn(4, 7, 100)
    w = torch.randn(100)
    want = F.rms_norm(x.double(), (100,), w.double(), eps=1e-6)
    assert rel_rms(reference_rms_norm(x.double(), w.double(), eps=1e-6), want) < 1e-12
    assert rel_rms(rms_norm(x, w, eps=1e-6), want) < TOL


def test_low_precision_input_fp32_weight(backend):
    x = torch.randn(6, 64, device=DEVICE, dtype=torch.float16)
    z = torch.randn(6, 64, device=DEVICE, dtype=torch.float16)
    w = torch.randn(64, device=DEVICE)
    y = gated_rms_norm(x, z, w)
    assert y.dtype == torch.float16
    assert rel_rms(y, reference_gated_rms_norm(x.double(), z.double(), w.double())) < 2e-3


def test_bad_inputs():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.randn(7))
    with pytest.raises(ValueError, match="z"):
        gated_rms_norm(x, torch.randn(3, 7), torch.randn(8))
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, torch.randn(8), eps=-1.0)
    with pytest.raises(ValueError, match="8192"):
        rms_norm(torch.randn(2, 8193), torch.randn(8193))
    with pytest.raises(TypeError, match="x"):
        rms_norm(x.long(), torch.randn(8))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [128, 2048, 4096, 8192, 1000])
def test_norms_gpu(monkeypatch, dtype, d):
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    x = torch.randn(4, 2048, d, device=DEVICE, dtype=dtype)
    z = torch.randn(4, 2048, d, device=DEVICE, dtype=dtype)
    w = (1 + 0.1 * torch.randn(d, device=DEVICE)).to(dtype)
    check(rms_norm, reference_rms_norm, (x, w), tol=tol)
    check(gated_rms_norm, reference_gated_rms_norm, (x, z, w), tol=tol)


@pytest.mark.parametrize("shape", [(48,), (3, 100), (2, 5, 2, 128), (2, 3, 4, 33), (1, 3), (40, 2, 64)])
def test_l2_norm(backend, shape):
    x = torch.randn(*shape, device=DEVICE)
    check(l2_norm, reference_l2_norm, (x,), eps=1e-6)
    want = F.normalize(x.double(), dim=-1, eps=0)
    assert rel_rms(l2_norm(x, eps=1e-6), want) < TOL


def test_l2_norm_float64_gradcheck():
    x = torch.randn(3, 5, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: l2_norm(t, eps=1e-6), (x,))


def test_l2_norm_bad_inputs():
    with pytest.raises(TypeError, match="x"):
        l2_norm(torch.randint(0, 3, (2, 4)))
    with pytest.raises(ValueError, match="eps"):
        l2_norm(torch.randn(2, 4), eps=-1.0)


def test_rms_norm_out_dtype(backend):
    """fp32 input, bf16 output (a pre-norm under autocast): the output is the fp32 result rounded
    once (within one bf16 step: the interpreter truncates where the GPU rounds to nearest); dx stays
    fp32 and equals the fp32 path's for the same bf16 output gradient."""
    x = torch.randn(5, 96, device=DEVICE)
    w = 1 + 0.1 * torch.randn(96, device=DEVICE)
    xa, xb = (x.clone().requires_grad_() for _ in range(2))
    y = rms_norm(xa, w, out_dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16
    y32 = rms_norm(xb, w)
    torch.testing.assert_close(y.float(), y32.detach(), rtol=2**-7, atol=0)
    dy = torch.randn(5, 96, device=DEVICE).to(torch.bfloat16)
    y.backward(dy)
    y32.backward(dy.float())
    assert xa.grad.dtype == torch.float32 and rel_rms(xa.grad, xb.grad) < TOL
    with pytest.raises(TypeError, match="out_dtype"):
        rms_norm(x, w, out_dtype=torch.int32)
