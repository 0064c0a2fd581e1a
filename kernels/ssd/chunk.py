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

``chunk_ssd`` maps Mamba2's inputs onto simple GLA (``q = C, k = B, v = x dt, g = A dt``, groups
repeated over heads) with torch ops, so dx, ddt, dA, dB, dC (group sums) follow by autograd; only
``v = x dt`` and its backward (``dx = dv dt``, ``ddt = sum_p dv x``) are one fused kernel each
(``scale_rows``): as torch ops they ran through fp32 temporaries, six elementwise kernels that
took ~0.6 ms of a 2.1 ms fwd+bwd at 4 x 4096 (H200 profile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttr.kernels.common.cumsum import chunk_local_cumsum
from ttr.kernels.common.index import keep_states, prepare_chunks
from ttr.kernels.common.output import output_bwd_dqk, output_bwd_dv, output_fwd
from ttr.kernels.common.state import state_bwd, state_fwd
from ttr.kernels.gla.reference import check_gla_inputs, chunked
from ttr.kernels.ssd.reference import check_ssd_inputs, ssd_as_simple_gla
from ttr.kernels.utils import kernel_backend


class ChunkSimpleGLAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, initial_state, scale, output_final_state, cu_seqlens):
        q, k, v, g = (x.contiguous() for x in (q, k, v, g))
        initial_state = None if initial_state is None else initial_state.contiguous()
        plan = prepare_chunks(cu_seqlens, q.shape[0], q.shape[1], device=q.device)
        gc = chunk_local_cumsum(g, plan)
        h, _, final = state_fwd(k, v, plan, g=gc, initial_state=initial_state,
                                output_final_state=output_final_state)
        o = output_fwd(q, k, v, h, plan, scale=scale, g=gc)
        ctx.save_for_backward(q, k, v, gc, initial_state, *((h,) if keep_states(plan) else ()))
        ctx.plan, ctx.scale = plan, scale
        return o, final

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, gc, initial_state, *kept = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        do = do.contiguous()
        h = kept[0] if kept else state_fwd(k, v, plan, g=gc, initial_state=initial_state)[0]
        dv_intra = output_bwd_dv(q, k, do, plan, scale=scale, g=gc)
        dh, dh0, dv = state_bwd(q, k, do, dv_intra, plan, scale=scale, g=gc,
                                dht=None if dht is None else dht.contiguous(),
                                need_dh0=initial_state is not None)
        dq, dk, _, dgc = output_bwd_dqk(q, k, v, h, dh, do, plan, scale=scale, g=gc)
        dg = chunk_local_cumsum(dgc, plan, reverse=True)
        return dq, dk.to(k.dtype), dv.to(v.dtype), dg, dh0, None, None, None


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
def scale_rows_bwd_kernel(x, dt, dv, dx, ddt, R, P: tl.constexpr, BR: tl.constexpr, BP: tl.constexpr):
    rows, offs, m_r, m, b_x, b_dt = _rows(x, dt, R, P, BR, BP)
    b_dv = tl.load(dv + offs, mask=m, other=0.).to(tl.float32)
    tl.store(dx + offs, (b_dv * b_dt[:, None]).to(dx.dtype.element_ty), mask=m)
    tl.store(ddt + rows, tl.sum(b_dv * b_x, 1), mask=m_r)


def _scale_rows_launch(P: int) -> tuple[int, int]:
    BP = max(16, triton.next_power_of_2(P))
    return BP, max(1, 4096 // BP)


class ScaleRowsFunction(torch.autograd.Function):
    """``v = x * dt[..., None]`` in x's dtype (products in fp32), x ``[B, T, H, P]``, dt ``[B, T, H]`` fp32."""

    @staticmethod
    def forward(ctx, x, dt):
        x, dt = x.contiguous(), dt.contiguous()
        v = torch.empty_like(x)
        R, P = dt.numel(), x.shape[-1]
        BP, BR = _scale_rows_launch(P)
        scale_rows_fwd_kernel[(triton.cdiv(R, BR),)](x, dt, v, R, P=P, BR=BR, BP=BP)
        ctx.save_for_backward(x, dt)
        return v

    @staticmethod
    def backward(ctx, dv):
        x, dt = ctx.saved_tensors
        dv = dv.contiguous()
        dx, ddt = torch.empty_like(x), torch.empty_like(dt)
        R, P = dt.numel(), x.shape[-1]
        BP, BR = _scale_rows_launch(P)
        scale_rows_bwd_kernel[(triton.cdiv(R, BR),)](x, dt, dv, dx, ddt, R, P=P, BR=BR, BP=BP)
        return dx, ddt


def _simple_gla(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens):
    # float64 (oracle inputs) and empty inputs take the torch path: no kernel handles either
    if kernel_backend(q) == "torch" or q.dtype == torch.float64 or q.shape[1] == 0:
        return chunked(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens)
    return ChunkSimpleGLAFunction.apply(q, k, v, g, initial_state, scale, output_final_state, cu_seqlens)


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
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]`` (fp32, fp16 or bf16, one dtype).
        g: ``[B, T, H]`` log decay (fp32, <= 0).
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` fp32, N = B (or the number of packed sequences).
        output_final_state: also return the final states ``[N, H, K, V]`` fp32.
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of packed sequences (B must be 1).

    Returns:
        ``(o [B, T, H, V] in v's dtype, final_state or None)``.
    """
    _, scale = check_gla_inputs(
        q, k, v, g, vector_gate=False, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens
    )
    return _simple_gla(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens)


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
        cu_seqlens: ``[N_seq + 1]`` offsets of packed sequences (batch must be 1).

    Returns:
        ``(y [B, T, H, P] in x's dtype, final_state or None)``. No D skip, no gating, no scale:
        those belong to the layer. Gradients flow to x, dt, A, B, C and initial_state.
    """
    check_ssd_inputs(x, dt, A, B, C, initial_state=initial_state, cu_seqlens=cu_seqlens)
    fused = kernel_backend(x) == "triton" and x.dtype != torch.float64 and x.shape[1] > 0
    q, k, v, g = ssd_as_simple_gla(x, dt, A, B, C, scale_rows=ScaleRowsFunction.apply if fused else None)
    return _simple_gla(q, k, v, g, 1.0, initial_state, output_final_state, cu_seqlens)
