"""The output stage and its backward, for a scalar (or no) gate.

Per chunk, with ``h`` the state before the chunk and g the cumulative log gate (0 without one):
``o = scale (q ⊙ exp(g)) h + scale (q k^T ⊙ causal ⊙ Γ) v``, ``Γ_ij = exp(g_i - g_j)``,
causal including the diagonal. ``v`` is the corrected value ``v_new`` for delta rules.

Backward (``dS = scale (do v^T) ⊙ causal ⊙ Γ``):
``dv_intra = scale (q k^T ⊙ causal ⊙ Γ)^T do`` (``output_bwd_dv``, needed before the state pass),
``dq = scale (do h^T) ⊙ exp(g) + dS k``, ``dk = dS^T q + (v dh^T) ⊙ exp(g_last - g)``
(formed transposed),
``dw = -dv2 h^T`` (delta rules, where ``v = u - w h``), and the cumulative-gate gradient
``dg_i = q_i·dq_state_i + sum_j P_ij - sum_j P_ji - k_i·dk_state_i (+ last row terms)`` with
``P = dS ⊙ q k^T``; since ``sum_j P_ij = q_i·dq_intra_i`` and ``sum_j P_ji = k_i·dk_intra_i`` that is
``q_i·dq_i - k_i·dk_i`` (+ last row terms), formed without ``q k^T``. Programs of ``output_bwd_dqk``
may split K; their dg partials are summed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttr.kernels.common.approx import fast_exp
from ttr.kernels.common.index import ChunkPlan, block_size, cdiv, rows_grid, sm_count, tuned
from ttr.kernels.common.tile import chunk_gate, chunk_gate_last, chunk_span, grid_ids, qk_rows, tile


@triton.jit
def output_fwd_kernel(q, k, v, h, g, o, cu_seqlens, chunk_indices, seq_len, scale, H: tl.constexpr, HK: tl.constexpr,
                      K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      USE_G: tl.constexpr, FOLD: tl.constexpr):
    i_v, i_t, i_h = grid_ids(tl.cdiv(V, BV), FOLD)
    i_n, i_c, bos, eos = chunk_span(chunk_indices, cu_seqlens, seq_len, i_t, BT)
    T = eos - bos
    b_g = None
    if USE_G:
        b_g = chunk_gate(g, bos + i_c * BT, T - i_c * BT, i_h, H, BT)  # padded rows: the last valid g
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        p_q, m_q = tile(qk_rows(q, bos, i_h, H, HK, K), i_c * BT, i_k * BK, T, K, HK * K, 1, BT, BK)
        p_k, m_k = tile(qk_rows(k, bos, i_h, H, HK, K), i_k * BK, i_c * BT, K, T, 1, HK * K, BK, BT)
        p_h, m_h = tile(h + (i_t.to(tl.int64) * H + i_h) * K * V, i_k * BK, i_v * BV, K, V, V, 1, BK, BV)
        b_q = tl.load(p_q, mask=m_q, other=0.)
        b_k = tl.load(p_k, mask=m_k, other=0.)
        b_h = tl.load(p_h, mask=m_h, other=0.)
        b_o += tl.dot(b_q, b_h.to(b_q.dtype))
        b_A += tl.dot(b_q, b_k)
    p_v, m_v = tile(v + (bos * H + i_h) * V, i_c * BT, i_v * BV, T, V, H * V, 1, BT, BV)
    p_o, m_o = tile(o + (bos * H + i_h) * V, i_c * BT, i_v * BV, T, V, H * V, 1, BT, BV)
    b_o = chunk_output(b_o, b_A, tl.load(p_v, mask=m_v, other=0.), b_g, scale, BT, USE_G, False)
    tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=m_o)


@triton.jit
def chunk_output(b_o, b_A, b_v, b_g, scale, BT: tl.constexpr, USE_G: tl.constexpr, SCORED: tl.constexpr):
    """One chunk's output from its two products, ``b_o = q h`` (``[BT, BV]``) and ``b_A = q k^T``
    (``[BT, BT]``), both fp32, its values ``b_v`` and its gate ``b_g`` (``tile.chunk_gate``'s, read
    by the caller, which chooses when): ``scale ((q h) ⊙ exp(g) + (q k^T ⊙ causal ⊙ Γ) v)``
    (``output_fwd``'s, and the state walk's when it forms the output). ``SCORED``: ``b_A`` is
    already ``q k^T ⊙ causal ⊙ Γ`` in the values' dtype (the scores ``wy_fwd`` keeps)."""
    o_i = tl.arange(0, BT)
    m_A = o_i[:, None] >= o_i[None, :]
    if USE_G:
        b_o *= fast_exp(b_g)[:, None]
        if not SCORED:
            b_A *= fast_exp(tl.where(m_A, b_g[:, None] - b_g[None, :], 0.))
    if not SCORED:
        b_A = tl.where(m_A, b_A, 0.)
    return (b_o + tl.dot(b_A.to(b_v.dtype), b_v)) * scale


@triton.jit
def dv_scores(b_A, g, bos, i_c, T, i_h, scale, H: tl.constexpr, BT: tl.constexpr, USE_G: tl.constexpr):
    """The scores of one chunk's intra-chunk dv, ``[j, i] = scale k_j·q_i Γ_ij`` on ``i >= j`` from
    ``b_A[j, i] = k_j·q_i`` (fp32): ``dv = scores do`` (``output_bwd_dv``'s, and the backward state
    walk's when it forms dv)."""
    o_i = tl.arange(0, BT)
    m_A = o_i[:, None] <= o_i[None, :]
    if USE_G:
        b_g = chunk_gate(g, bos + i_c * BT, T - i_c * BT, i_h, H, BT)  # padded rows: the last valid g
        b_A *= fast_exp(tl.where(m_A, b_g[None, :] - b_g[:, None], 0.))
    return tl.where(m_A, b_A * scale, 0.)


@triton.jit
def output_bwd_dv_kernel(q, k, g, do, dv, cu_seqlens, chunk_indices, seq_len, scale, H: tl.constexpr, HK: tl.constexpr,
                         K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                         USE_G: tl.constexpr):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    i_n, i_c, bos, eos = chunk_span(chunk_indices, cu_seqlens, seq_len, i_t, BT)
    T = eos - bos
    b_A = tl.zeros([BT, BT], dtype=tl.float32)  # [j, i] = k_j . q_i
    for i_k in range(tl.cdiv(K, BK)):
        p_k, m_k = tile(qk_rows(k, bos, i_h, H, HK, K), i_c * BT, i_k * BK, T, K, HK * K, 1, BT, BK)
        p_q, m_q = tile(qk_rows(q, bos, i_h, H, HK, K), i_k * BK, i_c * BT, K, T, 1, HK * K, BK, BT)
        b_A += tl.dot(tl.load(p_k, mask=m_k, other=0.), tl.load(p_q, mask=m_q, other=0.))
    b_A = dv_scores(b_A, g, bos, i_c, T, i_h, scale, H, BT, USE_G)
    scores_times_rows(b_A, do, dv, bos, i_c, i_h, T, H, V, BT, BV)


@triton.jit
def scores_times_rows(b_A, do, dv, bos, i_c, i_h, T, H: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                      BV: tl.constexpr):
    """``dv = A dy`` for one chunk and head, ``b_A [BT, BT]`` in registers, over V in blocks of BV
    (the intra-chunk value gradient of the output stage, generic and SSD's grouped one)."""
    for i_v in range(tl.cdiv(V, BV)):
        p_do, m_do = tile(do + (bos * H + i_h) * V, i_c * BT, i_v * BV, T, V, H * V, 1, BT, BV)
        p_dv, m_dv = tile(dv + (bos * H + i_h) * V, i_c * BT, i_v * BV, T, V, H * V, 1, BT, BV)
        b_do = tl.load(p_do, mask=m_do, other=0.)
        tl.store(p_dv, tl.dot(b_A.to(b_do.dtype), b_do).to(p_dv.dtype.element_ty), mask=m_dv)


@triton.jit
def output_bwd_dqk_kernel(q, k, v, h, dh, do, dv, g, dq, dk, dw, dg, cu_seqlens, chunk_indices, seq_len, scale, TT,
                          H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                          BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, USE_W: tl.constexpr,
                          FOLD: tl.constexpr):
    i_k, i_t, i_h = grid_ids(tl.cdiv(K, BK), FOLD)
    i_n, i_c, bos, eos = chunk_span(chunk_indices, cu_seqlens, seq_len, i_t, BT)
    T = eos - bos
    p_hb = h + (i_t.to(tl.int64) * H + i_h) * K * V
    p_dhb = dh + (i_t.to(tl.int64) * H + i_h) * K * V
    b_dqs = tl.zeros([BT, BK], dtype=tl.float32)
    b_dksT = tl.zeros([BK, BT], dtype=tl.float32)  # dk's state part, transposed (see below)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_dS = tl.zeros([BT, BT], dtype=tl.float32)
    b_hdh = tl.zeros([BK], dtype=tl.float32)
    b_g, b_gl = None, None
    if USE_G and USE_W:
        # the delta rules' stage reads the gate before the products over the values, so that its
        # loads are in flight during them rather than waited out after; the stage without w (simple
        # GLA) leaves it to _dqk_chunk, after them, the form it was timed in (docs/benchmarks.md,
        # the choices table)
        b_g, b_gl = chunk_gate_last(g, bos + i_c * BT, T - i_c * BT, i_h, H, BT)  # padded rows: the last g
    for i_v in range(tl.cdiv(V, BV)):
        p_v, m_v = tile(v + (bos * H + i_h) * V, i_c * BT, i_v * BV, T, V, H * V, 1, BT, BV)
        p_do, m_do = tile(do + (bos * H + i_h) * V, i_c * BT, i_v * BV, T, V, H * V, 1, BT, BV)
        p_h, m_h = tile(p_hb, i_v * BV, i_k * BK, V, K, 1, V, BV, BK)
        p_dh, m_dh = tile(p_dhb, i_v * BV, i_k * BK, V, K, 1, V, BV, BK)
        b_v = tl.load(p_v, mask=m_v, other=0.)  # [BT, BV]
        b_do = tl.load(p_do, mask=m_do, other=0.)  # [BT, BV]
        b_h = tl.load(p_h, mask=m_h, other=0.)  # [BV, BK]
        b_dh = tl.load(p_dh, mask=m_dh, other=0.)  # [BV, BK]
        b_dqs += tl.dot(b_do, b_h.to(b_do.dtype))
        b_dksT += tl.dot(tl.trans(b_dh).to(b_v.dtype), tl.trans(b_v))
        b_dS += tl.dot(b_do, tl.trans(b_v).to(b_do.dtype))
        if USE_G:
            b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), 0)
        if USE_W:
            p_dv, m_dv = tile(dv + (bos * H + i_h) * V, i_c * BT, i_v * BV, T, V, H * V, 1, BT, BV)
            b_dv = tl.load(p_dv, mask=m_dv, other=0.)
            b_dw += tl.dot(b_dv.to(b_h.dtype), b_h)
    b_q, b_k = _qk_tiles(q, k, bos, i_c, i_k, i_h, T, H, HK, K, BT, BK)
    _dqk_chunk(b_dqs, b_dksT, b_dw, b_dS, b_hdh, b_q, b_k, g, b_g, b_gl, dq, dk, dw, dg, bos, i_c, i_k, i_h, T,
               scale, TT, H, K, BT, BK, USE_G, USE_W)


@triton.jit
def _qk_tiles(q, k, bos, i_c, i_k, i_h, T, H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
              BK: tl.constexpr):
    p_q, m_q = tile(qk_rows(q, bos, i_h, H, HK, K), i_c * BT, i_k * BK, T, K, HK * K, 1, BT, BK)
    p_k, m_k = tile(qk_rows(k, bos, i_h, H, HK, K), i_c * BT, i_k * BK, T, K, HK * K, 1, BT, BK)
    return tl.load(p_q, mask=m_q, other=0.), tl.load(p_k, mask=m_k, other=0.)


@triton.jit
def _store_dw(dw, b_dw, bos, i_c, i_k, i_h, T, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    # the WY backward takes dw with the sign of ``v_new = u - w h``
    p_dw, m_dw = tile(dw + (bos * H + i_h) * K, i_c * BT, i_k * BK, T, K, H * K, 1, BT, BK)
    tl.store(p_dw, (-b_dw).to(p_dw.dtype.element_ty), mask=m_dw)


@triton.jit
def _dqk_chunk(b_dqs, b_dksT, b_dw, b_dS, b_hdh, b_q, b_k, g, b_g, b_gl, dq, dk, dw, dg, bos, i_c, i_k, i_h, T,
               scale, TT, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, USE_G: tl.constexpr,
               USE_W: tl.constexpr):
    """One chunk's dq, dk (and dw, dg) of key block ``i_k`` from the products over the values,
    ``b_dqs = do h^T``, ``b_dksT = dh v^T``, ``b_dw = dv h^T``, ``b_dS = do v^T`` (fp32), the
    chunk's q and k tiles, and its gate and last gate where the caller read them (``b_g``, ``b_gl``;
    else None, and with a gate they are read here from ``g``; ``output_bwd_dqk``'s and its walk's)."""
    o_i = tl.arange(0, BT)
    m_t = i_c * BT + o_i < T
    m_A = o_i[:, None] >= o_i[None, :]
    b_dqs *= scale
    if USE_G:
        last = tl.minimum((i_c + 1) * BT, T) - 1
        if b_g is None:
            b_gl = tl.load(g + (bos + last) * H + i_h)
            b_g = chunk_gate(g, bos + i_c * BT, T - i_c * BT, i_h, H, BT)  # padded rows: the last valid g
        b_dqs *= fast_exp(b_g)[:, None]
        b_dksT *= fast_exp(tl.where(m_t, b_gl - b_g, 0.))[None, :]
        b_dS *= fast_exp(tl.where(m_A, b_g[:, None] - b_g[None, :], 0.))
    b_dS = tl.where(m_A, b_dS * scale, 0.)
    b_dq = b_dqs + tl.dot(b_dS.to(b_k.dtype), b_k)
    # dk = dS^T q is formed transposed, dk^T = q^T dS, so dS enters the product as formed:
    # tl.trans of a dot result used as a dot operand miscompiles on Hopper with Triton 3.4 - 3.7.0
    # (fla issue #640), and dS^T by a product of its own costs a fifth of the loop's products
    b_dkT = b_dksT + tl.dot(tl.trans(b_q), b_dS.to(b_q.dtype))
    p_dq, m_dq = tile(dq + (bos * H + i_h) * K, i_c * BT, i_k * BK, T, K, H * K, 1, BT, BK)
    p_dkT, m_dkT = tile(dk + (bos * H + i_h) * K, i_k * BK, i_c * BT, K, T, 1, H * K, BK, BT)
    tl.store(p_dq, b_dq.to(p_dq.dtype.element_ty), mask=m_dq)
    tl.store(p_dkT, b_dkT.to(p_dkT.dtype.element_ty), mask=m_dkT)
    if USE_W:
        _store_dw(dw, b_dw, bos, i_c, i_k, i_h, T, H, K, BT, BK)
    if USE_G:
        # sum_j P_ij = q_i . (dS k)_i and sum_j P_ji = k_i . (dS^T q)_i, so with the state parts
        # dG_i = q_i . dq_i - k_i . dk_i (+ the last row's terms): no q k^T product needed
        b_kT = tl.trans(b_k).to(tl.float32)
        b_dg = tl.sum(b_dq * b_q.to(tl.float32), 1) - tl.sum(b_dkT * b_kT, 0)
        b_dg += tl.where(i_c * BT + o_i == last, tl.sum(b_dksT * b_kT) + fast_exp(b_gl) * tl.sum(b_hdh, 0), 0.)
        tl.store(dg + i_k * TT * H + (bos + i_c * BT + o_i) * H + i_h, b_dg, mask=m_t)


@triton.jit
def output_bwd_dqk_walk_kernel(q, k, v, dh, do, dv, h0, dq, dk, dw, cu_seqlens, chunk_offsets, scale, TT,
                               H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                               BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_H0: tl.constexpr,
                               FOLD: tl.constexpr):
    # One program per (sequence, head, key block) walks the chunks in order and holds the block's
    # state transposed, ``h^T [V, BK]`` in fp32, from which each chunk's products read it (rounded
    # to the inputs' dtype, as a stored h would be) before the ungated update ``h += k^T v``: the
    # stage needs no stored states. ``v`` is v_new as the forward stored it, so the update repeats
    # the forward's products on the same operands. The whole value row is one tile (BV >= V).
    i_k, i_nh, _ = grid_ids(tl.cdiv(K, BK), FOLD)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = eos - bos
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    b_hT = tl.zeros([BV, BK], dtype=tl.float32)
    if USE_H0:
        p_h0, m_h0 = tile(h0 + i_nh.to(tl.int64) * K * V, 0, i_k * BK, V, K, 1, V, BV, BK)
        b_hT += tl.load(p_h0, mask=m_h0, other=0.).to(tl.float32)
    for i_c in range(tl.cdiv(T, BT)):
        p_v, m_v = tile(v + (bos * H + i_h) * V, i_c * BT, 0, T, V, H * V, 1, BT, BV)
        p_do, m_do = tile(do + (bos * H + i_h) * V, i_c * BT, 0, T, V, H * V, 1, BT, BV)
        p_dv, m_dv = tile(dv + (bos * H + i_h) * V, i_c * BT, 0, T, V, H * V, 1, BT, BV)
        p_dh, m_dh = tile(dh + ((boh + i_c) * H + i_h) * K * V, 0, i_k * BK, V, K, 1, V, BV, BK)
        b_v = tl.load(p_v, mask=m_v, other=0.)  # [BT, BV]
        b_do = tl.load(p_do, mask=m_do, other=0.)  # [BT, BV]
        b_dv = tl.load(p_dv, mask=m_dv, other=0.)  # [BT, BV]
        b_dh = tl.load(p_dh, mask=m_dh, other=0.)  # [BV, BK]
        b_h = b_hT.to(b_do.dtype)
        # dw first, stored before the other products are formed: its accumulator is then not live
        # beside theirs, which is what lets the walk run on one warpgroup without spilling
        _store_dw(dw, tl.dot(b_dv.to(b_h.dtype), b_h), bos, i_c, i_k, i_h, T, H, K, BT, BK)
        b_dqs = tl.dot(b_do, b_h)
        b_dksT = tl.dot(tl.trans(b_dh).to(b_v.dtype), tl.trans(b_v))
        b_dS = tl.dot(b_do, tl.trans(b_v).to(b_do.dtype))
        b_q, b_k = _qk_tiles(q, k, bos, i_c, i_k, i_h, T, H, HK, K, BT, BK)
        # no gate: the gate, its state term and dg are not read
        _dqk_chunk(b_dqs, b_dksT, None, b_dS, None, b_q, b_k, None, None, None, dq, dk, dw, None, bos, i_c, i_k, i_h,
                   T, scale, TT, H, K, BT, BK, False, False)
        b_hT += tl.dot(tl.trans(b_v), b_k)


def output_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: torch.Tensor, plan: ChunkPlan, *,
               scale: float, g: torch.Tensor | None = None) -> torch.Tensor:
    """``o [B, T, H, V]``; q and k may have ``HK < H`` heads, each shared by ``H / HK`` heads of v."""
    B, T, HK, K = q.shape
    H, V = v.shape[2:]
    BK = block_size(K, 64)
    o = torch.empty_like(v)
    # BV 128: one program per chunk covers a whole value head, so q k^T is formed once per chunk
    # instead of once per V block; 8 warps and 3 stages keep the loads of the next K block in flight
    # (the delta rules run the same kernel on the same shapes, with v_new for v)
    cfg = tuned("output_fwd", BV=block_size(V, 128), num_warps=8, num_stages=3)
    grid, fold = rows_grid(cdiv(V, cfg['BV']), plan.num_chunks, H)
    output_fwd_kernel[grid](
        q, k, v, h, g, o, plan.cu_seqlens, plan.chunk_indices, plan.seq_len, scale, H=H, HK=HK, K=K, V=V,
        BT=plan.chunk_size, BK=BK, USE_G=g is not None, FOLD=fold, **cfg)
    return o


def output_bwd_dv(q: torch.Tensor, k: torch.Tensor, do: torch.Tensor, plan: ChunkPlan, *, scale: float,
                  g: torch.Tensor | None = None) -> torch.Tensor:
    B, T, HK, K = q.shape
    H, V = do.shape[2:]
    BK, BV = block_size(K, 64), block_size(V, 64)
    dv = torch.empty_like(do)
    output_bwd_dv_kernel[(plan.num_chunks, H)](q, k, g, do, dv, plan.cu_seqlens, plan.chunk_indices, plan.seq_len,
                                               scale, H=H, HK=HK, K=K, V=V, BT=plan.chunk_size, BK=BK, BV=BV,
                                               USE_G=g is not None, **tuned("output_bwd_dv"))
    return dv


def dqk_walks(plan: ChunkPlan, heads: int, K: int, V: int, device: torch.device, gated: bool) -> bool:
    """Whether the delta rule's backward, given the v_new its forward kept, leaves the states to
    ``output_bwd_dqk``'s walk (``h=None``) rather than forming them by a walk of their own for the
    chunk-parallel stage to read back: without a gate, at most 128 values, and where one program
    per (sequence, head, key block of 64) fills the GPU. The walk holds each state in registers, so
    ``h`` is neither written nor read (twice the size of k in bytes, each way, at V = 128), and
    the k and v_new tiles its update needs are the ones the stage loads anyway; with few
    programs its chunks in turn would take longer than the parallel stage (docs/benchmarks.md).
    ``TUNING["output_bwd_dqk_walk"]["walk"]`` overrides."""
    if gated or V > 128:
        return False
    full = plan.num_seqs * heads * cdiv(K, 64) >= 0.9 * sm_count(device)
    return bool(tuned("output_bwd_dqk_walk", walk=full)["walk"])


def output_bwd_dqk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: torch.Tensor | None, dh: torch.Tensor,
                   do: torch.Tensor, plan: ChunkPlan, *, scale: float, g: torch.Tensor | None = None,
                   dv: torch.Tensor | None = None, h0: torch.Tensor | None = None):
    """Returns ``(dq, dk, dw or None, dg fp32 in cumulative-gate space or None)``, dq and dk in q's
    dtype. The delta rules' WY backward adds its part to this dk: handing it on in bf16 rather than
    fp32 rounds it once more (as fla's delta rules do) and timed faster for the two stages on an
    H200, a quarter of their traffic (docs/benchmarks.md, launch choices). With q/k of
    ``HK < H`` heads (groups) dq and dk are per value head, ``[B, T, H, K]``: the caller sums each
    group.

    ``h=None`` (the delta rule without a gate, ``v`` its kept v_new, ``dv`` given; ``dqk_walks``):
    the stage walks each sequence's chunks and forms the states from ``h0`` (the initial state, or
    zeros) by the forward's update ``h += k^T v_new``."""
    B, T, HK, K = q.shape
    H, V = v.shape[2:]
    if h is None:
        if g is not None or dv is None or V > 128:
            raise ValueError("output_bwd_dqk: h=None (the walk) takes no gate, needs dv and at most 128 values")
        return _dqk_walk(q, k, v, dh, do, dv, h0, plan, scale=scale)
    BV = block_size(V, 64)
    if K <= 128 and g is None:
        # without a gate (DeltaNet): one program per chunk over all of K, so dS is formed once, not once per K
        # block, and v, do and dv are read once; 8 warps hold the wider [BT, K] tiles. With a gate
        # the wider program timed slower than two K blocks on 4 warps (H100, docs/benchmarks.md,
        # launch choices)
        cfg = tuned("output_bwd_dqk", BK=block_size(K, 128), BV=BV, num_warps=8,
                    num_stages=2 if q.element_size() == 4 else 3)
    else:
        # key blocks of 64, masked at narrower heads: at 32 keys and 64 values on four warps the
        # stage's gated form made an illegal memory access on Hopper (Triton 3.6), where the masked
        # block of 64 gives the float64 oracle's results (tests/kernels/test_gla_gpu.py)
        cfg = tuned("output_bwd_dqk", BK=64, BV=BV, num_stages=2 if q.element_size() == 4 else 3)
    NK = cdiv(K, cfg["BK"])
    dq = q.new_empty(B, T, H, K)
    dk = q.new_empty(B, T, H, K)
    dw = q.new_empty(B, T, H, K) if dv is not None else None
    dg = torch.empty(NK, B, T, H, device=q.device, dtype=torch.float32) if g is not None else None
    grid, fold = rows_grid(NK, plan.num_chunks, H)
    output_bwd_dqk_kernel[grid](
        q, k, v, h, dh, do, dv, g, dq, dk, dw, dg, plan.cu_seqlens, plan.chunk_indices, plan.seq_len, scale, B * T,
        H=H, HK=HK, K=K, V=V, BT=plan.chunk_size, USE_G=g is not None, USE_W=dv is not None, FOLD=fold, **cfg)
    if dg is not None:
        dg = dg[0] if NK == 1 else dg.sum(0)
    return dq, dk, dw, dg


def _dqk_walk(q, k, v, dh, do, dv, h0, plan: ChunkPlan, *, scale: float):
    B, T, HK, K = q.shape
    H, V = v.shape[2:]
    # the whole value row in one tile. 16-bit inputs: one warpgroup holds the state's [V, 64] fp32
    # block (64 registers a thread at V = 128) beside the products, within 255 registers because the
    # kernel stores dw before it forms the other three (docs/benchmarks.md, the choices table); two
    # stages of the chunk's six tiles take 184 KB of shared memory at K = V = 128. fp32 inputs spill
    # on one warpgroup and take 8 warps and one stage
    wide = q.element_size() == 4
    cfg = tuned("output_bwd_dqk_walk", BK=block_size(K, 64), BV=block_size(V, 128), num_warps=8 if wide else 4,
                num_stages=1 if wide else 2)
    cfg.pop("walk", None)
    dq, dk, dw = (q.new_empty(B, T, H, K) for _ in range(3))
    grid, fold = rows_grid(cdiv(K, cfg["BK"]), plan.num_seqs * H)
    output_bwd_dqk_walk_kernel[grid](
        q, k, v, dh, do, dv, h0, dq, dk, dw, plan.cu_seqlens, plan.chunk_offsets, scale, B * T, H=H, HK=HK, K=K,
        V=V, BT=plan.chunk_size, USE_H0=h0 is not None, FOLD=fold, **cfg)
    return dq, dk, dw, None
