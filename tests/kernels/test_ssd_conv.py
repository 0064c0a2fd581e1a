"""Mamba2's D skip inside SSD and the fused short conv + SSD (``chunk_conv_ssd``): every backend
against the float64 oracle, outputs, final states and all gradients (x or xBC, the conv's weight
and bias, dt, A, B, C, D, initial_state), T in {1, 15, 64, 65, 200}, groups 1 and > 1, packed
documents; and what the Triton path keeps for the backward."""

import pytest
import torch

from ttr.kernels.ssd import chunk_conv_ssd, chunk_ssd, recurrent_ssd, reference_conv_ssd, reference_ssd
from ttr.kernels.ssd.reference import xbc_views

from .conftest import rel_rms
from .test_ssd import SSD_NAMES, TOL, check, ssd_inputs

CONV_NAMES = ["dxBC", "dconv_weight", "dconv_bias", "ddt", "dA", "dD"]


def with_d(fn):
    """``fn`` with D as the sixth positional input, so ``check`` makes it a leaf with a gradient."""
    return lambda x, dt, A, B, C, D, **kw: fn(x, dt, A, B, C, D=D, **kw)


def conv_inputs(t, h, groups, n_state, p, *, w=4, bias=True, n=1):
    (x, dt, A, B, C), h0 = ssd_inputs(1, t, h, groups, n_state, p, h0=True, n=n)
    width = h * p + 2 * groups * n_state
    xbc = torch.randn(1, t, width)
    weight = torch.randn(width, w) / w**0.5
    D = torch.randn(h)
    return (xbc, weight, torch.randn(width) if bias else None, dt, A, D), h0


def conv_ssd(fn, groups, n_state):
    def call(xbc, weight, bias, dt, A, D, **kw):
        return fn(xbc, weight, bias, dt, A, D=D, groups=groups, state_size=n_state, **kw)
    return call


def check_conv(inputs, h0, groups, n_state, cu=None, tol=TOL):
    names = CONV_NAMES if inputs[2] is not None else [n for n in CONV_NAMES if n != "dconv_bias"]
    kept = [t for t in inputs if t is not None]
    bias_at = 2 if inputs[2] is not None else None

    def wrap(fn):
        def call(*args, **kw):
            args = list(args)
            if bias_at is None:
                args.insert(2, None)
            return conv_ssd(fn, groups, n_state)(*args, **kw)
        return call

    check(wrap(chunk_conv_ssd), wrap(reference_conv_ssd), kept, names, h0, cu, tol=tol)


@pytest.mark.parametrize("t", [1, 15, 64, 65, 200])
@pytest.mark.parametrize("groups", [1, 2])
def test_ssd_with_skip(backend, t, groups):
    (x, dt, A, B, C), h0 = ssd_inputs(1, t, 4, groups, 6, 5, h0=True)
    check(with_d(chunk_ssd), with_d(reference_ssd), (x, dt, A, B, C, torch.randn(4)), [*SSD_NAMES, "dD"], h0)


def test_ssd_with_skip_packed(backend):
    lengths = [1, 63, 64, 130]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    (x, dt, A, B, C), h0 = ssd_inputs(1, sum(lengths), 4, 2, 8, 6, h0=True, n=len(lengths))
    check(with_d(chunk_ssd), with_d(reference_ssd), (x, dt, A, B, C, torch.randn(4)), [*SSD_NAMES, "dD"], h0, cu)


def test_recurrent_ssd_with_skip(backend):
    (x, dt, A, B, C), h0 = ssd_inputs(1, 12, 4, 2, 6, 5, h0=True)
    D = torch.randn(4)
    y, f = chunk_ssd(x, dt, A, B, C, D=D, initial_state=h0, output_final_state=True)
    y_r, f_r = recurrent_ssd(x, dt, A, B, C, D=D, initial_state=h0, output_final_state=True)
    assert rel_rms(y_r, y) < TOL and rel_rms(f_r, f) < TOL


@pytest.mark.parametrize("t", [1, 15, 64, 65, 200])
@pytest.mark.parametrize("groups", [1, 2])
def test_conv_ssd(backend, t, groups):
    inputs, h0 = conv_inputs(t, 4, groups, 6, 5)
    check_conv(inputs, h0, groups, 6)


@pytest.mark.parametrize("w", [2, 3])
def test_conv_ssd_no_bias_narrow_conv(backend, w):
    inputs, h0 = conv_inputs(70, 4, 4, 3, 8, w=w, bias=False)
    check_conv(inputs, h0, 4, 3)


def test_conv_ssd_packed(backend):
    """The conv and the state restart at every document (lengths 1 and chunk multiples)."""
    lengths = [1, 63, 64, 130]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    inputs, h0 = conv_inputs(sum(lengths), 4, 2, 6, 5, n=len(lengths))
    check_conv(inputs, h0, 2, 6, cu)
    y, _ = conv_ssd(chunk_conv_ssd, 2, 6)(*inputs, cu_seqlens=cu)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        xbc, weight, bias, dt, A, D = inputs
        y_i, _ = conv_ssd(chunk_conv_ssd, 2, 6)(xbc[:, s:e], weight, bias, dt[:, s:e], A, D)
        torch.testing.assert_close(y[:, s:e], y_i, rtol=1e-5, atol=1e-5)


def test_conv_ssd_kept_states(monkeypatch):
    """The backward from the states the forward keeps for long sequences."""
    from ttr.kernels.common import index

    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    monkeypatch.setattr(index, "KEEP_STATES_MIN_CHUNKS", 0)
    inputs, h0 = conv_inputs(130, 4, 2, 6, 5)
    check_conv(inputs, h0, 2, 6)


def test_conv_ssd_fp16(backend):
    (xbc, weight, bias, dt, A, D), h0 = conv_inputs(130, 4, 2, 16, 16)
    inputs = (xbc.half(), weight.half(), bias.half(), dt, A, D)
    check_conv(inputs, h0, 2, 16, tol=3e-3)


def saved_bytes(fn, *args, **kw):
    """Bytes of the distinct storages autograd keeps for fn's backward, besides the inputs'."""
    inputs = {a.untyped_storage().data_ptr() for a in (*args, *kw.values()) if isinstance(a, torch.Tensor)}
    kept = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in inputs:
            kept[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args, **kw)
    return sum(kept.values())


@pytest.mark.parametrize("states", ["auto", "recompute"])
@pytest.mark.parametrize("walk", [False, True], ids=["output_launch", "walk_forms_y"])
def test_what_the_backward_keeps(monkeypatch, states, walk):
    """chunk_ssd keeps x, B, C (its contiguous copies of strided views), dt and the cumulative gate
    (fp32, dt's size), not ``x dt``; chunk_conv_ssd keeps what it got (xBC read in place from the
    projection) and the cumulative gate. Both keep the chunks' ``C B^T`` (fp32 ``[NT, G, 64, 64]``)
    that the output launch read, unless ``TTR_CHUNK_STATES=recompute``; where the state walk forms y
    it reads none, and the backward forms them (``chunk.walk_forms_ssd_output``)."""
    from ttr.kernels.common.index import TUNING, prepare_chunks
    from ttr.kernels.ssd.chunk import walk_forms_ssd_output

    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    monkeypatch.setenv("TTR_CHUNK_STATES", states)
    monkeypatch.setitem(TUNING, "ssd_output", {"walk": walk})
    t, h, groups, n_state, p = 128, 4, 2, 8, 16
    assert walk_forms_ssd_output(n_state, p, prepare_chunks(None, 1, t), h, torch.device("cpu")) == walk
    width = h * p + 2 * groups * n_state
    proj = torch.randn(1, t, 10 + width, requires_grad=True)
    (_, _, _, dt, A, D), _ = conv_inputs(t, h, groups, n_state, p)
    weight, bias = torch.randn(width, 4, requires_grad=True), torch.randn(width, requires_grad=True)
    dt, A, D = (z.requires_grad_() for z in (dt, A, D))
    xbc = proj[..., 10:]
    gate = dt.numel() * 4 + (0 if states == "recompute" or walk else 2 * groups * 64 * 64 * 4)  # 2 chunks
    assert saved_bytes(chunk_conv_ssd, xbc, weight, bias, dt, A, D=D, groups=groups, state_size=n_state) == gate
    x, B, C = (z.detach().requires_grad_() for z in xbc_views(xbc, h, groups, n_state))
    copies = (x.numel() + B.numel() + C.numel()) * 4
    assert saved_bytes(chunk_ssd, x, dt, A, B, C, D=D) == copies + gate


def test_conv_ssd_errors():
    (xbc, weight, bias, dt, A, D), _ = conv_inputs(8, 4, 2, 6, 5)
    with pytest.raises(ValueError, match="xBC's last dim"):
        chunk_conv_ssd(xbc[..., 1:], weight[1:], bias[1:], dt, A, D=D, groups=2, state_size=6)
    with pytest.raises(ValueError, match="groups"):
        chunk_conv_ssd(xbc, weight, bias, dt, A, D=D, groups=0, state_size=6)
    with pytest.raises(ValueError, match="conv|weight"):
        chunk_conv_ssd(xbc, weight[:, :1], bias, dt, A, D=D, groups=2, state_size=6)
    with pytest.raises(ValueError, match="D"):
        chunk_conv_ssd(xbc, weight, bias, dt, A, D=D[:3], groups=2, state_size=6)
    x, B, C = xbc_views(xbc, 4, 2, 6)
    with pytest.raises(TypeError, match="D"):
        chunk_ssd(x, dt, A, B, C, D=D.half())
