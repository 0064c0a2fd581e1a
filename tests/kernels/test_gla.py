"""GLA (per-key vector gate): every backend against the float64 per-token oracle.

Outputs, final states and the gradients of q, k, v, g and initial_state; odd lengths, packed
documents, strong decay, head dims that are not powers of two. The "triton" backend runs the
Triton kernels (under the interpreter on CPU, in float32).
"""

import pytest
import torch

from ttr.kernels.gla import chunk_gla, recurrent_gla, reference_gla

from .conftest import rel_rms

TOL = 1e-4


def make_inputs(b, t, h, dk, dv, *, decay=1.0, h0=False, n=None, device="cpu", dtype=torch.float32):
    q = torch.randn(b, t, h, dk, device=device, dtype=dtype)
    k = torch.randn(b, t, h, dk, device=device, dtype=dtype)
    v = torch.randn(b, t, h, dv, device=device, dtype=dtype)
    # log gates in [-decay, 0): decay 5 is "strong" (exp(-5) per token)
    g = -decay * torch.rand(b, t, h, dk, device=device).clamp_min(0.02)
    state = torch.randn(n or b, h, dk, dv, device=device) if h0 else None
    return q, k, v, g, state


def run(fn, q, k, v, g, h0, cu, *, upcast):
    leaves = [x.detach().double() if upcast else x.detach().clone() for x in (q, k, v, g)]
    h0 = None if h0 is None else (h0.detach().double() if upcast else h0.detach().clone())
    for x in leaves + ([h0] if h0 is not None else []):
        x.requires_grad_(True)
    o, final = fn(*leaves, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(o.shape, generator=gen).to(o)
    dfinal = torch.randn(final.shape, generator=gen).to(final)
    ((o * do).sum() + (final * dfinal).sum()).backward()
    grads = [x.grad for x in leaves] + ([h0.grad] if h0 is not None else [])
    return o, final, grads


def check(fn, ref, q, k, v, g, h0=None, cu=None, tol=TOL, tol_dg=TOL):
    o, final, grads = run(fn, q, k, v, g, h0, cu, upcast=False)
    o_ref, final_ref, grads_ref = run(ref, q, k, v, g, h0, cu, upcast=True)
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    assert rel_rms(o, o_ref) < tol, f"o: {rel_rms(o, o_ref)}"
    assert rel_rms(final, final_ref) < tol, f"final state: {rel_rms(final, final_ref)}"
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dh0"], grads, grads_ref):
        assert torch.isfinite(a).all(), name
        limit = tol_dg if name == "dg" else tol
        assert rel_rms(a, b) < limit, f"{name}: {rel_rms(a, b)}"


@pytest.mark.parametrize("t", [1, 15, 63, 64, 65, 200])
def test_lengths(backend, t):
    check(chunk_gla, reference_gla, *make_inputs(2, t, 2, 5, 7, h0=True))


@pytest.mark.parametrize("decay", [0.05, 5.0])
def test_decay_ranges(backend, decay):
    check(chunk_gla, reference_gla, *make_inputs(1, 130, 2, 16, 16, decay=decay, h0=True))


def test_strong_decay_is_finite(backend):
    # g ~ -8 per token: exp(-g) over a 64-token chunk would be exp(512), far beyond fp32
    q, k, v, g, h0 = make_inputs(1, 128, 1, 8, 8, decay=8.0, h0=True)
    g = g.clamp_max(-6.0)
    # dg is a reverse cumulative sum of terms that cancel; fp32 loses a little more there
    check(chunk_gla, reference_gla, q, k, v, g, h0, tol_dg=5e-4)


def test_packed(backend):
    lengths = [1, 63, 0, 64, 130]  # an empty document passes its initial state through
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v, g, h0 = make_inputs(1, sum(lengths), 2, 6, 5, h0=True, n=len(lengths))
    check(chunk_gla, reference_gla, q, k, v, g, h0, cu)
    # packed == each document alone
    o, f = chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_i, f_i = chunk_gla(
            q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], initial_state=h0[i : i + 1], output_final_state=True
        )
        torch.testing.assert_close(o[:, s:e], o_i, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(f[i : i + 1], f_i, rtol=1e-5, atol=1e-5)


def test_no_initial_state_and_scale(backend):
    q, k, v, g, _ = make_inputs(2, 70, 2, 5, 7)
    o, f = chunk_gla(q, k, v, g, scale=0.3)
    o_ref, _ = reference_gla(q.double(), k.double(), v.double(), g.double(), scale=0.3)
    assert f is None
    assert rel_rms(o, o_ref) < TOL


def test_recurrent_matches_chunk(backend):
    q, k, v, g, h0 = make_inputs(2, 20, 2, 5, 7, h0=True)
    o, f = chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    state, outs = h0, []
    for i in range(20):
        sl = slice(i, i + 1)
        o_i, state = recurrent_gla(q[:, sl], k[:, sl], v[:, sl], g[:, sl], initial_state=state, output_final_state=True)
        outs.append(o_i)
    assert rel_rms(torch.cat(outs, 1), o) < TOL
    assert rel_rms(state, f) < TOL


def test_errors(monkeypatch):
    q, k, v, g, h0 = make_inputs(2, 8, 2, 4, 4, h0=True)
    with pytest.raises(ValueError, match="g"):
        chunk_gla(q, k, v, g[..., 0])
    with pytest.raises(TypeError, match="g"):
        chunk_gla(q, k, v, g.half())
    with pytest.raises(ValueError, match="k"):
        chunk_gla(q, k[:, :4], v, g)
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_gla(q, k, v, g, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_gla(q[:1], k[:1], v[:1], g[:1], cu_seqlens=torch.tensor([0, 5, 7]))
    with pytest.raises(ValueError, match="initial_state"):
        chunk_gla(q, k, v, g, initial_state=h0[:1])
    with pytest.raises(ValueError, match="head dim"):
        big = torch.randn(1, 2, 1, 300)
        chunk_gla(big, big, big, -torch.rand(1, 2, 1, 300))
    with pytest.raises(TypeError, match="dtype"):
        chunk_gla(q.int(), k.int(), v.int(), g)
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "cuda")
    with pytest.raises(ValueError, match="TTR_KERNEL_BACKEND"):
        chunk_gla(q, k, v, g)


def test_recurrent_packed(backend):
    cu = torch.tensor([0, 1, 1, 5, 12], dtype=torch.int32)
    q, k, v, g, h0 = make_inputs(1, 12, 2, 5, 7, h0=True, n=4)
    o, f = recurrent_gla(q, k, v, g, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    o_ref, f_ref = reference_gla(*(x.double() for x in (q, k, v, g)), initial_state=h0.double(),
                                 output_final_state=True, cu_seqlens=cu)
    assert rel_rms(o, o_ref) < TOL and rel_rms(f, f_ref) < TOL


def test_fp16(backend):
    # fp16 q/k/v exercise the kernels' casts (the interpreter cannot load bf16); grads in input dtypes
    q, k, v, g, h0 = make_inputs(1, 130, 2, 16, 16, h0=True)
    q, k, v = (x.half() for x in (q, k, v))
    o, final, grads = run(chunk_gla, q, k, v, g, h0, None, upcast=False)
    o_ref, final_ref, grads_ref = run(reference_gla, q, k, v, g, h0, None, upcast=True)
    assert o.dtype == torch.float16 and final.dtype == torch.float32
    assert [x.dtype for x in grads] == [torch.float16] * 3 + [torch.float32] * 2
    for a, b in zip([o, final, *grads], [o_ref, final_ref, *grads_ref]):
        assert rel_rms(a, b) < 2e-3


def test_autocast_does_not_change_numerics(backend):
    q, k, v, g, h0 = make_inputs(1, 70, 2, 8, 8, h0=True)
    o, f = chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o_ac, f_ac = chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o_ac, o)
    torch.testing.assert_close(f_ac, f)


def test_non_contiguous_inputs(backend):
    # views as a layer produces them: q, k, v split from one projection, a transposed state
    qkv = torch.randn(1, 70, 2, 3 * 8)
    q, k, v = qkv.split(8, dim=-1)
    g = -torch.rand(1, 70, 2, 8)
    h0 = torch.randn(1, 2, 8, 8).transpose(-1, -2)
    check(chunk_gla, reference_gla, q, k, v, g, h0)


def test_packed_strong_decay_partial_chunks(backend):
    """Packed documents whose chunks end part-way, under strong per-key decay: the diagonal
    sub-blocks' per-token loop must mask padded tokens before the exponential."""
    lengths = [1, 37, 64, 90]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v, g, h0 = make_inputs(1, sum(lengths), 2, 20, 8, decay=8.0, h0=True, n=len(lengths))
    check(chunk_gla, reference_gla, q, k, v, g.clamp_max(-4.0), h0, cu, tol_dg=5e-4)
