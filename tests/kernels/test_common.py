"""Engine stages (ttr.kernels.common) on the paths the delta rules do not take: per-key gates,
no WY correction (GLA / SSD style), the cumulative sums; Triton under the interpreter vs float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton

from ttr.kernels.common.cumsum import chunk_local_cumsum
from ttr.kernels.common.index import block_size, cdiv, next_power_of_2, prepare_chunks, sm_count
from ttr.kernels.common.output import output_bwd_dqk, output_bwd_dv, output_fwd
from ttr.kernels.common.state import state_bwd, state_fwd

CASES = [(2, 65, None), (1, 130, [0, 1, 64, 130])]


def rel(a, b):
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm()).item()


def spans(B, T, cu):
    return [(b, 0, T) for b in range(B)] if cu is None else [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def reference_states(k, v, g, gk, h0, B, T, cu, chunk=64):
    """Per-token linear recurrence ``S <- decay S + k v^T``; returns the state before each chunk
    (per sequence, chunk order) and the final states."""
    starts, finals = [], []
    for n, (b, s, e) in enumerate(spans(B, T, cu)):
        S = h0[n]
        for t in range(s, e):
            if (t - s) % chunk == 0:
                starts.append(S)
            if g is not None:
                S = S * g[b, t].exp()[:, None, None]
            if gk is not None:
                S = S * gk[b, t].exp()[:, :, None]
            S = S + k[b, t][:, :, None] * v[b, t][:, None, :]
        finals.append(S)
    return torch.stack(starts), torch.stack(finals)


def reference_scores(q, k, gc, H, B, T, cu, chunk=64):
    """The chunks' ``q k^T ⊙ causal ⊙ Γ`` (float64) in ``wy_fwd``'s layout ``[B, T, H, chunk]``: row t
    holds row t mod chunk of its chunk's scores; q and k's heads shared by H / HK consecutive heads."""
    rep = H // q.shape[2]
    q, k = q.double().repeat_interleave(rep, 2), k.double().repeat_interleave(rep, 2)
    S = torch.zeros(B, T, H, chunk, dtype=torch.float64)
    for b, s, e in spans(B, T, cu):
        for c in range(s, e, chunk):
            n = min(chunk, e - c)
            A = torch.einsum("ihd,jhd->hij", q[b, c:c + n], k[b, c:c + n])
            if gc is not None:
                gg = gc[b, c:c + n].double().t()
                A = A * (gg[:, :, None] - gg[:, None, :]).clamp(max=0).exp()
            S[b, c:c + n, :, :n] = A.tril().permute(1, 0, 2)
    return S


def test_host_launch_arithmetic_is_tritons():
    """The launchers' int helpers give what Triton's constexpr functions give, without their cost."""
    assert [next_power_of_2(n) for n in range(-3, 300)] == [triton.next_power_of_2(n) for n in range(-3, 300)]
    for b in (1, 3, 16, 64):
        assert [cdiv(a, b) for a in range(-5, 200)] == [triton.cdiv(a, b) for a in range(-5, 200)]
    assert sm_count(torch.device("cpu")) == 1


@pytest.mark.parametrize("B,T,cu", CASES)
@pytest.mark.parametrize("heads", [(2,), (70,), (2, 20)], ids=["scalar", "scalar-wide", "vector"])
def test_chunk_local_cumsum(B, T, cu, heads):
    """Scalar gates are summed with the heads as a tile's columns (70 heads: two column blocks, the
    second masked), per-key gates with the keys."""
    g = -torch.rand((B, T, *heads))
    plan = prepare_chunks(torch.tensor(cu) if cu else None, B, T)
    out, back = chunk_local_cumsum(g, plan), chunk_local_cumsum(g, plan, reverse=True)
    for b, s, e in spans(B, T, cu):
        for c0 in range(s, e, 64):
            c1 = min(c0 + 64, e)
            x = g[b, c0:c1]
            assert torch.allclose(out[b, c0:c1], x.cumsum(0), atol=1e-5)
            assert torch.allclose(back[b, c0:c1], x.flip(0).cumsum(0).flip(0), atol=1e-5)
    # per-head factors (Mamba2's g = A dt summed without a product pass), a different one per head
    A = -torch.linspace(0.5, 3.0, heads[0])
    A_shape = (heads[0],) + (1,) * (len(heads) - 1)
    assert torch.allclose(chunk_local_cumsum(g, plan, scale=A), chunk_local_cumsum(g * A.view(A_shape), plan),
                          atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(64,), (16,), (80,), (16, 64)], ids=str)
def test_chunk_local_cumsum_gpu(heads):
    """The presets' gate shapes (Mamba2's 64 heads, the delta rules' 16, GLA's per-key gate) and a
    head count past one column block, against torch's cumsum per chunk; the last chunk is partial."""
    B, T = 2, 4000
    g = -torch.rand((B, T, *heads), device="cuda")
    A = -torch.linspace(0.5, 3.0, heads[0], device="cuda").view((heads[0],) + (1,) * (len(heads) - 1))
    plan = prepare_chunks(None, B, T, device="cuda")
    out = chunk_local_cumsum(g, plan, scale=A.flatten())
    back = chunk_local_cumsum(g, plan, reverse=True)
    for c0 in range(0, T, 64):
        x = g[:, c0 : c0 + 64].double()
        assert torch.allclose(out[:, c0 : c0 + 64].double(), (x * A).cumsum(1), rtol=1e-5, atol=1e-4)
        assert torch.allclose(back[:, c0 : c0 + 64].double(), x.flip(1).cumsum(1).flip(1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("B,T,cu", CASES)
def test_scalar_gate_linear_attention_fwd_bwd(B, T, cu):
    """SSD / simple-GLA composition: cumsum -> state_fwd (no w) -> output, and the backward chain."""
    H, K, V, scale = 2, 20, 24, 0.3
    N = B if cu is None else len(cu) - 1
    q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K) * 0.3, torch.randn(B, T, H, V)
    g = F.logsigmoid(torch.randn(B, T, H) + 2)
    h0, do, dht = torch.randn(N, H, K, V), torch.randn(B, T, H, V), torch.randn(N, H, K, V)
    cu_t = torch.tensor(cu, dtype=torch.int32) if cu else None
    plan = prepare_chunks(cu_t, B, T)
    gc = chunk_local_cumsum(g, plan)
    h, v_new, ht = state_fwd(k, v, plan, g=gc, initial_state=h0, output_final_state=True)
    assert v_new is v
    o = output_fwd(q, k, v, h, plan, scale=scale, g=gc)
    dvl = output_bwd_dv(q, k, do, plan, scale=scale, g=gc)
    dh, dh0, dv = state_bwd(q, k, do, dvl, plan, scale=scale, g=gc, dht=dht, need_dh0=True)
    dq, dk, dw, dgc = output_bwd_dqk(q, k, v, h, dh, do, plan, scale=scale, g=gc)
    assert dw is None
    dg = chunk_local_cumsum(dgc, plan, reverse=True)

    x = {n: t.double().requires_grad_(True) for n, t in dict(q=q, k=k, v=v, g=g, h0=h0).items()}
    outs, finals = [], []
    for n, (b, s, e) in enumerate(spans(B, T, cu)):
        S = x["h0"][n]
        for t in range(s, e):
            S = S * x["g"][b, t].exp()[:, None, None] + x["k"][b, t][:, :, None] * x["v"][b, t][:, None, :]
            outs.append((b, t, torch.einsum("hk,hkv->hv", x["q"][b, t] * scale, S)))
        finals.append(S)
    o_ref = torch.zeros(B, T, H, V, dtype=torch.float64)
    for b, t, val in outs:
        o_ref = o_ref.index_put((torch.tensor(b), torch.tensor(t)), val)
    ht_ref = torch.stack(finals)
    ((o_ref * do.double()).sum() + (ht_ref * dht.double()).sum()).backward()
    assert rel(o, o_ref) < 1e-5 and rel(ht, ht_ref) < 1e-5
    for name, got in dict(q=dq, k=dk, v=dv, g=dg, h0=dh0).items():
        assert rel(got, x[name].grad) < 1e-4, name


@pytest.mark.parametrize("B,T,cu", CASES)
@pytest.mark.parametrize("K,V", [(20, 24), (136, 128)])
@pytest.mark.parametrize("initial", [True, False], ids=["h0", "zeros"])
def test_dqk_walk_forms_the_states_it_reads(B, T, cu, K, V, initial):
    """The delta rule's dq/dk stage walking the chunks (``h=None``, no gate) forms each state from
    the initial one by ``h += k^T v_new`` as it goes: the same dq, dk and dw as the chunk-parallel
    stage reading the states a walk stored (fp32 products summed in another order, so to fp32's
    rounding). Packed sequences with a one-token document and partial chunks; K = 136 takes three
    key blocks, V = 128 the widest value row the walk holds."""
    H, scale = 2, 0.4
    N = B if cu is None else len(cu) - 1
    q, k, v_new = torch.randn(B, T, H, K), torch.randn(B, T, H, K) * 0.3, torch.randn(B, T, H, V)
    do, dv = torch.randn(B, T, H, V), torch.randn(B, T, H, V)
    h0 = torch.randn(N, H, K, V) if initial else None
    plan = prepare_chunks(torch.tensor(cu, dtype=torch.int32) if cu else None, B, T)
    h = state_fwd(k, v_new, plan, initial_state=h0)[0]
    dh = torch.randn_like(h)
    want = output_bwd_dqk(q, k, v_new, h, dh, do, plan, scale=scale, dv=dv)
    got = output_bwd_dqk(q, k, v_new, None, dh, do, plan, scale=scale, dv=dv, h0=h0)
    assert got[3] is None
    for name, a, b in zip(("dq", "dk", "dw"), got, want):
        assert rel(a, b) < 1e-6, name
    with pytest.raises(ValueError, match="h=None"):
        output_bwd_dqk(q, k, v_new, None, dh, do, plan, scale=scale, dv=dv, g=torch.zeros(B, T, H))
    with pytest.raises(ValueError, match="h=None"):
        output_bwd_dqk(q, k, v_new, None, dh, do, plan, scale=scale)


@pytest.mark.parametrize("B,T,cu,K", [(2, 65, None, 20), (1, 130, [0, 1, 64, 130], 20), (1, 70, None, 136)])
def test_vector_gate_state_pass_fwd_bwd(B, T, cu, K):
    """GLA's state stage: per-key decay, no WY correction, forward states and the reverse pass
    (K = 136 takes the two-half state path used beyond K = 128)."""
    H, V, scale = 2, 24, 0.5
    N = B if cu is None else len(cu) - 1
    q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K) * 0.3, torch.randn(B, T, H, V)
    gk = F.logsigmoid(torch.randn(B, T, H, K) + 3)
    h0, do, dht = torch.randn(N, H, K, V), torch.randn(B, T, H, V), torch.randn(N, H, K, V)
    cu_t = torch.tensor(cu, dtype=torch.int32) if cu else None
    plan = prepare_chunks(cu_t, B, T)
    gkc = chunk_local_cumsum(gk, plan)
    h, _, ht = state_fwd(k, v, plan, gk=gkc, initial_state=h0, output_final_state=True)
    _, dh0, dv = state_bwd(q, k, do, torch.zeros_like(v), plan, scale=scale, gk=gkc, dht=dht, need_dh0=True)

    x = {n: t.double().requires_grad_(True) for n, t in dict(v=v, h0=h0).items()}
    h_ref, ht_ref = reference_states(k.double(), x["v"], None, gk.double(), x["h0"], B, T, cu)
    assert rel(h, h_ref) < 1e-5 and rel(ht, ht_ref) < 1e-5
    # the inter-chunk output term the state pass back-propagates: scale (q ⊙ exp(gk_cum)) h[c]
    loss = (ht_ref * dht.double()).sum()
    i = 0
    for b, s, e in spans(B, T, cu):
        for c0 in range(s, e, 64):
            c1 = min(c0 + 64, e)
            qg = q[b, c0:c1].double() * gkc[b, c0:c1].double().exp()
            loss = loss + scale * torch.einsum("thk,hkv,thv->", qg, h_ref[i], do[b, c0:c1].double())
            i += 1
    loss.backward()
    assert rel(dv, x["v"].grad) < 1e-4 and rel(dh0, x["h0"].grad) < 1e-4


@pytest.mark.parametrize("B,T,cu", CASES)
@pytest.mark.parametrize("K,V", [(20, 24), (64, 40)])
def test_vector_gate_walk_forms_the_output(monkeypatch, B, T, cu, K, V):
    """GLA's walk forms ``vector_gate_output``'s o from the states it holds and the kept scores A:
    the same o, states and final state as the walk and the launch (an initial state, packed
    sequences, decays of up to e^-300 in a chunk), and no states written with ``keep_h=False``. The
    output needs A, and the two-level pass (long sequences) leaves it to the launch."""
    from ttr.kernels.common import intra_vector_gate as vg
    from ttr.kernels.common import state

    H, scale = 2, 0.5
    N = B if cu is None else len(cu) - 1
    q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K) * 0.3, torch.randn(B, T, H, V)
    gk = -5 * torch.rand(B, T, H, K)
    h0 = torch.randn(N, H, K, V)
    plan = prepare_chunks(torch.tensor(cu, dtype=torch.int32) if cu else None, B, T)
    gkc = chunk_local_cumsum(gk, plan)
    A = vg.vector_gate_scores(q, k, gkc, plan, scale=scale)
    h, _, ht = state_fwd(k, v, plan, gk=gkc, initial_state=h0, output_final_state=True)
    o = vg.vector_gate_output(q, v, gkc, A, h, plan, scale=scale)
    assert state.walk_can_form_output(K, plan, H, gk=gkc)
    h1, _, ht1, o1 = state_fwd(k, v, plan, gk=gkc, initial_state=h0, output_final_state=True, q=q,
                               scale=scale, scores=A)
    for a, b in ((h1, h), (ht1, ht), (o1, o)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    h2, _, _, o2 = state_fwd(k, v, plan, gk=gkc, initial_state=h0, q=q, scale=scale, scores=A, keep_h=False)
    assert h2 is None
    torch.testing.assert_close(o2, o, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="needs scores"):
        state_fwd(k, v, plan, gk=gkc, q=q)
    monkeypatch.setattr(state, "_two_level", lambda *a, **kw: True)
    assert not state.walk_can_form_output(K, plan, H, gk=gkc)
    with pytest.raises(ValueError, match="formed by the walk only"):
        state_fwd(k, v, plan, gk=gkc, q=q, scores=A)


@pytest.mark.parametrize("B,T,cu", CASES)
@pytest.mark.parametrize("K,V", [(20, 24), (64, 40)])
def test_vector_gate_walk_forms_dv_and_dA(monkeypatch, B, T, cu, K, V):
    """GLA's backward walk forms ``vector_gate_dv_dA``'s intra-chunk dv (completed by ``k dh``) and
    dA over whole value rows: the same dh, dh0, dv and dA as the launch and the walk (an initial
    state's and a final state's gradient, packed sequences, decays of up to e^-300 in a chunk);
    refused without gk or A, with value blocks narrower than V, and on the two-level pass."""
    from ttr.kernels.common import index, state
    from ttr.kernels.common import intra_vector_gate as vg

    H, scale = 2, 0.5
    N = B if cu is None else len(cu) - 1
    q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K) * 0.3, torch.randn(B, T, H, V)
    gk, do, dht = -5 * torch.rand(B, T, H, K), torch.randn(B, T, H, V), torch.randn(N, H, K, V)
    plan = prepare_chunks(torch.tensor(cu, dtype=torch.int32) if cu else None, B, T)
    gkc = chunk_local_cumsum(gk, plan)
    A = vg.vector_gate_scores(q, k, gkc, plan, scale=scale)
    dvi, dA = vg.vector_gate_dv_dA(A, v, do, plan, scale=scale)
    dh, dh0, dv = state_bwd(q, k, do, dvi, plan, scale=scale, gk=gkc, dht=dht, need_dh0=True)
    assert state.walk_forms_dv_dA(K, plan, H, q.device, gk=gkc)
    dh1, dh01, dv1, dA1 = state_bwd(q, k, do, None, plan, scale=scale, gk=gkc, dht=dht, need_dh0=True,
                                    intra_dv=True, scores=A, values=v)
    valid = torch.zeros(B, T, dtype=torch.bool)  # dA's rows past a sequence's end are never written
    for b, s, e in spans(B, T, cu):
        valid[b, s:e] = True
    for a, b in ((dh1, dh), (dh01, dh0), (dv1, dv), (dA1[valid], dA[valid])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="values"):
        state_bwd(q, k, do, None, plan, scale=scale, intra_dv=True, scores=A, values=v)
    with pytest.raises(ValueError, match="values"):
        state_bwd(q, k, do, None, plan, scale=scale, gk=gkc, intra_dv=True, values=v)
    with pytest.raises(ValueError, match="pass values"):
        state_bwd(q, k, do, None, plan, scale=scale, gk=gkc, intra_dv=True, scores=A)
    monkeypatch.setitem(index.TUNING, "state_bwd", {"BV": 16})
    with pytest.raises(ValueError, match="whole value rows"):
        state_bwd(q, k, do, None, plan, scale=scale, gk=gkc, intra_dv=True, scores=A, values=v)
    monkeypatch.setitem(index.TUNING, "state_bwd", {"two_level": True})
    assert not state.walk_forms_dv_dA(K, plan, H, q.device, gk=gkc)
    with pytest.raises(ValueError, match="not the two-level pass"):
        state_bwd(q, k, do, None, plan, scale=scale, gk=gkc, intra_dv=True, scores=A, values=v)


def test_gla_walk_forms_dv_and_dA_where_one_program_per_head_fills_the_gpu(monkeypatch):
    """On 132 SMs: 16 heads of 8 sequences walk whole value rows, of 4 do not; long sequences take
    the two-level pass (no walk); ``TUNING["state_bwd"]["intra_dv"]`` overrides the grid's rule."""
    from ttr.kernels.common import index, state

    monkeypatch.setattr(state, "sm_count", lambda device: 132)
    gk, cuda = torch.empty(0), torch.device("cuda")
    forms = state.walk_forms_dv_dA
    assert forms(64, prepare_chunks(None, 8, 4096), 16, cuda, gk=gk)
    assert not forms(64, prepare_chunks(None, 4, 4096), 16, cuda, gk=gk)
    assert not forms(64, prepare_chunks(None, 8, 8192), 16, cuda, gk=gk)
    assert not forms(256, prepare_chunks(None, 8, 4096), 16, cuda, gk=gk)
    monkeypatch.setitem(index.TUNING, "state_bwd", {"intra_dv": True})
    assert forms(64, prepare_chunks(None, 4, 4096), 16, cuda, gk=gk)
    monkeypatch.setitem(index.TUNING, "state_bwd", {"intra_dv": False})
    assert not forms(64, prepare_chunks(None, 8, 4096), 16, cuda, gk=gk)


@pytest.mark.parametrize("states", ["auto", "recompute"])
def test_gla_forms_its_output_in_the_walk_or_a_launch(monkeypatch, states):
    """``chunk_gla``'s walks form o, and dv and dA, by default (here) and the launches do under
    ``TUNING["state_fwd"]["output"] = False`` and ``TUNING["state_bwd"]["intra_dv"] = False``: the
    same output and gradients, also where the forward's walk writes no states
    (``TTR_CHUNK_STATES=recompute``: the backward forms them again)."""
    from ttr.kernels.common import index, state
    from ttr.kernels.gla import chunk_gla

    monkeypatch.setenv("TTR_CHUNK_STATES", states)
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    calls, bwd = [], []
    real, real_bwd = state.state_fwd, state.state_bwd
    monkeypatch.setattr("ttr.kernels.gla.chunk.state_fwd",
                        lambda *a, **kw: calls.append("q" in kw) or real(*a, **kw))
    monkeypatch.setattr("ttr.kernels.gla.chunk.state_bwd",
                        lambda *a, **kw: bwd.append("values" in kw) or real_bwd(*a, **kw))
    x = [torch.randn(1, 100, 2, 16), torch.randn(1, 100, 2, 16) * 0.3, torch.randn(1, 100, 2, 24),
         -torch.rand(1, 100, 2, 16)]
    outs = []
    for walk in (True, False):
        monkeypatch.setitem(index.TUNING, "state_fwd", {"output": walk})
        monkeypatch.setitem(index.TUNING, "state_bwd", {"intra_dv": walk})
        leaves = [t.clone().requires_grad_(True) for t in x]
        o, _ = chunk_gla(*leaves)
        o.square().sum().backward()
        outs.append([o.detach(), *(t.grad for t in leaves)])
    assert calls[0] and not calls[-1] and bwd == [True, False]
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("K", [20, 136])
def test_delta_state_pass_with_w(K):
    """The delta-rule state pass (v_new = u - w h) against float64, including the two-half path."""
    B, T, H, V = 1, 130, 2, 16
    k = F.normalize(torch.randn(B, T, H, K), dim=-1)
    w, u = torch.randn(B, T, H, K) * 0.1, torch.randn(B, T, H, V)
    g = F.logsigmoid(torch.randn(B, T, H) + 2)
    plan = prepare_chunks(None, B, T)
    gc = chunk_local_cumsum(g, plan)
    h, v_new, ht = state_fwd(k, u, plan, w=w, g=gc, output_final_state=True)
    S = torch.zeros(H, K, V, dtype=torch.float64)
    states, news = [], []
    for c in range(0, T, 64):
        states.append(S)
        kc, wc, uc, gcc = (x[0, c:c + 64].double().transpose(0, 1) for x in (k, w, u, gc))
        vn = uc - wc @ S
        news.append(vn)
        S = gcc[:, -1].exp()[:, None, None] * S + (kc * (gcc[:, -1:] - gcc).exp()[..., None]).transpose(1, 2) @ vn
    assert rel(h, torch.stack(states)) < 1e-5 and rel(ht[0], S) < 1e-5
    assert rel(v_new[0].transpose(0, 1), torch.cat(news, 1)) < 1e-5


@pytest.mark.parametrize("two_level", [False, True])
def test_state_backward_without_dv(monkeypatch, two_level):
    """``dv=None`` gives the same dh and no dv2 on both state passes; the delta rule, whose dh reads
    dv2, refuses it."""
    from ttr.kernels.common import state

    monkeypatch.setattr(state, "_two_level", lambda *a, **k: two_level)
    B, T, H, K, V = 1, 130, 2, 32, 16
    q, k, do, dv = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V), torch.randn(B, T, H, V)
    plan = prepare_chunks(None, B, T)
    gc = chunk_local_cumsum(F.logsigmoid(torch.randn(B, T, H) + 2), plan)
    dh, dh0, dv2 = state_bwd(q, k, do, dv, plan, scale=0.5, g=gc, need_dh0=True)
    dh_alone, dh0_alone, none = state_bwd(q, k, do, None, plan, scale=0.5, g=gc, need_dh0=True)
    assert none is None and dv2 is not None
    torch.testing.assert_close(dh_alone, dh)
    torch.testing.assert_close(dh0_alone, dh0)
    with pytest.raises(ValueError, match="needs dv"):
        state_bwd(q, k, do, None, plan, scale=0.5, w=torch.randn(B, T, H, K))


# the walks that form the output stage's products: (gate, w, (H, HK), K, two-level pass): the delta
# rules' walk with and without a gate and with grouped q/k heads, the split state (K > 128, which
# takes the launches), the walk without w, and the two-level pass
WALK_CASES = [(False, True, (2, 2), 32, False), (True, True, (4, 2), 32, False), (True, True, (2, 2), 160, False),
              (False, False, (2, 2), 32, False), (True, False, (2, 2), 32, True)]


@pytest.mark.parametrize("B,T,cu", CASES)
@pytest.mark.parametrize("gated,use_w,heads,K,two_level", WALK_CASES)
def test_state_backward_forms_the_intra_chunk_dv(monkeypatch, B, T, cu, gated, use_w, heads, K, two_level):
    """``intra_dv=True``: the walk (or, on the two-level pass, a launch before it) forms
    ``output_bwd_dv``'s dv itself, and every output matches the two launches', also under a decay
    that spans e^-120 within a chunk (grouped q/k heads, split K, packed sequences)."""
    from ttr.kernels.common import state

    monkeypatch.setattr(state, "_two_level", lambda *a, **k: two_level)
    H, HK = heads
    V = 16
    q, k = torch.randn(B, T, HK, K), F.normalize(torch.randn(B, T, HK, K), dim=-1)
    do, w = torch.randn(B, T, H, V), 0.1 * torch.randn(B, T, H, K)
    plan = prepare_chunks(torch.tensor(cu) if cu is not None else None, B, T)
    gc = chunk_local_cumsum(-4 * torch.rand(B, T, H), plan) if gated else None
    w = w if use_w else None
    dv = output_bwd_dv(q, k, do, plan, scale=0.5, g=gc)
    two = state_bwd(q, k, do, dv, plan, scale=0.5, w=w, g=gc, need_dh0=True)
    one = state_bwd(q, k, do, None, plan, scale=0.5, w=w, g=gc, need_dh0=True, intra_dv=True)
    S = reference_scores(q, k, gc, H, B, T, cu).float()
    kept = state_bwd(q, k, do, None, plan, scale=0.5, w=w, g=gc, need_dh0=True, intra_dv=True, scores=S)
    for a, b in zip(one + kept, two + two):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="state_bwd: scores"):
        state_bwd(q, k, do, dv, plan, scale=0.5, w=w, g=gc, scores=S)
    with pytest.raises(ValueError, match="intra_dv"):
        state_bwd(q, k, do, dv, plan, scale=0.5, w=w, g=gc, intra_dv=True)
    with pytest.raises(ValueError, match="intra_dv"):
        state_bwd(q, k, do, None, plan, scale=0.5, gk=torch.zeros(B, T, HK, K), intra_dv=True)


@pytest.mark.parametrize("B,T,cu", CASES)
@pytest.mark.parametrize("gated,use_w,heads,K,two_level", WALK_CASES)
def test_state_forward_forms_the_output(monkeypatch, B, T, cu, gated, use_w, heads, K, two_level):
    """``state_fwd(q=...)``: the walk (or, on the two-level pass and at K > 128, a launch after it)
    forms ``output_fwd``'s o, and v_new, the final state and o match the two launches' (grouped q/k
    heads, an initial state, packed sequences, a decay spanning e^-120 in a chunk); ``keep_h=False``
    writes no states."""
    from ttr.kernels.common import state

    monkeypatch.setattr(state, "_two_level", lambda *a, **k: two_level)
    H, HK = heads
    V = 16
    N = B if cu is None else len(cu) - 1
    q, k = torch.randn(B, T, HK, K), F.normalize(torch.randn(B, T, HK, K), dim=-1)
    u, w, h0 = torch.randn(B, T, H, V), 0.1 * torch.randn(B, T, H, K), torch.randn(N, H, K, V)
    plan = prepare_chunks(torch.tensor(cu) if cu is not None else None, B, T)
    gc = chunk_local_cumsum(-4 * torch.rand(B, T, H), plan) if gated else None
    w = w if use_w else None
    h, v_new, ht = state_fwd(k, u, plan, w=w, g=gc, initial_state=h0, output_final_state=True)
    o = output_fwd(q, k, v_new, h, plan, scale=0.5, g=gc)
    h1, v_new1, ht1, o1 = state_fwd(k, u, plan, w=w, g=gc, initial_state=h0, output_final_state=True, q=q,
                                    scale=0.5, keep_h=False)
    for a, b in ((v_new1, v_new), (ht1, ht), (o1, o)):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    walked = K <= 128 and not two_level
    assert (h1 is None) == walked
    h2 = state_fwd(k, u, plan, w=w, g=gc, initial_state=h0, q=q, scale=0.5)[0]
    torch.testing.assert_close(h2, h)
    # the walk reading the kept scores (``wy_fwd(..., q=q)``'s) instead of forming them
    S = reference_scores(q, k, gc, H, B, T, cu).float()
    o3 = state_fwd(k, u, plan, w=w, g=gc, initial_state=h0, output_final_state=True, q=q, scale=0.5, keep_h=False,
                   scores=S)[3]
    torch.testing.assert_close(o3, o, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="state_fwd: q"):
        state_fwd(k, u, plan, gk=torch.zeros(B, T, HK, K), q=q)
    with pytest.raises(ValueError, match="state_fwd: scores"):
        state_fwd(k, u, plan, w=w, g=gc, scores=S)


@pytest.mark.parametrize("choice,stage,key", [("walk_forms_output", "state_fwd", "output"),
                                              ("walk_forms_dv", "state_bwd", "intra_dv")])
def test_the_delta_rules_walks_form_their_products(monkeypatch, choice, stage, key):
    """The delta rules' default: the walks form the output and the intra-chunk dv, with a gate only
    from kept scores, launches before or after them without; ``TUNING[stage][key]`` overrides either
    way."""
    from ttr.kernels.common import index, state

    forms = getattr(state, choice)
    assert forms(gated=False) and forms(gated=True, scores=True) and not forms(gated=True)
    monkeypatch.setitem(index.TUNING, stage, {key: True})
    assert forms(gated=True)
    monkeypatch.setitem(index.TUNING, stage, {key: False})
    assert not forms(gated=False) and not forms(gated=True, scores=True)


def test_the_gated_walks_read_kept_scores_where_they_fill_the_gpu(monkeypatch):
    """With a gate the scores are kept where the walks fill the GPU with value blocks of 64 (132 SMs:
    16 heads of V = 128 at 4 sequences, not at 2), never without one; ``TUNING`` overrides, except
    at K > 128, where no walk forms the output."""
    from ttr.kernels.common import index, state

    monkeypatch.setattr(state, "sm_count", lambda device: 132)
    reads = state.walk_reads_scores
    assert reads(True, 4 * 16, 128, 128, "cuda") and reads(True, 8 * 16, 128, 128, "cuda")
    assert not reads(True, 2 * 16, 128, 128, "cuda") and not reads(False, 8 * 16, 128, 128, "cuda")
    assert not reads(True, 8 * 16, 256, 128, "cuda")
    monkeypatch.setitem(index.TUNING, "state_fwd", {"scores": True})
    assert reads(True, 1, 128, 128, "cuda") and reads(False, 1, 128, 128, "cuda")
    assert not reads(True, 1, 192, 128, "cuda")


def test_state_pass_refuses_the_wrong_launch_shape():
    """16-bit inputs with one pipeline stage and BV < 64 gave wrong states on the H200."""
    from ttr.kernels.common.state import _checked

    bad = {"BV": 32, "num_warps": 4, "num_stages": 1}
    with pytest.raises(ValueError, match="BV >= 64"):
        _checked(bad, 2)
    assert _checked(bad, 4) == bad and _checked({**bad, "BV": 64}, 2)["BV"] == 64
    assert _checked({**bad, "num_stages": 2}, 2)["num_stages"] == 2


def test_unpacked_plans_are_cached_and_index_every_row():
    a = prepare_chunks(None, 3, 130, device="cpu")
    assert prepare_chunks(None, 3, 130, device=torch.device("cpu")) is a
    assert a.cu_seqlens.tolist() == [0, 130, 260, 390]
    assert a.chunk_indices.tolist() == [[n, c] for n in range(3) for c in range(3)]
    assert a.chunk_offsets.tolist() == [0, 3, 6, 9] and (a.num_seqs, a.num_chunks) == (3, 9)
    b = prepare_chunks(None, 3, 129, device="cpu")
    assert b is not a and b.num_chunks == 9 and a.num_chunks == 9
    assert prepare_chunks(torch.tensor([0, 130]), 1, 130) is not prepare_chunks(torch.tensor([0, 130]), 1, 130)


def test_backend_override_sets_and_restores(monkeypatch):
    import os

    from ttr.kernels.utils import backend_override, kernel_backend

    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    with backend_override("torch"):
        assert kernel_backend(torch.zeros(1)) == "torch"
    assert os.environ["TTR_KERNEL_BACKEND"] == "triton"
    monkeypatch.delenv("TTR_KERNEL_BACKEND")
    with pytest.raises(RuntimeError, match="inside"):
        with backend_override("torch"):
            raise RuntimeError("inside")
    assert "TTR_KERNEL_BACKEND" not in os.environ
    with pytest.raises(ValueError, match="backend"):
        with backend_override("cuda"):
            pass


def test_block_size_is_the_capped_power_of_two():
    """Every stage sizes its tiles with ``block_size``: the next power of two, at least 16, at most the cap."""
    import triton

    for cap in (16, 32, 64, 128, 256):
        for n in range(0, 600):
            assert block_size(n, cap) == min(cap, max(16, triton.next_power_of_2(n))), (n, cap)
