"""RMSNorm, gated RMSNorm, L2 norm and an output norm with its projection (``norm_linear``): every
backend against the float64 oracle (outputs, dx, dz, dweight, the projection's gradients).

Odd D, leading dims of any rank, mixed dtypes (fp32 weight with lower-precision x). The "triton"
backend runs the Triton kernels (interpreter on CPU, fp32).
"""

import pytest
import torch
import torch.nn.functional as F

from ttr.kernels.norm import (
    gated_rms_norm,
    l2_norm,
    norm_linear,
    reference_gated_rms_norm,
    reference_l2_norm,
    reference_residual_rms_norm,
    reference_rms_norm,
    residual_rms_norm,
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


@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize(("shape", "groups"), [((2, 5, 48), 1), ((2, 5, 48), 3), ((3, 100), 4), ((1, 64), 2),
                                               ((2, 3, 4, 33), 1), ((37, 256), 8)])
def test_gated_rms_norm_gate_first_and_groups(backend, shape, groups, norm_before_gate):
    """Mamba2's output norm (gate, then per-group statistics) and the grouped norm-then-gate form."""
    x = torch.randn(*shape, device=DEVICE)
    z = 2 * torch.randn(*shape, device=DEVICE)
    w = 1 + 0.1 * torch.randn(shape[-1], device=DEVICE)
    check(gated_rms_norm, reference_gated_rms_norm, (x, z, w), eps=1e-6, norm_before_gate=norm_before_gate,
          groups=groups)


def test_gated_rms_norm_groups_are_separate_norms(backend):
    """groups=G is G independent norms over the slices of the last dim, each with its weight slice."""
    x, z = torch.randn(4, 3, 60, device=DEVICE), torch.randn(4, 3, 60, device=DEVICE)
    w = torch.randn(60, device=DEVICE)
    y = gated_rms_norm(x, z, w, norm_before_gate=False, groups=3)
    for g in range(3):
        sl = slice(20 * g, 20 * (g + 1))
        want = gated_rms_norm(x[..., sl].contiguous(), z[..., sl].contiguous(), w[sl], norm_before_gate=False)
        assert rel_rms(y[..., sl], want) < TOL


@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_gated_rms_norm_reads_a_sliced_gate_in_place(backend, norm_before_gate):
    """z a column slice of a wider projection (Mamba2's z from its in_proj): read without a copy,
    so the tensor kept for the backward is the projection itself; gradients reach the projection."""
    proj = torch.randn(2, 70, 3 * 40, device=DEVICE, requires_grad=True)
    x = torch.randn(2, 70, 40, device=DEVICE, requires_grad=True)
    w = 1 + 0.1 * torch.randn(40, device=DEVICE)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = gated_rms_norm(x, proj[..., 40:80], w, norm_before_gate=norm_before_gate, groups=2)
    if backend == "triton":
        assert proj.untyped_storage().data_ptr() in {t.untyped_storage().data_ptr() for t in saved}
    dy = torch.randn_like(y)
    y.backward(dy)
    p64, x64 = proj.detach().double().requires_grad_(), x.detach().double().requires_grad_()
    y64 = reference_gated_rms_norm(x64, p64[..., 40:80], w.double(), norm_before_gate=norm_before_gate, groups=2)
    y64.backward(dy.double())
    assert rel_rms(y, y64) < TOL and rel_rms(x.grad, x64.grad) < TOL and rel_rms(proj.grad, p64.grad) < TOL


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
    with pytest.raises(ValueError, match="groups"):
        gated_rms_norm(x, torch.randn(3, 8), torch.randn(8), groups=3)
    with pytest.raises(TypeError, match="norm_before_gate"):
        gated_rms_norm(x, torch.randn(3, 8), torch.randn(8), norm_before_gate=None)
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
    for groups in (1, 4):
        check(gated_rms_norm, reference_gated_rms_norm, (x, z, w), tol=tol, norm_before_gate=False, groups=groups)


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


@pytest.mark.parametrize("shape", [(48,), (3, 100), (2, 5, 48), (2, 3, 4, 33), (1, 3), (37, 1000)])
def test_residual_rms_norm(backend, shape):
    """s = h + branch and rms_norm(s): both outputs and the gradients of h, branch and weight, with
    an upstream gradient on each output (the residual stream's and the normalised input's)."""
    h = torch.randn(*shape, device=DEVICE)
    branch = torch.randn(*shape, device=DEVICE)
    w = 1 + 0.1 * torch.randn(shape[-1], device=DEVICE)
    fn, ref = residual_rms_norm, reference_residual_rms_norm
    leaves = [a.clone().requires_grad_() for a in (h, branch, w)]
    ref_leaves = [a.double().requires_grad_() for a in (h, branch, w)]
    s, y = fn(*leaves, eps=1e-5)
    s_ref, y_ref = ref(*ref_leaves, eps=1e-5)
    assert s.dtype == y.dtype == h.dtype
    assert rel_rms(s, s_ref) < TOL and rel_rms(y, y_ref) < TOL
    ds, dy = torch.randn_like(s_ref), torch.randn_like(y_ref)
    grads = torch.autograd.grad((s, y), leaves, (ds.float(), dy.float()))
    grads_ref = torch.autograd.grad((s_ref, y_ref), ref_leaves, (ds, dy))
    for name, g, r in zip(("h", "branch", "weight"), grads, grads_ref):
        assert rel_rms(g, r) < TOL, f"d{name}: {rel_rms(g, r)}"
    # only one output used: each gradient path alone
    (dh_only,) = torch.autograd.grad(fn(*leaves, eps=1e-5)[0], leaves[0], ds.float())
    assert rel_rms(dh_only, ds) < TOL
    dy_only = torch.autograd.grad(fn(*leaves, eps=1e-5)[1], leaves, dy.float())
    dy_ref = torch.autograd.grad(ref(*ref_leaves, eps=1e-5)[1], ref_leaves, dy)
    for g, r in zip(dy_only, dy_ref):
        assert rel_rms(g, r) < TOL


def test_residual_rms_norm_equals_add_then_norm(backend):
    """An fp32 stream plus a bf16 branch, the normalised output in bf16 (a pre-norm block under
    autocast): the same values and gradients, in the same dtypes, as the add followed by
    ``rms_norm``."""
    h = torch.randn(6, 256, device=DEVICE)
    branch = torch.randn(6, 256, device=DEVICE).to(torch.bfloat16)
    w = 1 + 0.1 * torch.randn(256, device=DEVICE)
    a = [t.clone().requires_grad_() for t in (h, branch, w)]
    b = [t.clone().requires_grad_() for t in (h, branch, w)]
    s, y = residual_rms_norm(*a, eps=1e-6, out_dtype=torch.bfloat16)
    s2 = b[0] + b[1]
    y2 = rms_norm(s2, b[2], eps=1e-6, out_dtype=torch.bfloat16)
    assert s.dtype == torch.float32 and y.dtype == torch.bfloat16
    torch.testing.assert_close(s, s2, rtol=0, atol=0)
    torch.testing.assert_close(y.float(), y2.float(), rtol=2**-7, atol=0)
    ds, dy = torch.randn_like(s), torch.randn_like(y)
    ga = torch.autograd.grad((s, y), a, (ds, dy))
    gb = torch.autograd.grad((s2, y2), b, (ds, dy))
    for name, g, r in zip(("h", "branch", "weight"), ga, gb):
        assert g.dtype == r.dtype, name
        assert rel_rms(g.float(), r.float()) < (1e-2 if g.dtype == torch.bfloat16 else TOL), name


def test_residual_rms_norm_bad_inputs():
    h = torch.randn(3, 8)
    with pytest.raises(ValueError, match="branch"):
        residual_rms_norm(h, torch.randn(3, 7), torch.randn(8))
    with pytest.raises(TypeError, match="branch"):
        residual_rms_norm(h, torch.randint(0, 3, (3, 8)), torch.randn(8))
    with pytest.raises(ValueError, match="weight"):
        residual_rms_norm(h, torch.randn(3, 8), torch.randn(7))


@pytest.mark.gpu
@pytest.mark.parametrize("d", [1024, 2048, 4096])
def test_residual_rms_norm_gpu(monkeypatch, d):
    """bf16 branch on an fp32 stream, bf16 output, against the float64 oracle."""
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    h = torch.randn(4, 2048, d, device=DEVICE)
    branch = torch.randn(4, 2048, d, device=DEVICE).to(torch.bfloat16)
    w = 1 + 0.1 * torch.randn(d, device=DEVICE)
    leaves = [t.clone().requires_grad_() for t in (h, branch, w)]
    ref_leaves = [t.double().requires_grad_() for t in (h, branch, w)]
    s, y = residual_rms_norm(*leaves, out_dtype=torch.bfloat16)
    s_ref, y_ref = reference_residual_rms_norm(*ref_leaves)
    assert rel_rms(s, s_ref) < 1e-6 and rel_rms(y, y_ref) < 1e-2
    ds, dy = torch.randn_like(s_ref), torch.randn_like(y_ref)
    grads = torch.autograd.grad((s, y), leaves, (ds.float(), dy.bfloat16()))
    grads_ref = torch.autograd.grad((s_ref, y_ref), ref_leaves, (ds, dy.bfloat16().double()))
    for name, g, r, tol in zip(("h", "branch", "weight"), grads, grads_ref, (1e-4, 1e-2, 1e-3)):
        assert rel_rms(g, r) < tol, f"d{name}: {rel_rms(g, r)}"


@pytest.mark.parametrize("stage", ["norm_fwd", "norm_bwd"])
def test_norm_launch_overrides(monkeypatch, stage):
    """Another launch (``index.TUNING``, what ``bench_fused --sweep`` sets) gives the same results:
    fewer elements per block than a row (one row each), more programs than row blocks."""
    from ttr.kernels.common import index

    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    monkeypatch.setitem(index.TUNING, stage, dict(ELEMS=64, num_warps=2, SM_PROGS=8))
    h, branch = torch.randn(9, 100, device=DEVICE), torch.randn(9, 100, device=DEVICE)
    w = 1 + 0.1 * torch.randn(100, device=DEVICE)
    check(rms_norm, reference_rms_norm, (h, w))
    leaves = [t.clone().requires_grad_() for t in (h, branch, w)]
    ref_leaves = [t.double().requires_grad_() for t in (h, branch, w)]
    out, ref = residual_rms_norm(*leaves), reference_residual_rms_norm(*ref_leaves)
    grads = torch.autograd.grad(out, leaves, [torch.ones_like(o) for o in out])
    grads_ref = torch.autograd.grad(ref, ref_leaves, [torch.ones_like(o) for o in ref])
    for g, r in zip(grads, grads_ref):
        assert rel_rms(g, r) < TOL


def reference_norm_linear(x, z, w, pw, pb=None, *, eps=1e-6, norm_before_gate=True, groups=1, heads=False):
    y = reference_gated_rms_norm(x, z, w, eps=eps, norm_before_gate=norm_before_gate, groups=groups) if z is not None \
        else reference_rms_norm(x, w, eps=eps)
    return F.linear(y.flatten(-2) if heads else y, pw.to(y.dtype), None if pb is None else pb.to(y.dtype))


def check_norm_linear(args, tol, **kw):
    """norm_linear against the float64 composition: output and every input's gradient, each in
    its input's dtype."""
    outs = []
    for upcast in (False, True):
        leaves = [None if a is None else (a.detach().double() if upcast else a.detach().clone()).requires_grad_()
                  for a in args]
        y = (reference_norm_linear if upcast else norm_linear)(*leaves, **kw)
        if not outs:
            dy = torch.randn(y.shape, device=y.device, dtype=torch.float64)
        used = [a for a in leaves if a is not None]
        outs.append((y, torch.autograd.grad(y, used, dy.to(y.dtype)), used))
    (y, grads, used), (y_ref, grads_ref, _) = outs
    assert y.dtype == args[0].dtype and y.shape == y_ref.shape
    assert rel_rms(y, y_ref) < tol
    for i, (g, r, a) in enumerate(zip(grads, grads_ref, used)):
        assert g.dtype == a.dtype and g.shape == a.shape
        assert rel_rms(g, r) < tol, f"grad {i}: {rel_rms(g, r)}"


@pytest.mark.parametrize("gate", ["none", "after", "first"])
@pytest.mark.parametrize("heads", [False, True])
def test_norm_linear(backend, gate, heads):
    """Per-head norms merged for the projection (Gated DeltaNet, GLA, DeltaNet without a gate) and
    one norm over the row, gate first in groups (Mamba2), with a bias."""
    shape = (2, 7, 3, 32) if heads else (2, 7, 96)
    x = torch.randn(*shape, device=DEVICE)
    z = None if gate == "none" else 2 * torch.randn(*shape, device=DEVICE)
    w = 1 + 0.1 * torch.randn(shape[-1], device=DEVICE)
    pw = torch.randn(40, 96, device=DEVICE) / 10
    pb = torch.randn(40, device=DEVICE)
    groups = 2 if gate == "first" and not heads else 1
    check_norm_linear((x, z, w, pw, pb), TOL, norm_before_gate=gate != "first", groups=groups, heads=heads)


def test_norm_linear_one_head(backend):
    """One head: x ``[B, T, 1, D]`` still gives ``[B, T, O]``."""
    x = torch.randn(2, 5, 1, 32, device=DEVICE)
    out = norm_linear(x, None, torch.ones(32, device=DEVICE), torch.randn(8, 32, device=DEVICE), heads=True)
    assert out.shape == (2, 5, 8)


def test_norm_linear_bf16_with_fp32_projection(backend):
    """bf16 activations, fp32 norm and projection weights (a mixed-precision layer): the output in
    bf16, every weight's gradient in fp32."""
    x, z = (torch.randn(3, 20, 4, 16, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    w = 1 + 0.1 * torch.randn(16, device=DEVICE)
    check_norm_linear((x, z, w, torch.randn(24, 64, device=DEVICE) / 8, None), 2e-2, heads=True)


def test_norm_linear_keeps_no_norm_output(backend):
    """What the backward keeps is x, z, the norm's weight and statistics and the projection's
    weight: not the norm's ``[tokens, F]`` output."""
    x, z = (torch.randn(4, 8, 2, 16, device=DEVICE, requires_grad=True) for _ in range(2))
    w = torch.ones(16, device=DEVICE, requires_grad=True)
    pw = torch.randn(8, 32, device=DEVICE, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        out = norm_linear(x, z, w, pw, heads=True)
    out.sum().backward()
    if backend == "triton":
        assert sorted(saved) == sorted([x.numel(), z.numel(), w.numel(), 4 * 8 * 2, pw.numel()])
    assert all(t.grad is not None for t in (x, z, w, pw))


def test_norm_linear_bad_inputs():
    x = torch.randn(2, 3, 4, 8)
    w = torch.ones(8)
    with pytest.raises(ValueError, match="proj_weight"):
        norm_linear(x, None, w, torch.randn(5, 8), heads=True)
    with pytest.raises(ValueError, match="proj_weight"):
        norm_linear(x, None, w, torch.randn(5, 32))
    with pytest.raises(ValueError, match="proj_bias"):
        norm_linear(x, None, w, torch.randn(5, 8), torch.randn(4))
    with pytest.raises(ValueError, match="weight"):
        norm_linear(x, None, torch.ones(7), torch.randn(5, 8))
    with pytest.raises(ValueError, match="heads"):
        norm_linear(torch.randn(8), None, w, torch.randn(5, 8), heads=True)
    with pytest.raises(TypeError, match="norm_before_gate"):
        norm_linear(x, x, w, torch.randn(5, 8), norm_before_gate="no")


@pytest.mark.gpu
@pytest.mark.parametrize("layer", ["gated_deltanet", "mamba2"])
def test_norm_linear_gpu(monkeypatch, layer):
    """bf16 at the 1.3B layers' shapes (Gated DeltaNet's 16 heads of 128 gated after the norm;
    Mamba2's 4096 channels gated first, the gate a column slice of a wider tensor), fp32
    weights: against float64."""
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    torch.manual_seed(0)
    if layer == "gated_deltanet":
        x, z = (torch.randn(2, 2048, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        kw = dict(heads=True)
    else:
        x = torch.randn(2, 2048, 4096, device="cuda", dtype=torch.bfloat16)
        z = torch.randn(2, 2048, 4096 + 96, device="cuda", dtype=torch.bfloat16)[..., 48:4096 + 48]
        kw = dict(norm_before_gate=False)
    w = 1 + 0.1 * torch.randn(x.shape[-1], device="cuda")
    pw = torch.randn(2048, 2048 if layer == "gated_deltanet" else 4096, device="cuda") / 64
    check_norm_linear((x, z, w, pw, None), 1e-2, **kw)


@pytest.mark.parametrize("gate_first", [False, True])
@pytest.mark.parametrize("heads", [False, True])
def test_norm_linear_writes_z_gradient_into_a_given_buffer(backend, gate_first, heads):
    """``dz_into``: z's gradient lands in a column block of a caller's wider buffer, as the layer's
    projections' gradients share one (``models.modules.GradColumns``); the same values as a new
    tensor, the other columns untouched. The torch path makes its own tensor."""
    shape = (2, 7, 3, 32) if heads else (2, 7, 96)
    x, z = torch.randn(*shape, device=DEVICE), 2 * torch.randn(*shape, device=DEVICE)
    w = 1 + 0.1 * torch.randn(shape[-1], device=DEVICE)
    pw = torch.randn(40, 96, device=DEVICE) / 10
    kw = dict(norm_before_gate=not gate_first, groups=2 if gate_first and not heads else 1, heads=heads)
    dy = torch.randn(2, 7, 40, device=DEVICE)
    zz = z.clone().requires_grad_()
    norm_linear(x, zz, w, pw, **kw).backward(dy)
    buf = torch.full((2, 7, 96 + 24), 7.0, device=DEVICE)
    block = buf[..., 16:16 + 96].view(shape)
    calls = []
    zz2 = z.clone().requires_grad_()
    out = norm_linear(x, zz2, w, pw, dz_into=lambda: calls.append(1) or block, **kw)
    (dz,) = torch.autograd.grad(out, zz2, dy)
    torch.testing.assert_close(dz, zz.grad, rtol=1e-6, atol=1e-6)
    if backend == "triton":
        assert calls == [1] and dz.data_ptr() == block.data_ptr()
        torch.testing.assert_close(block, zz.grad, rtol=1e-6, atol=1e-6)
        assert (buf[..., :16] == 7).all() and (buf[..., 16 + 96:] == 7).all()


def test_norm_linear_rejects_a_bad_z_gradient_buffer(backend):
    x, z = torch.randn(2, 5, 3, 16), torch.randn(2, 5, 3, 16, requires_grad=True)
    w, pw = torch.ones(16), torch.randn(8, 48)
    # z's gradient in another shape, and its heads' channels not dense
    for make in (lambda: torch.empty(2, 5, 48), lambda: torch.empty(2, 5, 16, 3).transpose(2, 3)):
        out = norm_linear(x, z, w, pw, heads=True, dz_into=make)
        if backend == "triton":
            with pytest.raises(ValueError, match="dz_into"):
                out.sum().backward()
        else:
            out.sum().backward()  # the torch path makes its own tensor
