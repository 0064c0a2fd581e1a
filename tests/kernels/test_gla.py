"""GLA (per-key vector gate): every backend against the float64 per-token oracle.

Outputs, final states and the gradients of q, k, v, g and initial_state; odd lengths, packed
documents, strong decay, head dims that are not powers of two. The "triton" backend runs the
Triton kernels (under the interpreter on CPU, in float32).
"""

import pytest
import torch
import torch.nn.functional as F

from ttr.kernels.common import intra_vector_gate
from ttr.kernels.common.index import TUNING
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


# The diagonal 16 x 16 sub-blocks of the intra-chunk stage (kernels/common/intra_vector_gate.py) take
# a tensor-core product when the sub-chunk's gate span is <= SAFE_SPAN, per K block, and the
# per-token loop otherwise. These tests fix which path runs and check both against the oracle.


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")


def diagonal_paths(g, cu, bk):
    """The path ("dot" or "loop") of every diagonal sub-block, one tuple over the K blocks per
    (sub-chunk, head), as the kernels choose it: the span ``G_first - G_last valid`` of the
    chunk-local cumulative gate within the sub-chunk (= minus the sum of the later gates)."""
    b, t, h, dk = g.shape
    bounds = [i * t for i in range(b + 1)] if cu is None else cu.tolist()
    flat = g.reshape(b * t, h, dk)
    paths = set()
    for s, e in zip(bounds[:-1], bounds[1:]):
        for u in range(s, e, 16):  # chunks of 64 start at s, so every sub-chunk starts at s + 16n
            span = -flat[u + 1 : min(u + 16, e)].sum(0)  # [H, K]
            for i_h in range(h):
                safe = [span[i_h, i : i + bk].max() <= intra_vector_gate.SAFE_SPAN for i in range(0, dk, bk)]
                paths.add(tuple("dot" if ok else "loop" for ok in safe))
    return paths


def split_gates(b, t, h, dk, *, strong):
    """Mild GLA gates ``logsigmoid(x) / 16``; the first ``strong`` key dims decay by about e^-6.5 per
    token instead: a full sub-chunk spans ~97 > SAFE_SPAN there, and the factored product would
    overflow fp32 (e^97 > 3.4e38 ~ e^88.7), so only the per-token loop gets those blocks right."""
    g = F.logsigmoid(torch.randn(b, t, h, dk)) / 16
    g[..., :strong] = -6.5 + 0.1 * torch.rand(b, t, h, strong)
    return g


@pytest.mark.parametrize("path", ["dot", "loop"])
def test_diagonal_block_paths_mild_gates(triton_backend, monkeypatch, path):
    """Mild gates: every diagonal block takes the tensor-core product, or, with SAFE_SPAN below any
    span, every one takes the per-token loop; both match the oracle."""
    q, k, v, _, h0 = make_inputs(1, 80, 1, 32, 8, h0=True)
    g = split_gates(1, 80, 1, 32, strong=0)
    if path == "loop":
        monkeypatch.setattr(intra_vector_gate, "SAFE_SPAN", -1.0)
    assert diagonal_paths(g, None, 32) == {(path,)}
    check(chunk_gla, reference_gla, q, k, v, g, h0)


@pytest.fixture
def two_k_blocks(monkeypatch):
    """K blocks of 16 in both sub-chunk kernels, so that one K block can take the loop and the other
    the product within one program."""
    for stage in ("vector_gate_scores", "vector_gate_intra_bwd"):
        monkeypatch.setitem(TUNING, stage, {"BK": 16})
    return 16


def test_diagonal_block_paths_mixed(triton_backend, two_k_blocks):
    """Strong decay in the first K block (loop), mild in the second (product), in the same
    sub-chunks: outputs, final state and every gradient exact and finite."""
    q, k, v, _, h0 = make_inputs(1, 130, 1, 32, 8, h0=True)
    g = split_gates(1, 130, 1, 32, strong=16)
    # 130 = 64 + 64 + 2: the last sub-chunk has 2 rows, a span of ~6.5: the product even there
    assert diagonal_paths(g, None, two_k_blocks) == {("loop", "dot"), ("dot", "dot")}
    check(chunk_gla, reference_gla, q, k, v, g, h0, tol_dg=5e-4)


def test_diagonal_block_paths_packed_strong_decay(triton_backend, two_k_blocks):
    """Packed documents of 1, 37, 63, 64 and 130 tokens under strong decay: partial sub-chunks (1,
    5, 15 and 2 valid rows) whose padded rows read the last valid row's gate. The 5 rows of the
    37-token document take the product in the strong K block although its cumulative gate is near
    -240 there: a padded row reading 0 would turn ``0 * exp(240)`` into NaN in the valid rows."""
    lengths = [1, 37, 63, 64, 130]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v, _, h0 = make_inputs(1, sum(lengths), 1, 32, 8, h0=True, n=len(lengths))
    g = split_gates(1, sum(lengths), 1, 32, strong=16)
    assert diagonal_paths(g, cu, two_k_blocks) == {("loop", "dot"), ("dot", "dot")}
    check(chunk_gla, reference_gla, q, k, v, g, h0, cu, tol_dg=5e-4)


@pytest.mark.parametrize("packed", [False, True])
def test_kept_states_match_oracle(triton_backend, monkeypatch, packed):
    """The backward from the states (and cumulative gates) kept by the forward, as for long
    sequences, instead of recomputed."""
    from ttr.kernels.common import index

    monkeypatch.setattr(index, "KEEP_STATES_MIN_CHUNKS", 0)
    lengths = [1, 63, 130] if packed else [130]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32) if packed else None
    q, k, v, g, h0 = make_inputs(1, sum(lengths), 2, 6, 5, h0=True, n=len(lengths))
    check(chunk_gla, reference_gla, q, k, v, g, h0, cu)


@pytest.mark.parametrize("clamp_min", [None, -0.05])
@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gate_logits_are_the_gate_then_the_op(backend, clamp_min, logits_dtype):
    """``chunk_gla(gate_logits=)`` on the logits z: the output and gradients of ``chunk_gla`` on
    ``gla_gate(z)`` (the same bits: the same arithmetic in another kernel), z's gradient in z's dtype,
    against the float64 oracle; packed, with an initial state; ``recurrent_gla`` and
    ``reference_gla`` take the logits alike."""
    from ttr.kernels.gla.gate import gla_gate

    torch.manual_seed(5)
    q, k, v, _, h0 = make_inputs(1, 150, 2, 16, 32, h0=True, n=2)
    z = (3 * torch.randn(1, 150, 2, 16)).to(logits_dtype)
    cu = torch.tensor([0, 70, 150])
    gate = (16.0, clamp_min)
    do = torch.randn(1, 150, 2, 32)
    results = []
    for fused in (True, False):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, z, h0)]
        g = leaves[3] if fused else gla_gate(leaves[3], *gate)
        o, _ = chunk_gla(*leaves[:3], g, initial_state=leaves[4], cu_seqlens=cu, gate_logits=gate if fused else None)
        results.append((o, torch.autograd.grad(o, leaves, do)))
    (o, grads), (o_sep, grads_sep) = results
    assert torch.equal(o, o_sep) and grads[3].dtype == logits_dtype
    for a, b in zip(grads, grads_sep):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    leaves = [t.double().requires_grad_() for t in (q, k, v, z, h0)]
    o64, _ = reference_gla(*leaves[:4], initial_state=leaves[4], cu_seqlens=cu, gate_logits=gate)
    grads64 = torch.autograd.grad(o64, leaves, do.double())
    assert rel_rms(o, o64) < TOL
    for name, a, b in zip("q k v z h0".split(), grads, grads64):
        assert rel_rms(a, b) < (TOL if logits_dtype == torch.float32 or name != "z" else 5e-3), name
    o_rec, _ = recurrent_gla(q, k, v, z, initial_state=h0, cu_seqlens=cu, gate_logits=gate)
    assert rel_rms(o_rec, o64) < TOL


def test_gate_logits_errors():
    q, k, v, g, _ = make_inputs(1, 10, 2, 8, 8)
    for bad, match in (((0.0, None), "normalizer"), ((16.0, 0.1), "clamp_min"), ((16.0,), "gate_logits"),
                       ((True, None), "normalizer")):
        with pytest.raises((ValueError, TypeError), match=match):
            chunk_gla(q, k, v, g, gate_logits=bad)
    with pytest.raises(TypeError, match="g has unsupported dtype"):
        chunk_gla(q, k, v, g.bfloat16())
    chunk_gla(q, k, v, g.bfloat16(), gate_logits=(16.0, None))


@pytest.mark.parametrize("two_level", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_grads_into_a_callers_buffer(triton_backend, monkeypatch, two_level, packed):
    """``grads_into``: dq, dk and dv are written into the column blocks of one wider buffer (a
    layer's projections' gradient, ``models.modules.GradColumns``), by the sequential walk and by
    the two-level pass: the same bits as new tensors, the buffer's other columns untouched."""
    from ttr.kernels.common import state

    monkeypatch.setattr(state, "_two_level", lambda *a, **kw: two_level)
    torch.manual_seed(6)
    b, t = (1, 150) if packed else (2, 75)
    cu = torch.tensor([0, 70, 150]) if packed else None
    q, k, v, g, _ = make_inputs(b, t, 2, 16, 32)
    do = torch.randn(b, t, 2, 32)
    buf = torch.full((b, t, 3 + 2 * 16 + 2 * 16 + 2 * 32 + 5), 7.0)
    blocks = [x.view(b, t, 2, -1) for x in buf[..., 3:-5].split([32, 32, 64], -1)]
    results = []
    for into in (None, lambda: tuple(blocks)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
        o, _ = chunk_gla(*leaves, cu_seqlens=cu, grads_into=into)
        results.append(torch.autograd.grad(o, leaves, do))
    for name, a, r in zip("q k v g".split(), *results):
        torch.testing.assert_close(a, r, rtol=0, atol=0, msg=name)
    for a, blk in zip(results[1], blocks):
        assert a.data_ptr() == blk.data_ptr()
    assert (buf[..., :3] == 7).all() and (buf[..., -5:] == 7).all()


def test_grads_into_errors(triton_backend):
    q, k, v, g, _ = make_inputs(1, 10, 2, 8, 8)
    with pytest.raises(TypeError, match="grads_into"):
        chunk_gla(q, k, v, g, grads_into=(q, k, v))
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
    spread = torch.empty(1, 10, 8, 2).transpose(2, 3)  # heads not dense
    o, _ = chunk_gla(*leaves, grads_into=lambda: (spread, torch.empty_like(k), torch.empty_like(v)))
    with pytest.raises(ValueError, match="dq"):
        o.sum().backward()
