"""Intra-chunk stage for a per-key-dimension (vector) gate, as in GLA; forward and backward.

With ``G = gk_cum`` the chunk-local cumulative log gate ``[B, T, H, K]`` (non-increasing in t),
the intra-chunk scores of chunk c are

    A_ij = scale * sum_d q_id k_jd exp(G_id - G_jd)        for j <= i (0 above the diagonal)

and the chunk output is ``o = scale * (q ⊙ exp(G)) h + A v`` (``h`` the state before the chunk).

Numerical safety. ``exp(G_id - G_jd) <= 1`` for ``j <= i``, but the factored form
``(q ⊙ exp(G)) (k ⊙ exp(-G))^T`` overflows ``exp(-G)`` under strong decay (g = -5 per token
reaches exp(320) over a 64-token chunk). The chunk (BT = 64) is split into sub-chunks of
BC = 16 and every product is arranged so that no exponent is positive:

- off-diagonal sub-blocks (row sub-chunk r > column sub-chunk s): with the reference point
  ``G_ref = G`` at the first row of sub-chunk r, ``exp(G_i - G_jd) = exp(G_i - G_ref) *
  exp(G_ref - G_j)``; both exponents are <= 0 because ``j < first row of r <= i``, so the
  sub-block is one matrix product of ``q ⊙ exp(G - G_ref)`` and ``k ⊙ exp(G_ref - G)``.
  The backward of dk uses ``G_ref`` at the last row of the column sub-chunk, for the same reason.
- diagonal sub-blocks: element-wise, one token at a time (``[16, BK]`` products of
  ``exp(G_i - G_j)`` per key dimension), with the exponent masked to ``j <= i`` *before* the
  exponential. (One ``[16, 16, BK]`` product measured 2.9x slower on the H200.)

An underflow to 0 of one factor is harmless: the true product is smaller still.

The backward: ``dA = scale * tril(do v^T)`` (``vector_gate_dA``), the intra parts of dq and dk
(``vector_gate_intra_bwd``), and ``vector_gate_bwd_dqkg``, which adds the inter-chunk parts
(through the states ``h`` and their gradients ``dh`` from ``state.state_bwd``) and turns
``dG = q ⊙ dq - k ⊙ dk`` (+ the last-row terms of the state update) into the gradient of the raw
gate by a reverse cumulative sum within the chunk. The gradient of v is ``A^T do``
(``vector_gate_dv``, the intra part that ``state.state_bwd`` completes).

Shapes: q, k, gk_cum ``[B, T, H, K]``; v, do ``[B, T, H, V]``; A, dA ``[B, T, H, BT]`` fp32;
h, dh ``[NT, H, K, V]`` fp32 (per chunk, see ``index.ChunkPlan``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttr.kernels.common.index import ChunkPlan, tuned

SUB_CHUNK = 16
# Launch parameters: each launcher's defaults come from the H200 sweep of
# ``python -m ttr.scripts.bench_rows_gla_ssd --sweep`` (4 x 4096, H = 16, K = V = 128, bf16; the
# numbers beside each launcher) and can be overridden through ``index.TUNING`` under the stage names
# "vector_gate_scores", "vector_gate_output", "vector_gate_dv", "vector_gate_dA",
# "vector_gate_intra_bwd", "vector_gate_bwd_dqkg".
NUM_WARPS = 8


@triton.jit
def vector_gate_scores_kernel(q, k, gk, A, cu_seqlens, chunk_indices, scale, H: tl.constexpr,
                              K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr):
    i_t, i_i, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_c = tl.load(chunk_indices + i_t * 2), tl.load(chunk_indices + i_t * 2 + 1)
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    t0 = bos + i_c * BT
    s_i = t0 + i_i * BC
    if s_i >= eos:
        return
    o_c = tl.arange(0, BC)
    o_i = s_i + o_c
    m_i = o_i < eos
    for i_j in tl.static_range(BT // BC):
        b_A = tl.zeros([BC, BC], dtype=tl.float32)
        if i_j < i_i:
            o_j = t0 + i_j * BC + o_c
            for i_k in range(tl.cdiv(K, BK)):
                o_k = i_k * BK + tl.arange(0, BK)
                m_k = o_k < K
                m_ik = m_i[:, None] & m_k[None, :]
                b_gn = tl.load(gk + (s_i * H + i_h) * K + o_k, mask=m_k, other=0)  # [BK] reference point
                b_q = tl.load(q + (o_i[:, None] * H + i_h) * K + o_k[None, :], mask=m_ik, other=0)  # [BC, BK]
                b_g = tl.load(gk + (o_i[:, None] * H + i_h) * K + o_k[None, :], mask=m_ik, other=0)
                b_qg = b_q.to(tl.float32) * tl.exp(tl.where(m_ik, b_g - b_gn[None, :], 0))
                b_k = tl.load(k + (o_j[:, None] * H + i_h) * K + o_k[None, :], mask=m_k[None, :], other=0)
                b_gk = tl.load(gk + (o_j[:, None] * H + i_h) * K + o_k[None, :], mask=m_k[None, :], other=0)
                b_kg = b_k.to(tl.float32) * tl.exp(b_gn[None, :] - b_gk)  # [BC, BK]
                b_A += tl.dot(b_qg, tl.trans(b_kg))
        elif i_j == i_i:
            for i_k in range(tl.cdiv(K, BK)):
                o_k = i_k * BK + tl.arange(0, BK)
                m_k = o_k < K
                m_ik = m_i[:, None] & m_k[None, :]
                p_ik = (o_i[:, None] * H + i_h) * K + o_k[None, :]
                b_q = tl.load(q + p_ik, mask=m_ik, other=0).to(tl.float32)  # [BC, BK]
                b_g = tl.load(gk + p_ik, mask=m_ik, other=0)
                # one column j at a time: [BC, BK] element-wise, exponent masked to j <= i
                for j in range(BC):
                    p_j = ((s_i + j) * H + i_h) * K + o_k
                    j_ok = s_i + j < eos
                    m_j = o_k < tl.where(j_ok, K, 0)
                    b_kj = tl.load(k + p_j, mask=m_j, other=0).to(tl.float32)
                    b_gj = tl.load(gk + p_j, mask=m_j, other=0)
                    m_e = (o_c >= tl.where(j_ok, j, BC)) & m_i
                    b_e = tl.exp(tl.where(m_e[:, None], b_g - b_gj[None, :], float("-inf")))
                    b_a = tl.sum(b_q * b_kj[None, :] * b_e, 1)
                    b_A += tl.where(o_c[None, :] == j, b_a[:, None], 0)
        p_A = A + (o_i[:, None] * H + i_h) * BT + i_j * BC + o_c[None, :]
        tl.store(p_A, b_A * scale, mask=m_i[:, None])


@triton.jit
def vector_gate_output_kernel(q, v, gk, A, h, o, cu_seqlens, chunk_indices, scale, H: tl.constexpr,
                              K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                              BV: tl.constexpr):
    i_t, i_v, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_c = tl.load(chunk_indices + i_t * 2), tl.load(chunk_indices + i_t * 2 + 1)
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    o_t = bos + i_c * BT + tl.arange(0, BT)
    m_t = o_t < eos
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        b_q = tl.load(q + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0)  # [BT, BK]
        b_g = tl.load(gk + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0)
        b_qg = (b_q.to(tl.float32) * tl.exp(b_g)).to(b_q.dtype)
        p_h = h + ((i_t.to(tl.int64) * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
        b_h = tl.load(p_h, mask=m_k[:, None] & m_v[None, :], other=0).to(b_q.dtype)  # [BK, BV]
        b_o += tl.dot(b_qg, b_h)
    b_A = tl.load(A + (o_t[:, None] * H + i_h) * BT + tl.arange(0, BT)[None, :], mask=m_t[:, None], other=0)
    b_v = tl.load(v + (o_t[:, None] * H + i_h) * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0)
    b_o = b_o * scale + tl.dot(b_A.to(b_v.dtype), b_v)
    p_o = o + (o_t[:, None] * H + i_h) * V + o_v[None, :]
    tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])


@triton.jit
def vector_gate_dv_kernel(A, do, dv, cu_seqlens, chunk_indices, H: tl.constexpr, V: tl.constexpr,
                          BT: tl.constexpr, BV: tl.constexpr):
    i_t, i_v, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_c = tl.load(chunk_indices + i_t * 2), tl.load(chunk_indices + i_t * 2 + 1)
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    o_t = bos + i_c * BT + tl.arange(0, BT)
    m_t = o_t < eos
    o_v = i_v * BV + tl.arange(0, BV)
    m_tv = m_t[:, None] & (o_v < V)[None, :]
    b_A = tl.load(A + (o_t[:, None] * H + i_h) * BT + tl.arange(0, BT)[None, :], mask=m_t[:, None], other=0)
    b_do = tl.load(do + (o_t[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0)  # [BT, BV]
    b_dv = tl.dot(tl.trans(b_A).to(b_do.dtype), b_do)
    tl.store(dv + (o_t[:, None] * H + i_h) * V + o_v[None, :], b_dv.to(dv.dtype.element_ty), mask=m_tv)


@triton.jit
def vector_gate_dA_kernel(v, do, dA, cu_seqlens, chunk_indices, scale, H: tl.constexpr, V: tl.constexpr,
                          BT: tl.constexpr, BV: tl.constexpr):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    i_n, i_c = tl.load(chunk_indices + i_t * 2), tl.load(chunk_indices + i_t * 2 + 1)
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    o_c = tl.arange(0, BT)
    o_t = bos + i_c * BT + o_c
    m_t = o_t < eos
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        b_do = tl.load(do + (o_t[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0)  # [BT, BV]
        b_v = tl.load(v + (o_t[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0)
        b_dA += tl.dot(b_do, tl.trans(b_v))
    b_dA = tl.where(o_c[:, None] >= o_c[None, :], b_dA * scale, 0)
    tl.store(dA + (o_t[:, None] * H + i_h) * BT + o_c[None, :], b_dA, mask=m_t[:, None])


@triton.jit
def vector_gate_intra_bwd_kernel(q, k, gk, dA, dq, dk, cu_seqlens, chunk_indices, H: tl.constexpr,
                                 K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr):
    i_t, i_i, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_c = tl.load(chunk_indices + i_t * 2), tl.load(chunk_indices + i_t * 2 + 1)
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    t0 = bos + i_c * BT
    s_i = t0 + i_i * BC
    if s_i >= eos:
        return
    o_c = tl.arange(0, BC)
    o_i = s_i + o_c
    m_i = o_i < eos
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_ik = m_i[:, None] & m_k[None, :]
        p_ik = (o_i[:, None] * H + i_h) * K + o_k[None, :]
        b_g = tl.load(gk + p_ik, mask=m_ik, other=0)  # [BC, BK]
        # dq of rows in this sub-chunk: earlier sub-chunks through the reference point G(first row)
        b_dq = tl.zeros([BC, BK], dtype=tl.float32)
        b_gn = tl.load(gk + (s_i * H + i_h) * K + o_k, mask=m_k, other=0)
        for i_j in range(i_i):
            o_j = t0 + i_j * BC + o_c
            p_jk = (o_j[:, None] * H + i_h) * K + o_k[None, :]
            b_kj = tl.load(k + p_jk, mask=m_k[None, :], other=0).to(tl.float32)
            b_gj = tl.load(gk + p_jk, mask=m_k[None, :], other=0)
            b_dAij = tl.load(dA + (o_i[:, None] * H + i_h) * BT + i_j * BC + o_c[None, :], mask=m_i[:, None], other=0)
            b_dq += tl.dot(b_dAij, b_kj * tl.exp(b_gn[None, :] - b_gj))
        b_dq *= tl.exp(tl.where(m_ik, b_g - b_gn[None, :], 0))
        # dk of rows in this sub-chunk: later sub-chunks through G(last row of this sub-chunk)
        b_dk = tl.zeros([BC, BK], dtype=tl.float32)
        if s_i + BC < eos:
            b_gl = tl.load(gk + ((s_i + BC - 1) * H + i_h) * K + o_k, mask=m_k, other=0)
            for i_x in range(i_i + 1, BT // BC):
                o_x = t0 + i_x * BC + o_c
                m_x = o_x < eos
                m_xk = m_x[:, None] & m_k[None, :]
                p_xk = (o_x[:, None] * H + i_h) * K + o_k[None, :]
                b_qx = tl.load(q + p_xk, mask=m_xk, other=0).to(tl.float32)
                b_gx = tl.load(gk + p_xk, mask=m_xk, other=0)
                b_qg = b_qx * tl.exp(tl.where(m_xk, b_gx - b_gl[None, :], 0))
                p_dA = dA + (o_x[:, None] * H + i_h) * BT + i_i * BC + o_c[None, :]
                b_dAxi = tl.load(p_dA, mask=m_x[:, None], other=0)  # [BC rows x, BC cols i]
                b_dk += tl.dot(tl.trans(b_dAxi), b_qg)
            b_dk *= tl.exp(tl.where(m_ik, b_gl[None, :] - b_g, 0))
        # the diagonal sub-block one token x at a time, [BC, BK] element-wise: x as the column
        # (dq of rows i >= x) and as the row (dk of rows j <= x); exponents masked before exp
        for x in range(BC):
            p_x = ((s_i + x) * H + i_h) * K + o_k
            x_ok = s_i + x < eos
            m_x = o_k < tl.where(x_ok, K, 0)
            b_kx = tl.load(k + p_x, mask=m_x, other=0).to(tl.float32)
            b_qx = tl.load(q + p_x, mask=m_x, other=0).to(tl.float32)
            b_gx = tl.load(gk + p_x, mask=m_x, other=0)
            p_row = dA + ((s_i + x) * H + i_h) * BT + i_i * BC
            b_dAcol = tl.load(dA + (o_i * H + i_h) * BT + i_i * BC + x, mask=m_i & (o_c >= x), other=0)
            b_dArow = tl.load(p_row + o_c, mask=o_c <= tl.where(x_ok, x, -1), other=0)  # [BC] over j
            b_eq = tl.exp(tl.where(((o_c >= tl.where(x_ok, x, BC)) & m_i)[:, None], b_g - b_gx[None, :],
                                   float("-inf")))
            b_ek = tl.exp(tl.where(((o_c <= tl.where(x_ok, x, -1)) & m_i)[:, None], b_gx[None, :] - b_g,
                                   float("-inf")))
            b_dq += b_dAcol[:, None] * b_eq * b_kx[None, :]
            b_dk += b_dArow[:, None] * b_ek * b_qx[None, :]
        tl.store(dq + p_ik, b_dq, mask=m_ik)
        tl.store(dk + p_ik, b_dk, mask=m_ik)


@triton.jit
def vector_gate_bwd_dqkg_kernel(q, k, v, gk, h, dh, do, dq_intra, dk_intra, dq, dk, dg, cu_seqlens,
                                chunk_indices, scale, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                                BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    i_t, i_k, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_c = tl.load(chunk_indices + i_t * 2), tl.load(chunk_indices + i_t * 2 + 1)
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    o_t = bos + i_c * BT + tl.arange(0, BT)
    m_t = o_t < eos
    last = tl.minimum(bos + i_c * BT + BT, eos) - 1
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_hdh = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        b_do = tl.load(do + (o_t[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0)  # [BT, BV]
        b_v = tl.load(v + (o_t[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0)
        p_h = ((i_t.to(tl.int64) * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
        m_kv = m_k[:, None] & m_v[None, :]
        b_h = tl.load(h + p_h, mask=m_kv, other=0)  # [BK, BV] state before the chunk
        b_dh = tl.load(dh + p_h, mask=m_kv, other=0)  # gradient of the state after the chunk
        b_dq += tl.dot(b_do, tl.trans(b_h).to(b_do.dtype))
        b_dk += tl.dot(b_v, tl.trans(b_dh).to(b_v.dtype))
        b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), 1)
    p_tk = (o_t[:, None] * H + i_h) * K + o_k[None, :]
    b_g = tl.load(gk + p_tk, mask=m_tk, other=0)  # [BT, BK]
    b_gl = tl.load(gk + (last * H + i_h) * K + o_k, mask=m_k, other=0)  # [BK]
    b_q = tl.load(q + p_tk, mask=m_tk, other=0).to(tl.float32)
    b_k = tl.load(k + p_tk, mask=m_tk, other=0).to(tl.float32)
    b_dq = b_dq * tl.exp(b_g) * scale
    b_dk = tl.where(m_tk, b_dk * tl.exp(tl.where(m_tk, b_gl[None, :] - b_g, 0)), 0)
    # the state update h' = exp(G_last) h + (k exp(G_last - G))^T v depends on G_last directly
    b_dgl = b_hdh * tl.exp(b_gl) + tl.sum(b_k * b_dk, 0)
    b_dq += tl.load(dq_intra + p_tk, mask=m_tk, other=0)
    b_dk += tl.load(dk_intra + p_tk, mask=m_tk, other=0)
    b_dG = b_q * b_dq - b_k * b_dk
    b_dG += tl.where((o_t == last)[:, None], b_dgl[None, :], 0)
    b_dG = tl.where(m_tk, b_dG, 0)
    # gradient of the raw gate: reverse cumulative sum within the chunk
    b_dg = tl.sum(b_dG, 0)[None, :] - tl.cumsum(b_dG, 0) + b_dG
    tl.store(dq + p_tk, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + p_tk, b_dk.to(dk.dtype.element_ty), mask=m_tk)
    tl.store(dg + p_tk, b_dg, mask=m_tk)


def _block_k(K: int) -> int:
    return min(max(triton.next_power_of_2(K), 16), 64)


def _block_k_sub(K: int) -> int:
    """K block of the sub-chunk kernels, whose diagonal blocks hold [16, 16, BK] element-wise."""
    return min(max(triton.next_power_of_2(K), 16), 32)


def _block_v(V: int) -> int:
    return min(max(triton.next_power_of_2(V), 16), 64)


def vector_gate_scores(q, k, gk_cum, plan: ChunkPlan, *, scale: float) -> torch.Tensor:
    """``A [B, T, H, BT]`` fp32: the scaled, causal, gate-decayed intra-chunk scores."""
    B, T, H, K = q.shape
    BT = plan.chunk_size
    A = torch.empty(B, T, H, BT, device=q.device, dtype=torch.float32)
    # H200 sweep (4 x 4096, H 16, K 128): the per-token diagonal loop with 2 warps, 1.84 -> 0.64 ms
    cfg = tuned("vector_gate_scores", BK=min(_block_k_sub(K), 32), num_warps=2)
    vector_gate_scores_kernel[(plan.num_chunks, BT // SUB_CHUNK, H)](
        q, k, gk_cum, A, plan.cu_seqlens, plan.chunk_indices, scale, H=H, K=K, BT=BT, BC=SUB_CHUNK, **cfg)
    return A


def vector_gate_output(q, v, gk_cum, A, h, plan: ChunkPlan, *, scale: float) -> torch.Tensor:
    """``o = scale * (q ⊙ exp(G)) h + A v`` in v's dtype."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = torch.empty_like(v)
    # H200 sweep: BV 128 with 4 warps, 0.229 -> 0.149 ms
    cfg = tuned("vector_gate_output", BK=_block_k(K), BV=min(128, max(16, triton.next_power_of_2(V))), num_warps=4)
    vector_gate_output_kernel[(plan.num_chunks, triton.cdiv(V, cfg["BV"]), H)](
        q, v, gk_cum, A, h, o, plan.cu_seqlens, plan.chunk_indices, scale, H=H, K=K, V=V, BT=plan.chunk_size,
        **cfg)
    return o


def vector_gate_dv(A, do, plan: ChunkPlan) -> torch.Tensor:
    """The intra-chunk gradient of v: ``A^T do`` (fp32)."""
    B, T, H, V = do.shape
    dv = torch.empty(do.shape, device=do.device, dtype=torch.float32)
    cfg = tuned("vector_gate_dv", BV=min(128, max(16, triton.next_power_of_2(V))), num_warps=4)  # 0.092 -> 0.073
    vector_gate_dv_kernel[(plan.num_chunks, triton.cdiv(V, cfg["BV"]), H)](
        A, do, dv, plan.cu_seqlens, plan.chunk_indices, H=H, V=V, BT=plan.chunk_size, **cfg)
    return dv


def vector_gate_dA(v, do, plan: ChunkPlan, *, scale: float) -> torch.Tensor:
    """``dA = scale * tril(do v^T)`` per chunk, ``[B, T, H, BT]`` fp32 (includes the score scale)."""
    B, T, H, V = v.shape
    dA = torch.empty(B, T, H, plan.chunk_size, device=v.device, dtype=torch.float32)
    cfg = tuned("vector_gate_dA", BV=_block_v(V), num_warps=NUM_WARPS)
    vector_gate_dA_kernel[(plan.num_chunks, H)](v, do, dA, plan.cu_seqlens, plan.chunk_indices, scale, H=H, V=V,
                                               BT=plan.chunk_size, **cfg)
    return dA


def vector_gate_intra_bwd(q, k, gk_cum, dA, plan: ChunkPlan):
    """Intra-chunk parts of dq and dk (fp32) from ``dA`` (which already holds the scale)."""
    B, T, H, K = q.shape
    dq = torch.empty(q.shape, device=q.device, dtype=torch.float32)
    dk = torch.empty(q.shape, device=q.device, dtype=torch.float32)
    # H200 sweep: the per-token diagonal loop, BK 64, 4 warps: 4.56 -> 1.48 ms
    cfg = tuned("vector_gate_intra_bwd", BK=_block_k(K), num_warps=4)
    vector_gate_intra_bwd_kernel[(plan.num_chunks, plan.chunk_size // SUB_CHUNK, H)](
        q, k, gk_cum, dA, dq, dk, plan.cu_seqlens, plan.chunk_indices, H=H, K=K, BT=plan.chunk_size, BC=SUB_CHUNK,
        **cfg)
    return dq, dk


def vector_gate_bwd_dqkg(q, k, v, gk_cum, h, dh, do, dq_intra, dk_intra, plan: ChunkPlan, *, scale: float):
    """Full dq, dk (input dtypes) and the gradient of the raw gate dg (fp32).

    ``v`` is the value the state update used, ``h[c]`` the state before chunk c and ``dh[c]`` the
    gradient of the state after chunk c (``state.state_bwd``).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dg = torch.empty(q.shape, device=q.device, dtype=torch.float32)
    cfg = tuned("vector_gate_bwd_dqkg", BK=_block_k(K), BV=_block_v(V), num_warps=4)  # sweep: 0.598 -> 0.509
    vector_gate_bwd_dqkg_kernel[(plan.num_chunks, triton.cdiv(K, cfg["BK"]), H)](
        q, k, v, gk_cum, h, dh, do, dq_intra, dk_intra, dq, dk, dg, plan.cu_seqlens, plan.chunk_indices, scale,
        H=H, K=K, V=V, BT=plan.chunk_size, **cfg)
    return dq, dk, dg
