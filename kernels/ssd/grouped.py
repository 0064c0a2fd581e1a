"""Mamba2's SSD stages that share one ``C B^T`` per group of heads (the intra-chunk part).

In Mamba2 the H heads read B and C by G groups (``H / G`` consecutive heads each; at 1.3B one
group for 64 heads), so the chunk's score matrix ``CB = C B^T`` (``[BT, BT]``, a ``BT x BT x N``
product) is the same for every head of a group; only the gate ``Γ_h`` and the values differ.
The generic output stage (``ttr.kernels.common.output``) forms ``q k^T`` per head, and its
backward writes ``dq``, ``dk`` per head (``[B, T, H, N]``) for the caller to sum over the group.
Here, per chunk c, head h of group r, ``G`` the chunk-local cumulative gate (fp32), ``h_h`` the
state before the chunk (``[N, P]``), ``v_h = x_h dt_h`` and ``Γ_h[i, j] = exp(G_i - G_j)`` on the
causal triangle ``j <= i`` (formed as a masked difference, exponent <= 0):

- ``cb_fwd``: ``CB[c, r] = C B^T`` in fp32, ``[NT, G, BT, BT]``, one program per (chunk, group).
- ``output_fwd``: ``y_h = (C ⊙ exp(G)) h_h + (CB ⊙ Γ_h) v_h (+ D_h x_h``, Mamba2's skip, in fp32
  before the one rounding), reading the CB tile instead of forming it, and x and dt instead of v
  (``dt`` scales the scores' columns).
- ``output_bwd_dcb``: first ``M = sum_h (dy_h v_h^T) ⊙ Γ_h`` per (chunk, group), ``[NT, G, BT, BT]``
  in C's dtype (the precision the product with B or C reads it in), by a kernel of its own; then one
  program per (chunk, group, block of N) walks the group's heads and keeps two accumulators in
  registers, ``dC_inter = sum_h (dy_h ⊙ exp(G)) h_h^T`` and
  ``dB_inter = sum_h (v_h ⊙ exp(G_last - G)) dh_h^T``, then writes ``dC = dC_inter + M B`` and
  ``dB = dB_inter + M^T C`` as ``[B, T, G, N]``: no per-head ``dq``/``dk``, no group sum. It reads x
  and dt instead of v: ``v = x dt`` and the gate's factors are row and column scales of each head's
  products, whose operands are the tiles as loaded. On the way it writes each head's state terms
  of the gate's gradient for the row stage, which then needs neither C nor the states h:
  ``C_i·(dy_h h_h^T)_i`` (``dy·y^inter`` without its ``exp(G_i)``) and ``<h_h, dh_h>``, per block
  of N (the products are the ones dC needs; the row stage would form a ``[BT, N] x [N, P]`` product
  of its own for them).
- ``rows_bwd``: one program per (chunk, head) forms the head's full value gradient
  ``dv = (CB ⊙ Γ_h)^T dy_h + (B ⊙ exp(G_last - G)) dh_h`` (the state pass leaves that share to it)
  and from it ``dx = dv dt + D dy``, ``ddt = sum_p dv x + A dg``, the chunk's shares of
  ``dA = sum dg dt`` and ``dD = sum dy x``, where the gate's gradient ``dg`` is the chunk's reverse
  cumulative sum of

      dG_i = dy_i·y^inter_i - v_i·dv^inter_i + sum_j (S_h ⊙ CB ⊙ Γ_h)_ij - sum_j (S_h ⊙ CB ⊙ Γ_h)_ji
      dG_last += exp(G_last) <h_h, dh_h> + sum_j v_j·dv^inter_j

  (``S_h = dy_h v_h^T``; ``y^inter = (C ⊙ exp(G)) h_h`` and ``dv^inter`` are the parts through the
  states), the ``dg`` of ``output.output_bwd_dqk`` on the same chunk: ``C_i·dC_i`` and
  ``B_i·dB_i`` written with the head's own values. Every term is an fp32 sum of products of the
  stored inputs; ``dy·y`` with the kept (rounded) output instead measured ten times the error in
  dA, since the query and key sums cancel.

``M^T`` is read from memory as the transposed tile rather than transposed in registers, so no
transposed dot result feeds a ``tl.dot``: that pattern miscompiles on Hopper with Triton 3.4 - 3.7.0
(the note at ``output.output_bwd_dqk_kernel``, which forms dk transposed for the same reason).

Padded rows of a sequence's last chunk: x, B, C, dy load as zeros and the gate as the last valid
value (``tile.chunk_gate``), so every exponent stays <= 0 and no product turns into ``0 * inf``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttr.kernels.common.approx import fast_exp
from ttr.kernels.common.index import ChunkPlan, block_size, cdiv, folds, next_power_of_2, rows_grid, tuned
from ttr.kernels.common.tile import (
    chunk_gate,
    chunk_gate_last,
    chunk_span,
    grid_ids,
    load_tile,
    qk_rows,
    tile,
)


@triton.jit
def cb_fwd_kernel(C, B, cb, cu_seqlens, chunk_indices, seq_len, G: tl.constexpr, N: tl.constexpr, BT: tl.constexpr,
                  BK: tl.constexpr):
    i_t, i_r = tl.program_id(0), tl.program_id(1)
    i_n, i_c, bos, eos = chunk_span(chunk_indices, cu_seqlens, seq_len, i_t, BT)
    T = eos - bos
    b_cb = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(N, BK)):
        p_c, m_c = tile(qk_rows(C, bos, i_r, G, G, N), i_c * BT, i_k * BK, T, N, G * N, 1, BT, BK)
        p_b, m_b = tile(qk_rows(B, bos, i_r, G, G, N), i_k * BK, i_c * BT, N, T, 1, G * N, BK, BT)
        b_cb += tl.dot(tl.load(p_c, mask=m_c, other=0.), tl.load(p_b, mask=m_b, other=0.))  # [BT, BT]
    p_cb, m_cb = tile(cb + (i_t.to(tl.int64) * G + i_r) * BT * BT, 0, 0, BT, BT, BT, 1, BT, BT)
    tl.store(p_cb, b_cb, mask=m_cb)


@triton.jit
def gated_scores(cb, g, i_t, i_c, i_h, bos, T, H: tl.constexpr, G: tl.constexpr, BT: tl.constexpr,
                 TRANSPOSED: tl.constexpr):
    """``(G, G_last, CB ⊙ causal ⊙ Γ_h)`` of head h's chunk from its group's CB tile, or the transpose
    (``[j, i]``, the tile read transposed from memory rather than transposed in registers)."""
    o_i = tl.arange(0, BT)
    base = cb + (i_t.to(tl.int64) * G + i_h // (H // G)) * BT * BT
    b_g, b_gl = chunk_gate_last(g, bos + i_c * BT, T - i_c * BT, i_h, H, BT)  # padded rows: the last G
    if TRANSPOSED:
        p_cb, m_cb = tile(base, 0, 0, BT, BT, 1, BT, BT, BT)
        m_A = o_i[:, None] <= o_i[None, :]
        b_A = tl.load(p_cb, mask=m_cb, other=0.) * fast_exp(tl.where(m_A, b_g[None, :] - b_g[:, None], 0.))
    else:
        p_cb, m_cb = tile(base, 0, 0, BT, BT, BT, 1, BT, BT)
        m_A = o_i[:, None] >= o_i[None, :]
        b_A = tl.load(p_cb, mask=m_cb, other=0.) * fast_exp(tl.where(m_A, b_g[:, None] - b_g[None, :], 0.))
    return b_g, b_gl, tl.where(m_A, b_A, 0.)


@triton.jit
def output_fwd_kernel(C, x, dt, h, cb, g, D, o, cu_seqlens, chunk_indices, seq_len, H: tl.constexpr, G: tl.constexpr,
                      N: tl.constexpr, P: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      HAS_D: tl.constexpr, FOLD: tl.constexpr):
    i_v, i_t, i_h = grid_ids(tl.cdiv(P, BV), FOLD)
    i_n, i_c, bos, eos = chunk_span(chunk_indices, cu_seqlens, seq_len, i_t, BT)
    T = eos - bos
    o_i = tl.arange(0, BT)
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(tl.cdiv(N, BK)):
        p_c, m_c = tile(qk_rows(C, bos, i_h, H, G, N), i_c * BT, i_k * BK, T, N, G * N, 1, BT, BK)
        p_h, m_h = tile(h + (i_t.to(tl.int64) * H + i_h) * N * P, i_k * BK, i_v * BV, N, P, P, 1, BK, BV)
        b_c = tl.load(p_c, mask=m_c, other=0.)
        b_o += tl.dot(b_c, tl.load(p_h, mask=m_h, other=0.).to(b_c.dtype))
    b_g, _, b_A = gated_scores(cb, g, i_t, i_c, i_h, bos, T, H, G, BT, False)
    p_x, m_x = tile(x + (bos * H + i_h) * P, i_c * BT, i_v * BV, T, P, H * P, 1, BT, BV)
    p_o, m_o = tile(o + (bos * H + i_h) * P, i_c * BT, i_v * BV, T, P, H * P, 1, BT, BV)
    b_x = tl.load(p_x, mask=m_x, other=0.)
    # v = x dt as a column scale of the scores (fp32, before their one rounding), so x is the one
    # tile read for both the product and the skip
    b_dt = tl.load(dt + (bos + i_c * BT + o_i) * H + i_h, mask=i_c * BT + o_i < T, other=0.)
    b_o = b_o * fast_exp(b_g)[:, None] + tl.dot((b_A * b_dt[None, :]).to(b_x.dtype), b_x)
    if HAS_D:
        # the skip in fp32 before the output's one rounding (no pass of its own over y)
        b_o += tl.load(D + i_h) * b_x.to(tl.float32)
    tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=m_o)


@triton.jit
def scores_grad_kernel(x, dt, do, g, M, cu_seqlens, chunk_indices, seq_len, H: tl.constexpr, G: tl.constexpr,
                       P: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr):
    """``M = sum_h (dy_h v_h^T) ⊙ Γ_h`` (causal, ``v = x dt``) of one chunk and group, in M's dtype."""
    i_t, i_r = tl.program_id(0), tl.program_id(1)
    i_n, i_c, bos, eos = chunk_span(chunk_indices, cu_seqlens, seq_len, i_t, BT)
    T = eos - bos
    o_i = tl.arange(0, BT)
    m_t = i_c * BT + o_i < T
    m_A = o_i[:, None] >= o_i[None, :]
    b_m = tl.zeros([BT, BT], dtype=tl.float32)
    for i_j in range(H // G):
        i_h = i_r * (H // G) + i_j
        b_g = chunk_gate(g, bos + i_c * BT, T - i_c * BT, i_h, H, BT)  # padded rows: the last valid G
        b_dt = tl.load(dt + (bos + i_c * BT + o_i) * H + i_h, mask=m_t, other=0.)
        b_ds = tl.zeros([BT, BT], dtype=tl.float32)
        for i_v in range(tl.cdiv(P, BV)):
            p_x, m_x = tile(x + (bos * H + i_h) * P, i_c * BT, i_v * BV, T, P, H * P, 1, BT, BV)
            p_do, m_do = tile(do + (bos * H + i_h) * P, i_c * BT, i_v * BV, T, P, H * P, 1, BT, BV)
            b_ds += tl.dot(tl.load(p_do, mask=m_do, other=0.), tl.trans(tl.load(p_x, mask=m_x, other=0.)))
        b_ds *= b_dt[None, :]  # dy v^T
        b_m += tl.where(m_A, b_ds * fast_exp(tl.where(m_A, b_g[:, None] - b_g[None, :], 0.)), 0.)
    p_m, m_m = tile(M + (i_t.to(tl.int64) * G + i_r) * BT * BT, 0, 0, BT, BT, BT, 1, BT, BT)
    tl.store(p_m, b_m.to(p_m.dtype.element_ty), mask=m_m)


@triton.jit
def output_bwd_dcb_kernel(C, B, x, dt, h, dh, do, g, M, dC, dB, ydo, hdh, R, cu_seqlens, chunk_indices, seq_len,
                          H: tl.constexpr, G: tl.constexpr, N: tl.constexpr, P: tl.constexpr, BT: tl.constexpr,
                          BK: tl.constexpr, BV: tl.constexpr, FOLD: tl.constexpr):
    i_k, i_t, i_r = grid_ids(tl.cdiv(N, BK), FOLD)
    if FOLD:
        NT = tl.num_programs(0) // tl.cdiv(N, BK)
    else:
        NT = tl.num_programs(1)
    i_n, i_c, bos, eos = chunk_span(chunk_indices, cu_seqlens, seq_len, i_t, BT)
    T = eos - bos
    o_i = tl.arange(0, BT)
    m_t = i_c * BT + o_i < T
    b_dc = tl.zeros([BT, BK], dtype=tl.float32)
    b_db = tl.zeros([BT, BK], dtype=tl.float32)
    p_c, m_c = tile(qk_rows(C, bos, i_r, G, G, N), i_c * BT, i_k * BK, T, N, G * N, 1, BT, BK)
    b_c = tl.load(p_c, mask=m_c, other=0.)  # [BT, BK]
    for i_j in range(H // G):
        i_h = i_r * (H // G) + i_j
        p_hb = h + (i_t.to(tl.int64) * H + i_h) * N * P
        p_dhb = dh + (i_t.to(tl.int64) * H + i_h) * N * P
        # the gate and its last value read before the head's products, so that their loads are in
        # flight during them (docs/benchmarks.md, the choices table)
        b_g, b_gl = chunk_gate_last(g, bos + i_c * BT, T - i_c * BT, i_h, H, BT)  # padded rows: the last G
        b_dt = tl.load(dt + (bos + i_c * BT + o_i) * H + i_h, mask=m_t, other=0.)
        # the row scales dt, exp(G) and exp(G_last - G) go on the products, not on the loaded tiles,
        # so every product reads its operands as loaded and the head loop's pipeline can stage them
        b_dch = tl.zeros([BT, BK], dtype=tl.float32)
        b_dbh = tl.zeros([BT, BK], dtype=tl.float32)
        b_hdh = tl.zeros([BK], dtype=tl.float32)
        for i_v in range(tl.cdiv(P, BV)):
            p_x, m_x = tile(x + (bos * H + i_h) * P, i_c * BT, i_v * BV, T, P, H * P, 1, BT, BV)
            p_do, m_do = tile(do + (bos * H + i_h) * P, i_c * BT, i_v * BV, T, P, H * P, 1, BT, BV)
            p_h, m_h = tile(p_hb, i_k * BK, i_v * BV, N, P, P, 1, BK, BV)
            p_dh, m_dh = tile(p_dhb, i_k * BK, i_v * BV, N, P, P, 1, BK, BV)
            b_h = tl.load(p_h, mask=m_h, other=0.)
            b_dh = tl.load(p_dh, mask=m_dh, other=0.)
            b_dch += tl.dot(tl.load(p_do, mask=m_do, other=0.), tl.trans(b_h))
            b_dbh += tl.dot(tl.load(p_x, mask=m_x, other=0.), tl.trans(b_dh))
            b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), 1)
        # the row stage's state terms of the gate's gradient, this N block's share: dy_i·y^inter_i
        # without its exp(G_i) (C_i·(dy h^T)_i) and <h, dh>
        tl.store(ydo + (i_k * R + bos + i_c * BT + o_i) * H + i_h, tl.sum(b_c * b_dch, 1), mask=m_t)
        tl.store(hdh + (i_k * NT + i_t) * H + i_h, tl.sum(b_hdh, 0))
        b_dc += b_dch * fast_exp(b_g)[:, None]
        b_db += b_dbh * (b_dt * fast_exp(b_gl - b_g))[:, None]
    # the scores' terms M B and M^T C, with M and M^T both read from memory (no transpose in registers)
    p_m, m_m = tile(M + (i_t.to(tl.int64) * G + i_r) * BT * BT, 0, 0, BT, BT, BT, 1, BT, BT)
    p_mT, m_mT = tile(M + (i_t.to(tl.int64) * G + i_r) * BT * BT, 0, 0, BT, BT, 1, BT, BT, BT)
    p_bT, m_bT = tile(qk_rows(B, bos, i_r, G, G, N), i_k * BK, i_c * BT, N, T, 1, G * N, BK, BT)
    b_dc += tl.dot(tl.load(p_m, mask=m_m, other=0.), tl.trans(tl.load(p_bT, mask=m_bT, other=0.)))
    b_db += tl.dot(tl.load(p_mT, mask=m_mT, other=0.), b_c)
    p_dc, m_dc = tile(qk_rows(dC, bos, i_r, G, G, N), i_c * BT, i_k * BK, T, N, G * N, 1, BT, BK)
    p_db, m_db = tile(qk_rows(dB, bos, i_r, G, G, N), i_c * BT, i_k * BK, T, N, G * N, 1, BT, BK)
    tl.store(p_dc, b_dc.to(p_dc.dtype.element_ty), mask=m_dc)
    tl.store(p_db, b_db.to(p_db.dtype.element_ty), mask=m_db)


@triton.jit
def rows_bwd_kernel(B, x, dt, dh, cb, g, do, ydo, hdh, A, D, dx, ddt, dA, dD, R, cu_seqlens, chunk_indices, seq_len,
                    H: tl.constexpr, G: tl.constexpr, N: tl.constexpr, P: tl.constexpr, BT: tl.constexpr,
                    BK: tl.constexpr, BP: tl.constexpr, NK: tl.constexpr, HAS_D: tl.constexpr,
                    EARLY_LOADS: tl.constexpr, HEADS_FIRST: tl.constexpr):
    """One chunk of one head, every value column (module docstring): ``dv``, then ``dx``, ``ddt``, the
    gate's gradient and this chunk's shares of ``dA`` and ``dD`` (``[NT, H]``, summed by the caller).
    The state terms ``dy·y^inter`` and ``<h, dh>`` come from the dB/dC stage (``NK`` N blocks each).
    ``EARLY_LOADS`` (N in one block): B's and dh's tiles are loaded with x's and dy's, before the
    first product, so the program waits on memory once rather than twice. ``HEADS_FIRST``: the grid
    is ``(H, NT)``, so the heads of a group that read one chunk's CB and B tiles run next to each other."""
    if HEADS_FIRST:
        i_h, i_t = tl.program_id(0), tl.program_id(1)
        NT = tl.num_programs(1)
    else:
        i_t, i_h = tl.program_id(0), tl.program_id(1)
        NT = tl.num_programs(0)
    i_n, i_c, bos, eos = chunk_span(chunk_indices, cu_seqlens, seq_len, i_t, BT)
    T = eos - bos
    o_i = tl.arange(0, BT)
    m_t = i_c * BT + o_i < T
    last = tl.minimum((i_c + 1) * BT, T) - 1
    b_ydo = tl.zeros([BT], dtype=tl.float32)
    b_hdh = 0.
    # the N blocks' terms and the state's share of dv below in unrolled loops: at N = 128 (two blocks
    # of terms) the kernel then fits the cap of 168 registers without the stack it spilled to as
    # loops, and timed faster (docs/benchmarks.md, the choices table)
    for i_k in tl.static_range(NK):
        b_ydo += tl.load(ydo + (i_k * R + bos + i_c * BT + o_i) * H + i_h, mask=m_t, other=0.)
        b_hdh += tl.load(hdh + (i_k * NT + i_t) * H + i_h)
    p_x, m_x = tile(x + (bos * H + i_h) * P, i_c * BT, 0, T, P, H * P, 1, BT, BP)
    p_do, m_do = tile(do + (bos * H + i_h) * P, i_c * BT, 0, T, P, H * P, 1, BT, BP)
    if not EARLY_LOADS:
        b_g, b_gl, b_A = gated_scores(cb, g, i_t, i_c, i_h, bos, T, H, G, BT, False)
    b_x = tl.load(p_x, mask=m_x, other=0.)
    b_do = tl.load(p_do, mask=m_do, other=0.)
    b_dt = tl.load(dt + (bos + i_c * BT + o_i) * H + i_h, mask=m_t, other=0.)
    if EARLY_LOADS:
        b_b = load_tile(qk_rows(B, bos, i_h, H, G, N), i_c * BT, 0, T, N, G * N, 1, BT, BK)
        b_dh = load_tile(dh + (i_t.to(tl.int64) * H + i_h) * N * P, 0, 0, N, P, P, 1, BK, BP)
        b_g, b_gl, b_A = gated_scores(cb, g, i_t, i_c, i_h, bos, T, H, G, BT, False)
    # v = x dt as a column scale of dy x^T and a row scale of x·dv (the dB/dC stage's v, in fp32)
    b_p = b_A * tl.dot(b_do, tl.trans(b_x)) * b_dt[None, :]  # (CB ⊙ Γ) ⊙ (dy v^T), fp32
    b_dG = b_ydo * fast_exp(b_g) + tl.sum(b_p, 1) - tl.sum(b_p, 0)
    # the part of dv from the state after the chunk, formed after the scores' terms so that its
    # accumulator is not live next to theirs: the kernel then does not spill, and timed faster at
    # Mamba2-1.3B's shape and at N = 64 in 8 groups on an H200 (docs/benchmarks.md)
    if EARLY_LOADS:
        b_dv = tl.dot(b_b, b_dh)
    else:
        b_dv = tl.zeros([BT, BP], dtype=tl.float32)
        for k0 in tl.static_range(0, N, BK):
            p_b, m_b = tile(qk_rows(B, bos, i_h, H, G, N), i_c * BT, k0, T, N, G * N, 1, BT, BK)
            p_dh, m_dh = tile(dh + (i_t.to(tl.int64) * H + i_h) * N * P, k0, 0, N, P, P, 1, BK, BP)
            b_dv += tl.dot(tl.load(p_b, mask=m_b, other=0.), tl.load(p_dh, mask=m_dh, other=0.))
    b_dv *= fast_exp(b_gl - b_g)[:, None]
    b_vdv = b_dt * tl.sum(b_x.to(tl.float32) * b_dv, 1)
    b_dG -= b_vdv
    # the state after the chunk, exp(G_last) h + sum_j exp(G_last - G_j) B_j v_j^T, on its last row
    b_dG += tl.where(i_c * BT + o_i == last, fast_exp(b_gl) * b_hdh + tl.sum(b_vdv, 0), 0.)
    b_dg = tl.sum(b_dG, 0) - tl.cumsum(b_dG, 0) + b_dG  # d/d(A dt): the reverse sum inside the chunk
    b_dv += tl.dot(tl.trans(b_A).to(b_do.dtype), b_do)
    b_x = b_x.to(tl.float32)
    b_do = b_do.to(tl.float32)
    b_dx = b_dv * b_dt[:, None]
    if HAS_D:
        b_dx += tl.load(D + i_h) * b_do
        tl.store(dD + i_t * H + i_h, tl.sum(tl.sum(b_do * b_x, 1), 0))
    p_dx, m_dx = tile(dx + (bos * H + i_h) * P, i_c * BT, 0, T, P, H * P, 1, BT, BP)
    tl.store(p_dx, b_dx.to(p_dx.dtype.element_ty), mask=m_dx)
    b_dg = tl.where(m_t, b_dg, 0.)
    tl.store(ddt + (bos + i_c * BT + o_i) * H + i_h, tl.sum(b_dv * b_x, 1) + tl.load(A + i_h) * b_dg, mask=m_t)
    tl.store(dA + i_t * H + i_h, tl.sum(b_dg * b_dt, 0))


def cb_fwd(C: torch.Tensor, B: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """``C B^T`` per chunk and group, fp32 ``[NT, G, BT, BT]`` (rows of padded tokens are zeros)."""
    _, _, G, N = C.shape
    BT = plan.chunk_size
    cb = torch.empty(plan.num_chunks, G, BT, BT, device=C.device, dtype=torch.float32)
    cb_fwd_kernel[(plan.num_chunks, G)](C, B, cb, plan.cu_seqlens, plan.chunk_indices, plan.seq_len, G=G, N=N, BT=BT,
                                        **tuned("ssd_cb", BK=block_size(N, 64), num_warps=4))
    return cb


def output_fwd(C: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, h: torch.Tensor, cb: torch.Tensor,
               g: torch.Tensor, plan: ChunkPlan, *, D: torch.Tensor | None = None) -> torch.Tensor:
    """``y [B, T, H, P]`` in x's dtype: ``(C ⊙ exp(g)) h + (CB ⊙ causal ⊙ Γ) v (+ D x)`` with ``v = x dt``
    (dt ``[B, T, H]`` fp32, applied to the scores' columns, so no v tensor is read), C by group; with
    ``D`` (``[H]`` fp32) the skip ``D x`` is added in fp32 before the one rounding."""
    _, _, G, N = C.shape
    H, P = x.shape[2:]
    o = torch.empty_like(x)
    # one program covers a whole head of up to 128 values, so the CB tile and the gate are read once,
    # and at up to 64 values all of N up to 128 in one block: on an H200 (Triton 3.6) faster than BK 32
    # at N = 64 in 8 groups and than BK 64 at Mamba2-1.3B's N = 128. A cap of 128 registers timed
    # faster at both (8 x 2048 and 1 x 16384 alike; a cap of 168 gained less, or lost;
    # docs/benchmarks.md, launch choices). The compiler's report then gave the launch 128 registers
    # with or without the cap, so the gain was the schedule ptxas makes under the directive; with
    # the approximate exp the launch compiles to more registers without the cap (145 at N = 128, 168
    # at N = 64) and keeps 8 bytes of stack under it
    BV = block_size(P, 128)
    cap = {"maxnreg": 128} if BV <= 64 else {}
    cfg = tuned("ssd_output_fwd", BK=block_size(N, 128 if BV <= 64 else 64), BV=BV,
                num_warps=4 if BV <= 64 else 8, num_stages=3, **cap)
    grid, fold = rows_grid(cdiv(P, cfg["BV"]), plan.num_chunks, H)
    output_fwd_kernel[grid](
        C, x, dt, h, cb, g, D, o, plan.cu_seqlens, plan.chunk_indices, plan.seq_len, H=H, G=G, N=N, P=P,
        BT=plan.chunk_size, HAS_D=D is not None, FOLD=fold, **cfg)
    return o


def output_bwd_dcb(C: torch.Tensor, B: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, h: torch.Tensor,
                   dh: torch.Tensor, do: torch.Tensor, g: torch.Tensor, plan: ChunkPlan):
    """Returns ``(dC, dB, terms)``: ``dC``, ``dB`` ``[B, T, G, N]`` in C's dtype, the gradients through
    the output (``dB`` includes the state's ``v ⊙ exp(G_last - G) dh`` part), and the row stage's
    state terms (``rows_bwd``'s ``terms``). ``v = x dt`` enters as a scale of the products with x in
    fp32 (not rounded to x's dtype as the forward's v), so a backward from kept states needs no ``v``
    tensor; the gate's gradient is the row stage's (``chunk._ssd_backward``)."""
    _, _, G, N = C.shape
    H, P = x.shape[2:]
    # M once per chunk and group by a kernel of its own (not once per N block inside the head loop),
    # so this stage keeps two [BT, BK] accumulators and runs on 4 warps with 3 stages staging the next
    # head's tiles; M's kernel walks the heads on 2 warps (each head's product is one [BT, BT] tile).
    # On an H200 the two kernels timed faster than M in the head loop (8 warps, 2 stages) at
    # Mamba2-1.3B's N = 128 and at N = 64 in 8 groups, and M's kernel faster on 2 warps than on 4
    # (docs/benchmarks.md)
    M = C.new_empty(plan.num_chunks, G, plan.chunk_size, plan.chunk_size)
    scores_grad_kernel[(plan.num_chunks, G)](x, dt, do, g, M, plan.cu_seqlens, plan.chunk_indices, plan.seq_len, H=H,
                                             G=G, P=P, BT=plan.chunk_size,
                                             **tuned("ssd_scores_grad", BV=block_size(P, 64), num_warps=2,
                                                     num_stages=3))
    cfg = tuned("ssd_output_bwd_dcb", BK=block_size(N, 64), BV=block_size(P, 64), num_warps=4, num_stages=3)
    dC, dB = torch.empty_like(C), torch.empty_like(B)
    NK = cdiv(N, cfg["BK"])
    # per N block: dy·y^inter without exp(G) [NK, B, T, H] and <h, dh> [NK, NT, H], fp32
    ydo = dt.new_empty(NK, *dt.shape, dtype=torch.float32)
    hdh = dt.new_empty(NK, plan.num_chunks, H, dtype=torch.float32)
    grid, fold = rows_grid(NK, plan.num_chunks, G)
    output_bwd_dcb_kernel[grid](
        C, B, x, dt, h, dh, do, g, M, dC, dB, ydo, hdh, dt.numel() // H, plan.cu_seqlens, plan.chunk_indices,
        plan.seq_len, H=H, G=G, N=N, P=P, BT=plan.chunk_size, FOLD=fold, **cfg)
    return dC, dB, (ydo, hdh)


def rows_bwd(B, x, dt, A, D, dh, cb, g, do, terms, plan: ChunkPlan):
    """``rows_bwd_kernel`` over every chunk and head: ``(dx, ddt, dA, dD or None)``; ``terms`` are the
    state terms of the gate's gradient that ``output_bwd_dcb`` returns."""
    _, _, G, N = B.shape
    ydo, hdh = terms
    H, P = x.shape[2:]
    NT = plan.num_chunks
    dx, ddt = torch.empty_like(x), torch.empty_like(dt)
    # the chunks' shares of dA and dD side by side, so one reduction sums both
    shares = dt.new_empty(1 if D is None else 2, NT, H)
    dA, dD = shares[0], (None if D is None else shares[1])
    # one N block of 128 on 4 warps: on an H200 at Mamba2-1.3B's shape faster than BK 64 and than
    # 8 warps (1 - 3 stages alike), measured before the kernel formed the state's share of dv last.
    # It compiled to 212 (N = 64) - 225 (N = 128) registers, two programs per SM; capped at 168
    # (three) it timed faster at N = 64 in 8 groups and at N = 128 (8 x 2048 and 1 x 16384 alike);
    # at 128 it spills and timed slower (docs/benchmarks.md, launch choices). With the approximate
    # exp it compiles to 176 registers without the cap at N = 128, where the cap still pays.
    # At N <= 64 B's and dh's tiles are loaded before the first product (162 registers under the cap;
    # without it slower); at N = 128, where those tiles are twice as large, the early loads timed
    # slower and the grid heads first (a group's heads, which read one chunk's CB and B tiles, side by
    # side) faster; on an H200 at Mamba2-1.3B's N = 128 and at N = 64 in 8 groups (docs/benchmarks.md,
    # launch choices)
    cfg = tuned("ssd_rows_bwd", BK=block_size(N, 128), num_warps=4, num_stages=2, maxnreg=168, EARLY_LOADS=N <= 64,
                HEADS_FIRST=N > 64)
    if cfg["EARLY_LOADS"] and cfg["BK"] < N:
        raise ValueError(f"ssd_rows_bwd: EARLY_LOADS needs N in one block, got N={N} and BK={cfg['BK']}")
    # more chunks than a grid's second dimension holds go first
    cfg["HEADS_FIRST"] = cfg["HEADS_FIRST"] and not folds(NT)
    grid = (H, NT) if cfg["HEADS_FIRST"] else (NT, H)
    rows_bwd_kernel[grid](B, x, dt, dh, cb, g, do, ydo, hdh, A, D, dx, ddt, dA, dD if dD is not None else dA,
                          dt.numel() // H, plan.cu_seqlens, plan.chunk_indices, plan.seq_len, H=H, G=G, N=N, P=P,
                          BT=plan.chunk_size, BP=max(16, next_power_of_2(P)), NK=ydo.shape[0],
                          HAS_D=D is not None, **cfg)
    sums = shares.sum(1)
    return dx, ddt, sums[0], None if D is None else sums[1]
