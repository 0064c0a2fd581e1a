"""``ttr bench --stages``: each engine stage of an op timed on its own, and (``--sweep``) the launch
alternatives of ``SWEEPS`` next to the heuristic defaults, fastest first; a winner becomes the
stage's default in ``kernels/common``. The delta rules and simple GLA run at H = 16, K = V = 128,
GLA at gla-1.3b's H = 16, K = 64, V = 128 (``GLA_STAGE_SHAPE``), SSD at Mamba2-1.3B's shape
(``SSD_STAGE_SHAPE``) and with N = 64 in 8 groups (``SSD_G8_STAGE_SHAPE``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ttr.scripts.bench_kernels import (
    HEAD_DIM,
    HEADS,
    Shape,
    delta_inputs,
    gla_inputs,
    simple_gla_inputs,
    ssd_inputs,
)

# GLA's stages run at gla-1.3b's layer shape: 16 heads of K = 64 keys and V = 128 values
GLA_STAGE_SHAPE = Shape("gla", HEADS, 64, 128)


def _stage_inputs(make_inputs, B: int, T: int, device, shape: Shape | None = None):
    """bf16 inputs of ``shape`` (default H = HEADS, K = V = HEAD_DIM), an output gradient, the scale
    and the chunk plan."""
    from ttr.kernels.common.index import prepare_chunks

    shape = Shape("", HEADS, HEAD_DIM, HEAD_DIM) if shape is None else shape
    x = make_inputs(B, T, shape, torch.bfloat16, device)
    return x, torch.randn_like(x["v"]), shape.K**-0.5, prepare_chunks(None, B, T, device=device)


def delta_stage_calls(B: int, T: int, gated: bool, device) -> dict[str, Callable]:
    """One closure per stage of the (gated) delta rule's forward and backward, on bf16 inputs; the
    total counts the stages the op runs at this shape (under ``TTR_CHUNK_STATES=recompute`` its
    backward also runs the state pass with w, which no closure times)."""
    from ttr.kernels.common.cumsum import chunk_local_cumsum
    from ttr.kernels.common.index import keep_states
    from ttr.kernels.common.output import output_bwd_dqk, output_bwd_dv, output_fwd
    from ttr.kernels.common.state import (
        state_bwd,
        state_fwd,
        walk_forms_dv,
        walk_forms_output,
        walk_reads_scores,
    )
    from ttr.kernels.common.wy import wy_bwd, wy_fwd
    from ttr.kernels.delta.chunk import backward_states
    from ttr.scripts.bench_utils import Stages

    def forward_walk():
        # as the op runs it: the walk forms the output (writing the states only where the op keeps
        # them), or ``output_fwd`` reads its states after it (``TUNING["state_fwd"]["output"]`` chooses)
        if walk_forms_output(gated, scores is not None):
            return state_fwd(k, u, plan, w=w, g=gc, q=q, scale=scale, keep_h=keep_states(plan), scores=scores)[3]
        h, vn, _ = state_fwd(k, u, plan, w=w, g=gc)
        return output_fwd(q, k, vn, h, plan, scale=scale, g=gc)

    def backward_walk():
        # as the op runs it: the walk forms the intra-chunk dv, or takes it from ``output_bwd_dv``,
        # timed with the walk (``TUNING["state_bwd"]["intra_dv"]`` chooses; the default by the gate)
        intra = walk_forms_dv(gated, scores is not None)
        dvl = None if intra else output_bwd_dv(q, k, do, plan, scale=scale, g=gc)
        return state_bwd(q, k, do, dvl, plan, scale=scale, w=w, g=gc, intra_dv=intra,
                         scores=scores if intra else None)

    x, do, scale, plan = _stage_inputs(delta_inputs(gated), B, T, device)
    q, k, v, beta, g = x["q"], x["k"], x["v"], x["beta"], x.get("g")
    gc = chunk_local_cumsum(g, plan) if gated else None
    # with a gate the WY forward also forms the scores the walks read (``walk_reads_scores``)
    qs = q if walk_reads_scores(gated, B * q.shape[2], k.shape[3], v.shape[3], q.device) else None
    w, u, Ai, *kept = wy_fwd(k, v, beta, plan, g=gc, q=qs)
    scores = kept[0] if kept else None
    h, vn, _ = state_fwd(k, u, plan, w=w, g=gc)
    dh, _, dv2 = backward_walk()
    dq, dk, dw, dg = output_bwd_dqk(q, k, vn, h, dh, do, plan, scale=scale, g=gc, dv=dv2)
    calls = Stages({
        "wy_fwd": lambda: wy_fwd(k, v, beta, plan, g=gc, q=qs),
        "wy_fwd_reuse": lambda: wy_fwd(k, v, beta, plan, g=gc, Ai=Ai),
        "state_fwd": forward_walk,
        "state_bwd": backward_walk,
        "output_bwd_dqk": lambda: output_bwd_dqk(q, k, vn, h, dh, do, plan, scale=scale, g=gc, dv=dv2),
        "wy_bwd": lambda: wy_bwd(k, v, beta, Ai, dw, dv2, plan, g=gc, dk=dk, dg=dg),
        # the backward's walk that forms the states again from the kept v_new (without w)
        "state_fwd_again": lambda: state_fwd(k, vn, plan, g=gc, again=True),
    })
    if gated:
        calls["cumsum"] = lambda: chunk_local_cumsum(g, plan)
    else:
        # the dq/dk stage that walks the chunks and forms those states itself (``output.dqk_walks``)
        calls["output_bwd_dqk_walk"] = lambda: output_bwd_dqk(q, k, vn, None, dh, do, plan, scale=scale, dv=dv2)
    # the alternatives the op does not take at this shape (``delta.chunk.backward_states``)
    off = {"kept": {"wy_fwd_reuse", "state_fwd_again", "output_bwd_dqk_walk"},
           "dqk_walk": {"wy_fwd_reuse", "state_fwd_again", "output_bwd_dqk"},
           "walk": {"wy_fwd_reuse", "output_bwd_dqk_walk"},
           "recompute": {"state_fwd_again", "output_bwd_dqk_walk"}}
    calls.off_path = frozenset(off[backward_states(plan, q.shape[2], q.shape[3], v.shape[3], q.device, gated)]
                               & set(calls))
    return calls


def gla_stage_calls(B: int, T: int, device) -> dict[str, Callable]:
    """One closure per stage of chunk_gla's forward and backward, on bf16 inputs."""
    from ttr.kernels.common import intra_vector_gate as vg
    from ttr.kernels.common.cumsum import chunk_local_cumsum
    from ttr.kernels.common.index import keep_states
    from ttr.kernels.common.state import state_fwd
    from ttr.kernels.gla.chunk import GLA_KEEP_STATES_MIN_CHUNKS, state_gradients, states_and_output

    x, do, scale, plan = _stage_inputs(gla_inputs, B, T, device, GLA_STAGE_SHAPE)
    q, k, v, g = x["q"], x["k"], x["v"], x["g"]
    gk = chunk_local_cumsum(g, plan)
    h, _, _ = state_fwd(k, v, plan, gk=gk)
    A = vg.vector_gate_scores(q, k, gk, plan, scale=scale)
    dh, _, _, dA = state_gradients(q, k, v, gk, A, do, plan, scale=scale)
    dqi, dki = vg.vector_gate_intra_bwd(q, k, gk, dA, plan)
    return {
        "cumsum": lambda: chunk_local_cumsum(g, plan),
        # the walks as the op runs them, each with the launch it takes in place of what the walk
        # forms (``TUNING["state_fwd"]["output"]``, ``TUNING["state_bwd"]["intra_dv"]`` choose)
        "state_fwd": lambda: states_and_output(q, k, v, gk, A, plan, scale=scale,
                                               keep_h=keep_states(plan, GLA_KEEP_STATES_MIN_CHUNKS)),
        "vector_gate_scores": lambda: vg.vector_gate_scores(q, k, gk, plan, scale=scale),
        "state_bwd": lambda: state_gradients(q, k, v, gk, A, do, plan, scale=scale),
        "vector_gate_intra_bwd": lambda: vg.vector_gate_intra_bwd(q, k, gk, dA, plan),
        "vector_gate_bwd_dqkg": lambda: vg.vector_gate_bwd_dqkg(q, k, v, gk, h, dh, do, dqi, dki, plan, scale=scale),
    }


def simple_gla_stage_calls(B: int, T: int, device) -> dict[str, Callable]:
    """One closure per stage of chunk_simple_gla's forward and backward, on bf16 inputs."""
    from ttr.kernels.common.cumsum import chunk_local_cumsum
    from ttr.kernels.common.output import output_bwd_dqk, output_bwd_dv, output_fwd
    from ttr.kernels.common.state import state_bwd, state_fwd

    x, do, scale, plan = _stage_inputs(simple_gla_inputs, B, T, device)
    q, k, v, g = x["q"], x["k"], x["v"], x["g"]
    gc = chunk_local_cumsum(g, plan)
    h, _, _ = state_fwd(k, v, plan, g=gc)
    dvi = output_bwd_dv(q, k, do, plan, scale=scale, g=gc)
    dh, _, _ = state_bwd(q, k, do, dvi, plan, scale=scale, g=gc)
    return {
        "cumsum": lambda: chunk_local_cumsum(g, plan),
        "state_fwd": lambda: state_fwd(k, v, plan, g=gc),
        "output_fwd": lambda: output_fwd(q, k, v, h, plan, scale=scale, g=gc),
        "output_bwd_dv": lambda: output_bwd_dv(q, k, do, plan, scale=scale, g=gc),
        "state_bwd": lambda: state_bwd(q, k, do, dvi, plan, scale=scale, g=gc),
        "output_bwd_dqk": lambda: output_bwd_dqk(q, k, v, h, dh, do, plan, scale=scale, g=gc),
        "cumsum_reverse": lambda: chunk_local_cumsum(gc, plan, reverse=True),
    }


# the shapes ``--stages`` times SSD at: Mamba2-1.3B's layer (H = 64, P = 64, N = 128, one group) and
# the preset table's variant with N = 64 in 8 groups
SSD_STAGE_SHAPE = Shape("ssd", 64, 128, 64, groups=1)
SSD_G8_STAGE_SHAPE = Shape("ssd", 64, 64, 64, groups=8)


def ssd_stage_calls(B: int, T: int, device, shape: Shape | None = None) -> dict[str, Callable]:
    """One closure per stage of chunk_ssd's forward and backward at ``shape`` (default
    ``SSD_STAGE_SHAPE``), on bf16 inputs; the keys of the grouped stages are their tuning names.
    ``state_fwd_y`` is the walk forming y, ``state_fwd`` the forward's walk alone and
    ``state_fwd_again`` the backward's (the same walk, tuned apart); the total leaves out the forward
    the op does not take at this shape (``chunk.walk_forms_ssd_output``) and the backward's walk
    where the forward keeps the states."""
    from ttr.kernels.common.cumsum import chunk_local_cumsum
    from ttr.kernels.common.index import keep_states, prepare_chunks
    from ttr.kernels.common.state import state_bwd, state_fwd
    from ttr.kernels.ssd import grouped
    from ttr.kernels.ssd.chunk import walk_forms_ssd_output
    from ttr.scripts.bench_utils import Stages

    shape = SSD_STAGE_SHAPE if shape is None else shape

    x = ssd_inputs(B, T, shape, torch.bfloat16, device)
    xs, dt, A, Bm, C = x["x"], x["dt"], x["A"], x["B"], x["C"]
    D = torch.ones(shape.H, device=device)
    plan = prepare_chunks(None, B, T, device=device)
    do = torch.randn_like(xs)
    gc = chunk_local_cumsum(dt, plan, scale=A)
    h, _, _ = state_fwd(Bm, xs, plan, g=gc, u_scale=dt)
    cb = grouped.cb_fwd(C, Bm, plan)
    dh, _, _ = state_bwd(C, Bm, do, None, plan, scale=1.0, g=gc)
    terms = grouped.output_bwd_dcb(C, Bm, xs, dt, h, dh, do, gc, plan)[2]
    calls = Stages({
        "cumsum": lambda: chunk_local_cumsum(dt, plan, scale=A),
        "state_fwd_y": lambda: state_fwd(Bm, xs, plan, g=gc, u_scale=dt, q=C, skip=D, keep_h=keep_states(plan)),
        "state_fwd": lambda: state_fwd(Bm, xs, plan, g=gc, u_scale=dt),
        "state_fwd_again": lambda: state_fwd(Bm, xs, plan, g=gc, u_scale=dt, again=True),
        "ssd_cb": lambda: grouped.cb_fwd(C, Bm, plan),
        "ssd_output_fwd": lambda: grouped.output_fwd(C, xs, dt, h, cb, gc, plan, D=D),
        "state_bwd": lambda: state_bwd(C, Bm, do, None, plan, scale=1.0, g=gc),
        "ssd_output_bwd_dcb": lambda: grouped.output_bwd_dcb(C, Bm, xs, dt, h, dh, do, gc, plan),
        "ssd_rows_bwd": lambda: grouped.rows_bwd(Bm, xs, dt, A, D, dh, cb, gc, do, terms, plan),
    })
    walk_y = walk_forms_ssd_output(shape.K, shape.V, plan, shape.H, xs.device)
    off = {"ssd_output_fwd", "state_fwd"} if walk_y else {"state_fwd_y"}
    if keep_states(plan):
        off.add("state_fwd_again")
    calls.off_path = frozenset(off)
    return calls


def stage_shapes(name: str) -> list[Shape | None]:
    """The shapes ``--stages`` times op ``name`` at, passed to its closures as a fourth argument
    (None: the op's one shape, no argument): SSD at both of its preset shapes."""
    return [SSD_STAGE_SHAPE, SSD_G8_STAGE_SHAPE] if name == "ssd" else [None]


STAGE_CALLS = {
    "ssd": ssd_stage_calls,
    "gated_delta": lambda B, T, device: delta_stage_calls(B, T, True, device),
    "delta": lambda B, T, device: delta_stage_calls(B, T, False, device),
    "gla": gla_stage_calls,
    "simple_gla": simple_gla_stage_calls,
}

# The sequential state pass with 8 warps (or BV = 32): fewer registers per thread than the 4-warp
# defaults (BV = 64) at K = 128 (scripts/kernel_resources.py).
# One stage with BV < 64 is left out: it gives wrong states on the H200 (state._checked).
STATE_WALK_SWEEP = {
    "state_fwd": [dict(two_level=False, num_warps=8, num_stages=ns) for ns in (2, 3)]
    + [dict(two_level=False, BV=32, num_warps=4, num_stages=3)],
    "state_bwd": [dict(two_level=False, num_warps=8, num_stages=ns, BV=bv) for ns, bv in ((1, 64), (2, 32), (3, 32))]
    + [dict(two_level=False, BV=32, num_warps=4, num_stages=2)],
}
# the backward's walk forming the states again (no w, no output): every width of value block (BV 128
# only on 2 stages, which is all its tiles leave room for), 4 or 8 warps, 2 or 3 stages
STATE_AGAIN_SWEEP = [dict(BV=bv, num_warps=nw, num_stages=ns) for bv in (32, 64, 128) for nw in (4, 8)
                     for ns in (2, 3) if bv < 128 or ns == 2]
# the WY forward's products on 2 or 8 warps and its inverse on 2 or 4; the dq/dk stage in two K blocks
# on 4 or 8 warps or one on 8 (the delta rule's default, the gated one's alternative)
DELTA_SWEEP = {
    "wy_fwd": [dict(num_warps=nw) for nw in (2, 8)],
    "wy_inverse": [dict(num_warps=nw) for nw in (2, 4)],
    "output_bwd_dqk": [dict(BK=64, num_warps=nw) for nw in (4, 8)] + [dict(BK=128, BV=bv, num_warps=8, num_stages=ns)
                                                                  for bv in (32, 64) for ns in (2, 3)]
    # in two K blocks on 4 warps (the gated default) with deeper pipelines, over value blocks of 64 or 32
    + [dict(BK=64, BV=bv, num_warps=4, num_stages=ns) for bv, ns in ((64, 4), (32, 3), (32, 4), (32, 6))],
    **STATE_WALK_SWEEP,
    "state_fwd_again": STATE_AGAIN_SWEEP,
    # the forward walk forming the output or an output launch after it (``state.walk_forms_output``)
    "state_fwd": STATE_WALK_SWEEP["state_fwd"] + [dict(output=o, num_warps=nw, num_stages=ns) for o in (True, False)
                                                  for nw in (4, 8) for ns in (2, 3)],
    # the backward walk forming the intra-chunk dv or reading it from a launch of its own
    # (``state.walk_forms_dv``); over value blocks of 64 or whole rows of 128 (``state._state_blocks``)
    "state_bwd": STATE_WALK_SWEEP["state_bwd"] + [dict(intra_dv=True), dict(intra_dv=False)]
    + [dict(two_level=False, BV=bv, num_warps=8, num_stages=ns) for bv, ns in ((64, 3), (128, 2))]
    # the gated walk reading the kept scores holds no [BT, BT] fp32 tile: 4 warps may fit it
    + [dict(two_level=False, BV=64, num_warps=4, num_stages=ns) for ns in (2, 3)],
}

# Tunings of kernels that run inside another stage's call: ``--sweep`` times that call under their
# name (the two-level state pass's scan, the dB/dC stage's scores-gradient kernel, the WY forward's
# inverse, the gated delta rule's output and intra-chunk dv launches beside its walks); the stage line
# and its total list each call once.
SWEEP_ALIASES = {"state_fwd_scan": "state_fwd", "state_bwd_scan": "state_bwd", "ssd_scores_grad": "ssd_output_bwd_dcb",
                 "wy_inverse": "wy_fwd", "output_fwd": "state_fwd", "output_bwd_dv": "state_bwd",
                 "vector_gate_output": "state_fwd", "vector_gate_dv_dA": "state_bwd"}

# Launch alternatives per op and stage (overrides of ``index.TUNING``) that ``--stages --sweep`` times.
SWEEPS = {
    "gated_delta": {
        # BK 32 is left out: (32, 32) gave an illegal memory access on the H200 (Triton 3.6), after which
        # every later launch of the sweep failed
        "wy_bwd": [dict(BK=bk, BV=bv, num_warps=nw) for bk, bv in ((64, 64), (64, 128), (128, 64), (128, 128))
                   for nw in (4, 8)]
        + [dict(num_stages=ns) for ns in (2, 4)],
        **DELTA_SWEEP,
        # the launches beside the gated walks: the output after the forward walk, the intra-chunk dv
        # before the backward walk (timed through the walk's stage, ``SWEEP_ALIASES``)
        "output_fwd": [dict(BV=bv, num_warps=nw, num_stages=ns) for bv in (64, 128) for nw in (4, 8)
                       for ns in (2, 3, 4)],
        "output_bwd_dv": [dict(num_warps=nw, num_stages=ns) for nw in (2, 4, 8) for ns in (1, 2, 3, 4)],
    },
    "delta": {
        **DELTA_SWEEP,
        # the dq/dk walk on 8 warps, on one stage (two programs per SM), or over the whole key row (one
        # program per sequence and head: half the programs, each step reading v_new, do and dv once)
        "output_bwd_dqk_walk": [dict(BK=64, num_warps=nw, num_stages=ns) for nw, ns in ((8, 2), (4, 1))]
        + [dict(BK=128, num_warps=8, num_stages=1)],
    },
    "gla": {
        "vector_gate_scores": [dict(BK=bk, num_warps=nw, num_stages=ns) for bk in (32, 64) for nw in (2, 4, 8)
                               for ns in (1, 2, 3)],
        "vector_gate_intra_bwd": [dict(BK=bk, num_warps=nw, num_stages=ns) for bk in (32, 64) for nw in (2, 4, 8)
                                  for ns in (1, 2)],
        # and under a cap of 168 registers: three programs per SM instead of two (its epilogue spills)
        "vector_gate_bwd_dqkg": [dict(BK=bk, BV=bv, num_warps=nw, num_stages=ns) for bk in (32, 64)
                                 for bv in (32, 64, 128) for nw in (4, 8) for ns in (1, 2, 3)]
        + [dict(maxnreg=168, num_stages=ns) for ns in (1, 2)],
        "vector_gate_output": [dict(BK=bk, BV=bv, num_warps=nw, num_stages=ns) for bk in (32, 64) for bv in (64, 128)
                               for nw in (4, 8) for ns in (1, 2, 3)],
        # the sequential state pass (two_level=False) against the two-level one's tiles; the walk
        # forming the output or the output launch after it (``state.walk_forms_output``)
        "state_fwd": [dict(two_level=False)] + STATE_WALK_SWEEP["state_fwd"]
        + [dict(output=o, BV=bv, num_warps=nw, num_stages=ns) for o in (True, False) for bv in (32, 64)
           for nw in (4, 8) for ns in (2, 3)],
        # the walk forming dv and dA over whole value rows or ``vector_gate_dv_dA`` before it (the
        # narrower value blocks only for the latter: the former refuses them)
        "state_bwd": [dict(two_level=False)]
        + [dict(c, intra_dv=False) for c in STATE_WALK_SWEEP["state_bwd"]]
        + [dict(intra_dv=dv, num_warps=nw, num_stages=ns) for dv in (True, False) for nw in (4, 8)
           for ns in (1, 2, 3)],
        "state_fwd_scan": [dict(BK=bk, BV=bv, num_warps=nw, num_stages=ns) for bk, bv in ((16, 32), (32, 32),
                           (32, 64), (64, 64)) for nw in (2, 4) for ns in (2, 4)],
        "state_bwd_scan": [dict(BK=bk, BV=bv, num_warps=4, num_stages=ns) for bk, bv in ((16, 32), (32, 32),
                           (32, 64)) for ns in (2, 4)],
    },
    "ssd": {
        "ssd_output_bwd_dcb": [dict(BK=bk, BV=bv, num_warps=nw, num_stages=ns) for bk in (32, 64)
                               for bv in (32, 64) for nw in (4, 8) for ns in (1, 2, 3)],
        "ssd_output_fwd": [dict(BK=bk, BV=bv, num_warps=nw, num_stages=ns) for bk in (32, 64, 128) for bv in (32, 64)
                           for nw in (4, 8) for ns in (2, 3)],
        "ssd_scores_grad": [dict(BV=bv, num_warps=nw, num_stages=ns) for bv in (32, 64) for nw in (2, 4, 8)
                            for ns in (1, 2, 3)],
        # BK 32: an illegal memory access on Hopper (Triton 3.6), as simple GLA's dq/dk stage below
        "ssd_rows_bwd": [dict(BK=bk, num_warps=nw, num_stages=ns) for bk in (64, 128) for nw in (4, 8)
                         for ns in (1, 2, 3)]
        # B's and dh's tiles loaded before the first product or not, the grid heads first or not
        + [dict(EARLY_LOADS=e, HEADS_FIRST=f) for e in (False, True) for f in (False, True)],
        "ssd_cb": [dict(BK=bk, num_warps=nw, num_stages=ns) for bk in (32, 64, 128) for nw in (4, 8)
                   for ns in (1, 2, 3)],
        # and narrower value blocks, for the walks of few long sequences (B*H = 64 at 1 x 16384)
        "state_fwd": [dict(two_level=False), dict(two_level=True)] + STATE_WALK_SWEEP["state_fwd"]
        + [dict(two_level=False, BV=16, num_warps=nw, num_stages=3) for nw in (2, 4)],
        # value blocks of 64 on 4 or 8 warps (the launch of a full grid), against the narrower blocks of
        # a small one
        "state_bwd": [dict(two_level=False), dict(two_level=True)] + STATE_WALK_SWEEP["state_bwd"]
        + [dict(two_level=False, BV=16, num_warps=nw, num_stages=ns) for nw in (2, 4, 8) for ns in (2, 3)]
        + [dict(two_level=False, BV=64, num_warps=nw, num_stages=3) for nw in (4, 8)],
        "state_fwd_again": STATE_AGAIN_SWEEP,
    },
    "simple_gla": {
        # BK 32 is left out: an illegal memory access on Hopper (Triton 3.6), not reproduced by the interpreter
        "output_bwd_dqk": [dict(BK=bk, num_warps=nw, num_stages=ns) for bk in (64, 128) for nw in (4, 8)
                           for ns in (1, 2, 3)],
        "output_fwd": [dict(BV=bv, num_warps=nw, num_stages=ns) for bv in (64, 128) for nw in (4, 8)
                       for ns in (2, 3)],
        "output_bwd_dv": [dict(num_warps=nw, num_stages=ns) for nw in (2, 4, 8) for ns in (1, 2, 3)],
        "state_fwd": [dict(two_level=False), dict(two_level=True)],
        "state_bwd": [dict(two_level=False), dict(two_level=True)],
    },
}

# Every kernel stage's default launch under a register cap (``maxnreg``): at 4 warps, 168 registers
# let 3 programs share an SM and 128 let 4, where a kernel compiled to more than 168 fits 2.
REG_CAPS = (128, 168)
DELTA_STAGES = ("wy_fwd", "state_fwd", "state_bwd", "output_bwd_dqk", "wy_bwd")
CAPPED_STAGES = {
    "gated_delta": DELTA_STAGES,
    "delta": DELTA_STAGES,
    "gla": ("state_fwd", "state_bwd", "vector_gate_scores", "vector_gate_output", "vector_gate_intra_bwd",
            "vector_gate_bwd_dqkg"),
    "ssd": ("state_fwd", "state_bwd", "ssd_cb", "ssd_output_fwd", "ssd_scores_grad", "ssd_output_bwd_dcb",
            "ssd_rows_bwd"),
}
SWEEPS = {op: {**sweep, **{stage: sweep.get(stage, []) + [dict(maxnreg=r) for r in REG_CAPS]
                           for stage in CAPPED_STAGES.get(op, ())}}
          for op, sweep in SWEEPS.items()}


def sweep_stages(parser, value: str | None, ops: list[str]) -> set[str] | None:
    """``--sweep``'s stages: None (no sweep), every stage of ``SWEEPS`` for ``all``, or the named ones;
    a name that no chosen op sweeps is a parser error that names the flag."""
    if value is None:
        return None
    known = sorted({stage for op in ops for stage in SWEEPS.get(op, {})})
    if value == "all":
        return set(known)
    names = set(value.split(","))
    if not names <= set(known):
        parser.error(f"--sweep: unknown stages {sorted(names - set(known))}; expected some of {known}")
    return names


def profile_stages(ops: list[str], shapes: list[tuple[int, int]], sweep: set[str] | None, top: int = 5) -> str:
    """Median ms per stage at the heuristic launch parameters, and per alternative of the ``sweep``
    stages (``SWEEPS``): the ``top`` fastest, or all with ``top=0``."""
    from ttr.scripts.bench_utils import time_stages

    device = torch.device("cuda")
    out = []
    for name in ops:
        alternatives = {k: v for k, v in SWEEPS.get(name, {}).items() if k in sweep} if sweep else None
        for shape in stage_shapes(name):
            for B, T in shapes:
                calls = STAGE_CALLS[name](B, T, device, *([shape] if shape else []))
                label = f"{name} {shape.label() + ' ' if shape else ''}{B}x{T}"
                out += time_stages(calls, label, alternatives, top=top, aliases=SWEEP_ALIASES)
    return "\n".join(out)


def chunk_states_table(todo, choices: list[str], device=None, rounds: int = 3) -> tuple[str, list[dict]]:
    """``ttr bench --chunk-states``: ttr's op of each row of ``todo`` (``bench_kernels.plan``) under each
    ``TTR_CHUNK_STATES`` choice, on one set of inputs, the choices timed in turn ``rounds`` times
    (reversed every other time, so that a drift of the GPU reaches each alike): the GPU time of one
    fwd+bwd (on a CPU the host clock, which measures nothing), the memory the forward holds for the
    backward (its output included: what a model holds per layer), the peak of one fwd+bwd above the
    inputs, and the worst relative difference of the output and gradients from the first choice's."""
    import statistics

    from ttr.kernels.utils import env_override
    from ttr.scripts.bench_kernels import (
        _fwd_bwd_step,
        _gpu_fwd_bwd,
        _inputs,
        _outputs,
        _peak,
        max_rel_error,
        rows,
    )
    from ttr.scripts.bench_utils import time_ms

    device = torch.device(device or "cuda")
    on_gpu = device.type == "cuda"
    table = rows()
    lines = [f"ttr's ops under each TTR_CHUNK_STATES choice, bf16, {rounds} rounds in turn "
             f"({'GPU time' if on_gpu else 'CPU: code paths only, the times measure nothing'})", "",
             "| op | shape | B x T | TTR_CHUNK_STATES | ms fwd+bwd, each round | median | held for the backward, MiB "
             "| peak MiB | diff vs first |", "|---|---|---|---|---|---|---|---|---|"]
    found = []
    for s, B, T in todo:
        row = table[s.op]
        x, do = _inputs(row, B, T, s, device)
        res = {c: {"op": s.op, "shape": s.label(), "B": B, "T": T, "chunk_states": c, "rounds_ms": []}
               for c in choices}
        first = None
        for c, r in res.items():
            with env_override("TTR_CHUNK_STATES", c):
                r["peak_mib"] = _peak(row.ttr, x, do)
                base = torch.cuda.memory_allocated(device) if on_gpu else 0
                out = row.ttr(**x)
                r["held_mib"] = (torch.cuda.memory_allocated(device) - base) / 2**20 if on_gpu else None
                del out
                outputs = _outputs(row.ttr, x, do)
            first = outputs if first is None else first
            r["diff_vs_first"] = max_rel_error(outputs, first)
        for i in range(rounds):
            for c in choices if i % 2 == 0 else choices[::-1]:
                with env_override("TTR_CHUNK_STATES", c):
                    res[c]["rounds_ms"].append(_gpu_fwd_bwd(row.ttr, x, do) if on_gpu else
                                               time_ms(_fwd_bwd_step(row.ttr, x, do), reps=1, warmup=0, device=device))
        for c, r in res.items():
            r["ms"] = statistics.median(r["rounds_ms"])
            cells = [" / ".join(f"{t:.3f}" for t in r["rounds_ms"]), f"{r['ms']:.3f}"]
            cells += ["" if r[key] is None else f"{r[key]:.0f}" for key in ("held_mib", "peak_mib")]
            lines.append(f"| {s.op} | {s.label()} | {B} x {T} | {c} | " + " | ".join(cells)
                         + f" | {r['diff_vs_first']:.1e} |")
            print(lines[-1], flush=True)
            found.append(r)
        del x, do
    return "\n".join(lines), found
