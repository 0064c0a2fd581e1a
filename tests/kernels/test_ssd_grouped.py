"""SSD's grouped stages (``ttr.kernels.ssd.grouped``): one ``C B^T`` per chunk and group, dB and dC
accumulated over the heads of a group.

Stage by stage against the generic engine (the same numbers as ``output_fwd``, ``output_bwd_dv`` with
``state_bwd`` and ``output_bwd_dqk``, plus the group sums and the map to x, dt, A and D, on padded last chunks and packed documents),
then ``chunk_ssd`` / ``chunk_conv_ssd`` against the float64 oracle: groups 1, between and H, state
sizes split over two N blocks and head dims that are not powers of two, packing, initial and final
states, strong decay, the kept-states path and fp16. GPU cases at Mamba2-1.3B's shapes (``-m gpu``).
"""

import pytest
import torch
import torch.nn.functional as F

from ttr.kernels.common.cumsum import chunk_local_cumsum
from ttr.kernels.common.index import prepare_chunks
from ttr.kernels.common.output import output_bwd_dqk, output_bwd_dv, output_fwd
from ttr.kernels.common.state import state_bwd, state_fwd
from ttr.kernels.ssd import chunk_ssd, grouped, reference_ssd

from .conftest import rel_rms
from .test_ssd import SSD_NAMES, check, ssd_inputs
from .test_ssd_conv import check_conv, conv_inputs, with_d


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")


def cu_of(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize(
    "batch,T,lengths,H,G,N,P,dt_max",
    [(2, 65, None, 4, 1, 20, 24, 1.0), (1, 137, [1, 64, 72], 4, 2, 72, 24, 1.0), (1, 100, None, 3, 3, 8, 8, 8.0)],
    ids=["batch2-G1", "packed-G2-Nsplit", "G=H-strong-decay"],
)
def test_stages_match_the_generic_engine(batch, T, lengths, H, G, N, P, dt_max):
    """The grouped stages give the generic stages' numbers on the same inputs: y (and y + D x), dC and
    dB (the engine's per-head dq, dk summed over each group) with the state terms for the row stage,
    and the row stage's dx, ddt, dA and dD from the engine's full dv and gate gradient; the state
    gradient without dv is the same; padded rows of last chunks (T = 65, 72, 100) and strong decay
    (dt_max 8) included."""
    cu = None if lengths is None else cu_of(lengths)
    n = batch if cu is None else len(lengths)
    (x, dt, A, B, C), h0 = ssd_inputs(batch, T, H, G, N, P, h0=True, n=n, dt_max=dt_max)
    do, dht = torch.randn(batch, T, H, P), torch.randn(n, H, N, P)
    plan = prepare_chunks(cu, batch, T)
    gc = chunk_local_cumsum(dt, plan, scale=A)
    v, D = x * dt[..., None], torch.randn(H)
    h, _, _ = state_fwd(B, v, plan, g=gc, initial_state=h0)
    cb = grouped.cb_fwd(C, B, plan)
    y = output_fwd(C, B, v, h, plan, scale=1.0, g=gc)
    # the values scaled inside the state pass: the states of v = x dt as a tensor
    h_scaled, none, _ = state_fwd(B, x, plan, g=gc, u_scale=dt, initial_state=h0)
    assert none is None
    torch.testing.assert_close(h_scaled, h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grouped.output_fwd(C, x, dt, h, cb, gc, plan), y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grouped.output_fwd(C, x, dt, h, cb, gc, plan, D=D), y + D[:, None] * x, rtol=1e-5,
                               atol=1e-5)
    # the state walk forming y itself (chunk_ssd's forward where it can): the same states and y + D x
    h_walk, none, _, y_walk = state_fwd(B, x, plan, g=gc, u_scale=dt, initial_state=h0, q=C, skip=D)
    assert none is None
    torch.testing.assert_close(h_walk, h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y_walk, y + D[:, None] * x, rtol=1e-5, atol=1e-5)
    dh, _, dv = state_bwd(C, B, do, output_bwd_dv(C, B, do, plan, scale=1.0, g=gc), plan, scale=1.0, g=gc,
                          dht=dht)
    dh_alone, _, none = state_bwd(C, B, do, None, plan, scale=1.0, g=gc, dht=dht)
    assert none is None and torch.equal(dh_alone, dh)
    dC, dB, terms = grouped.output_bwd_dcb(C, B, x, dt, h, dh, do, gc, plan)
    dq, dk, _, dgc = output_bwd_dqk(C, B, v, h, dh, do, plan, scale=1.0, g=gc)
    torch.testing.assert_close(dC, dq.view(batch, T, G, H // G, N).sum(3), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(dB, dk.view(batch, T, G, H // G, N).sum(3), rtol=1e-5, atol=1e-4)
    # the state terms it hands the row stage, summed over its N blocks: dy·(C h) and <h, dh>
    y_inter = output_fwd(C, B, torch.zeros_like(v), h, plan, scale=1.0, g=torch.zeros_like(gc))
    torch.testing.assert_close(terms[0].sum(0), (do * y_inter).sum(-1), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(terms[1].sum(0), (h * dh).sum((-2, -1)), rtol=1e-5, atol=1e-4)
    # the row stage: the engine's full dv and gate gradient, mapped back to x, dt, A and D
    dg = chunk_local_cumsum(dgc, plan, reverse=True)
    dx, ddt, dA, dD = grouped.rows_bwd(B, x, dt, A, D, dh, cb, gc, do, terms, plan)
    torch.testing.assert_close(dx, dv * dt[..., None] + D[:, None] * do, rtol=1e-5, atol=1e-4)
    assert rel_rms(ddt, (dv * x).sum(-1) + A * dg) < 1e-5
    # dA sums signed terms over every token, in another order than the engine's: fp32 cancellation
    assert rel_rms(dA, (dg * dt).sum((0, 1))) < 5e-4
    torch.testing.assert_close(dD, (do * x).sum((0, 1, 3)), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("t", [15, 130])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_ssd_vs_oracle(triton_backend, t, groups):
    # N = 72: two N blocks per program of the dB/dC stage; P = 40 not a power of two
    inputs, h0 = ssd_inputs(1, t, 4, groups, 72, 40, h0=True)
    check(chunk_ssd, reference_ssd, inputs, SSD_NAMES, h0)


@pytest.mark.parametrize("walk", [True, False], ids=["walk-forms-y", "output-launch"])
def test_ssd_packed_with_skip(triton_backend, monkeypatch, walk):
    """Three heads per group, documents of length 1 and chunk multiples, D, initial and final states;
    y formed by the state walk and by the output launch after it."""
    from ttr.kernels.common import index

    monkeypatch.setitem(index.TUNING, "ssd_output", {"walk": walk})
    lengths = [1, 64, 72]
    (x, dt, A, B, C), h0 = ssd_inputs(1, sum(lengths), 6, 2, 20, 24, h0=True, n=len(lengths))
    check(with_d(chunk_ssd), with_d(reference_ssd), (x, dt, A, B, C, torch.randn(6)), [*SSD_NAMES, "dD"], h0,
          cu_of(lengths))


def test_walk_output_needs_the_sequential_walk():
    """The walk forms y only over one key block (N <= 128) and not in the two-level pass; the launch
    that the engine falls back to there takes neither SSD's scale of the values nor its skip."""
    (x, dt, A, B, C), _ = ssd_inputs(1, 70, 2, 1, 136, 8)
    plan = prepare_chunks(None, 1, 70)
    gc = chunk_local_cumsum(dt, plan, scale=A)
    with pytest.raises(ValueError, match="gk, u_scale or skip"):
        state_fwd(B, x, plan, g=gc, u_scale=dt, q=C)
    with pytest.raises(ValueError, match="skip is a term of the output"):
        state_fwd(B[..., :8], x, plan, g=gc, u_scale=dt, skip=torch.ones(2))


def test_ssd_strong_decay_finite(triton_backend):
    # T = 100: the partial last chunk's cumulative gate falls far below -88 (exp(-G) overflows fp32)
    inputs, h0 = ssd_inputs(1, 100, 4, 1, 16, 8, h0=True, dt_max=8.0)
    check(chunk_ssd, reference_ssd, inputs, SSD_NAMES, h0, tol_grad={"ddt": 5e-4, "dA": 5e-4})


@pytest.mark.parametrize("packed", [False, True])
def test_ssd_kept_states(triton_backend, monkeypatch, packed):
    from ttr.kernels.common import index

    monkeypatch.setattr(index, "KEEP_STATES_MIN_CHUNKS", 0)
    lengths = [1, 63, 130] if packed else [130]
    inputs, h0 = ssd_inputs(1, sum(lengths), 4, 1, 72, 24, h0=True, n=len(lengths))
    check(chunk_ssd, reference_ssd, inputs, SSD_NAMES, h0, cu_of(lengths) if packed else None)


def test_ssd_fp16(triton_backend):
    # fp16 x/B/C exercise the stages' casts (the interpreter cannot load bf16)
    (x, dt, A, B, C), h0 = ssd_inputs(1, 130, 4, 1, 72, 16, h0=True)
    check(chunk_ssd, reference_ssd, (x.half(), dt, A, B.half(), C.half()), SSD_NAMES, h0, tol=2e-3)


def test_conv_ssd_groups_equal_heads(triton_backend):
    inputs, h0 = conv_inputs(70, 4, 4, 72, 8)
    check_conv(inputs, h0, 4, 72)


# GPU, bf16, at the shapes of Mamba2-1.3B: H = 64 heads of P = 64, N = 128 in one group, and N = 64 in 8.
GPU_SHAPES = [(1, 2048, 1, 128, None), (1, 2048, 8, 64, None), (1, 2048, 1, 128, [0, 1, 64, 1000, 2048])]


@pytest.mark.gpu
@pytest.mark.parametrize("batch,t,groups,n_state,cu", GPU_SHAPES,
                         ids=["G1-N128", "G8-N64", "G1-N128-packed"])
def test_ssd_bf16_mamba2_shape(batch, t, groups, n_state, cu):
    h, p = 64, 64
    n = batch if cu is None else len(cu) - 1
    cu = None if cu is None else torch.tensor(cu, device="cuda", dtype=torch.int32)
    x = torch.randn(batch, t, h, p, device="cuda")
    dt = F.softplus(torch.randn(batch, t, h, device="cuda") - 3.0)
    A = -torch.rand(h, device="cuda").mul(15).add(1)
    B = torch.randn(batch, t, groups, n_state, device="cuda") * n_state**-0.5
    C = torch.randn(batch, t, groups, n_state, device="cuda")
    D, h0 = torch.randn(h, device="cuda"), torch.randn(n, h, n_state, p, device="cuda")
    dy = torch.randn(batch, t, h, p, device="cuda", dtype=torch.float64)
    dht = torch.randn(n, h, n_state, p, device="cuda", dtype=torch.float64)

    def run(fn, tensors):
        leaves = [z.detach().clone().requires_grad_(True) for z in tensors]
        y, ht = fn(*leaves[:5], D=leaves[5], initial_state=leaves[6], output_final_state=True, cu_seqlens=cu)
        ((y.double() * dy).sum() + (ht.double() * dht).sum()).backward()
        return y, ht, [z.grad for z in leaves]

    data = [x.bfloat16(), dt, A, B.bfloat16(), C.bfloat16(), D, h0]
    ref = run(reference_ssd, [z.double() for z in data])
    torch.full((1 << 28,), float("nan"), device="cuda")  # poison the allocator's free blocks
    got = run(chunk_ssd, data)
    assert rel_rms(got[0], ref[0]) < 1e-2, f"y {rel_rms(got[0], ref[0])}"
    assert rel_rms(got[1], ref[1]) < 1e-2, f"final state {rel_rms(got[1], ref[1])}"
    for name, a, r in zip(["dx", "ddt", "dA", "dB", "dC", "dD", "dh0"], got[2], ref[2]):
        assert torch.isfinite(a).all(), name
        limit = 2e-2 if name in ("ddt", "dA") else 1e-2
        assert rel_rms(a, r) < limit, f"{name} {rel_rms(a, r)}"


@pytest.mark.parametrize("N", [72, 40])
@pytest.mark.parametrize("variant", [{"EARLY_LOADS": True}, {"HEADS_FIRST": True},
                                     {"EARLY_LOADS": True, "HEADS_FIRST": True}, {}],
                         ids=["early", "heads-first", "both", "default"])
def test_rows_launch_variants_same_bits(monkeypatch, variant, N):
    """The row stage with B's and dh's tiles loaded before the first product, or its grid heads first,
    or both, or as the heuristic chooses for N, gives the plain launch's dx, ddt, dA and dD bit for
    bit (the same arithmetic in the same order); a padded last chunk and packed documents with two
    heads per group."""
    from ttr.kernels.common import index

    lengths = [1, 64, 72]
    H, G, P = 4, 2, 24
    (x, dt, A, B, C), _ = ssd_inputs(1, sum(lengths), H, G, N, P, h0=True, n=len(lengths))
    do, D = torch.randn(1, sum(lengths), H, P), torch.randn(H)
    plan = prepare_chunks(cu_of(lengths), 1, sum(lengths))
    gc = chunk_local_cumsum(dt, plan, scale=A)
    h, _, _ = state_fwd(B, x, plan, g=gc, u_scale=dt)
    dh, _, _ = state_bwd(C, B, do, None, plan, scale=1.0, g=gc)
    cb = grouped.cb_fwd(C, B, plan)
    _, _, terms = grouped.output_bwd_dcb(C, B, x, dt, h, dh, do, gc, plan)
    monkeypatch.setitem(index.TUNING, "ssd_rows_bwd", {"EARLY_LOADS": False, "HEADS_FIRST": False})
    plain = grouped.rows_bwd(B, x, dt, A, D, dh, cb, gc, do, terms, plan)
    monkeypatch.setitem(index.TUNING, "ssd_rows_bwd", variant)
    for got, want in zip(grouped.rows_bwd(B, x, dt, A, D, dh, cb, gc, do, terms, plan), plain, strict=True):
        assert torch.equal(got, want)
    if variant.get("EARLY_LOADS"):
        # N in two blocks: the early loads hold one block, so the launch refuses
        monkeypatch.setitem(index.TUNING, "ssd_rows_bwd", {**variant, "BK": 32})
        with pytest.raises(ValueError, match="EARLY_LOADS needs N in one block"):
            grouped.rows_bwd(B, x, dt, A, D, dh, cb, gc, do, terms, plan)


def test_rows_heads_first_falls_back_past_the_grid_limit(monkeypatch):
    """More chunks than a grid's second dimension holds: the heads-first launch runs chunks first
    instead (the same bits), so no input is refused for its length."""
    from ttr.kernels.common import index

    H, G, N, P, T = 4, 2, 72, 24, 130
    (x, dt, A, B, C), _ = ssd_inputs(1, T, H, G, N, P, h0=True)
    do = torch.randn(1, T, H, P)
    plan = prepare_chunks(None, 1, T)
    gc = chunk_local_cumsum(dt, plan, scale=A)
    h, _, _ = state_fwd(B, x, plan, g=gc, u_scale=dt)
    dh, _, _ = state_bwd(C, B, do, None, plan, scale=1.0, g=gc)
    cb = grouped.cb_fwd(C, B, plan)
    _, _, terms = grouped.output_bwd_dcb(C, B, x, dt, h, dh, do, gc, plan)
    grids, kernel = [], grouped.rows_bwd_kernel

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(grouped, "rows_bwd_kernel", Spy())
    monkeypatch.setitem(index.TUNING, "ssd_rows_bwd", {"HEADS_FIRST": True})
    first = grouped.rows_bwd(B, x, dt, A, None, dh, cb, gc, do, terms, plan)
    monkeypatch.setattr(index, "MAX_GRID_Y", plan.num_chunks - 1)
    fallback = grouped.rows_bwd(B, x, dt, A, None, dh, cb, gc, do, terms, plan)
    assert grids == [(H, plan.num_chunks), (plan.num_chunks, H)]
    for got, want in zip(fallback, first, strict=True):
        assert (got is None and want is None) or torch.equal(got, want)
