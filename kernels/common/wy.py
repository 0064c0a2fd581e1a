"""WY / UT representation of a chunk of delta-rule updates (DeltaNet paper, Yang et al. 2024, §3).

Inside a chunk of BT = 64 tokens with keys K, values V, betas b and cumulative log gates g:
``A = tril(diag(b) K K^T ⊙ Γ, -1)`` with ``Γ_ij = exp(g_i - g_j)`` (all ones without a gate),
``Ainv = (I + A)^-1`` (unit lower triangular), ``T = Ainv diag(b)``, ``w = T (K ⊙ exp(g))``,
``u = T V``. Then the chunk's corrected values are ``v_new = u - w S`` for the state S before
the chunk (``state.py``).

The inverse: the four 16 x 16 diagonal blocks by forward substitution (rows read back from a
global fp32 scratch), then the off-diagonal blocks by block
forward substitution, ``Inv_rc = -Inv_rr sum_{c <= m < r} A_rm Inv_mc``. This is exact
arithmetic on bounded quantities; a Neumann/product series would form powers of A whose
entries grow like binomials when keys are correlated. The inverse is a launch of its own
(``wy_inverse_kernel``), w and u another (``wy_fwd_kernel``), which alone runs when ``Ainv`` is given.

Shapes: k ``[B,T,H,K]``, v ``[B,T,H,V]``, beta ``[B,T,H]``, g ``[B,T,H]`` fp32 (cumulative),
Ainv ``[B,T,H,BT]`` in k's dtype (row t holds row t mod BT of its chunk's inverse).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttr.kernels.common.approx import fast_exp
from ttr.kernels.common.index import ChunkPlan, block_size, tuned
from ttr.kernels.common.tile import chunk_gate, chunk_span, tile

# The inverse's halves (the diagonal blocks' substitution, the merge) are chains of small steps
# through its scratch; on one warp its launch ran faster than on two or four, its spills included
# (docs/benchmarks.md, the WY forward's choice).
WY_INVERSE_WARPS = 1


@triton.jit
def _ld16(Ai, g0, r, c, n_valid, i_h, H: tl.constexpr, BT: tl.constexpr):
    o_s = tl.arange(0, 16)
    rows = r * 16 + o_s
    p = Ai + ((g0 + rows).to(tl.int64) * H + i_h)[:, None] * BT + c * 16 + o_s[None, :]
    return tl.load(p, mask=(rows < n_valid)[:, None], other=0.)


@triton.jit
def _st16(Ai, b, g0, r, c, n_valid, i_h, H: tl.constexpr, BT: tl.constexpr):
    o_s = tl.arange(0, 16)
    rows = r * 16 + o_s
    p = Ai + ((g0 + rows).to(tl.int64) * H + i_h)[:, None] * BT + c * 16 + o_s[None, :]
    tl.store(p, b.to(Ai.dtype.element_ty), mask=(rows < n_valid)[:, None])


@triton.jit
def _inv_diag16(S, g0, n_valid, i_h, H: tl.constexpr, BT: tl.constexpr):
    """Overwrite the four strictly lower 16 x 16 diagonal blocks of the scratch ``S`` with
    ``(I + A_rr)^-1``, all four at once, by forward substitution over the 16 rows."""
    o_r = tl.arange(0, 4)
    o_s = tl.arange(0, 16)
    b_n = tl.zeros([4, 16, 16], dtype=tl.float32)
    for i in tl.static_range(1, 16):  # unrolled: the 15 row loads do not wait on the substitution
        row = o_r * 16 + i  # [4]
        p = S + ((g0 + row).to(tl.int64) * H + i_h)[:, None] * BT + (o_r * 16)[:, None] + o_s[None, :]
        b_a = -tl.load(p, mask=(o_s[None, :] < i) & (row < n_valid)[:, None], other=0.)  # [4, 16]
        b_a = b_a + tl.sum(b_a[:, :, None] * b_n, 1)
        b_n = tl.where((o_s == i)[None, :, None], b_a[:, None, :], b_n)
    b_n += tl.where(o_s[:, None] == o_s[None, :], 1., 0.)[None, :, :]
    rows = o_r[:, None] * 16 + o_s[None, :]  # [4, 16]
    p = (S + ((g0 + rows).to(tl.int64) * H + i_h)[:, :, None] * BT + (o_r * 16)[:, None, None]
         + o_s[None, None, :])
    tl.debug_barrier()
    tl.store(p, b_n, mask=(rows < n_valid)[:, :, None])


@triton.jit
def _dot(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _wy_chunk(beta, g, cu_seqlens, chunk_indices, seq_len, H: tl.constexpr, BT: tl.constexpr, USE_G: tl.constexpr):
    """What every WY launch opens with for its program's (chunk, head): the head, the chunk's index
    in its sequence, the sequence's start and length, the chunk's first token, its valid rows (index,
    count, mask), its betas (fp32), its cumulative gates (``chunk_gate``; zeros without a gate) and
    the offsets of its ``[BT, BT]`` tile in ``Ai`` (and in the inverse's fp32 scratch, of the same
    layout)."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    i_n, i_c, bos, eos = chunk_span(chunk_indices, cu_seqlens, seq_len, i_t, BT)
    T = eos - bos
    g0 = bos + i_c * BT
    n_valid = T - i_c * BT
    o_i = tl.arange(0, BT)
    m_t = o_i < n_valid
    b_beta = tl.load(beta + (g0 + o_i) * H + i_h, mask=m_t, other=0.).to(tl.float32)
    if USE_G:
        b_g = chunk_gate(g, g0, n_valid, i_h, H, BT)  # padded rows: the last valid g
    else:
        b_g = tl.zeros([BT], dtype=tl.float32)
    o_A = ((g0 + o_i) * H + i_h)[:, None] * BT + o_i[None, :]
    return i_h, i_c, bos, T, g0, n_valid, o_i, m_t, b_beta, b_g, o_A


@triton.jit
def wy_inverse_kernel(k, beta, g, S, Ai, cu_seqlens, chunk_indices, seq_len, H: tl.constexpr, K: tl.constexpr,
                      BT: tl.constexpr, BK: tl.constexpr, USE_G: tl.constexpr):
    """``Ai = (I + A)^-1`` of each chunk, a launch of its own (on one warp, ``WY_INVERSE_WARPS``)
    rather than the head of the w, u products' launch (docs/benchmarks.md, the WY forward's choice).
    The substitutions run in fp32 through the scratch ``S``; ``Ai`` takes each finished block in
    the inputs' dtype, the one its readers round it to for their products."""
    i_h, i_c, bos, T, g0, n_valid, o_i, m_t, b_beta, b_g, o_A = _wy_chunk(beta, g, cu_seqlens, chunk_indices,
                                                                          seq_len, H, BT, USE_G)
    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        p_k, m_k = tile(k + (bos * H + i_h) * K, i_c * BT, i_k * BK, T, K, H * K, 1, BT, BK)
        b_k = tl.load(p_k, mask=m_k, other=0.)  # [BT, BK]
        b_A += tl.dot(b_k, tl.trans(b_k))
    m_A = o_i[:, None] > o_i[None, :]
    if USE_G:
        b_A *= fast_exp(tl.where(m_A, b_g[:, None] - b_g[None, :], 0.))
    b_A = tl.where(m_A, b_A * b_beta[:, None], 0.)
    # the scratch takes only the blocks the substitutions read (on and below the diagonal): each
    # byte of it written is also written back to memory, though nothing reads it after this launch
    tl.store(S + o_A, b_A, mask=m_t[:, None] & (o_i[None, :] // 16 <= o_i[:, None] // 16))
    tl.debug_barrier()

    _inv_diag16(S, g0, n_valid, i_h, H, BT)
    tl.debug_barrier()
    # rows 2 and 3, then row 4: row 4's blocks are loaded once rows 2 and 3 are done (the barrier
    # keeps the loads from moving up), so fewer 16 x 16 blocks are live at once: the merge spilled
    # less and ran faster (measured on 2 warps, with the inverse in the products' launch:
    # docs/benchmarks.md). Ai takes the diagonal blocks as the merge loads them and the merged
    # blocks as it forms them (nothing reads those back).
    b_i11 = _ld16(S, g0, 0, 0, n_valid, i_h, H, BT)
    b_i22 = _ld16(S, g0, 1, 1, n_valid, i_h, H, BT)
    b_a21 = _ld16(S, g0, 1, 0, n_valid, i_h, H, BT)
    b_i33 = _ld16(S, g0, 2, 2, n_valid, i_h, H, BT)
    b_a31 = _ld16(S, g0, 2, 0, n_valid, i_h, H, BT)
    b_a32 = _ld16(S, g0, 2, 1, n_valid, i_h, H, BT)
    tl.debug_barrier()
    _st16(Ai, b_i11, g0, 0, 0, n_valid, i_h, H, BT)
    _st16(Ai, b_i22, g0, 1, 1, n_valid, i_h, H, BT)
    _st16(Ai, b_i33, g0, 2, 2, n_valid, i_h, H, BT)
    b_i21 = -_dot(b_i22, _dot(b_a21, b_i11))
    _st16(Ai, b_i21, g0, 1, 0, n_valid, i_h, H, BT)
    b_i32 = -_dot(b_i33, _dot(b_a32, b_i22))
    b_i31 = -_dot(b_i33, _dot(b_a31, b_i11) + _dot(b_a32, b_i21))
    _st16(Ai, b_i31, g0, 2, 0, n_valid, i_h, H, BT)
    _st16(Ai, b_i32, g0, 2, 1, n_valid, i_h, H, BT)
    b_i44 = _ld16(S, g0, 3, 3, n_valid, i_h, H, BT)
    b_a41 = _ld16(S, g0, 3, 0, n_valid, i_h, H, BT)
    b_a42 = _ld16(S, g0, 3, 1, n_valid, i_h, H, BT)
    b_a43 = _ld16(S, g0, 3, 2, n_valid, i_h, H, BT)
    tl.debug_barrier()
    _st16(Ai, b_i44, g0, 3, 3, n_valid, i_h, H, BT)
    b_i43 = -_dot(b_i44, _dot(b_a43, b_i33))
    b_i42 = -_dot(b_i44, _dot(b_a42, b_i22) + _dot(b_a43, b_i32))
    b_i41 = -_dot(b_i44, _dot(b_a41, b_i11) + _dot(b_a42, b_i21) + _dot(b_a43, b_i31))
    _st16(Ai, b_i41, g0, 3, 0, n_valid, i_h, H, BT)
    _st16(Ai, b_i42, g0, 3, 1, n_valid, i_h, H, BT)
    _st16(Ai, b_i43, g0, 3, 2, n_valid, i_h, H, BT)
    # the blocks above the diagonal: zeros
    b_0 = tl.zeros([16, 16], dtype=tl.float32)
    for r in tl.static_range(3):
        for c in tl.static_range(r + 1, 4):
            _st16(Ai, b_0, g0, r, c, n_valid, i_h, H, BT)


@triton.jit
def wy_fwd_kernel(k, v, beta, g, w, u, Ai, q, s, cu_seqlens, chunk_indices, seq_len, H: tl.constexpr, K: tl.constexpr,
                  V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr,
                  SCORES: tl.constexpr):
    """``w = T (K ⊙ exp(g))`` and ``u = T V`` with ``T = Ai diag(beta)``; ``SCORES``: also the
    chunk's ``s = q k^T ⊙ causal ⊙ Γ`` (in s's dtype, the layout of ``Ai``), from the k tiles
    loaded for w."""
    i_h, i_c, bos, T, g0, n_valid, o_i, m_t, b_beta, b_g, o_A = _wy_chunk(beta, g, cu_seqlens, chunk_indices,
                                                                          seq_len, H, BT, USE_G)
    b_T = tl.load(Ai + o_A, mask=m_t[:, None], other=0.) * b_beta[None, :]  # [BT, BT]
    if SCORES:
        b_S = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        p_k, m_k = tile(k + (bos * H + i_h) * K, i_c * BT, i_k * BK, T, K, H * K, 1, BT, BK)
        p_w, m_w = tile(w + (bos * H + i_h) * K, i_c * BT, i_k * BK, T, K, H * K, 1, BT, BK)
        b_k = tl.load(p_k, mask=m_k, other=0.)
        if SCORES:
            p_q, m_q = tile(q + (bos * H + i_h) * K, i_c * BT, i_k * BK, T, K, H * K, 1, BT, BK)
            b_S += tl.dot(tl.load(p_q, mask=m_q, other=0.), tl.trans(b_k))
        if USE_G:
            b_k = (b_k * fast_exp(b_g)[:, None]).to(b_k.dtype)
        b_w = tl.dot(b_T.to(b_k.dtype), b_k)
        tl.store(p_w, b_w.to(p_w.dtype.element_ty), mask=m_w)
    for i_v in range(tl.cdiv(V, BV)):
        p_v, m_v = tile(v + (bos * H + i_h) * V, i_c * BT, i_v * BV, T, V, H * V, 1, BT, BV)
        p_u, m_u = tile(u + (bos * H + i_h) * V, i_c * BT, i_v * BV, T, V, H * V, 1, BT, BV)
        b_v = tl.load(p_v, mask=m_v, other=0.)
        b_u = tl.dot(b_T.to(b_v.dtype), b_v)
        tl.store(p_u, b_u.to(p_u.dtype.element_ty), mask=m_u)
    if SCORES:
        # as ``output.chunk_output`` forms them: the gate's factors in fp32, one rounding to s's dtype
        m_S = o_i[:, None] >= o_i[None, :]
        if USE_G:
            b_S *= fast_exp(tl.where(m_S, b_g[:, None] - b_g[None, :], 0.))
        tl.store(s + o_A, tl.where(m_S, b_S, 0.).to(s.dtype.element_ty), mask=m_t[:, None])


@triton.jit
def wy_bwd_kernel(k, v, beta, g, Ai, dw, du, dk_in, dg_in, dk, dv, dbeta, dg, cu_seqlens, chunk_indices, seq_len,
                  H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, USE_G: tl.constexpr, HAS_DK: tl.constexpr, HAS_DG: tl.constexpr):
    i_h, i_c, bos, T, g0, n_valid, o_i, m_t, b_beta, b_g, o_A = _wy_chunk(beta, g, cu_seqlens, chunk_indices,
                                                                          seq_len, H, BT, USE_G)
    m_A = o_i[:, None] > o_i[None, :]
    dt = k.dtype.element_ty
    if USE_G:
        b_eg = fast_exp(b_g)

    # T = Ainv diag(beta), w = T kg and u = T v (kg = k ⊙ exp(g)), and dT = dw kg^T + du v^T. Through
    # Ainv = (I + A)^-1: dA = -Ainv^T dT diag(beta) Ainv^T = -(X w^T + Y u^T) with X = Ainv^T dw and
    # Y = Ainv^T du; and dbeta_j = (Ainv^T dT)_jj = sum_k X_jk kg_jk + sum_v Y_jv v_jv. So every
    # product is a [BT, BT] x [BT, BK] one in the input dtype, X and Y also give dk's and dv's share
    # (diag(beta) X, diag(beta) Y), and no [BT, BT] fp32 product runs. w and u are formed again as
    # the forward formed them (T rounded to the input dtype). Against forming dT and the two fp32
    # products by the inverse, the errors against float64 stay the same in bf16 (docs/benchmarks.md).
    # w^T and u^T are formed as products of transposed tiles (kg^T T^T, v^T T^T), not by transposing
    # w and u: a transposed product result as a product's operand is the pattern of the Hopper
    # miscompile below. The two forms time the same (docs/benchmarks.md).
    b_Ai = tl.load(Ai + o_A, mask=m_t[:, None], other=0.)
    b_TT = tl.trans(b_Ai * b_beta[None, :]).to(dt)  # T^T
    b_AiT = tl.trans(b_Ai).to(dt)
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    b_KK = tl.zeros([BT, BT], dtype=tl.float32)
    b_dbeta = tl.zeros([BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        p_k, m_k = tile(k + (bos * H + i_h) * K, i_c * BT, i_k * BK, T, K, H * K, 1, BT, BK)
        p_dw, m_dw = tile(dw + (bos * H + i_h) * K, i_c * BT, i_k * BK, T, K, H * K, 1, BT, BK)
        b_k = tl.load(p_k, mask=m_k, other=0.)
        b_KK += tl.dot(b_k, tl.trans(b_k))
        if USE_G:
            b_k = (b_k * b_eg[:, None]).to(dt)
        b_X = tl.dot(b_AiT, tl.load(p_dw, mask=m_dw, other=0.).to(dt))
        b_dbeta += tl.sum(b_X * b_k.to(tl.float32), 1)
        b_dA += tl.dot(b_X.to(dt), tl.dot(tl.trans(b_k), b_TT).to(dt))
    for i_v in range(tl.cdiv(V, BV)):
        p_v, m_v = tile(v + (bos * H + i_h) * V, i_c * BT, i_v * BV, T, V, H * V, 1, BT, BV)
        p_du, m_du = tile(du + (bos * H + i_h) * V, i_c * BT, i_v * BV, T, V, H * V, 1, BT, BV)
        p_dv, m_dv = tile(dv + (bos * H + i_h) * V, i_c * BT, i_v * BV, T, V, H * V, 1, BT, BV)
        b_v = tl.load(p_v, mask=m_v, other=0.)
        b_Y = tl.dot(b_AiT, tl.load(p_du, mask=m_du, other=0.).to(dt))
        tl.store(p_dv, (b_Y * b_beta[:, None]).to(p_dv.dtype.element_ty), mask=m_dv)  # T^T du
        b_dbeta += tl.sum(b_Y * b_v.to(tl.float32), 1)
        b_dA += tl.dot(b_Y.to(dt), tl.dot(tl.trans(b_v), b_TT).to(dt))
    b_dA = tl.where(m_A, -b_dA, 0.)
    if USE_G:
        b_dA *= fast_exp(tl.where(m_A, b_g[:, None] - b_g[None, :], 0.))
    # A_ij = beta_i <k_i, k_j> Γ_ij (i > j): b_dA (times Γ above) is now the gradient of
    # beta_i <k_i, k_j>, so dbeta_i += sum_j b_dA_ij <k_i, k_j> and the gradient of <k_i, k_j> is
    # dB = b_dA ⊙ beta_i; with the gate, dB ⊙ <k_i, k_j> also flows to g_i (+) and g_j (-).
    b_dbeta += tl.sum(b_dA * b_KK, 1)
    tl.store(dbeta + (g0 + o_i) * H + i_h, b_dbeta.to(dbeta.dtype.element_ty), mask=m_t)
    b_dB = b_dA * b_beta[:, None]
    if USE_G:
        b_P = b_dB * b_KK
        b_dgc = tl.sum(b_P, 1) - tl.sum(b_P, 0)
        if HAS_DG:
            # read before the key loop below, so that its load is in flight during the loop's products;
            # added after the loop's terms
            b_dgi = tl.load(dg_in + (g0 + o_i) * H + i_h, mask=m_t, other=0.)
    # dk = (dB + dB^T) k, the dB^T k half as (k^T dB)^T: a product's result transposed and added,
    # never dB transposed as the first operand (Triton 3.4 - 3.7.0 miscompile tl.trans of a dot
    # result used as a dot's first operand on Hopper: fla issue #640, Triton issue #6124), and no
    # round trip of dB through memory.
    b_dB = b_dB.to(dt)
    for i_k in range(tl.cdiv(K, BK)):
        p_k, m_k = tile(k + (bos * H + i_h) * K, i_c * BT, i_k * BK, T, K, H * K, 1, BT, BK)
        p_dw, m_dw = tile(dw + (bos * H + i_h) * K, i_c * BT, i_k * BK, T, K, H * K, 1, BT, BK)
        p_dk, m_dk = tile(dk + (bos * H + i_h) * K, i_c * BT, i_k * BK, T, K, H * K, 1, BT, BK)
        b_k = tl.load(p_k, mask=m_k, other=0.)
        # the gradient of kg: T^T dw = diag(beta) X, X formed again rather than kept per key block
        b_dkb = tl.dot(b_AiT, tl.load(p_dw, mask=m_dw, other=0.).to(dt)) * b_beta[:, None]
        b_dk = tl.dot(b_dB, b_k) + tl.trans(tl.dot(tl.trans(b_k), b_dB))
        if USE_G:
            b_dk += b_dkb * b_eg[:, None]
            b_dgc += tl.sum(b_dkb * b_k * b_eg[:, None], 1)
        else:
            b_dk += b_dkb
        if HAS_DK:
            p_dki, m_dki = tile(dk_in + (bos * H + i_h) * K, i_c * BT, i_k * BK, T, K, H * K, 1, BT, BK)
            b_dk += tl.load(p_dki, mask=m_dki, other=0.)
        tl.store(p_dk, b_dk.to(p_dk.dtype.element_ty), mask=m_dk)
    if USE_G:
        if HAS_DG:
            b_dgc += b_dgi
        b_dgc = tl.where(m_t, b_dgc, 0.)
        # back from cumulative to raw gates: a reverse cumsum inside the chunk
        b_dg = tl.sum(b_dgc, 0) - tl.cumsum(b_dgc, 0) + b_dgc
        tl.store(dg + (g0 + o_i) * H + i_h, b_dg, mask=m_t)


def wy_fwd(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, plan: ChunkPlan, *,
           g: torch.Tensor | None = None, Ai: torch.Tensor | None = None, q: torch.Tensor | None = None):
    """Returns ``(w, u, Ai)``. With ``Ai`` (from an earlier call on the same inputs) the inverse is
    reused, not recomputed. With ``q`` (``[B,T,H,K]``, k's heads) also the chunks' scores ``q k^T ⊙
    causal ⊙ Γ`` (``[B,T,H,BT]`` in q's dtype, laid out as ``Ai``), fourth, for the state walks to
    read (``state.walk_reads_scores``)."""
    if q is not None and q.shape != k.shape:
        raise ValueError(f"wy_fwd: q must have k's shape {tuple(k.shape)}, got {tuple(q.shape)}")
    B, T, H, K = k.shape
    V = v.shape[-1]
    BT = plan.chunk_size
    assert BT == 64, "the triangular inverse is written for 64-token chunks"
    BK, BV = block_size(K, 64), block_size(V, 64)
    w = torch.empty_like(k)
    u = torch.empty_like(v)
    grid = (plan.num_chunks, H)
    if Ai is None:
        # kept for the backward in k's dtype (half of fp32's bytes in bf16): every reader rounds
        # it to that dtype for its products; the substitutions' fp32 scratch lives for this launch
        scratch = torch.empty(B, T, H, BT, device=k.device, dtype=torch.float32)
        Ai = torch.empty(B, T, H, BT, device=k.device, dtype=k.dtype)
        wy_inverse_kernel[grid](k, beta, g, scratch, Ai, plan.cu_seqlens, plan.chunk_indices, plan.seq_len, H=H, K=K,
                                BT=BT, BK=BK, USE_G=g is not None, **tuned("wy_inverse", num_warps=WY_INVERSE_WARPS))
    scores = None if q is None else torch.empty(B, T, H, BT, device=k.device, dtype=q.dtype)
    wy_fwd_kernel[grid](k, v, beta, g, w, u, Ai, q, scores, plan.cu_seqlens, plan.chunk_indices, plan.seq_len, H=H,
                        K=K, V=V, BT=BT, USE_G=g is not None, SCORES=q is not None,
                        **tuned("wy_fwd", BK=BK, BV=BV, num_warps=4))
    return (w, u, Ai) if q is None else (w, u, Ai, scores)


def wy_bwd(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, Ai: torch.Tensor, dw: torch.Tensor,
           du: torch.Tensor, plan: ChunkPlan, *, g: torch.Tensor | None = None, dk: torch.Tensor | None = None,
           dg: torch.Tensor | None = None):
    """Returns ``(dk, dv, dbeta, dg)``; ``dg`` (raw-gate space, fp32) is None without ``g``."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    # blocks of at least 32 keys and 32 values, masked at narrower heads: tiles 16 wide (K or V of at
    # most 16) gave wrong dk, dv and dbeta on Hopper in 16-bit types (Triton 3.6), where blocks of 32
    # give the float64 oracle's results (tests/kernels/test_delta.py)
    BK, BV = max(32, block_size(K, 64)), max(32, block_size(V, 64))
    dk_out = torch.empty_like(k)
    dv = torch.empty_like(v)
    dbeta = torch.empty_like(beta)
    dg_out = torch.empty(B, T, H, device=k.device, dtype=torch.float32) if g is not None else None
    wy_bwd_kernel[(plan.num_chunks, H)](k, v, beta, g, Ai, dw, du, dk, dg, dk_out, dv, dbeta, dg_out,
                                         plan.cu_seqlens, plan.chunk_indices, plan.seq_len, H=H, K=K, V=V,
                                         BT=plan.chunk_size,
                                         USE_G=g is not None, HAS_DK=dk is not None, HAS_DG=dg is not None,
                                         **tuned("wy_bwd", BK=BK, BV=BV))
    return dk_out, dv, dbeta, dg_out
