"""The two-level state pass (``two_level.py``, which ``state.py`` runs without ``w``: chunk terms,
then a scan over chunks) against a float64 per-token recursion and against the sequential kernels
it replaces: states
before each chunk, final state, ``dh`` (gradient after each chunk), ``dh0`` and ``dv2``, for the
scalar gate, the per-key gate and no gate; Triton under the interpreter."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from ttr.kernels.common import state, two_level
from ttr.kernels.common.cumsum import chunk_local_cumsum
from ttr.kernels.common.index import TUNING, prepare_chunks
from ttr.kernels.common.state import state_bwd, state_fwd

from .conftest import rel_rms

BT = 64
PACKED = [1, 63, 0, 64, 130]  # an empty document passes its initial state (and dht) through


@pytest.fixture(autouse=True)
def two_level_by_default(monkeypatch):
    """These tests use short sequences, where the heuristic picks the sequential pass: make the
    two-level pass the default here (``sequential()`` still forces the other one)."""
    monkeypatch.setattr(state, "TWO_LEVEL_MIN_CHUNKS", 0)
    monkeypatch.setattr(state, "SCALAR_FWD_TWO_LEVEL_MIN_CHUNKS", 0)
    monkeypatch.setattr(state, "SCALAR_BWD_TWO_LEVEL_MAX_HEADS", 1 << 30)


@contextmanager
def sequential():
    """Runs the sequential kernels (the path the two-level one replaces) inside the block."""
    TUNING["state_fwd"] = TUNING["state_bwd"] = {"two_level": False}
    try:
        yield
    finally:
        TUNING.pop("state_fwd", None)
        TUNING.pop("state_bwd", None)


def make(B, T, H, K, V, gate, *, cu=None, decay=(2.0, 1.0), dtype=torch.float32, h0=True, dht=True):
    """Inputs and their chunk plan; ``decay = (shift, spread)`` of ``logsigmoid(randn * spread - shift)``."""
    N = B if cu is None else len(cu) - 1
    x = dict(q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K) * 0.3, v=torch.randn(B, T, H, V),
             do=torch.randn(B, T, H, V), dv=torch.randn(B, T, H, V))
    x = {n: t.to(dtype) for n, t in x.items()}
    shape = {"g": (B, T, H), "gk": (B, T, H, K)}.get(gate)
    x["g_raw"] = None if shape is None else F.logsigmoid(torch.randn(shape) * decay[1] - decay[0])
    x["h0"] = torch.randn(N, H, K, V) if h0 else None
    x["dht"] = torch.randn(N, H, K, V) if dht else None
    plan = prepare_chunks(None if cu is None else torch.tensor(cu, dtype=torch.int32), B, T)
    x["g_cum"] = None if shape is None else chunk_local_cumsum(x["g_raw"], plan)
    return x, plan


def run(x, plan, gate, scale):
    """``state_fwd`` then ``state_bwd``: ``(h, final, dh, dh0, dv2)``."""
    gates = {gate: x["g_cum"]} if gate else {}
    h, v_new, final = state_fwd(x["k"], x["v"], plan, initial_state=x["h0"], output_final_state=True, **gates)
    assert v_new is x["v"]
    dh, dh0, dv2 = state_bwd(x["q"], x["k"], x["do"], x["dv"], plan, scale=scale, dht=x["dht"],
                             need_dh0=x["h0"] is not None, **gates)
    return h, final, dh, dh0, dv2


def oracle(x, gate, spans, scale):
    """float64: ``S <- decay_t S + k_t v_t^T`` token by token; the loss ``<final, dht> + sum_c
    scale <(q ⊙ exp(g_cum)) h[c], do>`` (the inter-chunk output term the state pass
    back-propagates) gives dh (through the states at chunk ends), dh0 and ``dv2 = dv + dL/dv``."""
    d = {n: (None if t is None else t.double()) for n, t in x.items()}
    H, K, V = d["k"].shape[2], d["k"].shape[3], d["v"].shape[3]
    v = d["v"].requires_grad_(True)
    h0 = d["h0"] if d["h0"] is not None else torch.zeros(len(spans), H, K, V, dtype=torch.float64)
    h0.requires_grad_(True)
    before, after, finals, loss = [], [], [], 0.0
    for n, (b, s, e) in enumerate(spans):
        S = h0[n]
        for t in range(s, e):
            if (t - s) % BT == 0:
                before.append(S)
            if gate == "g":
                S = S * d["g_raw"][b, t].exp()[:, None, None]
            elif gate == "gk":
                S = S * d["g_raw"][b, t].exp()[:, :, None]
            S = S + d["k"][b, t][:, :, None] * v[b, t][:, None, :]
            qg = d["q"][b, t]
            if gate == "g":
                qg = qg * d["g_cum"][b, t].exp()[:, None]
            elif gate == "gk":
                qg = qg * d["g_cum"][b, t].exp()
            loss = loss + scale * torch.einsum("hk,hkv,hv->", qg, before[-1], d["do"][b, t])
            if (t - s) % BT == BT - 1 or t == e - 1:
                S.retain_grad()
                after.append(S)
        finals.append(S)
    final = torch.stack(finals)
    if d["dht"] is not None:
        loss = loss + (final * d["dht"]).sum()
    loss.backward()
    dh = torch.stack([a.grad if a.grad is not None else torch.zeros_like(a) for a in after])
    return torch.stack(before).detach(), final.detach(), dh, h0.grad, d["dv"] + v.grad


def spans_of(B, T, cu):
    return [(b, 0, T) for b in range(B)] if cu is None else [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def check(x, plan, gate, spans, scale, *, tol=1e-5, tol_grad=1e-4, vs_sequential=True):
    got = run(x, plan, gate, scale)
    ref = oracle(x, gate, spans, scale)
    names = ["h", "final", "dh", "dh0", "dv2"]
    for name, a, b in zip(names, got, ref):
        if name == "dh0" and x["h0"] is None:
            assert a is None
            continue
        err = rel_rms(a, b)
        assert err < (tol if name in ("h", "final") else tol_grad), f"{name}: {err}"
    if vs_sequential:
        with sequential():
            old = run(x, plan, gate, scale)
        for name, a, b in zip(names, got, old):
            if b is not None:
                assert rel_rms(a, b) < 1e-5, f"{name} vs sequential: {rel_rms(a, b)}"
    return got


@pytest.mark.parametrize("gate", [None, "g", "gk"])
@pytest.mark.parametrize("layout", ["packed", "batch"])
def test_two_level_matches_oracle_and_sequential(gate, layout):
    """Packed documents of length 1, 63, 0, 64, 130 with initial state and dht; a batch of two
    65-token sequences without either; K != V, neither a power of two."""
    if layout == "packed":
        cu = [0, *torch.tensor(PACKED).cumsum(0).tolist()]
        B, T, opts = 1, sum(PACKED), {}
    else:
        cu, B, T, opts = None, 2, 65, dict(h0=False, dht=False)
    x, plan = make(B, T, 2, 20, 24, gate, cu=cu, **opts)
    check(x, plan, gate, spans_of(B, T, cu), 0.4)


@pytest.mark.parametrize("gate", ["g", "gk"])
def test_two_level_strong_decay_partial_chunk(gate):
    """~ -7 per token: the cumulative gate of the partial last chunk (T = 100) is far below
    log(fp32 min), so padded rows must read the last valid gate (exp(0 - g) would overflow)."""
    x, plan = make(1, 100, 1, 8, 8, gate, decay=(7.0, 0.5))
    assert x["g_cum"][0, 64:].min() < -150
    got = check(x, plan, gate, spans_of(1, 100, None), 1.0)
    assert all(torch.isfinite(t).all() for t in got)


def test_two_level_k256():
    """K = 256 (the sequential pass splits the state in two halves there; the two-level one tiles
    K like any other dim)."""
    x, plan = make(1, 70, 1, 256, 20, "gk")
    check(x, plan, "gk", spans_of(1, 70, None), 256 ** -0.5)


def test_two_level_fp16():
    """16-bit inputs: h and dh in the input dtype, final state and dh0 fp32, dv2 in dv's dtype."""
    x, plan = make(1, 130, 2, 16, 16, "g", dtype=torch.float16)
    x["dv"] = x["dv"].float()  # GLA's intra-chunk dv is fp32
    h, final, dh, dh0, dv2 = check(x, plan, "g", spans_of(1, 130, None), 0.25, tol=2e-3, tol_grad=2e-3,
                                   vs_sequential=False)
    assert (h.dtype, dh.dtype, final.dtype, dh0.dtype, dv2.dtype) == (torch.float16, torch.float16,
                                                                       torch.float32, torch.float32, torch.float32)


@pytest.mark.parametrize("two_level", [True, False])
def test_grouped_qk_equals_repeated(two_level):
    """q/k with HK = 2 heads shared by H / HK = 3 heads each (Mamba2's groups, read in place by
    ``tile.qk_rows``) give what the same call with q/k repeated over the heads gives, on both paths."""
    x, plan = make(1, 130, 6, 16, 12, "g")
    grouped = dict(x, q=x["q"][:, :, ::3].contiguous(), k=x["k"][:, :, ::3].contiguous())
    repeated = dict(x, q=grouped["q"].repeat_interleave(3, 2), k=grouped["k"].repeat_interleave(3, 2))
    TUNING["state_fwd"] = TUNING["state_bwd"] = {"two_level": two_level}
    try:
        got, want = run(grouped, plan, "g", 0.5), run(repeated, plan, "g", 0.5)
    finally:
        TUNING.pop("state_fwd", None)
        TUNING.pop("state_bwd", None)
    for name, a, b in zip(["h", "final", "dh", "dh0", "dv2"], got, want):
        assert a.shape == b.shape and rel_rms(a, b) < 1e-6, name


@pytest.mark.parametrize("two_level", [True, False])
def test_u_scale_equals_scaled_values(two_level):
    """``u_scale`` (SSD's v = x dt, scaled inside the pass) gives the states of the scaled values on
    both paths, packed documents included; no v_new comes back, and the delta rule refuses it."""
    cu = [0, *torch.tensor(PACKED).cumsum(0).tolist()]
    x, plan = make(1, sum(PACKED), 2, 20, 24, "g", cu=cu)
    us = torch.rand(1, sum(PACKED), 2) * 2
    TUNING["state_fwd"] = {"two_level": two_level}
    try:
        h, none, final = state_fwd(x["k"], x["v"], plan, g=x["g_cum"], u_scale=us, initial_state=x["h0"],
                                   output_final_state=True)
        want, _, want_final = state_fwd(x["k"], x["v"] * us[..., None], plan, g=x["g_cum"],
                                        initial_state=x["h0"], output_final_state=True)
    finally:
        TUNING.pop("state_fwd", None)
    assert none is None
    assert rel_rms(h, want) < 1e-6 and rel_rms(final, want_final) < 1e-6
    with pytest.raises(ValueError, match="u_scale"):
        state_fwd(x["k"], x["v"], plan, w=x["k"], u_scale=us)


def test_path_switch(monkeypatch):
    """Without w the two-level pass runs unless TUNING says two_level=False; with w never."""
    calls = []
    scan = two_level.scan
    monkeypatch.setattr(two_level, "scan", lambda *a, **kw: calls.append(kw["stage"]) or scan(*a, **kw))
    x, plan = make(1, 20, 1, 8, 8, "g", h0=False, dht=False)
    run(x, plan, "g", 1.0)
    assert calls == ["state_fwd_scan", "state_bwd_scan"]
    calls.clear()
    with sequential():
        run(x, plan, "g", 1.0)
    state_fwd(x["k"], x["v"], plan, w=x["k"], g=x["g_cum"])
    assert calls == []


def test_walk_again_takes_its_own_launch(monkeypatch):
    """``state_fwd(..., again=True)`` (a backward forming the states again) is launched as TUNING's
    ``state_fwd_again``, not the forward's ``state_fwd``: an override of that key reaches its launch
    and not the forward's, and the states and final state are the same under either launch."""
    stages, launches = [], []
    launch = state._sequential_cfg

    def spy(stage, **cfg):
        stages.append(stage)
        launches.append(launch(stage, **cfg))
        return launches[-1]

    monkeypatch.setattr(state, "_sequential_cfg", spy)
    x, plan = make(1, 150, 2, 16, 32, "g", cu=[0, 70, 150])
    args = (x["k"], x["v"], plan)
    kw = dict(g=x["g_cum"], initial_state=x["h0"], output_final_state=True)
    with sequential():
        fwd = state_fwd(*args, **kw)
        again = state_fwd(*args, **kw, again=True)
    assert stages == ["state_fwd", "state_fwd_again"]
    assert torch.equal(fwd[0], again[0]) and torch.equal(fwd[2], again[2])
    monkeypatch.setitem(TUNING, "state_fwd", {"two_level": False})
    override = {"BV": 16, "num_warps": 2, "num_stages": 2}
    monkeypatch.setitem(TUNING, "state_fwd_again", override)
    h, _, final = state_fwd(*args, **kw, again=True)
    state_fwd(*args, **kw)
    assert stages[2:] == ["state_fwd_again", "state_fwd"]
    assert override.items() <= launches[2].items() and launches[3] == launches[0] != launches[2]
    assert rel_rms(h, fwd[0]) < 1e-6 and rel_rms(final, fwd[2]) < 1e-6


def test_path_heuristic(monkeypatch):
    """Long sequences (on average >= TWO_LEVEL_MIN_CHUNKS chunks) take the two-level pass, short
    ones the sequential walk; the forward with a scalar gate and the delta rules (w) always walk,
    the backward with a scalar gate unless at most SCALAR_BWD_TWO_LEVEL_MAX_HEADS (sequence, head)
    pairs; TUNING overrides."""
    monkeypatch.undo()  # the real threshold
    n = state.TWO_LEVEL_MIN_CHUNKS
    short, long = prepare_chunks(None, 4, 64 * (n - 1)), prepare_chunks(None, 2, 64 * n)
    packed = prepare_chunks(torch.tensor([0, 64 * n + 1, 64 * n + 2]), 1, 64 * n + 2)  # 2 seqs, n + 2 chunks
    gk = torch.empty(0)
    assert not state._two_level("state_fwd", None, short, gk, heads=1)
    assert state._two_level("state_fwd", None, long, gk, heads=1)
    assert state._two_level("state_bwd", None, long, gk, heads=64)
    assert state._two_level("state_bwd", None, long, None, heads=state.SCALAR_BWD_TWO_LEVEL_MAX_HEADS // 2)
    assert not state._two_level("state_bwd", None, long, None, heads=state.SCALAR_BWD_TWO_LEVEL_MAX_HEADS)  # 2 seqs
    assert not state._two_level("state_fwd", None, long, None, heads=1)  # a scalar gate's forward always walks
    assert not state._two_level("state_bwd", None, packed, None, heads=1)
    assert not state._two_level("state_fwd", torch.empty(0), long, gk, heads=1)
    monkeypatch.setitem(TUNING, "state_fwd", {"two_level": True})
    assert state._two_level("state_fwd", None, short, None, heads=1)


def test_walk_launch_heuristic(monkeypatch):
    """The sequential walk's launch on a 132-SM GPU: BV about one program per SM, 8 warps for the
    backward's wide tiles; the scalar gate's backward at K <= 64 on 8 warps and BV <= 32 while
    fewer than 1.5 programs of BV = 64 per SM (SSD at N = 64: 64 and 128 (sequence, head) pairs),
    and not with w, a vector gate, K = 128 or a full grid, and its forward walk at K <= 64 on 2
    stages from three programs per SM; DeltaNet's backward over rows of 128 values at a full grid."""
    monkeypatch.setattr(state, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")

    def blocks(K, V, programs, backward, walk):  # (BV, warps, stages)
        cfg = state._state_blocks(K, V, programs, cuda, 2, backward, walk)[2]
        # the register cap: the scalar gate's backward only
        assert cfg.get("maxnreg") == (168 if backward and walk == "scalar" and K <= 128 else None)
        return cfg["BV"], cfg["num_warps"], cfg["num_stages"]

    assert blocks(64, 64, 64, True, "scalar") == (32, 8, 3)
    assert blocks(64, 64, 128, True, "scalar") == (32, 8, 3)
    assert blocks(64, 64, 256, True, "scalar") == (64, 4, 3)  # 4 x 4096
    assert blocks(64, 64, 512, True, "scalar") == (64, 4, 3)
    assert blocks(64, 64, 64, False, "scalar") == (32, 4, 3)  # the forward keeps its launch
    # the scalar gate's walk of the states alone at K <= 64 on 2 stages from three programs per SM (SSD
    # at N = 64: 512 (sequence, head) pairs at 8 x 2048), so that two share an SM; not below, not at
    # K = 128, not the walk forming the output
    assert blocks(64, 64, 512, False, "scalar") == (64, 4, 2)
    assert blocks(64, 64, 256, False, "scalar") == (64, 4, 3)
    assert blocks(128, 64, 512, False, "scalar") == (64, 8, 3)
    assert state._state_blocks(64, 64, 512, cuda, 2, False, "scalar", forms=True)[2]["num_stages"] == 3
    assert blocks(64, 64, 128, True, "delta") == (64, 4, 3)
    # DeltaNet's backward over whole rows of 128 values once one program per (sequence, head) fills
    # the GPU; not with half a grid, a gate, fp32, a forward or K beyond one block of 128
    assert blocks(128, 128, 128, True, "delta") == (128, 8, 2)
    assert blocks(128, 256, 64, True, "delta") == (128, 8, 2)
    assert blocks(128, 128, 64, True, "delta") == (64, 8, 3)
    assert state._state_blocks(128, 128, 128, cuda, 2, True, "delta", gate=True)[2]["BV"] == 64
    assert state._state_blocks(128, 128, 128, cuda, 4, True, "delta")[2]["BV"] == 64
    assert blocks(128, 128, 128, False, "delta") == (64, 4, 3)
    assert blocks(64, 128, 128, True, "delta") == (64, 4, 3)
    assert state._state_blocks(256, 256, 128, cuda, 2, True, "delta")[2]["BV"] == 64
    assert blocks(64, 64, 128, True, "vector") == (64, 4, 3)
    # GLA-1.3B's forward walk (K = 64, V = 128) forming the output: 2 stages where the grid needs
    # two programs per SM (8 x 2048: 128 (sequence, head) pairs), 3 where one per SM covers it (4 x 4096)
    output = [state._state_blocks(64, 128, n, cuda, 2, False, "vector", forms=True)[2] for n in (128, 64)]
    assert [(c["BV"], c["num_warps"], c["num_stages"]) for c in output] == [(64, 4, 2), (64, 4, 3)]
    assert blocks(64, 128, 128, False, "vector") == (64, 4, 3)
    # its backward walk forming dv and dA: whole value rows on 2 stages, at any grid
    rows = [state._state_blocks(64, 128, n, cuda, 2, True, "vector", forms=True)[2] for n in (128, 16)]
    assert [(c["BV"], c["num_warps"], c["num_stages"]) for c in rows] == [(128, 8, 2), (128, 8, 2)]
    assert blocks(128, 64, 64, True, "scalar") == (32, 4, 3)
    assert blocks(128, 64, 128, True, "scalar") == (64, 8, 3)
