"""Fused recurrent (gated) delta rule for decoding: one program per (sequence, head, V-block)
walks the tokens with the ``[K, BV]`` state slice in registers (forward only).

``S <- exp(g_t) S``, ``S <- S + k_t (b_t (v_t - S^T k_t))^T``, ``o_t = S^T q_t * scale``.
The per-token correction ``S^T k_t`` reduces over K only, so V-blocks are independent.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttr.kernels.common.index import cdiv, next_power_of_2, prepare_chunks, rows_grid
from ttr.kernels.common.tile import grid_ids


@triton.jit
def recurrent_delta_kernel(q, k, v, g, beta, o, h0, ht, cu_seqlens, scale, H: tl.constexpr, K: tl.constexpr,
                           V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr,
                           USE_H0: tl.constexpr, STORE_HT: tl.constexpr, FOLD: tl.constexpr):
    i_v, i_nh, _ = grid_ids(tl.cdiv(V, BV), FOLD)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    p_s = i_nh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(h0 + p_s, mask=m_h, other=0.).to(tl.float32)
    for t in range(bos, eos):
        b_q = tl.load(q + (t * H + i_h) * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_k = tl.load(k + (t * H + i_h) * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_v = tl.load(v + (t * H + i_h) * V + o_v, mask=m_v, other=0.).to(tl.float32)
        b_beta = tl.load(beta + t * H + i_h).to(tl.float32)
        if USE_G:
            b_h *= tl.exp(tl.load(g + t * H + i_h))
        b_v = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))
        b_h += b_k[:, None] * b_v[None, :]
        b_o = tl.sum(b_h * b_q[:, None], 0) * scale
        tl.store(o + (t * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_HT:
        tl.store(ht + p_s, b_h, mask=m_h)


def recurrent_delta_triton(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
    B, T, H, K = q.shape
    V = v.shape[-1]
    plan = prepare_chunks(cu_seqlens, B, T, device=q.device)
    cu, N = plan.cu_seqlens, plan.num_seqs
    BK = max(16, next_power_of_2(K))
    BV = min(32 if BK <= 128 else 16, max(16, next_power_of_2(V)))
    o = torch.empty_like(v)
    ht = q.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    grid, fold = rows_grid(cdiv(V, BV), N * H)
    recurrent_delta_kernel[grid](
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous() if g is not None else None,
        beta.contiguous(), o, h0, ht, cu, scale, H=H, K=K, V=V, BK=BK, BV=BV, USE_G=g is not None,
        USE_H0=h0 is not None, STORE_HT=output_final_state, FOLD=fold, num_warps=4 if BK * BV <= 4096 else 8)
    return o, ht
