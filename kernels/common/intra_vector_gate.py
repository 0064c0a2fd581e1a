"""Intra-chunk stage for a per-key-dimension (vector) gate, as in GLA; forward and backward.

With ``G = gk_cum`` the chunk-local cumulative log gate ``[B, T, H, K]`` (non-increasing in t),
the intra-chunk scores of chunk c are

    A_ij = scale * sum_d q_id k_jd exp(G_id - G_jd)        for j <= i (0 above the diagonal)

and the chunk output is ``o = scale * (q ⊙ exp(G)) h + A v`` (``h`` the state before the chunk).

Numerical safety. ``exp(G_id - G_jd) <= 1`` for ``j <= i``, but the factored form
``(q ⊙ exp(G)) (k ⊙ exp(-G))^T`` overflows ``exp(-G)`` under strong decay (g = -5 per token
reaches exp(320) over a 64-token chunk). The chunk (BT = 64) is split into sub-chunks of BC = 16;
one program handles the rows of one sub-chunk r (rows ``s .. s + BC - 1``, valid up to the last
valid row ``l``) and factors every product through a reference point of that sub-chunk:

- off-diagonal sub-blocks (columns j of earlier sub-chunks): with ``G_ref = G_s`` (the first row),
  ``exp(G_i - G_j) = exp(G_i - G_ref) * exp(G_ref - G_j)`` and both exponents are <= 0 because
  ``j < s <= i``: one matrix product of ``q ⊙ exp(G - G_ref)`` and ``k ⊙ exp(G_ref - G)`` over
  all earlier columns at once (``[BC, BK] x [BK, BT]``). The backward takes dq's terms one earlier
  sub-chunk at a time (``[BC, BC] x [BC, BK]``), and dk's (rows x of later sub-chunks) one later
  sub-chunk at a time with ``G_ref = G_l``, for the same reason.
- the diagonal sub-block (``s <= j <= i <= l``) through the same reference points, as long as it
  is safe: with ``span = max_d (G_s,d - G_l,d)`` (per program and K block, at run time), the
  exponents of the two factors lie in ``[-span, 0]`` and ``[0, span]``. If ``span <= SAFE_SPAN``
  the block is one tensor-core product (``q ⊙ exp(G - G_s)`` times ``(k ⊙ exp(G_s - G))^T``,
  masked to ``j <= i`` after the product; in the backward ``dA_diag`` times ``k ⊙ exp(G_s - G)``
  for dq and ``dA_diag^T`` times ``q ⊙ exp(G - G_l)`` for dk, scaled by ``exp(G - G_s)`` and
  ``exp(G_l - G)``). Otherwise the fallback takes it element-wise, one token at a time
  (``[BC, BK]`` products of ``exp(G_i - G_j)``, the exponent masked to ``j <= i`` *before* the
  exponential), as exact as fp32 allows for any decay. (One ``[16, 16, BK]`` element-wise product
  instead of the loop is slower: it keeps a 3-D tile live and uses no tensor cores.)

Why ``SAFE_SPAN = 60`` is safe. Every exponential in the diagonal products lies in ``[e^-60,
e^60] ~ [8.8e-27, 1.1e26]``, well inside the normal range of fp32 and of tf32 (which the GPU's
tensor cores use for these fp32 operands, as for the off-diagonal ones; same 8-bit exponent):
``[1.2e-38, 3.4e38] ~ [e^-87, e^88]``. So no factor overflows or flushes to zero, and ``e^28 ~
1e12`` of headroom remains for ``|q|, |k|, |dA|`` and sums of BK (or BC) terms: even the entries
that the mask discards afterwards (``j > i``, up to ``e^60 |q_i . k_j|``) stay finite, and a
masked (zero) entry of dA multiplies a finite factor (``0 * finite = 0``, never ``0 * inf =
NaN``). For a kept entry every term of the sum equals ``q_id k_jd exp(G_id - G_jd)`` (or
``dA_ij k_jd exp(G_id - G_jd)``, ...) up to the rounding of its factors, so its error is relative
to the term's true magnitude (``<= |q_id k_jd|``): the accuracy of the off-diagonal blocks, with no
cancellation between large factored terms. Padded rows (``>= eos``) read ``G_l``, the last valid
row's gate, and 0 for q and k, so their exponents stay within ``[-span, span]`` as well. A
sub-chunk whose per-token log gates are >= -4 in every key dimension spans <= 60, so with GLA's
usual gates (``logsigmoid(x) / 16``) the fallback is rare. In the off-diagonal blocks an underflow
to 0 of one factor is harmless: the true product is smaller still. The exponentials are
``approx.fast_exp``, which flushes results below 2^-126 to 0 where ``tl.exp`` keeps them denormal:
an underflow of this kind, and the stages spend fewer instructions on each exponential.

The backward: ``dA = scale * tril(do v^T)`` and the intra part of v's gradient, ``A^T do``, which
``state.state_bwd`` completes (both from one read of do, ``vector_gate_dv_dA``), the intra parts of
dq and dk (``vector_gate_intra_bwd``), and ``vector_gate_bwd_dqkg``, which adds the inter-chunk
parts (through the states ``h`` and their gradients ``dh`` from ``state.state_bwd``) and turns
``dG = q ⊙ dq - k ⊙ dk`` (+ the last-row terms of the state update) into the gradient of the raw
gate by a reverse cumulative sum within the chunk.

Shapes: q, k, gk_cum ``[B, T, H, K]``; v, do ``[B, T, H, V]``; A ``[B, T, H, BT]`` in the inputs' dtype
(both products that read it, ``A v`` and ``A^T do``, take it in that dtype), dA ``[B, T, H, BT]`` fp32;
h, dh ``[NT, H, K, V]`` in k's dtype (per chunk, see ``index.ChunkPlan``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttr.kernels.common.approx import fast_exp
from ttr.kernels.common.cumsum import logit_gate_args, logit_gate_grad
from ttr.kernels.common.index import ChunkPlan, block_size, cdiv, token_stride, tuned
from ttr.kernels.common.tile import chunk_span

SUB_CHUNK = 16
# Largest gate span within a sub-chunk (``max_d G_first,d - G_last,d``) whose diagonal block is one
# tensor-core product; beyond it the per-token loop. Factors stay in [e^-60, e^60]: normal fp32/tf32
# with e^28 headroom below fp32's e^88 for |q k| and sums of BK terms (module docstring).
SAFE_SPAN = 60.0
# Launch parameters: each launcher's defaults are the fastest of a sweep (``ttr bench --stages --ops
# gla --sweep``: gla-1.3b's H = 16, K = 64, V = 128, bf16; the comments say where K = 128 differs) and
# can be overridden through ``index.TUNING`` under the stage names "vector_gate_scores",
# "vector_gate_output", "vector_gate_dv_dA", "vector_gate_intra_bwd", "vector_gate_bwd_dqkg".


@triton.jit
def vector_gate_scores_kernel(q, k, gk, A, cu_seqlens, chunk_indices, seq_len, scale, H: tl.constexpr,
                              K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                              SAFE_SPAN: tl.constexpr):
    """One program: the rows of sub-chunk ``i_i`` of one chunk and head, all ``BT`` columns."""
    i_t, i_i, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_c, bos, eos = chunk_span(chunk_indices, cu_seqlens, seq_len, i_t, BT)
    t0 = bos + i_c * BT
    s_i = t0 + i_i * BC
    if s_i >= eos:
        return
    l_i = tl.minimum(s_i + BC, eos) - 1  # last valid row of the sub-chunk
    o_c = tl.arange(0, BC)
    o_i = s_i + o_c
    m_i = o_i < eos
    o_s = tl.arange(0, BT)
    o_t = t0 + o_s
    m_t = o_t < s_i  # columns of the earlier sub-chunks (all valid)
    m_tri = o_c[:, None] >= o_c[None, :]
    b_A = tl.zeros([BC, BT], dtype=tl.float32)  # off-diagonal sub-blocks (0 from column s_i on)
    b_Ad = tl.zeros([BC, BC], dtype=tl.float32)  # diagonal sub-block
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_ik = m_i[:, None] & m_k[None, :]
        p_ik = (o_i[:, None] * H + i_h) * K + o_k[None, :]
        b_gn = tl.load(gk + (s_i * H + i_h) * K + o_k, mask=m_k, other=0)  # [BK] reference point
        b_gl = tl.load(gk + (l_i * H + i_h) * K + o_k, mask=m_k, other=0)  # [BK] last valid row
        b_q = tl.load(q + p_ik, mask=m_ik, other=0).to(tl.float32)  # [BC, BK]
        b_g = tl.where(m_i[:, None], tl.load(gk + p_ik, mask=m_ik, other=0), b_gl[None, :])  # padded: G_l
        b_qg = b_q * fast_exp(b_g - b_gn[None, :])  # exponent in [-span, 0]
        m_tk = m_t[:, None] & m_k[None, :]
        p_tk = (o_t[:, None] * H + i_h) * K + o_k[None, :]
        b_kt = tl.load(k + p_tk, mask=m_tk, other=0).to(tl.float32)  # [BT, BK]
        b_gt = tl.load(gk + p_tk, mask=m_tk, other=0)
        b_A += tl.dot(b_qg, tl.trans(b_kt * fast_exp(tl.where(m_tk, b_gn[None, :] - b_gt, 0))))
        b_k = tl.load(k + p_ik, mask=m_ik, other=0).to(tl.float32)  # outside the branch: pipelined
        if tl.max(b_gn - b_gl, 0) <= SAFE_SPAN:
            b_kg = b_k * fast_exp(b_gn[None, :] - b_g)  # exponent in [0, span]
            b_Ad += tl.where(m_tri, tl.dot(b_qg, tl.trans(b_kg)), 0)
        else:
            # fallback, one column j at a time: [BC, BK] element-wise, exponent masked to j <= i
            for j in range(BC):
                p_j = ((s_i + j) * H + i_h) * K + o_k
                j_ok = s_i + j < eos
                m_j = o_k < tl.where(j_ok, K, 0)
                b_kj = tl.load(k + p_j, mask=m_j, other=0).to(tl.float32)
                b_gj = tl.load(gk + p_j, mask=m_j, other=0)
                m_e = (o_c >= tl.where(j_ok, j, BC)) & m_i
                b_e = fast_exp(tl.where(m_e[:, None], b_g - b_gj[None, :], float("-inf")))
                b_a = tl.sum(b_q * b_kj[None, :] * b_e, 1)
                b_Ad += tl.where(o_c[None, :] == j, b_a[:, None], 0)
    # two disjoint stores: the row strip without the diagonal sub-block's columns, then that block
    p_A = A + (o_i[:, None] * H + i_h) * BT
    m_d = (o_s >= i_i * BC) & (o_s < i_i * BC + BC)
    tl.store(p_A + o_s[None, :], (b_A * scale).to(A.dtype.element_ty), mask=m_i[:, None] & ~m_d[None, :])
    tl.store(p_A + i_i * BC + o_c[None, :], (b_Ad * scale).to(A.dtype.element_ty), mask=m_i[:, None])


@triton.jit
def vector_gate_output_kernel(q, v, gk, A, h, o, cu_seqlens, chunk_indices, seq_len, scale, H: tl.constexpr,
                              K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                              BV: tl.constexpr):
    i_t, i_v, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_c, bos, eos = chunk_span(chunk_indices, cu_seqlens, seq_len, i_t, BT)
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
        b_qg = (b_q.to(tl.float32) * fast_exp(b_g)).to(b_q.dtype)
        p_h = h + ((i_t.to(tl.int64) * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
        b_h = tl.load(p_h, mask=m_k[:, None] & m_v[None, :], other=0).to(b_q.dtype)  # [BK, BV]
        b_o += tl.dot(b_qg, b_h)
    b_A = tl.load(A + (o_t[:, None] * H + i_h) * BT + tl.arange(0, BT)[None, :], mask=m_t[:, None], other=0)
    b_v = tl.load(v + (o_t[:, None] * H + i_h) * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0)
    b_o = b_o * scale + tl.dot(b_A.to(b_v.dtype), b_v)
    p_o = o + (o_t[:, None] * H + i_h) * V + o_v[None, :]
    tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])


@triton.jit
def vector_gate_dv_dA_kernel(A, v, do, dv, dA, cu_seqlens, chunk_indices, seq_len, scale, H: tl.constexpr,
                             V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr):
    """One chunk of one head: ``dv = A^T do`` and ``dA = scale tril(do v^T)``, do read once for both."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    i_n, i_c, bos, eos = chunk_span(chunk_indices, cu_seqlens, seq_len, i_t, BT)
    o_c = tl.arange(0, BT)
    o_t = bos + i_c * BT + o_c
    m_t = o_t < eos
    b_A = tl.load(A + (o_t[:, None] * H + i_h) * BT + o_c[None, :], mask=m_t[:, None], other=0)
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        b_do = tl.load(do + (o_t[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0)  # [BT, BV]
        b_v = tl.load(v + (o_t[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0)
        b_dv = tl.dot(tl.trans(b_A).to(b_do.dtype), b_do)
        tl.store(dv + (o_t[:, None] * H + i_h) * V + o_v[None, :], b_dv.to(dv.dtype.element_ty), mask=m_tv)
        b_dA += tl.dot(b_do, tl.trans(b_v))
    b_dA = tl.where(o_c[:, None] >= o_c[None, :], b_dA * scale, 0)
    tl.store(dA + (o_t[:, None] * H + i_h) * BT + o_c[None, :], b_dA, mask=m_t[:, None])


@triton.jit
def vector_gate_intra_bwd_kernel(q, k, gk, dA, dq, dk, cu_seqlens, chunk_indices, seq_len, H: tl.constexpr,
                                 K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                                 SAFE_SPAN: tl.constexpr):
    """One program: dq and dk of the rows of sub-chunk ``i_i`` of one chunk and head. The
    off-diagonal terms come one ``[BC, BK]`` sub-chunk at a time, each read for the one product it
    enters (dq's from earlier sub-chunks, dk's from later ones), where one ``[BT, BK]`` tile of the
    chunk masked into both kept four such tiles live and spilled on 2 warps."""
    i_t, i_i, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_c, bos, eos = chunk_span(chunk_indices, cu_seqlens, seq_len, i_t, BT)
    t0 = bos + i_c * BT
    s_i = t0 + i_i * BC
    if s_i >= eos:
        return
    l_i = tl.minimum(s_i + BC, eos) - 1  # last valid row of the sub-chunk
    o_c = tl.arange(0, BC)
    o_i = s_i + o_c
    m_i = o_i < eos
    # the rows of dA this program reads (its sub-chunk's), and the diagonal sub-block (lower
    # triangle incl. diagonal), for all K blocks
    p_dA = dA + (o_i[:, None] * H + i_h) * BT
    b_dAd = tl.load(p_dA + i_i * BC + o_c[None, :], mask=m_i[:, None] & (o_c[:, None] >= o_c[None, :]),
                    other=0)  # [BC, BC]
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_ik = m_i[:, None] & m_k[None, :]
        p_ik = (o_i[:, None] * H + i_h) * K + o_k[None, :]
        b_gn = tl.load(gk + (s_i * H + i_h) * K + o_k, mask=m_k, other=0)  # [BK] reference of dq
        b_gl = tl.load(gk + (l_i * H + i_h) * K + o_k, mask=m_k, other=0)  # [BK] reference of dk
        b_g = tl.where(m_i[:, None], tl.load(gk + p_ik, mask=m_ik, other=0), b_gl[None, :])  # padded: G_l
        # off-diagonal: dq from the earlier rows through G_s, dk from the later rows through G_l
        # (every exponent <= 0)
        b_dq = tl.zeros([BC, BK], dtype=tl.float32)
        b_dk = tl.zeros([BC, BK], dtype=tl.float32)
        for i_j in range(0, i_i):  # earlier sub-chunks: every row valid
            p_jk = ((t0 + i_j * BC + o_c)[:, None] * H + i_h) * K + o_k[None, :]
            m_jk = m_k[None, :] & (o_c[:, None] < BC)
            b_e = fast_exp(b_gn[None, :] - tl.load(gk + p_jk, mask=m_jk, other=0))
            b_kj = tl.load(k + p_jk, mask=m_jk, other=0).to(tl.float32)
            b_dAj = tl.load(p_dA + i_j * BC + o_c[None, :], mask=m_i[:, None], other=0)  # [BC, BC]
            b_dq += tl.dot(b_dAj, b_kj * b_e)
        for i_j in range(i_i + 1, tl.cdiv(tl.minimum(eos - t0, BT), BC)):  # later ones, to the last valid
            o_j = t0 + i_j * BC + o_c
            m_j = o_j < eos
            p_jk = (o_j[:, None] * H + i_h) * K + o_k[None, :]
            m_jk = m_j[:, None] & m_k[None, :]
            b_e = fast_exp(tl.where(m_jk, tl.load(gk + p_jk, mask=m_jk, other=0) - b_gl[None, :], 0))
            b_qj = tl.load(q + p_jk, mask=m_jk, other=0).to(tl.float32)
            b_dAj = tl.load(dA + (o_j[:, None] * H + i_h) * BT + i_i * BC + o_c[None, :], mask=m_j[:, None],
                            other=0)  # [BC, BC]: rows j, columns of this sub-chunk
            b_dk += tl.dot(tl.trans(b_dAj), b_qj * b_e)
        b_q = tl.load(q + p_ik, mask=m_ik, other=0).to(tl.float32)  # [BC, BK]
        b_k = tl.load(k + p_ik, mask=m_ik, other=0).to(tl.float32)
        if tl.max(b_gn - b_gl, 0) <= SAFE_SPAN:
            # the diagonal sub-block through the same reference points: exponents in [0, span]
            b_dq += tl.dot(b_dAd, b_k * fast_exp(b_gn[None, :] - b_g))
            b_dk += tl.dot(tl.trans(b_dAd), b_q * fast_exp(b_g - b_gl[None, :]))
            b_dq *= fast_exp(b_g - b_gn[None, :])
            b_dk *= fast_exp(b_gl[None, :] - b_g)
        else:
            b_dq *= fast_exp(b_g - b_gn[None, :])
            b_dk *= fast_exp(b_gl[None, :] - b_g)
            # fallback: the diagonal sub-block one token x at a time, [BC, BK] element-wise: x as the
            # column (dq of rows i >= x) and as the row (dk of rows j <= x); exponents masked before exp
            for x in range(BC):
                p_x = ((s_i + x) * H + i_h) * K + o_k
                x_ok = s_i + x < eos
                m_x = o_k < tl.where(x_ok, K, 0)
                b_kx = tl.load(k + p_x, mask=m_x, other=0).to(tl.float32)
                b_qx = tl.load(q + p_x, mask=m_x, other=0).to(tl.float32)
                b_gx = tl.load(gk + p_x, mask=m_x, other=0)
                b_dAcol = tl.load(dA + (o_i * H + i_h) * BT + i_i * BC + x, mask=m_i & (o_c >= x),
                                  other=0)  # [BC] over i
                b_dArow = tl.load(dA + ((s_i + x) * H + i_h) * BT + i_i * BC + o_c,
                                  mask=o_c <= tl.where(x_ok, x, -1), other=0)  # [BC] over j
                b_eq = fast_exp(tl.where(((o_c >= tl.where(x_ok, x, BC)) & m_i)[:, None], b_g - b_gx[None, :],
                                         float("-inf")))
                b_ek = fast_exp(tl.where(((o_c <= tl.where(x_ok, x, -1)) & m_i)[:, None], b_gx[None, :] - b_g,
                                         float("-inf")))
                b_dq += b_dAcol[:, None] * b_eq * b_kx[None, :]
                b_dk += b_dArow[:, None] * b_ek * b_qx[None, :]
        tl.store(dq + p_ik, b_dq, mask=m_ik)
        tl.store(dk + p_ik, b_dk, mask=m_ik)


@triton.jit
def vector_gate_bwd_dqkg_kernel(q, k, v, gk, h, dh, do, dq_intra, dk_intra, dq, dk, dg, z, cu_seqlens,
                                chunk_indices, seq_len, scale, inv_norm, clamp, SD, H: tl.constexpr, K: tl.constexpr,
                                V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                                LOGITS: tl.constexpr, CLAMP: tl.constexpr, DENSE: tl.constexpr):
    i_t, i_k, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_c, bos, eos = chunk_span(chunk_indices, cu_seqlens, seq_len, i_t, BT)
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
    b_dq = b_dq * fast_exp(b_g) * scale
    b_dk = tl.where(m_tk, b_dk * fast_exp(tl.where(m_tk, b_gl[None, :] - b_g, 0)), 0)
    # the state update h' = exp(G_last) h + (k exp(G_last - G))^T v depends on G_last directly
    b_dgl = b_hdh * fast_exp(b_gl) + tl.sum(b_k * b_dk, 0)
    b_dq += tl.load(dq_intra + p_tk, mask=m_tk, other=0)
    b_dk += tl.load(dk_intra + p_tk, mask=m_tk, other=0)
    b_dG = b_q * b_dq - b_k * b_dk
    b_dG += tl.where((o_t == last)[:, None], b_dgl[None, :], 0)
    b_dG = tl.where(m_tk, b_dG, 0)
    # gradient of the raw gate: reverse cumulative sum within the chunk
    b_dg = tl.sum(b_dG, 0)[None, :] - tl.cumsum(b_dG, 0) + b_dG
    if LOGITS:  # on to the gate's logits (``cumsum.logit_gate``), in their dtype
        b_dg = logit_gate_grad(tl.load(z + p_tk, mask=m_tk, other=0).to(tl.float32), b_dg, inv_norm, clamp, CLAMP)
    if DENSE:  # SD == H * K: the inputs' offsets
        p_dq, p_dk = dq + p_tk, dk + p_tk
    else:
        # at token stride SD (column blocks of a caller's gradient buffer), from the chunk's scalar
        # base and one int32 offset tile for both: a tile of int64 addresses per output spilled more,
        # and any second tile spills where the fp32 gate is read (the dense case's own offsets do not)
        p_d = (bos + i_c * BT) * SD + i_h * K
        o_d = tl.arange(0, BT)[:, None] * SD + o_k[None, :]
        p_dq, p_dk = dq + p_d + o_d, dk + p_d + o_d
    tl.store(p_dq, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(p_dk, b_dk.to(dk.dtype.element_ty), mask=m_tk)
    tl.store(dg + p_tk, b_dg.to(dg.dtype.element_ty), mask=m_tk)


def vector_gate_scores(q, k, gk_cum, plan: ChunkPlan, *, scale: float) -> torch.Tensor:
    """``A [B, T, H, BT]`` in q's dtype: the scaled, causal, gate-decayed intra-chunk scores, formed in
    fp32 and rounded once on the store, where the products that read them (``vector_gate_output``,
    ``vector_gate_dv_dA``) rounded them before (the same values, half the bytes kept and moved).

    One program per (chunk, sub-chunk of 16 rows, head): per K block one ``[16, BK] x [BK, BT]``
    product for the earlier sub-chunks and, when the sub-chunk's gate span is at most
    ``SAFE_SPAN``, one ``[16, BK] x [BK, 16]`` product for the diagonal sub-block (else the
    per-token loop); see the module docstring."""
    B, T, H, K = q.shape
    BT = plan.chunk_size
    A = torch.empty(B, T, H, BT, device=q.device, dtype=q.dtype)
    # Few warps and narrow K blocks: the products are small ([16, 32] tiles), so more warps only
    # add synchronisation; one stage, since each program loads every K block once. On an H200 BK 32
    # timed faster than BK 64 at K = 128 and a little slower at gla-1.3b's K = 64. At K = 64 a cap of
    # 128 registers (more programs per SM) timed faster at 8 x 2048 and 1 x 16384 (K = 128 not timed
    # with it; docs/benchmarks.md, launch choices); with the approximate exp the kernel compiles to
    # 128 registers without the cap as well
    cap = {"maxnreg": 128} if K <= 64 else {}
    cfg = tuned("vector_gate_scores", BK=block_size(K, 32), num_warps=2, num_stages=1, **cap)
    vector_gate_scores_kernel[(plan.num_chunks, BT // SUB_CHUNK, H)](
        q, k, gk_cum, A, plan.cu_seqlens, plan.chunk_indices, plan.seq_len, scale, H=H, K=K, BT=BT, BC=SUB_CHUNK,
        SAFE_SPAN=SAFE_SPAN, **cfg)
    return A


def vector_gate_output(q, v, gk_cum, A, h, plan: ChunkPlan, *, scale: float) -> torch.Tensor:
    """``o = scale * (q ⊙ exp(G)) h + A v`` in v's dtype."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = torch.empty_like(v)
    # BV 128: one program covers a whole value head, so A and q are read once per chunk
    cfg = tuned("vector_gate_output", BK=block_size(K, 64), BV=block_size(V, 128), num_warps=4)
    vector_gate_output_kernel[(plan.num_chunks, cdiv(V, cfg["BV"]), H)](
        q, v, gk_cum, A, h, o, plan.cu_seqlens, plan.chunk_indices, plan.seq_len, scale, H=H, K=K, V=V,
        BT=plan.chunk_size, **cfg)
    return o


def vector_gate_dv_dA(A, v, do, plan: ChunkPlan, *, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The intra-chunk gradient of v, ``A^T do`` in do's dtype (``state.state_bwd`` adds the state's
    share and hands dv on in the same dtype), and ``dA = scale * tril(do v^T)`` per chunk,
    ``[B, T, H, BT]`` fp32 (includes the score scale)."""
    B, T, H, V = do.shape
    dv = torch.empty_like(do)
    dA = torch.empty(B, T, H, plan.chunk_size, device=do.device, dtype=torch.float32)
    # one V block of 128 on 4 warps: on an H200 faster than the two products as kernels of their own,
    # than BV 64 and than 8 warps (docs/benchmarks.md, launch choices)
    cfg = tuned("vector_gate_dv_dA", BV=block_size(V, 128), num_warps=4)
    vector_gate_dv_dA_kernel[(plan.num_chunks, H)](A, v, do, dv, dA, plan.cu_seqlens, plan.chunk_indices,
                                                   plan.seq_len, scale, H=H, V=V, BT=plan.chunk_size, **cfg)
    return dv, dA


def vector_gate_intra_bwd(q, k, gk_cum, dA, plan: ChunkPlan):
    """Intra-chunk parts of dq and dk (fp32) from ``dA`` (which already holds the scale).

    One program per (chunk, sub-chunk of 16 rows, head); per K block one ``[16, 16] x [16, BK]``
    product per off-diagonal sub-block (dq's from each earlier sub-chunk, dk's from each later
    one) and, when the sub-chunk's gate span is at most ``SAFE_SPAN``, two more with the diagonal
    sub-block of dA (else the per-token loop)."""
    B, T, H, K = q.shape
    dq = torch.empty(q.shape, device=q.device, dtype=torch.float32)
    dk = torch.empty(q.shape, device=q.device, dtype=torch.float32)
    # All of K (up to 128) in one block, on 2 warps for 64 keys and 4 for 128: on an H200 faster than
    # BK 32 and than 4 or 8 warps at gla-1.3b's K = 64 (docs/benchmarks.md, launch choices)
    BK = block_size(K, 128)
    cfg = tuned("vector_gate_intra_bwd", BK=BK, num_warps=2 if BK <= 64 else 4, num_stages=1)
    vector_gate_intra_bwd_kernel[(plan.num_chunks, plan.chunk_size // SUB_CHUNK, H)](
        q, k, gk_cum, dA, dq, dk, plan.cu_seqlens, plan.chunk_indices, plan.seq_len, H=H, K=K, BT=plan.chunk_size,
        BC=SUB_CHUNK, SAFE_SPAN=SAFE_SPAN, **cfg)
    return dq, dk


def vector_gate_bwd_dqkg(q, k, v, gk_cum, h, dh, do, dq_intra, dk_intra, plan: ChunkPlan, *, scale: float,
                         logits: tuple | None = None, out: tuple | None = None):
    """Full dq, dk (input dtypes) and the gradient of the raw gate dg (fp32); with ``logits = (z,
    normalizer, clamp_min)``, where the raw gate was ``cumsum.logit_gate`` of the logits z, the
    gradient of z instead (in z's dtype). ``out = (dq, dk)``: where they are written (q's and k's
    shapes and dtypes, one token stride for both: ``index.token_stride``), in place of new tensors.

    ``v`` is the value the state update used, ``h[c]`` the state before chunk c and ``dh[c]`` the
    gradient of the state after chunk c (``state.state_bwd``).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    dq, dk = (torch.empty_like(q), torch.empty_like(k)) if out is None else out
    stride = token_stride("dq", dq, q.shape)
    if token_stride("dk", dk, k.shape) != stride:
        raise ValueError(f"dq and dk must have one token stride, got {dq.stride(1)} and {dk.stride(1)}")
    z = None if logits is None else logits[0]
    dg = torch.empty(q.shape, device=q.device, dtype=torch.float32 if z is None else z.dtype)
    inv_norm, clamp = logit_gate_args(None if logits is None else logits[1:])
    cfg = tuned("vector_gate_bwd_dqkg", BK=block_size(K, 64), BV=block_size(V, 64), num_warps=4)
    vector_gate_bwd_dqkg_kernel[(plan.num_chunks, cdiv(K, cfg["BK"]), H)](
        q, k, v, gk_cum, h, dh, do, dq_intra, dk_intra, dq, dk, dg, z, plan.cu_seqlens, plan.chunk_indices,
        plan.seq_len, scale, inv_norm, clamp, stride, H=H, K=K, V=V, BT=plan.chunk_size, LOGITS=z is not None,
        CLAMP=logits is not None and logits[2] is not None, DENSE=stride == H * K, **cfg)
    return dq, dk, dg
