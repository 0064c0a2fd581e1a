"""Chunkwise (gated) delta rule: the autograd Function composing ``ttr.kernels.common``.

Forward: chunk-local cumsum of g -> WY (w, u, (I + A)^-1, and with a gate, where the walks fill
the GPU, the chunks' scores ``q k^T ⊙ causal ⊙ Γ``, kept: ``state.walk_reads_scores``) -> state
pass (h, v_new) -> output, which the state walk forms itself from the states it holds, with a gate
only from kept scores, else a launch after it (``state.walk_forms_output``: the states are then
written only if kept).
Backward: w, h and v_new (recomputed from the saved inverse, or kept, see below), then: reverse
state pass (dh, dh0, and the full dv, whose intra-chunk part the walk forms from the q, k and do
tiles it reads anyway, or with a gate from the kept scores, else a launch before it:
``state.walk_forms_dv``) -> dq, dk, dw,
dg -> WY backward (dk, dv, dbeta, dg), whose last step maps dg from cumulative back to raw gates.

Keep or recompute (``TTR_CHUNK_STATES``, ``index.chunk_states``): the backward needs w, h and
v_new. ``h`` is ``[NT, H, K, V]`` in the input dtype (V/64 times the size of k), w and v_new the
size of k and v. When the sequences average at least ``index.KEEP_STATES_MIN_CHUNKS`` chunks (or
with ``keep``) the forward keeps all three. Otherwise, by default, it keeps w and v_new and the
backward walks the chunks again without w: with v_new given, the state update needs neither the
WY stage nor the ``w h`` product, so it is the cheaper walk of GLA and SSD (the forward's update
reads v_new as stored, so both walks form the states from the same operands). Without a gate,
where the grid is full (``output.dqk_walks``), that walk is the dq/dk stage itself: it forms each
state in registers as it goes, so h is never stored. ``backward_states`` names the four ways.
``recompute`` keeps none of them, nor the scores: the backward forms w and u (and the scores) again
from the kept inverse and runs the full state pass, the least memory.
"""

from __future__ import annotations

import torch

from ttr.kernels.common.cumsum import chunk_local_cumsum
from ttr.kernels.common.index import chunk_states, keep_states, prepare_chunks
from ttr.kernels.common.output import dqk_walks, output_bwd_dqk, output_bwd_dv, output_fwd
from ttr.kernels.common.state import state_bwd, state_fwd, walk_forms_dv, walk_forms_output, walk_reads_scores
from ttr.kernels.common.wy import wy_bwd, wy_fwd


def backward_states(plan, heads: int, K: int, V: int, device: torch.device, gated: bool) -> str:
    """How the op's backward has the chunk states (the module docstring): "kept" (the forward keeps
    w, h and v_new), "dqk_walk" (it keeps w and v_new, and the dq/dk stage forms h as it walks),
    "walk" (it keeps w and v_new, and a walk without w forms h again) or "recompute" (nothing kept)."""
    if keep_states(plan):
        return "kept"
    if chunk_states() == "recompute":
        return "recompute"
    return "dqk_walk" if dqk_walks(plan, heads, K, V, device, gated) else "walk"


class ChunkDeltaRuleFunction(torch.autograd.Function):
    """``(o, final_state)`` of validated inputs (``ttr.kernels.delta``): the stages above."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
        q, k, v, beta = (x.contiguous() for x in (q, k, v, beta))
        g = g.contiguous() if g is not None else None
        initial_state = initial_state.contiguous() if initial_state is not None else None
        B, T = q.shape[:2]
        plan = prepare_chunks(cu_seqlens, B, T, device=q.device)
        g_cum = chunk_local_cumsum(g, plan) if g is not None else None
        gated = g is not None
        if walk_reads_scores(gated, plan.num_seqs * q.shape[2], k.shape[3], v.shape[3], q.device):
            w, u, Ai, scores = wy_fwd(k, v, beta, plan, g=g_cum, q=q)
        else:
            (w, u, Ai), scores = wy_fwd(k, v, beta, plan, g=g_cum), None
        states = backward_states(plan, q.shape[2], k.shape[3], v.shape[3], q.device, gated=gated)
        keep_h = states == "kept"
        if walk_forms_output(gated, scores is not None):
            h, v_new, ht, o = state_fwd(k, u, plan, w=w, g=g_cum, initial_state=initial_state,
                                        output_final_state=output_final_state, q=q, scale=scale, keep_h=keep_h,
                                        scores=scores)
        else:
            h, v_new, ht = state_fwd(k, u, plan, w=w, g=g_cum, initial_state=initial_state,
                                     output_final_state=output_final_state)
            o = output_fwd(q, k, v_new, h, plan, scale=scale, g=g_cum)
        kept = (w, h, v_new) if keep_h else () if states == "recompute" else (w, v_new)
        # under ``recompute`` the scores are formed again with w and u rather than kept
        ctx.scored = scores is not None
        ctx.save_for_backward(q, k, v, g_cum, beta, Ai, initial_state, None if states == "recompute" else scores, *kept)
        ctx.plan, ctx.scale, ctx.states = plan, scale, states
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g_cum, beta, Ai, h0, scores, *kept = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        do = do.contiguous()
        dht = dht.contiguous() if dht is not None else None
        if ctx.states == "kept":
            w, h, v_new = kept
        elif kept:
            w, v_new = kept
            h = None
            if ctx.states != "dqk_walk":
                h = state_fwd(k, v_new, plan, g=g_cum, initial_state=h0, again=True)[0]
        else:
            w, u, _, *again = wy_fwd(k, v, beta, plan, g=g_cum, Ai=Ai, q=q if ctx.scored else None)
            scores = again[0] if again else None
            h, v_new, _ = state_fwd(k, u, plan, w=w, g=g_cum, initial_state=h0)
        intra = walk_forms_dv(g_cum is not None, scores is not None)
        dv = None if intra else output_bwd_dv(q, k, do, plan, scale=scale, g=g_cum)
        dh, dh0, dv = state_bwd(q, k, do, dv, plan, scale=scale, w=w, g=g_cum, dht=dht, need_dh0=h0 is not None,
                                intra_dv=intra, scores=scores if intra else None)
        dq, dk, dw, dg = output_bwd_dqk(q, k, v_new, h, dh, do, plan, scale=scale, g=g_cum, dv=dv, h0=h0)
        dk, dv, dbeta, dg = wy_bwd(k, v, beta, Ai, dw, dv, plan, g=g_cum, dk=dk, dg=dg)
        if dh0 is not None:
            dh0 = dh0.to(h0.dtype)
        return dq, dk, dv, dg, dbeta, None, dh0, None, None

