"""Simple GLA and Mamba2 SSD (scalar decay per head): every backend against the float64 oracle.

Outputs, final states and all gradients (q, k, v, g, initial_state; x, dt, A, B, C for the
Mamba2 form with groups G < H); odd lengths, packed documents, strong decay, head dims that are
not powers of two. The "triton" backend runs the Triton kernels (interpreter on CPU, float32).
"""

import pytest
import torch

from ttr.kernels.ssd import (
    chunk_simple_gla,
    chunk_ssd,
    recurrent_simple_gla,
    recurrent_ssd,
    reference_simple_gla,
    reference_ssd,
)

from .conftest import rel_rms

TOL = 1e-4


def run(fn, inputs, h0, cu, *, upcast, **kwargs):
    leaves = [x.detach().double() if upcast else x.detach().clone() for x in inputs]
    h0 = None if h0 is None else (h0.detach().double() if upcast else h0.detach().clone())
    for x in leaves + ([h0] if h0 is not None else []):
        x.requires_grad_(True)
    o, final = fn(*leaves, initial_state=h0, output_final_state=True, cu_seqlens=cu, **kwargs)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(o.shape, generator=gen).to(o)
    dfinal = torch.randn(final.shape, generator=gen).to(final)
    ((o * do).sum() + (final * dfinal).sum()).backward()
    return o, final, [x.grad for x in leaves] + ([h0.grad] if h0 is not None else [])


def check(fn, ref, inputs, names, h0=None, cu=None, tol=TOL, tol_grad=None, **kwargs):
    o, final, grads = run(fn, inputs, h0, cu, upcast=False, **kwargs)
    o_ref, final_ref, grads_ref = run(ref, inputs, h0, cu, upcast=True, **kwargs)
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    assert rel_rms(o, o_ref) < tol, f"o: {rel_rms(o, o_ref)}"
    assert rel_rms(final, final_ref) < tol, f"final state: {rel_rms(final, final_ref)}"
    for name, a, b in zip([*names, "dh0"], grads, grads_ref):
        assert torch.isfinite(a).all(), name
        limit = (tol_grad or {}).get(name, tol)
        assert rel_rms(a, b) < limit, f"{name}: {rel_rms(a, b)}"


def gla_inputs(b, t, h, dk, dv, *, decay=1.0, h0=False, n=None):
    q, k = torch.randn(b, t, h, dk), torch.randn(b, t, h, dk)
    v = torch.randn(b, t, h, dv)
    g = -decay * torch.rand(b, t, h).clamp_min(0.02)
    return (q, k, v, g), (torch.randn(n or b, h, dk, dv) if h0 else None)


def ssd_inputs(b, t, h, groups, n_state, p, *, h0=False, n=None, dt_max=1.0):
    x = torch.randn(b, t, h, p)
    dt = dt_max * torch.rand(b, t, h).clamp_min(0.02)
    A = -torch.rand(h).clamp_min(0.1) * 2
    B, C = torch.randn(b, t, groups, n_state), torch.randn(b, t, groups, n_state)
    return (x, dt, A, B, C), (torch.randn(n or b, h, n_state, p) if h0 else None)


GLA_NAMES = ["dq", "dk", "dv", "dg"]
SSD_NAMES = ["dx", "ddt", "dA", "dB", "dC"]
# under strong decay dg is a reverse cumulative sum of nearly cancelling fp32 terms: both the
# torch and the Triton backend land at 1-2e-4 relative RMS against float64 there
STRONG_DECAY_TOL = {"dg": 5e-4}


@pytest.mark.parametrize("t", [1, 15, 63, 64, 65, 200])
def test_simple_gla_lengths(backend, t):
    inputs, h0 = gla_inputs(2, t, 2, 5, 7, h0=True)
    check(chunk_simple_gla, reference_simple_gla, inputs, GLA_NAMES, h0)


@pytest.mark.parametrize("decay", [0.05, 5.0])
def test_simple_gla_decay_ranges(backend, decay):
    inputs, h0 = gla_inputs(1, 130, 2, 16, 16, decay=decay, h0=True)
    check(chunk_simple_gla, reference_simple_gla, inputs, GLA_NAMES, h0, tol_grad=STRONG_DECAY_TOL)


def test_simple_gla_strong_decay_finite(backend):
    # T = 100: the partial last chunk reaches a cumulative gate below -88 (exp(-g) overflows fp32),
    # so padded rows must never pair with valid ones
    (q, k, v, g), h0 = gla_inputs(1, 100, 1, 8, 8, h0=True)
    g = -6.0 - 2.0 * torch.rand_like(g)  # exp(-g) over a chunk would be exp(400+)
    check(chunk_simple_gla, reference_simple_gla, (q, k, v, g), GLA_NAMES, h0, tol_grad=STRONG_DECAY_TOL)


def test_simple_gla_packed_and_scale(backend):
    lengths = [1, 63, 64, 130]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    inputs, h0 = gla_inputs(1, sum(lengths), 2, 6, 5, h0=True, n=len(lengths))
    check(chunk_simple_gla, reference_simple_gla, inputs, GLA_NAMES, h0, cu, scale=0.7)


@pytest.mark.parametrize("t", [1, 63, 65, 200])
@pytest.mark.parametrize("groups", [1, 2])
def test_ssd(backend, t, groups):
    inputs, h0 = ssd_inputs(1, t, 4, groups, 6, 5, h0=True)
    check(chunk_ssd, reference_ssd, inputs, SSD_NAMES, h0)


def test_ssd_packed_no_initial_state(backend):
    lengths = [1, 63, 64, 130]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    inputs, _ = ssd_inputs(1, sum(lengths), 4, 2, 8, 6)
    check(chunk_ssd, reference_ssd, inputs, SSD_NAMES, None, cu)
    o, f = chunk_ssd(*inputs, output_final_state=True, cu_seqlens=cu)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        x, dt, A, B, C = inputs
        o_i, f_i = chunk_ssd(x[:, s:e], dt[:, s:e], A, B[:, s:e], C[:, s:e], output_final_state=True)
        torch.testing.assert_close(o[:, s:e], o_i, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(f[i : i + 1], f_i, rtol=1e-5, atol=1e-5)


def test_ssd_is_simple_gla_with_mamba2_map():
    # y_t = S_t^T C_t with S_t = exp(dt A) S + B (dt x)^T, written out by hand for one head
    (x, dt, A, B, C), _ = ssd_inputs(1, 9, 2, 1, 3, 4)
    x, dt, A, B, C = (y.double() for y in (x, dt, A, B, C))
    y, _ = reference_ssd(x, dt, A, B, C)
    for i_h in range(2):
        state = torch.zeros(3, 4, dtype=torch.float64)
        for t in range(9):
            state = torch.exp(dt[0, t, i_h] * A[i_h]) * state + torch.outer(B[0, t, 0], dt[0, t, i_h] * x[0, t, i_h])
            torch.testing.assert_close(y[0, t, i_h], state.T @ C[0, t, 0])


def test_recurrent_matches_chunk(backend):
    (q, k, v, g), h0 = gla_inputs(2, 12, 2, 5, 7, h0=True)
    o, f = chunk_simple_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    state, outs = h0, []
    for i in range(12):
        sl = slice(i, i + 1)
        o_i, state = recurrent_simple_gla(
            q[:, sl], k[:, sl], v[:, sl], g[:, sl], initial_state=state, output_final_state=True
        )
        outs.append(o_i)
    assert rel_rms(torch.cat(outs, 1), o) < TOL and rel_rms(state, f) < TOL
    (x, dt, A, B, C), h0 = ssd_inputs(1, 12, 4, 2, 6, 5, h0=True)
    y, f = chunk_ssd(x, dt, A, B, C, initial_state=h0, output_final_state=True)
    y_r, f_r = recurrent_ssd(x, dt, A, B, C, initial_state=h0, output_final_state=True)
    assert rel_rms(y_r, y) < TOL and rel_rms(f_r, f) < TOL


def test_errors():
    (x, dt, A, B, C), h0 = ssd_inputs(1, 8, 4, 2, 6, 5, h0=True)
    with pytest.raises(ValueError, match="groups"):
        chunk_ssd(x, dt, A, B[:, :, :1].expand(1, 8, 3, 6), C[:, :, :1].expand(1, 8, 3, 6))
    with pytest.raises(ValueError, match="A"):
        chunk_ssd(x, dt, A[:2], B, C)
    with pytest.raises(TypeError, match="dt"):
        chunk_ssd(x, dt.half(), A, B, C)
    with pytest.raises(ValueError, match="dt"):
        chunk_ssd(x, dt[:, :4], A, B, C)
    with pytest.raises(ValueError, match="C"):
        chunk_ssd(x, dt, A, B, C[:, :4])
    with pytest.raises(TypeError, match="B"):
        chunk_ssd(x, dt, A, B.half(), C)
    with pytest.raises(ValueError, match="initial_state"):
        chunk_ssd(x, dt, A, B, C, initial_state=h0[:, :2])
    (q, k, v, g), _ = gla_inputs(2, 8, 2, 4, 4)
    with pytest.raises(ValueError, match="g"):
        chunk_simple_gla(q, k, v, g[..., None].expand(2, 8, 2, 4))
    with pytest.raises(ValueError, match="v"):
        chunk_simple_gla(q, k, v[:, :3], g)
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_simple_gla(q, k, v, g, cu_seqlens=torch.tensor([0, 8]))


def test_fp16(backend):
    # fp16 x/B/C exercise the kernels' casts (the interpreter cannot load bf16)
    (x, dt, A, B, C), h0 = ssd_inputs(1, 130, 4, 2, 16, 16, h0=True)
    x, B, C = x.half(), B.half(), C.half()
    y, final, grads = run(chunk_ssd, (x, dt, A, B, C), h0, None, upcast=False)
    y_ref, final_ref, grads_ref = run(reference_ssd, (x, dt, A, B, C), h0, None, upcast=True)
    assert y.dtype == torch.float16 and final.dtype == torch.float32
    for a, b in zip([y, final, *grads], [y_ref, final_ref, *grads_ref]):
        assert rel_rms(a, b) < 2e-3


@pytest.mark.parametrize("packed", [False, True])
def test_kept_states_match_oracle(monkeypatch, packed):
    """The backward from the states kept by the forward, as for long sequences, instead of
    recomputed (simple GLA and SSD share the autograd Function)."""
    from ttr.kernels.common import index

    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    monkeypatch.setattr(index, "KEEP_STATES_MIN_CHUNKS", 0)
    lengths = [1, 63, 130] if packed else [130]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32) if packed else None
    inputs, h0 = gla_inputs(1, sum(lengths), 2, 6, 5, h0=True, n=len(lengths))
    check(chunk_simple_gla, reference_simple_gla, inputs, GLA_NAMES, h0, cu)
    inputs, h0 = ssd_inputs(1, sum(lengths), 4, 2, 6, 5, h0=True, n=len(lengths))
    check(chunk_ssd, reference_ssd, inputs, SSD_NAMES, h0, cu)


def test_kept_scores_give_the_same_bits(monkeypatch):
    """The backward from the forward's kept ``C B^T`` (``auto``) and from one formed again
    (``TTR_CHUNK_STATES=recompute``) give the same outputs and gradients bit for bit, packed."""
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    lengths = [1, 63, 130]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    inputs, h0 = ssd_inputs(1, sum(lengths), 4, 2, 6, 5, h0=True, n=len(lengths))
    results = []
    for states in ("auto", "recompute"):
        monkeypatch.setenv("TTR_CHUNK_STATES", states)
        o, final, grads = run(chunk_ssd, inputs, h0, cu, upcast=False)
        results.append([o, final, *grads])
    for name, a, b in zip(["o", "final", *SSD_NAMES, "dh0"], *results):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("p", [5, 64, 130])
def test_ssd_head_dims_through_fused_map(monkeypatch, p):
    """Mamba2's map inside chunk_ssd's one autograd node (``v = x dt`` and ``ddt`` in the row
    kernels, ``A dt`` in the chunk cumsum, group broadcasts and sums) against the oracle, for head
    dims below, at and above one row block; every input's gradient, dA and dB/dC group sums included."""
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    inputs, h0 = ssd_inputs(1, 37, 4, 2, 6, p, h0=True, n=1)
    check(chunk_ssd, reference_ssd, inputs, SSD_NAMES, h0, None)
