"""Causal depthwise short conv: every backend against the float64 per-token oracle.

Outputs, final states and the grads of x, weight, bias and initial_state; widths 2..4, odd
lengths, packed documents (lengths 1, 3, 64, 130 and an empty one), the decoding update step
against the full conv. The "triton" backend runs the Triton kernels (interpreter on CPU, fp32).
"""

import pytest
import torch

from ttr.kernels.common.index import TUNING
from ttr.kernels.conv import causal_conv1d, causal_conv1d_update, conv_bwd, conv_fwd, reference_causal_conv1d
from ttr.kernels.conv_backward import wave_segment

from .conftest import DEVICE, rel_rms

TOL = 1e-4


def fenced(t: torch.Tensor, pad: int = 256) -> torch.Tensor:
    """A leaf copy of t inside a buffer of NaN: a kernel that reads past t's ends, even where it
    then discards what it read, turns some result non-finite."""
    buf = torch.full((t.numel() + 2 * pad,), float("nan"), device=t.device, dtype=t.dtype)
    buf[pad : pad + t.numel()] = t.reshape(-1)
    return buf[pad : pad + t.numel()].view(t.shape)


def run(fn, x, weight, bias, h0, *, upcast, leaf=None, **kw):
    """fn's outputs and the gradients of its inputs; ``leaf`` makes each input's copy (a fresh
    clone, float64 with ``upcast``)."""
    cast = leaf or ((lambda t: t.detach().double()) if upcast else (lambda t: t.detach().clone()))
    leaves = [cast(t).requires_grad_() if t is not None else None for t in (x, weight, bias, h0)]
    y, final = fn(leaves[0], leaves[1], leaves[2], initial_state=leaves[3], output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(1)
    dy = torch.randn(y.shape, generator=gen).to(y)
    dfinal = torch.randn(final.shape, generator=gen).to(final)
    ((y * dy).sum() + (final * dfinal).sum()).backward()
    return y, final, [t.grad if t is not None else None for t in leaves]


def check(x, weight, bias=None, h0=None, tol=TOL, leaf=None, **kw):
    y, final, grads = run(causal_conv1d, x, weight, bias, h0, upcast=False, leaf=leaf, **kw)
    y_ref, final_ref, grads_ref = run(reference_causal_conv1d, x, weight, bias, h0, upcast=True, **kw)
    assert y.dtype == x.dtype and final.dtype == x.dtype
    assert torch.isfinite(y).all()
    assert rel_rms(y, y_ref) < tol, f"y: {rel_rms(y, y_ref)}"
    assert rel_rms(final, final_ref) < tol, f"final state: {rel_rms(final, final_ref)}"
    for name, a, b in zip(["dx", "dweight", "dbias", "dinitial_state"], grads, grads_ref):
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == {"dx": x, "dweight": weight, "dbias": bias, "dinitial_state": h0}[name].dtype, name
        assert torch.isfinite(a).all(), name
        assert rel_rms(a, b) < tol, f"{name}: {rel_rms(a, b)}"


def make(b, t, d, w, n=None, dtype=torch.float32):
    x = torch.randn(b, t, d, device=DEVICE, dtype=dtype)
    weight = torch.randn(d, w, device=DEVICE, dtype=dtype) / w**0.5
    bias = torch.randn(d, device=DEVICE, dtype=dtype)
    h0 = torch.randn(n or b, d, w - 1, device=DEVICE, dtype=dtype)
    return x, weight, bias, h0


@pytest.mark.parametrize("t", [1, 15, 64, 65, 200])
@pytest.mark.parametrize("w", [2, 3, 4])
def test_conv_silu_bias_states(backend, t, w):
    x, weight, bias, h0 = make(2, t, 40, w)
    check(x, weight, bias, h0, activation="silu")


@pytest.mark.parametrize("w", [2, 4])
def test_conv_plain_no_state(backend, w):
    x, weight, _, _ = make(2, 65, 24, w)
    check(x, weight)


@pytest.mark.parametrize("w", [2, 3, 4])
@pytest.mark.parametrize("h0", [False, True])
def test_conv_packed(backend, w, h0):
    lens = [1, 3, 64, 0, 130]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=DEVICE, dtype=torch.int32)
    x, weight, bias, state = make(1, sum(lens), 33, w, n=len(lens))
    check(x, weight, bias, state if h0 else None, activation="silu", cu_seqlens=cu)


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_conv_backward_small_blocks(backend, monkeypatch, activation, with_bias):
    """The forward in blocks of 16 tokens by 16 channels, the backward in walks of 7 tokens by 16
    channels (``index.TUNING``): packed documents shorter than W and
    across walk edges, 40 channels (a partial block), initial states and the final state's
    gradient; the walk's carried gradients stop at every document's end and start again at each
    walk's edge, its taps read the state before every start, and its per-walk dw partial sums are
    reduced over many walks."""
    monkeypatch.setitem(TUNING, "conv_fwd", {"BT": 16, "BD": 16})
    monkeypatch.setitem(TUNING, "conv_bwd", {"SEG": 7, "BD": 16})
    lens = [2, 17, 1, 0, 3, 30, 4, 14]  # T = 71, not a multiple of the block
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=DEVICE, dtype=torch.int32)
    x, weight, bias, h0 = make(1, sum(lens), 40, 4, n=len(lens))
    check(x, weight, bias if with_bias else None, h0, activation=activation, cu_seqlens=cu)


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("group", [8, 16, 12, 48])
@pytest.mark.parametrize("packed", [False, True])
def test_conv_l2_groups(backend, activation, group, packed):
    """Output normed per run of ``group`` channels: fused in the kernels for powers of 2 (blocks of
    whole groups), after the conv for 12 and 48; every gradient through the norm's backward."""
    lens = [2, 17, 1, 0, 3, 30] if packed else [33]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=DEVICE, dtype=torch.int32)
    x, weight, bias, h0 = make(1 if packed else 2, sum(lens), 48, 4, n=len(lens) if packed else None)
    check(x, weight, bias, h0, activation=activation, cu_seqlens=cu if packed else None, l2_group=group)


def test_conv_l2_group_wider_than_the_block(backend, monkeypatch):
    """A tuned block narrower than the group still holds whole groups."""
    monkeypatch.setitem(TUNING, "conv_fwd", {"BT": 16, "BD": 16})
    monkeypatch.setitem(TUNING, "conv_bwd", {"SEG": 8, "BD": 16})
    x, weight, bias, h0 = make(2, 37, 64, 4)
    check(x, weight, bias, h0, activation="silu", l2_group=32)


def test_conv_fwd_keeps_each_groups_inverse_norm():
    """With a norm the Triton forward also returns each group's 1/norm, which the backward takes in
    place of summing the group's squares again; without it none, and the backward refuses a norm
    without it."""
    x, weight, bias, _ = make(2, 21, 48, 4)
    y, rstd = conv_fwd(x, weight, bias, None, "silu", None, l2=16, l2_eps=1e-6)
    u, _ = reference_causal_conv1d(x.double(), weight.double(), bias.double(), activation="silu")
    want = (u.unflatten(-1, (3, 16)).square().sum(-1) + 1e-6).rsqrt()
    assert rstd.shape == (2, 21, 3) and rstd.dtype == torch.float32
    assert rel_rms(rstd, want) < 1e-5
    assert conv_fwd(x, weight, bias, None, "silu", None)[1] is None
    with pytest.raises(ValueError, match="rstd"):
        conv_bwd(x, weight, bias, None, torch.ones_like(y), None, "silu", None, l2=16)


def test_wave_segment_fills_whole_waves():
    """Walks sized so that rows x walks per row fill the waves that walks of 256 tokens would
    round to: the presets' 128 rows of 4096 tokens on 132 SMs."""
    for per_sm, seg in ((16, 256), (12, 344), (14, 296)):
        got = wave_segment(4096, 128, per_sm * 132)
        assert got == seg and got % 4 == 0
        assert 128 * -(-4096 // got) <= per_sm * 132
    # xBC's 272 rows: 2.06 waves of 256-token walks round to two, filled by walks of 276
    assert wave_segment(4096, 272, 16 * 132) == 276
    assert 272 * -(-4096 // 276) <= 2 * 16 * 132
    # a short input takes at least ``least`` tokens per walk; a long one fills the waves it rounds to
    assert wave_segment(100, 16, 2112) == 64
    t = 1 << 20
    waves = round(16 * t / 256 / 2112)
    assert 16 * -(-t // wave_segment(t, 16, 2112)) <= waves * 2112


@pytest.mark.parametrize("l2", [0, 16])
def test_walks_sized_by_resident_programs_equal_fixed_walks(monkeypatch, l2):
    """The GPU launcher's path (``SEG`` None) run under the interpreter: the walk length comes from
    ``resident_programs`` (here a stand-in holding 4 walks per SM on two SMs) through
    ``wave_segment`` (its compile arguments handed over as a callable, asked once per call here),
    and dx, dw and db equal those of walks of a fixed length."""
    from ttr.kernels import conv_backward

    asked = []

    def resident(kernel, key, args, **consts):
        asked.append(key)
        assert kernel is conv_backward._conv_bwd_kernel and len(args()) == 20 and consts["L2"] == l2
        return 4

    monkeypatch.setattr(conv_backward, "resident_programs", resident)
    monkeypatch.setattr(conv_backward, "sm_count", lambda device: 2)
    x, weight, bias, _ = make(2, 150, 32, 4)
    y, rstd = conv_fwd(x, weight, bias, None, "silu", None, l2=l2)
    dy = torch.randn_like(y)
    out = {}
    for name, seg in (("sized", None), ("fixed", 7)):
        monkeypatch.setitem(TUNING, "conv_bwd", {"SEG": seg, "BD": 16})
        out[name] = conv_bwd(x, weight, bias, None, dy, None, "silu", None, l2, rstd)
    assert len(asked) == 1 and wave_segment(150, 4, 8) == 76  # 2 x 2 rows of 16 channels: two walks each
    for a, b in zip(out["sized"][:3], out["fixed"][:3]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

def test_conv_l2_rows_have_unit_norm(backend):
    x, weight, bias, _ = make(2, 9, 32, 3)
    y, _ = causal_conv1d(x, weight, bias, activation="silu", l2_group=16)
    norms = y.unflatten(-1, (2, 16)).norm(dim=-1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-4)


@pytest.mark.parametrize("packed", [False, True])
def test_conv_reads_a_column_slice_in_place(backend, packed):
    """x a column slice of a wider projection (Mamba2's xBC): same result as a contiguous x, the
    projection itself is what the backward keeps (no copy), and its gradient is the oracle's."""
    b, t = (1, 131) if packed else (2, 70)
    proj = torch.randn(b, t, 100, device=DEVICE, requires_grad=True)
    _, weight, bias, _ = make(1, 1, 37, 4)
    cu = torch.tensor([0, 1, 65, t], device=DEVICE, dtype=torch.int32) if packed else None
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda s: saved.append(s) or s, lambda s: s):
        y, _ = causal_conv1d(proj[..., 50:87], weight, bias, activation="silu", cu_seqlens=cu)
    if backend == "triton":
        assert proj.untyped_storage().data_ptr() in {s.untyped_storage().data_ptr() for s in saved}
    dy = torch.randn_like(y)
    y.backward(dy)
    p64 = proj.detach().double().requires_grad_()
    y64, _ = reference_causal_conv1d(
        p64[..., 50:87], weight.double(), bias.double(), activation="silu", cu_seqlens=cu
    )
    y64.backward(dy.double())
    assert rel_rms(y, y64) < TOL and rel_rms(proj.grad, p64.grad) < TOL


def test_packed_equals_separate(backend):
    lens = [3, 64, 1, 50]
    x, weight, bias, h0 = make(1, sum(lens), 16, 4, n=len(lens))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=DEVICE)
    y, final = causal_conv1d(
        x, weight, bias, activation="silu", cu_seqlens=cu, initial_state=h0, output_final_state=True
    )
    for i, (a, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        y_i, f_i = causal_conv1d(
            x[:, a:e], weight, bias, activation="silu", initial_state=h0[i : i + 1], output_final_state=True
        )
        assert rel_rms(y[:, a:e], y_i) < TOL
        assert torch.equal(final[i : i + 1], f_i)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("w", [2, 3, 4])
def test_conv_reads_nothing_outside_its_inputs(backend, w, packed):
    """x, weight, bias and the initial state fenced by NaN: every output and gradient stays the
    oracle's. (The backward walk once read the state's slots of the tokens before a row's first
    token: one element before the tensor, a fault when that address is not mapped.)"""
    b, t, lens = (1, 70, [5, 1, 40, 24]) if packed else (2, 70, None)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=DEVICE, dtype=torch.int32) if lens else None
    x, weight, bias, h0 = make(b, t, 24, w, n=len(lens) if lens else None)
    check(x, weight, bias, h0, leaf=fenced, activation="silu", cu_seqlens=cu)


@pytest.mark.parametrize("w", [2, 3, 4])
def test_update_matches_full_conv(backend, w):
    x, weight, bias, h0 = make(3, 9, 20, w)
    y_ref, final_ref = reference_causal_conv1d(
        x, weight, bias, activation="silu", initial_state=h0, output_final_state=True
    )
    state, ys = h0.clone(), []
    for i in range(x.shape[1]):
        y_t, state = causal_conv1d_update(x[:, i], state, weight, bias, activation="silu")
        ys.append(y_t)
    assert rel_rms(torch.stack(ys, 1), y_ref) < TOL
    assert torch.equal(state, final_ref)


def test_update_with_l2_groups_matches_full_conv(backend):
    """The decoding step with the q/k head norm gives the full conv's normalised rows."""
    x, weight, bias, h0 = make(2, 5, 32, 4)
    y_ref, _ = reference_causal_conv1d(x, weight, bias, activation="silu", initial_state=h0, l2_group=8)
    state, ys = h0.clone(), []
    for i in range(x.shape[1]):
        y_t, state = causal_conv1d_update(x[:, i], state, weight, bias, activation="silu", l2_group=8)
        ys.append(y_t)
    assert rel_rms(torch.stack(ys, 1), y_ref) < TOL
    with pytest.raises(ValueError, match="l2_group"):
        causal_conv1d_update(x[:, 0], h0, weight, l2_group=5)


def test_update_does_not_modify_state(backend):
    x, weight, _, h0 = make(2, 1, 8, 3)
    kept = h0.clone()
    causal_conv1d_update(x[:, 0], h0, weight)
    assert torch.equal(h0, kept)


def test_final_state_of_short_sequence_keeps_initial_state():
    x, weight, _, h0 = make(1, 1, 4, 4)
    _, final = causal_conv1d(x, weight, initial_state=h0, output_final_state=True)
    assert torch.equal(final[0, :, :2], h0[0, :, 1:])
    assert torch.equal(final[0, :, 2], x[0, 0])
    _, final = causal_conv1d(x, weight, output_final_state=True)
    assert torch.equal(final[0, :, :2], torch.zeros_like(final[0, :, :2]))


def test_bad_inputs():
    x, weight, bias, h0 = make(2, 5, 8, 3)
    with pytest.raises(ValueError, match="W must be in 2..4"):
        causal_conv1d(x, torch.randn(8, 5))
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(x, torch.randn(7, 3))
    with pytest.raises(ValueError, match="x must have shape"):
        causal_conv1d(x[0], weight)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, weight, activation="relu")
    with pytest.raises(ValueError, match="initial_state"):
        causal_conv1d(x, weight, initial_state=h0[:1])
    with pytest.raises(ValueError, match="bias"):
        causal_conv1d(x, weight, torch.randn(3))
    with pytest.raises(ValueError, match="batch size 1"):
        causal_conv1d(x, weight, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_update(x[:, 0], h0[:, :, :1], weight)
    with pytest.raises(TypeError, match="x"):
        causal_conv1d(x.long(), weight)
    for group in (3, 0, True, 2.0):
        with pytest.raises(ValueError, match="l2_group"):
            causal_conv1d(x, weight, l2_group=group)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("w", [2, 4])
def test_conv_gpu(monkeypatch, dtype, w):
    """Triton at real sizes against the torch backend in float64 (itself checked against the oracle)."""
    tol = 5e-3 if dtype == torch.float32 else 1e-2
    lens = [1, 3, 1000, 4096, 2092]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=DEVICE, dtype=torch.int32)
    for kw, b in (({}, 2), ({"cu_seqlens": cu}, 1)):
        x, weight, bias, h0 = make(b, sum(lens), 2048, w, n=b if not kw else len(lens), dtype=dtype)
        monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
        y, final, grads = run(causal_conv1d, x, weight, bias, h0, upcast=False, activation="silu", **kw)
        monkeypatch.setenv("TTR_KERNEL_BACKEND", "torch")
        y_ref, final_ref, grads_ref = run(
            causal_conv1d, x, weight, bias, h0, upcast=True, activation="silu", **kw
        )
        assert rel_rms(y, y_ref) < tol
        assert torch.equal(final.double(), final_ref)
        for name, a, r in zip(["dx", "dweight", "dbias", "dinitial_state"], grads, grads_ref):
            assert rel_rms(a, r) < tol, f"{name}: {rel_rms(a, r)}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True])
def test_conv_l2_gpu(monkeypatch, dtype, packed):
    """The fused per-head L2 norm of the delta rules' q and k (128 channels) at a real size, packed
    and in a batch."""
    tol = 5e-3 if dtype == torch.float32 else 1e-2
    lens = [1, 3, 1000, 4096, 2092]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=DEVICE, dtype=torch.int32)
    b, n = (1, len(lens)) if packed else (2, None)
    x, weight, bias, h0 = make(b, sum(lens), 2048, 4, n=n, dtype=dtype)
    out = {}
    for backend, upcast in (("triton", False), ("torch", True)):
        monkeypatch.setenv("TTR_KERNEL_BACKEND", backend)
        out[backend] = run(causal_conv1d, x, weight, None, h0, upcast=upcast, activation="silu",
                           cu_seqlens=cu if packed else None, l2_group=128)
    (y, _, grads), (y_ref, _, grads_ref) = out["triton"], out["torch"]
    assert rel_rms(y, y_ref) < tol
    for name, a, r in zip(["dx", "dweight", "dbias", "dinitial_state"], grads, grads_ref):
        assert (a is None) == (r is None), name
        assert a is None or rel_rms(a, r) < tol, f"{name}: {rel_rms(a, r)}"


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("l2", [0, 128])
def test_gpu_walks_filling_whole_waves_equal_fixed_walks(monkeypatch, packed, l2):
    """The backward's default walks (sized by the compiled kernel's programs per SM to fill whole
    waves) give dx bit for bit as walks of 256 tokens do, and dw to fp32 rounding (the per-walk
    partial sums are cut elsewhere); the walks fill at most the waves they round to."""
    from ttr.kernels.common.index import prepare_packing, sm_count
    from ttr.kernels.utils import _RESIDENT

    b, t = (1, 16384) if packed else (4, 4096)
    x = torch.randn(b, t, 6144, device=DEVICE, dtype=torch.bfloat16)[..., :2048]
    weight = torch.randn(2048, 4, device=DEVICE) / 2
    dy = torch.randn(b, t, 2048, device=DEVICE, dtype=torch.bfloat16)
    pk = prepare_packing(torch.tensor([0, 5, 3000, 9000, t], device=DEVICE, dtype=torch.int32), t) if packed else None
    _, rstd = conv_fwd(x, weight, None, None, "silu", pk, l2)
    out = {}
    for name, cfg in (("waves", {}), ("fixed", {"SEG": 256})):
        monkeypatch.setitem(TUNING, "conv_bwd", cfg)
        out[name] = conv_bwd(x, weight, None, None, dy, None, "silu", pk, l2, rstd)
    assert torch.equal(out["waves"][0], out["fixed"][0])
    assert rel_rms(out["waves"][1], out["fixed"][1]) < 1e-5
    per_sm = [v for k, v in _RESIDENT.items() if "conv_bwd" in k and ("L2", l2) in k and ("IS_VARLEN", packed) in k]
    assert per_sm and 1 <= per_sm[0] <= 32
    seg = wave_segment(t, b * 16, per_sm[0] * sm_count(x.device))
    waves = max(1, round(b * 16 * -(-t // 256) / (per_sm[0] * sm_count(x.device))))
    assert b * 16 * -(-t // seg) <= waves * per_sm[0] * sm_count(x.device)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_gpu(monkeypatch, dtype):
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    x, weight, bias, h0 = make(8, 5, 4096, 4, dtype=dtype)
    y_ref, final_ref = causal_conv1d(
        x, weight, bias, activation="silu", initial_state=h0, output_final_state=True
    )
    state, ys = h0, []
    for i in range(x.shape[1]):
        y_t, state = causal_conv1d_update(x[:, i], state, weight, bias, activation="silu")
        ys.append(y_t)
    assert rel_rms(torch.stack(ys, 1), y_ref) < (1e-2 if dtype != torch.float32 else 1e-5)
    assert torch.equal(state, final_ref)
