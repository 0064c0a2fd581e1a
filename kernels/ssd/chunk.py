"""Chunkwise simple GLA and Mamba2 SSD in Triton: the engine's stages with a scalar gate (SSD's
intra-chunk part by group, ``ssd.grouped``).

Simple GLA's forward (chunk size 64, ``ttr.kernels.common``): ``G = chunk_local_cumsum(g)``; states
by ``state.state_fwd(k, v, g=G)``; ``o = scale (q ⊙ exp(G)) h + scale (q k^T ⊙ causal ⊙ Γ) v`` by
``output.output_fwd``, ``Γ_ij = exp(G_i - G_j)`` formed as a masked difference (exponent <= 0).

Backward (states ``h`` recomputed, or kept by the forward for long sequences:
``index.KEEP_STATES_MIN_CHUNKS``): ``dv = output_bwd_dv + (k ⊙ exp(G_last - G)) dh``
(``state.state_bwd``, which also gives ``dh`` and ``dh0``); dq, dk and the cumulative-gate gradient
``dG`` from ``output.output_bwd_dqk``:

    dG_i = q_i·dq_i - k_i·dk_i  (every path through exp(G_i - G_j), exp(G_i) and exp(G_last - G_i))
    dG_last += exp(G_last) <h, dh> + sum_j k_j·dk_j^state    (h' = exp(G_last) h + ...)

and since ``G_t = sum_{s <= t in chunk} g_s``, ``dg_t = sum_{s >= t in chunk} dG_s``: the reverse
chunk-local cumulative sum (``chunk_local_cumsum(dG, reverse=True)``).

``chunk_ssd`` maps Mamba2's inputs onto the same recurrence (``q = C, k = B, v = x dt, g = A dt``) as
one autograd node, ``ChunkSSDFunction``, with the state stages above and the intra-chunk stages of
``ssd.grouped``, which use that B and C are shared by the ``H / G`` heads of a group (one group
for all 64 heads at 1.3B). Forward: ``CB = C B^T`` once per chunk and group (fp32
``[NT, G, 64, 64]``), states by ``state_fwd`` (B read by group, ``tile.qk_rows``), then per head
``y = (C ⊙ exp(G)) h + (CB ⊙ causal ⊙ Γ) v + D x`` from the CB tile, the skip added in fp32 before
the output's one rounding; at small states where the walks fill the GPU the state walk forms y
itself from the states it holds (``walk_forms_ssd_output``), and reads no CB: the backward forms it
(a forward that formed it only to keep it would hold memory and save the fwd+bwd no time).
Backward: ``state_bwd`` for ``dh`` and ``dh0`` alone, then one program
per (chunk, group, N block) walks the group's heads and accumulates dC and dB in registers
(``grouped.output_bwd_dcb``: ``[B, T, G, N]`` written once, no per-head ``[B, T, H, N]`` gradients
to sum over the group), and one program per (chunk, head) forms the head's full ``dv`` and maps it
to ``dx = dv dt + D dy``, ``ddt = sum_p dv x + A dg`` and the shares of ``dA = sum dg dt`` and
``dD = sum dy x`` (``grouped.rows_bwd``, with the gate's gradient ``dg`` of the engine above). The
chunk cumsum multiplies by ``A`` as it sums, and ``v = x dt`` is never a tensor: the state pass
scales x's rows by dt (``state_fwd(u_scale=dt)``), the output stage the scores' columns, and the
backward's stages read x and dt. The same map as torch ops around simple GLA would cost a sizeable
share of a fwd+bwd: casts through fp32 temporaries, ``[B, T, H, N]`` group copies and sums, and one
autograd node per op.

Memory: the backward keeps x, B, C, dt and the cumulative gate (fp32 like dt: 1/32 of x at P = 64
in bf16), and CB (fp32, ``G * 64`` values a token: 1/32 of x's bytes at one group of 64 heads of 64
in bf16, a quarter at 8 groups) where the output stage formed it, which saves the backward a launch
of the ``64 x 64 x N`` product per chunk and group; ``TTR_CHUNK_STATES=recompute`` forms it again
instead, as it does the delta rules'
kept tensors, since a layer's kept tensors, summed over every layer, bound the batch a GPU can
train. ``chunk_conv_ssd`` (``ChunkConvSSDFunction``) also takes
Mamba2's short conv in: it keeps the conv's input, which the layer keeps anyway (a slice of its
input projection), and runs the conv again in the backward instead of keeping x, B and C.
"""

from __future__ import annotations

import torch

from ttr.kernels.common.cumsum import chunk_local_cumsum
from ttr.kernels.common.index import (
    cdiv,
    chunk_states,
    keep_states,
    prepare_chunks,
    prepare_packing,
    sm_count,
    tuned,
)
from ttr.kernels.common.output import output_bwd_dqk, output_bwd_dv, output_fwd
from ttr.kernels.common.state import state_bwd, state_fwd, walk_can_form_output
from ttr.kernels.common.torch_chunk import chunk_torch
from ttr.kernels.conv import conv_bwd, conv_fwd, rows_in_place, torch_causal_conv1d
from ttr.kernels.gla.reference import check_gla_inputs
from ttr.kernels.ssd import grouped
from ttr.kernels.ssd.reference import (
    check_conv_ssd_inputs,
    check_ssd_inputs,
    skip,
    ssd_as_simple_gla,
    xbc_views,
)
from ttr.kernels.utils import kernel_backend, on_input_device


def _forward(q, k, v, gc, initial_state, scale, output_final_state, plan):
    """Simple GLA's forward on the cumulative gate ``gc``: ``(o, final state, h if kept else None)``."""
    h, _, final = state_fwd(k, v, plan, g=gc, initial_state=initial_state, output_final_state=output_final_state)
    o = output_fwd(q, k, v, h, plan, scale=scale, g=gc)
    return o, final, (h if keep_states(plan) else None)


def _backward(q, k, v, gc, initial_state, h, do, dht, plan, scale):
    """Simple GLA's backward: ``(dq, dk, dv, dgc, dh0)``, dq/dk/dv in the input dtype, ``dgc`` (fp32) in
    cumulative-gate space (``chunk_local_cumsum(dgc, reverse=True)`` turns it into the gate's)."""
    do = do.contiguous()
    if h is None:
        h = state_fwd(k, v, plan, g=gc, initial_state=initial_state, again=True)[0]
    dv_intra = output_bwd_dv(q, k, do, plan, scale=scale, g=gc)
    dh, dh0, dv = state_bwd(q, k, do, dv_intra, plan, scale=scale, g=gc,
                            dht=None if dht is None else dht.contiguous(), need_dh0=initial_state is not None)
    dq, dk, _, dgc = output_bwd_dqk(q, k, v, h, dh, do, plan, scale=scale, g=gc)
    return dq, dk, dv.to(v.dtype), dgc, dh0


class ChunkSimpleGLAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, initial_state, scale, output_final_state, cu_seqlens):
        q, k, v, g = (x.contiguous() for x in (q, k, v, g))
        initial_state = None if initial_state is None else initial_state.contiguous()
        plan = prepare_chunks(cu_seqlens, q.shape[0], q.shape[1], device=q.device)
        gc = chunk_local_cumsum(g, plan)
        o, final, h = _forward(q, k, v, gc, initial_state, scale, output_final_state, plan)
        ctx.save_for_backward(q, k, v, gc, initial_state, h)
        ctx.plan, ctx.scale = plan, scale
        return o, final

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, gc, initial_state, h = ctx.saved_tensors
        dq, dk, dv, dgc, dh0 = _backward(q, k, v, gc, initial_state, h, do, dht, ctx.plan, ctx.scale)
        dg = chunk_local_cumsum(dgc, ctx.plan, reverse=True)
        return dq, dk, dv, dg, dh0, None, None, None


def _ssd_forward(x, dt, A, B, C, D, initial_state, output_final_state, plan):
    """``(y, final state, gc, h if kept else None, CB if kept else None)`` of SSD on contiguous inputs,
    ``y = SSD + D x``, with ``gc`` the chunk-local cumulative gate (fp32 ``[batch, T, H]``, dt's size,
    which the backward keeps rather than summing again). The stages read B and C by group
    (``[batch, T, G, N]``: head h uses group ``h // (H / G)``); the intra-chunk scores ``C B^T`` are
    formed once per chunk and group (``grouped.cb_fwd``) for the output stage, and kept (unless
    ``TTR_CHUNK_STATES=recompute``); where the state walk forms y, the backward forms them."""
    gc = chunk_local_cumsum(dt, plan, scale=A)
    if walk_forms_ssd_output(B.shape[3], x.shape[3], plan, x.shape[2], x.device):
        # the walk forms y without CB, so the backward forms it: the same one launch per fwd+bwd
        h, _, final, o = state_fwd(B, x, plan, g=gc, u_scale=dt, initial_state=initial_state,
                                   output_final_state=output_final_state, q=C, skip=D, keep_h=keep_states(plan))
        return o, final, gc, h, None
    h, _, final = state_fwd(B, x, plan, g=gc, u_scale=dt, initial_state=initial_state,
                            output_final_state=output_final_state)
    cb = grouped.cb_fwd(C, B, plan)
    o = grouped.output_fwd(C, x, dt, h, cb, gc, plan, D=D)
    return o, final, gc, (h if keep_states(plan) else None), (cb if chunk_states() != "recompute" else None)


def walk_forms_ssd_output(N: int, P: int, plan, heads: int, device) -> bool:
    """Whether SSD's forward has its state walk form y (``state_fwd(..., q=C, u_scale=dt, skip=D)``:
    each step adds ``C h``, ``C B^T`` and the scores' product to the state update) rather than
    ``grouped.output_fwd`` after it, which reads the states back; ``TUNING["ssd_output"]["walk"]``
    overrides where the walk can (``state.walk_can_form_output``). By default at states of at most
    64 rows where the walks (one per sequence, head and 64 values) number at least 1.5 per SM. On an
    H200 (bf16, 64 heads of P = 64) at N = 64 in 8 groups the forward timed faster so at 8 x 2048,
    4 x 4096 and 8 x 4096 (at N = 32 and 16 faster or even at 8 x 2048 and 4 x 4096), and slower
    at 2 x 8192 and 1 x 16384, where fewer and longer walks
    wait on each step's three extra products; at N = 128 it lost at every length: the walk
    compiles to 255 registers on 8 warps with a spill, one program per SM (docs/benchmarks.md)."""
    full = plan.num_seqs * heads * cdiv(P, 64) >= 1.5 * sm_count(device)
    walk = bool(tuned("ssd_output", walk=N <= 64 and full)["walk"])
    return walk and walk_can_form_output(N, plan, heads)


def _ssd_backward(x, dt, A, B, C, D, initial_state, gc, h, cb, do, dht, plan):
    """``(dx, ddt, dA, dB, dC, dD, dh0)`` of ``_ssd_forward`` from its kept cumulative gate ``gc``;
    ``C B^T`` (``grouped.cb_fwd``: fp32 ``[NT, G, 64, 64]``) and the states are formed again when the
    forward did not keep them. dB and dC come from ``grouped.output_bwd_dcb`` per group, in B's
    dtype; dx, ddt, dA and dD from ``grouped.rows_bwd``."""
    do = do.contiguous()
    if h is None:
        h = state_fwd(B, x, plan, g=gc, u_scale=dt, initial_state=initial_state, again=True)[0]
    dht = None if dht is None else dht.contiguous()
    dh, dh0, _ = state_bwd(C, B, do, None, plan, scale=1.0, g=gc, dht=dht, need_dh0=initial_state is not None)
    dC, dB, terms = grouped.output_bwd_dcb(C, B, x, dt, h, dh, do, gc, plan)
    if cb is None:
        cb = grouped.cb_fwd(C, B, plan)
    dx, ddt, dA, dD = grouped.rows_bwd(B, x, dt, A, D, dh, cb, gc, do, terms, plan)
    return dx, ddt, dA, dB, dC, dD, dh0


class ChunkSSDFunction(torch.autograd.Function):
    """Mamba2's SSD as one autograd node over the state stages and ``ssd.grouped`` (module docstring).
    The map costs no torch passes in the forward: the stages read B and C by group, ``A dt`` is
    summed by the chunk cumsum, ``x dt`` is formed inside the stages and ``D x`` is added by the output
    stage;
    the backward's row stage gives ``dx``, both parts of ``ddt``, ``dA`` and ``dD``; dB and dC come
    out per group. Kept for the backward: x, dt, B, C, the cumulative gate (and the states of long
    sequences)."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, initial_state, output_final_state, cu_seqlens):
        x, dt, A, B, C = (y.contiguous() for y in (x, dt, A, B, C))
        D = None if D is None else D.contiguous()
        initial_state = None if initial_state is None else initial_state.contiguous()
        plan = prepare_chunks(cu_seqlens, x.shape[0], x.shape[1], device=x.device)
        o, final, gc, h, cb = _ssd_forward(x, dt, A, B, C, D, initial_state, output_final_state, plan)
        ctx.save_for_backward(x, dt, A, B, C, D, initial_state, gc, h, cb)
        ctx.plan = plan
        return o, final

    @staticmethod
    def backward(ctx, do, dht):
        x, dt, A, B, C, D, initial_state, gc, h, cb = ctx.saved_tensors
        dx, ddt, dA, dB, dC, dD, dh0 = _ssd_backward(x, dt, A, B, C, D, initial_state, gc, h, cb, do, dht,
                                                     ctx.plan)
        return dx, ddt, dA, dB, dC, dD, dh0, None, None


def _split_xbc(xbc, heads: int, groups: int, state_size: int):
    """Contiguous ``x``, ``B``, ``C`` of the conv's output (the stages read contiguous rows)."""
    return tuple(t.contiguous() for t in xbc_views(xbc, heads, groups, state_size))


class ChunkConvSSDFunction(torch.autograd.Function):
    """Mamba2's short conv (SiLU) over xBC, then SSD, as one autograd node that keeps the conv's
    input and not its output: the backward runs the conv's forward again (a depthwise conv of width
    W, cheap next to SSD) instead of keeping x, B and C, a tensor of xBC's size per layer. The input
    is read in place when it is a column slice of the layer's input projection, which the layer
    keeps anyway for its gate."""

    @staticmethod
    def forward(ctx, xbc, conv_weight, conv_bias, dt, A, D, initial_state, output_final_state, cu_seqlens, groups,
                state_size):
        xbc, conv_weight = rows_in_place(xbc), conv_weight.contiguous()
        dt, A = dt.contiguous(), A.contiguous()
        D = None if D is None else D.contiguous()
        initial_state = None if initial_state is None else initial_state.contiguous()
        packing = None if cu_seqlens is None else prepare_packing(cu_seqlens, xbc.shape[1], device=xbc.device)
        plan = prepare_chunks(packing, xbc.shape[0], xbc.shape[1], device=xbc.device)
        x, B, C = _split_xbc(conv_fwd(xbc, conv_weight, conv_bias, None, "silu", packing)[0], dt.shape[2], groups,
                             state_size)
        o, final, gc, h, cb = _ssd_forward(x, dt, A, B, C, D, initial_state, output_final_state, plan)
        ctx.save_for_backward(xbc, conv_weight, conv_bias, dt, A, D, initial_state, gc, h, cb)
        ctx.plan, ctx.packing, ctx.groups, ctx.state_size = plan, packing, groups, state_size
        return o, final

    @staticmethod
    def backward(ctx, do, dht):
        xbc, conv_weight, conv_bias, dt, A, D, initial_state, gc, h, cb = ctx.saved_tensors
        x, B, C = _split_xbc(conv_fwd(xbc, conv_weight, conv_bias, None, "silu", ctx.packing)[0], dt.shape[2],
                             ctx.groups, ctx.state_size)
        dx, ddt, dA, dB, dC, dD, dh0 = _ssd_backward(x, dt, A, B, C, D, initial_state, gc, h, cb, do, dht,
                                                     ctx.plan)
        del x, B, C
        dconv = torch.cat([dx.flatten(2), dB.flatten(2), dC.flatten(2)], dim=-1)
        del dx, dB, dC
        dxbc, dw, db, _ = conv_bwd(xbc, conv_weight, conv_bias, None, dconv, None, "silu", ctx.packing)
        return dxbc, dw, db, ddt, dA, dD, dh0, None, None, None, None


def _use_torch(x: torch.Tensor) -> bool:
    # float64 (oracle inputs) and empty inputs take the torch path: no kernel handles either
    return kernel_backend(x) == "torch" or x.dtype == torch.float64 or x.shape[1] == 0


@on_input_device
def chunk_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
):
    """Linear attention with one log decay per head, chunkwise (training and prefill).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]`` (fp32, fp16 or bf16, one dtype; float64 takes
            the torch path).
        g: ``[B, T, H]`` log decay (fp32, <= 0).
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` fp32, N = B (or the number of packed sequences).
        output_final_state: also return the final states ``[N, H, K, V]`` fp32.
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of packed sequences (B must be 1), or a
            ``Packing`` from ``prepare_packing`` (no host copy, no re-indexing).

    Returns:
        ``(o [B, T, H, V] in v's dtype, final_state or None)``. Gradients flow to q, k, v, g and
        initial_state.
    """
    _, scale = check_gla_inputs(
        q, k, v, g, vector_gate=False, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens
    )
    if _use_torch(q):
        return chunk_torch(q, k, v, g, None, scale, initial_state, output_final_state, cu_seqlens)
    return ChunkSimpleGLAFunction.apply(q, k, v, g, initial_state, scale, output_final_state, cu_seqlens)


def _ssd_torch(x, dt, A, B, C, D, initial_state, output_final_state, cu_seqlens):
    q, k, v, g = ssd_as_simple_gla(x, dt, A, B, C)
    y, final = chunk_torch(q, k, v, g, None, 1.0, initial_state, output_final_state, cu_seqlens)
    return skip(y, x, D), final


@on_input_device
def chunk_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
):
    """Mamba2's state space duality (SSD) mixer, chunkwise: ``S_t = exp(dt_t A) S_{t-1} + B_t (dt_t x_t)^T``,
    ``y_t = S_t^T C_t + D x_t``.

    Args:
        x: ``[B, T, H, P]`` (fp32, fp16 or bf16).
        dt: ``[B, T, H]`` fp32 step sizes, already ``softplus(dt + dt_bias)``.
        A: ``[H]`` fp32, negative.
        B, C: ``[B, T, G, N]`` in x's dtype, G groups shared by H / G consecutive heads.
        D: ``[H]`` fp32 skip per head, or None (no skip). Added in fp32 before the output's one
            rounding to x's dtype (the torch form adds it in x's dtype).
        initial_state: ``[N_seq, H, N, P]`` fp32.
        output_final_state: also return the final states ``[N_seq, H, N, P]`` fp32.
        cu_seqlens: ``[N_seq + 1]`` int32/int64 offsets of packed sequences (batch must be 1), or a
            ``Packing`` from ``prepare_packing`` (no host copy, no re-indexing).

    Returns:
        ``(y [B, T, H, P] in x's dtype, final_state or None)``. No gating, no scale: those belong
        to the layer. Gradients flow to x, dt, A, B, C, D and initial_state.
    """
    check_ssd_inputs(x, dt, A, B, C, initial_state=initial_state, cu_seqlens=cu_seqlens, D=D)
    if _use_torch(x):
        return _ssd_torch(x, dt, A, B, C, D, initial_state, output_final_state, cu_seqlens)
    return ChunkSSDFunction.apply(x, dt, A, B, C, D, initial_state, output_final_state, cu_seqlens)


@on_input_device
def chunk_conv_ssd(
    xBC: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    dt: torch.Tensor,
    A: torch.Tensor,
    *,
    groups: int,
    state_size: int,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
):
    """Mamba2's causal short conv with SiLU over ``xBC = [x, B, C]``, then ``chunk_ssd``, as one op
    that keeps xBC for the backward instead of the conv's output (``ChunkConvSSDFunction``).

    Args:
        xBC: ``[B, T, H * P + 2 * groups * state_size]`` (fp32, fp16 or bf16), the columns of x
            (head-major), then B, then C; may be a column slice of a wider tensor.
        conv_weight: ``[H * P + 2 * groups * state_size, W]``, W in 2..4; conv_bias: that many or None.
        dt, A, D, initial_state, output_final_state, cu_seqlens: as ``chunk_ssd``; the conv starts
            every sequence from zeros (no conv state in or out).
        groups, state_size: G and N of B and C.

    Returns:
        ``(y [B, T, H, P] in xBC's dtype, final_state or None)``; gradients flow to xBC, the conv's
        weight and bias, dt, A, D and initial_state.
    """
    check_conv_ssd_inputs(xBC, conv_weight, conv_bias, dt, A, D, groups=groups, state_size=state_size,
                          initial_state=initial_state, cu_seqlens=cu_seqlens)
    if _use_torch(xBC):
        packing = None if cu_seqlens is None else prepare_packing(cu_seqlens, xBC.shape[1], device=xBC.device)
        y, _ = torch_causal_conv1d(xBC, conv_weight, conv_bias, "silu", packing, None, False)
        x, B, C = xbc_views(y, dt.shape[2], groups, state_size)
        return _ssd_torch(x, dt, A, B, C, D, initial_state, output_final_state, cu_seqlens)
    return ChunkConvSSDFunction.apply(xBC, conv_weight, conv_bias, dt, A, D, initial_state, output_final_state,
                                      cu_seqlens, groups, state_size)
