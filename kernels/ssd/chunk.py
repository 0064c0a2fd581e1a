"""Chunkwise simple GLA and Mamba2 SSD in Triton: the engine's stages with a scalar gate.

Forward (chunk size 64, ``ttr.kernels.common``): ``G = chunk_local_cumsum(g)``; states by
``state.state_fwd(k, v, g=G)``; ``o = scale (q ⊙ exp(G)) h + scale (q k^T ⊙ causal ⊙ Γ) v`` by
``output.output_fwd``, ``Γ_ij = exp(G_i - G_j)`` formed as a masked difference (exponent <= 0).

Backward (states ``h`` recomputed, or kept by the forward for long sequences:
``index.KEEP_STATES_MIN_CHUNKS``): ``dv = output_bwd_dv + (k ⊙ exp(G_last - G)) dh`` (``state.state_bwd``, which also gives
``dh`` and ``dh0``); dq, dk and the cumulative-gate gradient ``dG`` from ``output.output_bwd_dqk``:

    dG_i = q_i·dq_i - k_i·dk_i  (every path through exp(G_i - G_j), exp(G_i) and exp(G_last - G_i))
    dG_last += exp(G_last) <h, dh> + sum_j k_j·dk_j^state    (h' = exp(G_last) h + ...)

and since ``G_t = sum_{s <= t in chunk} g_s``, ``dg_t = sum_{s >= t in chunk} dG_s``: the reverse
chunk-local cumulative sum (``chunk_local_cumsum(dG, reverse=True)``).

``chunk_ssd`` runs the same stages on Mamba2's inputs (``q = C, k = B, v = x dt, g = A dt``) as one
autograd node, ``ChunkSSDFunction``: the stages read B and C by group (head h uses group
``h // (H / G)``, no ``[B, T, H, N]`` copies), the chunk cumsum multiplies by ``A`` as it sums, and
``v = x dt`` is one row kernel (``scale_rows``); the backward's row kernel gives ``dx = dv dt`` and
``ddt = sum_p dv x + A dg``, then ``dA = sum dg dt`` and the group sums of dB, dC. The same map as
torch ops around simple GLA costs a sizeable share of a fwd+bwd: casts through fp32 temporaries,
``[B, T, H, N]`` group copies and sums, and one autograd node per op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttr.kernels.common.cumsum import chunk_local_cumsum
from ttr.kernels.common.index import keep_states, prepare_chunks
from ttr.kernels.common.output import output_bwd_dqk, output_bwd_dv, output_fwd
from ttr.kernels.common.state import state_bwd, state_fwd
from ttr.kernels.common.torch_chunk import chunk_torch
from ttr.kernels.gla.reference import check_gla_inputs
from ttr.kernels.ssd.reference import check_ssd_inputs, ssd_as_simple_gla
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
        h = state_fwd(k, v, plan, g=gc, initial_state=initial_state)[0]
    dv_intra = output_bwd_dv(q, k, do, plan, scale=scale, g=gc)
    dh, dh0, dv = state_bwd(q, k, do, dv_intra, plan, scale=scale, g=gc,
                            dht=None if dht is None else dht.contiguous(), need_dh0=initial_state is not None)
    dq, dk, _, dgc = output_bwd_dqk(q, k, v, h, dh, do, plan, scale=scale, g=gc, dk_dtype=k.dtype)
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


@triton.jit
def _rows(x, dt, R, P: tl.constexpr, BR: tl.constexpr, BP: tl.constexpr):
    """This program's BR rows of x ``[R, P]`` (fp32) and dt ``[R]``, with offsets and masks."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BP)
    m_r = rows < R
    m = m_r[:, None] & (cols[None, :] < P)
    offs = rows.to(tl.int64)[:, None] * P + cols[None, :]
    b_x = tl.load(x + offs, mask=m, other=0.).to(tl.float32)
    return rows, offs, m_r, m, b_x, tl.load(dt + rows, mask=m_r, other=0.)


@triton.jit
def scale_rows_fwd_kernel(x, dt, v, R, P: tl.constexpr, BR: tl.constexpr, BP: tl.constexpr):
    rows, offs, m_r, m, b_x, b_dt = _rows(x, dt, R, P, BR, BP)
    tl.store(v + offs, (b_x * b_dt[:, None]).to(v.dtype.element_ty), mask=m)


@triton.jit
def scale_rows_bwd_kernel(x, dt, dv, dg, A, dx, ddt, dA, R, H: tl.constexpr, P: tl.constexpr, BR: tl.constexpr,
                          BP: tl.constexpr, BH: tl.constexpr):
    """``dx = dv dt``, ``ddt = sum_p dv x + dg A[h]`` and this program's part of ``dA[h] = sum dg dt``
    (row r = (b, t, h) of ``[B, T, H]``: the gate ``g = A dt`` shares dt's rows; ``dA`` is
    ``[programs, H]``, summed by the caller)."""
    rows, offs, m_r, m, b_x, b_dt = _rows(x, dt, R, P, BR, BP)
    b_dv = tl.load(dv + offs, mask=m, other=0.).to(tl.float32)
    tl.store(dx + offs, (b_dv * b_dt[:, None]).to(dx.dtype.element_ty), mask=m)
    b_dg = tl.load(dg + rows, mask=m_r, other=0.)
    b_h = rows % H
    tl.store(ddt + rows, tl.sum(b_dv * b_x, 1) + b_dg * tl.load(A + b_h, mask=m_r, other=0.), mask=m_r)
    o_h = tl.arange(0, BH)
    b_da = tl.sum(tl.where(b_h[:, None] == o_h[None, :], (b_dg * b_dt)[:, None], 0.), 0)  # [BH]
    tl.store(dA + tl.program_id(0) * H + o_h, b_da, mask=o_h < H)


def _scale_rows_launch(P: int) -> tuple[int, int]:
    BP = max(16, triton.next_power_of_2(P))
    return BP, max(1, 4096 // BP)


def _group_sum(dy: torch.Tensor, groups: int) -> torch.Tensor:
    """Per-head gradients ``[B, T, H, N]`` of B or C summed over the heads of each of the G groups."""
    B, T, H, N = dy.shape
    return dy if groups == H else dy.view(B, T, groups, H // groups, N).sum(3)


class ChunkSSDFunction(torch.autograd.Function):
    """Mamba2's SSD as one autograd node over simple GLA's stages (module docstring). The map costs no
    torch passes in the forward: the stages read B and C by group (``tile.qk_rows``), ``A dt`` is
    summed by the chunk cumsum and ``x dt`` is one row kernel; the backward adds the row kernel
    (``dx`` and both parts of ``ddt``), the group sums of dB and dC and ``dA``."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, initial_state, output_final_state, cu_seqlens):
        x, dt, A, B, C = (y.contiguous() for y in (x, dt, A, B, C))
        initial_state = None if initial_state is None else initial_state.contiguous()
        batch, T, H, P = x.shape
        plan = prepare_chunks(cu_seqlens, batch, T, device=x.device)
        q, k = C, B  # [batch, T, G, N]: the kernels read head h's group h // (H / G)
        v = torch.empty_like(x)
        BP, BR = _scale_rows_launch(P)
        scale_rows_fwd_kernel[(triton.cdiv(dt.numel(), BR),)](x, dt, v, dt.numel(), P=P, BR=BR, BP=BP)
        gc = chunk_local_cumsum(dt, plan, scale=A)
        o, final, h = _forward(q, k, v, gc, initial_state, 1.0, output_final_state, plan)
        ctx.save_for_backward(x, dt, A, q, k, v, gc, initial_state, h)
        ctx.plan = plan
        return o, final

    @staticmethod
    def backward(ctx, do, dht):
        x, dt, A, q, k, v, gc, initial_state, h = ctx.saved_tensors
        plan = ctx.plan
        dq, dk, dv, dgc, dh0 = _backward(q, k, v, gc, initial_state, h, do, dht, plan, 1.0)
        dg = chunk_local_cumsum(dgc, plan, reverse=True)  # d/d(A dt)
        dx, ddt = torch.empty_like(x), torch.empty_like(dt)
        R, H, P = dt.numel(), dt.shape[2], x.shape[-1]
        BP, BR = _scale_rows_launch(P)
        dA = dt.new_empty(triton.cdiv(R, BR), H)
        scale_rows_bwd_kernel[(dA.shape[0],)](x, dt, dv, dg, A, dx, ddt, dA, R, H=H, P=P, BR=BR, BP=BP,
                                              BH=triton.next_power_of_2(H))
        dA = dA.sum(0)
        G = k.shape[2]
        return dx, ddt, dA, _group_sum(dk, G), _group_sum(dq, G), dh0, None, None


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
    # float64 (oracle inputs) and empty inputs take the torch path: no kernel handles either
    if kernel_backend(q) == "torch" or q.dtype == torch.float64 or q.shape[1] == 0:
        return chunk_torch(q, k, v, g, None, scale, initial_state, output_final_state, cu_seqlens)
    return ChunkSimpleGLAFunction.apply(q, k, v, g, initial_state, scale, output_final_state, cu_seqlens)


@on_input_device
def chunk_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
):
    """Mamba2's state space duality (SSD) mixer, chunkwise: ``S_t = exp(dt_t A) S_{t-1} + B_t (dt_t x_t)^T``, ``y_t = S_t^T C_t``.

    Args:
        x: ``[B, T, H, P]`` (fp32, fp16 or bf16).
        dt: ``[B, T, H]`` fp32 step sizes, already ``softplus(dt + dt_bias)``.
        A: ``[H]`` fp32, negative.
        B, C: ``[B, T, G, N]`` in x's dtype, G groups shared by H / G consecutive heads.
        initial_state: ``[N_seq, H, N, P]`` fp32.
        output_final_state: also return the final states ``[N_seq, H, N, P]`` fp32.
        cu_seqlens: ``[N_seq + 1]`` int32/int64 offsets of packed sequences (batch must be 1), or a
            ``Packing`` from ``prepare_packing`` (no host copy, no re-indexing).

    Returns:
        ``(y [B, T, H, P] in x's dtype, final_state or None)``. No D skip, no gating, no scale:
        those belong to the layer. Gradients flow to x, dt, A, B, C and initial_state.
    """
    check_ssd_inputs(x, dt, A, B, C, initial_state=initial_state, cu_seqlens=cu_seqlens)
    if kernel_backend(x) == "torch" or x.dtype == torch.float64 or x.shape[1] == 0:
        q, k, v, g = ssd_as_simple_gla(x, dt, A, B, C)
        return chunk_torch(q, k, v, g, None, 1.0, initial_state, output_final_state, cu_seqlens)
    return ChunkSSDFunction.apply(x, dt, A, B, C, initial_state, output_final_state, cu_seqlens)
