"""``causal_conv1d_columns``: the short convs of consecutive column blocks of one tensor (the delta
rules' q, k and v from one projection), whose backward writes the blocks' input gradients into one
tensor, with trailing columns passed through (the delta rules' narrow gate maps in the same
product). Both backends against each block's own ``causal_conv1d`` (the same bits) and the float64
oracle; plain and packed; bad input; on the GPU in bf16."""

import pytest
import torch

from ttr.kernels.conv import causal_conv1d, causal_conv1d_columns, reference_causal_conv1d

from .conftest import DEVICE, rel_rms

WIDTHS, GROUPS = (64, 64, 32), (32, 32, None)


def _inputs(packed, dtype=torch.float32, device=DEVICE, widths=WIDTHS, t=37, rest=0):
    torch.manual_seed(0)
    b, t = (1, 70) if packed else (2, t)
    cu = torch.tensor([0, 20, 21, 45, 70], device=device, dtype=torch.int32) if packed else None
    wide = torch.randn(b, t, sum(widths) + rest + 40, device=device, dtype=dtype)
    x = wide[..., 24:24 + sum(widths) + rest]  # a column block of a wider product, read in place
    ws = [(torch.randn(d, 4, device=device) / 2).to(dtype) for d in widths]
    bs = [None, None, (torch.randn(widths[-1], device=device) / 4).to(dtype)]
    dys = [torch.randn(b, t, d, device=device, dtype=dtype) for d in widths + ((rest,) if rest else ())]
    return x, ws, bs, cu, dys


def _grads(fn, x, ws, bs, dys):
    leaves = [x.detach().clone().requires_grad_()] + [w.detach().clone().requires_grad_() for w in ws]
    bl = [b.detach().clone().requires_grad_() if b is not None else None for b in bs]
    ys = fn(leaves[0], leaves[1:], bl)
    used = leaves + [b for b in bl if b is not None]
    return ys, torch.autograd.grad(sum((y * dy.to(y.dtype)).sum() for y, dy in zip(ys, dys)), used)


def _blocks(fn, cu, groups=GROUPS, rest=0):
    """Each block by its own conv (``fn``: causal_conv1d or the oracle) on x's column views, then
    the last ``rest`` columns as they are."""
    def run(x, ws, bs):
        out, start = [], 0
        for w, b, g in zip(ws, bs, groups):
            out.append(fn(x[..., start:start + w.shape[0]], w, b, activation="silu", cu_seqlens=cu, l2_group=g)[0])
            start += w.shape[0]
        return out + ([x[..., start:]] if rest else [])
    return run


def _columns(cu, groups=GROUPS, rest=0):
    return lambda x, ws, bs: causal_conv1d_columns(x, ws, bs, activation="silu", cu_seqlens=cu, l2_groups=groups,
                                                   passthrough=rest)


@pytest.mark.parametrize("rest", [0, 5])
@pytest.mark.parametrize("packed", [False, True])
def test_columns_are_the_blocks_convs(backend, packed, rest):
    """The outputs and every gradient (x's as one tensor, the passed-through columns' included) are
    the bits of each block's own conv."""
    x, ws, bs, cu, dys = _inputs(packed, rest=rest)
    (ys, gs) = _grads(_columns(cu, rest=rest), x, ws, bs, dys)
    (ys_ref, gs_ref) = _grads(_blocks(causal_conv1d, cu, rest=rest), x, ws, bs, dys)
    assert len(ys) == 3 + bool(rest) and all(y.is_contiguous() for y in ys[:3])
    for a, b in zip([*ys, *gs], [*ys_ref, *gs_ref]):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a, b)


def test_columns_passthrough_without_its_gradient(backend):
    """An unused passed-through output gets a zero gradient in its columns, the blocks' as before."""
    x, ws, bs, cu, dys = _inputs(False, rest=5)
    leaf = x.detach().clone().requires_grad_()
    ys = _columns(cu, rest=5)(leaf, ws, bs)
    sum((y * dy).sum() for y, dy in zip(ys[:3], dys)).backward()
    ref = x.detach().clone().requires_grad_()
    sum((y * dy).sum() for y, dy in zip(_blocks(causal_conv1d, cu)(ref[..., :-5], ws, bs), dys)).backward()
    assert torch.equal(leaf.grad[..., -5:], torch.zeros_like(leaf.grad[..., -5:]))
    assert torch.equal(leaf.grad[..., :-5], ref.grad[..., :-5])


@pytest.mark.parametrize("rest", [0, 5])
@pytest.mark.parametrize("packed", [False, True])
def test_columns_against_the_oracle(backend, packed, rest):
    x, ws, bs, cu, dys = _inputs(packed, rest=rest)
    (ys, gs) = _grads(_columns(cu, rest=rest), x, ws, bs, dys)
    up = [t.double() if t is not None else None for t in (x, *ws, *bs)]
    ys_ref, gs_ref = _grads(_blocks(reference_causal_conv1d, cu, rest=rest), up[0], up[1:4], up[4:],
                            [d.double() for d in dys])
    for a, b in zip([*ys, *gs], [*ys_ref, *gs_ref]):
        assert rel_rms(a, b) < 1e-5


def test_columns_bad_inputs():
    x = torch.randn(2, 5, 24)
    ws = [torch.randn(8, 4), torch.randn(16, 4)]
    with pytest.raises(ValueError, match="weights"):
        causal_conv1d_columns(x, [torch.randn(8, 4), torch.randn(8, 4)])
    with pytest.raises(ValueError, match="weights, biases and l2_groups"):
        causal_conv1d_columns(x, ws, [None])
    with pytest.raises(ValueError, match="weight width"):
        causal_conv1d_columns(x, [torch.randn(8, 5), torch.randn(16, 4)])
    with pytest.raises(ValueError, match="l2_group"):
        causal_conv1d_columns(x, ws, l2_groups=[3, None])
    with pytest.raises(ValueError, match="x must have shape"):
        causal_conv1d_columns(x[0], ws)
    with pytest.raises(ValueError, match="passthrough=2"):
        causal_conv1d_columns(x, ws, passthrough=2)
    for bad in (-1, 1.0, True):
        with pytest.raises(ValueError, match="passthrough must be an int"):
            causal_conv1d_columns(x, ws, passthrough=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("rest", [0, 32])
@pytest.mark.parametrize("packed", [False, True])
def test_gpu_columns_are_the_blocks_convs(monkeypatch, packed, rest):
    """bf16 at the presets' widths (q and k normed per head of 128, v without, Gated DeltaNet's two
    16-wide gates passed through): the bits of each block's own conv."""
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    widths, groups = (512, 512, 256), (128, 128, None)
    x, ws, bs, cu, dys = _inputs(packed, torch.bfloat16, "cuda", widths, t=1000, rest=rest)
    (ys, gs) = _grads(_columns(cu, groups, rest), x, ws, bs, dys)
    (ys_ref, gs_ref) = _grads(_blocks(causal_conv1d, cu, groups, rest), x, ws, bs, dys)
    for a, b in zip([*ys, *gs], [*ys_ref, *gs_ref]):
        assert torch.equal(a, b)
