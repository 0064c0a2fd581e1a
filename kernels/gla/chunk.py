"""Chunkwise GLA in Triton: the engine's stages composed (``ttr.kernels.common``).

Forward (chunk size 64): ``G = chunk_local_cumsum(g)``; intra-chunk scores ``A`` by
``intra_vector_gate.vector_gate_scores`` (sub-chunks of 16 with a reference point at a sub-chunk
boundary; the diagonal 16 x 16 blocks as one product when the gate's span inside the sub-chunk keeps
every factor below e^60, else token by token: see that module); states ``h`` by ``state.state_fwd``
with the per-key gate ``gk = G`` and ``o = scale (q ⊙ exp(G)) h + A v``: the sequential walk forms o
from the states it holds and A (``state.walk_forms_output``), the two-level pass of long sequences
leaves it to ``vector_gate_output``.

Backward: ``dv = A^T do`` (with ``dA = scale tril(do v^T)``, from one read of do: formed by
``state.state_bwd``'s walk where one program per sequence and head fills the GPU,
``state.walk_forms_dv_dA``, else by ``vector_gate_dv_dA`` first) completed by ``state.state_bwd``
(which also yields ``dh`` and ``dh0``); dA gives the intra parts of dq and dk;
the inter parts and the gate gradient ``dg`` (reverse cumsum of ``q ⊙ dq - k ⊙ dk`` plus the
state-update terms at the chunk's last row) come from ``vector_gate_bwd_dqkg``. dv goes from stage
to stage in v's dtype; with ``grads_into`` dq, dk and dv are written into a caller's buffers (the
column blocks of its projections' gradient). With ``gate_logits`` g holds the gate's logits: the
cumsum maps them to the log gate as it loads them and ``vector_gate_bwd_dqkg`` maps ``dg`` back to
theirs before it stores (``cumsum.logit_gate``), so the fp32 gate is never written; the logits are
kept in its place.
The forward keeps ``A``, the cumulative gate (in place of the raw gate, which the backward does
not need) and the states ``h`` at any length (``GLA_KEEP_STATES_MIN_CHUNKS``); under
``TTR_CHUNK_STATES=recompute`` the backward forms ``h`` again, on a second stream beside the
stages up to ``vector_gate_bwd_dqkg`` (``common.overlap``).
"""

from __future__ import annotations

import torch

from ttr.kernels.common.cumsum import chunk_local_cumsum
from ttr.kernels.common.index import keep_states, prepare_chunks
from ttr.kernels.common.intra_vector_gate import (
    vector_gate_bwd_dqkg,
    vector_gate_dv_dA,
    vector_gate_intra_bwd,
    vector_gate_output,
    vector_gate_scores,
)
from ttr.kernels.common.overlap import kept_or_beside
from ttr.kernels.common.state import (
    state_bwd,
    state_fwd,
    walk_can_form_output,
    walk_forms_dv_dA,
    walk_forms_output,
)
from ttr.kernels.common.torch_chunk import chunk_torch
from ttr.kernels.gla.reference import check_gla_inputs, logit_gate_of
from ttr.kernels.utils import kernel_backend, on_input_device

# GLA keeps its states at every length by default (``index.keep_states``): at K = V / 2 they are
# twice the size of k (3 GiB at a 1.3B preset's batch of 8 x 4096), and sparing the backward the
# walk that forms them again saves about half the time per byte of the delta rules' kept w and
# v_new, more than the states the other ops leave to ``keep`` would (``index.keep_states``)
GLA_KEEP_STATES_MIN_CHUNKS = 0


def states_and_output(q, k, v, gk, A, plan, *, scale: float, initial_state=None, output_final_state=False,
                      keep_h=True):
    """``(h, final_state, o)``: the states and ``o = scale (q ⊙ exp(G)) h + A v``. The sequential
    walk forms o from the states it holds and the kept A (``state.walk_forms_output``), writing no
    states where ``keep_h`` is off (h None); the two-level pass of long sequences, which holds no
    running state, leaves o to ``vector_gate_output``."""
    if walk_can_form_output(q.shape[3], plan, q.shape[2], gk=gk) and walk_forms_output(True, scores=True):
        h, _, final, o = state_fwd(k, v, plan, gk=gk, initial_state=initial_state,
                                   output_final_state=output_final_state, q=q, scale=scale, keep_h=keep_h, scores=A)
        return h, final, o
    h, _, final = state_fwd(k, v, plan, gk=gk, initial_state=initial_state, output_final_state=output_final_state)
    return h, final, vector_gate_output(q, v, gk, A, h, plan, scale=scale)


def state_gradients(q, k, v, gk, A, do, plan, *, scale: float, dht=None, need_dh0=False, dv_out=None):
    """``(dh, dh0, dv, dA)``: the states' gradients, v's (the intra-chunk ``A^T do`` plus the
    states' share) and ``dA = scale tril(do v^T)``. The state walk forms the intra-chunk dv and dA
    from the do tiles it loads anyway where one program per sequence and head fills the GPU
    (``state.walk_forms_dv_dA``); elsewhere ``vector_gate_dv_dA`` forms them first, from one read of
    do. ``dv_out``: dv's buffer (``state.state_bwd``'s)."""
    if walk_forms_dv_dA(q.shape[3], plan, q.shape[2], q.device, gk=gk):
        return state_bwd(q, k, do, None, plan, scale=scale, gk=gk, dht=dht, need_dh0=need_dh0, dv_out=dv_out,
                         intra_dv=True, scores=A, values=v)
    dv_intra, dA = vector_gate_dv_dA(A, v, do, plan, scale=scale)
    dh, dh0, dv = state_bwd(q, k, do, dv_intra, plan, scale=scale, gk=gk, dht=dht, need_dh0=need_dh0,
                            dv_out=dv_out)
    return dh, dh0, dv, dA


class ChunkGLAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, initial_state, scale, output_final_state, cu_seqlens, gate_logits, grads_into):
        q, k, v, g = (x.contiguous() for x in (q, k, v, g))
        initial_state = None if initial_state is None else initial_state.contiguous()
        plan = prepare_chunks(cu_seqlens, q.shape[0], q.shape[1], device=q.device)
        gk = chunk_local_cumsum(g, plan, logits=gate_logits)
        A = vector_gate_scores(q, k, gk, plan, scale=scale)
        keep = keep_states(plan, GLA_KEEP_STATES_MIN_CHUNKS)
        h, final, o = states_and_output(q, k, v, gk, A, plan, scale=scale, initial_state=initial_state,
                                        output_final_state=output_final_state, keep_h=keep)
        # the cumulative gate in place of the raw one (the backward needs only it): the same memory,
        # no second cumsum pass over [B, T, H, K] fp32
        kept = (h,) if keep else ()
        # with gate_logits the logits (the size of k, in their dtype) for the gate's derivative
        ctx.save_for_backward(q, k, v, gk, A, initial_state, None if gate_logits is None else g, *kept)
        ctx.plan, ctx.scale, ctx.gate_logits, ctx.grads_into = plan, scale, gate_logits, grads_into
        return o, final

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, gk, A, initial_state, z, *kept = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        do = do.contiguous()
        # the states formed again beside the stages up to dq/dk, which do not read them (``overlap``)
        def again():
            return state_fwd(k, v, plan, gk=gk, initial_state=initial_state, again=True)[0]

        states = kept_or_beside(kept[0] if kept else None, again, q.device)
        # the caller's buffers for dq, dk and dv (the column blocks of its projections' gradient)
        into = ctx.grads_into() if ctx.grads_into is not None else (None, None, None)
        dh, dh0, dv, dA = state_gradients(q, k, v, gk, A, do, plan, scale=scale,
                                          dht=None if dht is None else dht.contiguous(),
                                          need_dh0=initial_state is not None, dv_out=into[2])
        dq_intra, dk_intra = vector_gate_intra_bwd(q, k, gk, dA, plan)
        dq, dk, dg = vector_gate_bwd_dqkg(q, k, v, gk, states(), dh, do, dq_intra, dk_intra, plan, scale=scale,
                                          logits=None if z is None else (z, *ctx.gate_logits),
                                          out=None if into[0] is None else into[:2])
        return dq, dk, dv, dg, dh0, None, None, None, None, None


@on_input_device
def chunk_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    gate_logits: tuple[float, float | None] | None = None,
    grads_into=None,
):
    """Gated linear attention, chunkwise (training and prefill).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]`` (fp32, fp16 or bf16, one dtype; float64 takes
            the torch path).
        g: ``[B, T, H, K]`` log gate (fp32, <= 0), the per-key decay ``exp(g)``.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` fp32, N = B (or the number of packed sequences).
        output_final_state: also return the final states ``[N, H, K, V]`` fp32.
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of packed sequences (B must be 1), or a
            ``Packing`` from ``prepare_packing`` (no host copy, no re-indexing).
        gate_logits: ``(normalizer, clamp_min)``: g holds the forget gate's logits z (any float
            dtype) and the gate is ``gla_gate(z, normalizer, clamp_min)``, formed inside the op's
            kernels (the chunks' cumulative sum forward, the dq/dk stage backward): the values of
            ``chunk_gla(q, k, v, gla_gate(z, ...))`` without the fp32 gate written and read each way.
        grads_into: a callable giving the tensors ``(dq, dk, dv)`` that the backward writes q's, k's
            and v's gradients into (their shapes and dtypes, dense heads with evenly spaced tokens:
            ``index.token_stride``; the column blocks of a caller's gradient buffer), called once
            in the backward; None for new tensors. The torch path makes its own.

    Returns:
        ``(o [B, T, H, V] in v's dtype, final_state or None)``. Gradients flow to q, k, v, g (in
        g's dtype) and initial_state.
    """
    if grads_into is not None and not callable(grads_into):
        raise TypeError(f"grads_into must be a callable giving (dq, dk, dv) or None, got {type(grads_into).__name__}")
    _, scale = check_gla_inputs(
        q, k, v, g, vector_gate=True, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
        gate_logits=gate_logits,
    )
    # float64 (oracle inputs) and empty inputs take the torch path: no kernel handles either
    if kernel_backend(q) == "torch" or q.dtype == torch.float64 or q.shape[1] == 0:
        return chunk_torch(q, k, v, logit_gate_of(g, gate_logits), None, scale, initial_state, output_final_state,
                           cu_seqlens)
    if gate_logits is not None:
        gate_logits = (float(gate_logits[0]), None if gate_logits[1] is None else float(gate_logits[1]))
    return ChunkGLAFunction.apply(q, k, v, g, initial_state, scale, output_final_state, cu_seqlens, gate_logits,
                                  grads_into)
