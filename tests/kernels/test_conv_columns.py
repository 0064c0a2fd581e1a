"""``causal_conv1d_columns``: the short convs of consecutive column blocks of one tensor (the delta
rules' q, k and v from one projection), whose backward writes the blocks' input gradients into one
tensor. Both backends against each block's own ``causal_conv1d`` (the same bits) and the float64
oracle; plain and packed; bad input; on the GPU in bf16."""

import pytest
import torch

from ttr.kernels.conv import causal_conv1d, causal_conv1d_columns, reference_causal_conv1d

from .conftest import DEVICE, rel_rms

WIDTHS, GROUPS = (64, 64, 32), (32, 32, None)


def _inputs(packed, dtype=torch.float32, device=DEVICE, widths=WIDTHS, t=37):
    torch.manual_seed(0)
    b, t = (1, 70) if packed else (2, t)
    cu = torch.tensor([0, 20, 21, 45, 70], device=device, dtype=torch.int32) if packed else None
    wide = torch.randn(b, t, sum(widths) + 40, device=device, dtype=dtype)
    x = wide[..., 24:24 + sum(widths)]  # a column block of a wider product, read in place
    ws = [(torch.randn(d, 4, device=device) / 2).to(dtype) for d in widths]
    bs = [None, None, (torch.randn(widths[-1], device=device) / 4).to(dtype)]
    dys = [torch.randn(b, t, d, device=device, dtype=dtype) for d in widths]
    return x, ws, bs, cu, dys


def _grads(fn, x, ws, bs, dys):
    leaves = [x.detach().clone().requires_grad_()] + [w.detach().clone().requires_grad_() for w in ws]
    bl = [b.detach().clone().requires_grad_() if b is not None else None for b in bs]
    ys = fn(leaves[0], leaves[1:], bl)
    used = leaves + [b for b in bl if b is not None]
    return ys, torch.autograd.grad(sum((y * dy.to(y.dtype)).sum() for y, dy in zip(ys, dys)), used)


def _blocks(fn, cu, groups=GROUPS):
    """Each block by its own conv (``fn``: causal_conv1d or the oracle) on x's column views."""
    def run(x, ws, bs):
        out, start = [], 0
        for w, b, g in zip(ws, bs, groups):
            out.append(fn(x[..., start:start + w.shape[0]], w, b, activation="silu", cu_seqlens=cu, l2_group=g)[0])
            start += w.shape[0]
        return out
    return run


def _columns(cu, groups=GROUPS):
    return lambda x, ws, bs: causal_conv1d_columns(x, ws, bs, activation="silu", cu_seqlens=cu, l2_groups=groups)


@pytest.mark.parametrize("packed", [False, True])
def test_columns_are_the_blocks_convs(backend, packed):
    """The outputs and every gradient (x's as one tensor) are the bits of each block's own conv."""
    x, ws, bs, cu, dys = _inputs(packed)
    (ys, gs), (ys_ref, gs_ref) = _grads(_columns(cu), x, ws, bs, dys), _grads(_blocks(causal_conv1d, cu), x, ws, bs, dys)
    assert len(ys) == 3 and all(y.is_contiguous() for y in ys)
    for a, b in zip([*ys, *gs], [*ys_ref, *gs_ref]):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a, b)


@pytest.mark.parametrize("packed", [False, True])
def test_columns_against_the_oracle(backend, packed):
    x, ws, bs, cu, dys = _inputs(packed)
    (ys, gs) = _grads(_columns(cu), x, ws, bs, dys)
    up = [t.double() if t is not None else None for t in (x, *ws, *bs)]
    ys_ref, gs_ref = _grads(_blocks(reference_causal_conv1d, cu), up[0], up[1:4], up[4:], [d.double() for d in dys])
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


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
def test_gpu_columns_are_the_blocks_convs(monkeypatch, packed):
    """bf16 at the presets' widths (q and k normed per head of 128, v without): the bits of each
    block's own conv."""
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    widths, groups = (512, 512, 256), (128, 128, None)
    x, ws, bs, cu, dys = _inputs(packed, torch.bfloat16, "cuda", widths, t=1000)
    (ys, gs) = _grads(_columns(cu, groups), x, ws, bs, dys)
    (ys_ref, gs_ref) = _grads(_blocks(causal_conv1d, cu, groups), x, ws, bs, dys)
    for a, b in zip([*ys, *gs], [*ys_ref, *gs_ref]):
        assert torch.equal(a, b)
