"""Flash-style causal / sliding-window attention in Triton, forward and backward.

Math (per head, one sequence of length L, scale c, window W; W = L when there is none):
``S = c Q K^T`` restricted to the band ``0 <= t - s < W``, ``P = softmax(S)`` row-wise,
``O = P V``. The forward streams key blocks through an online softmax (Milakov & Gimelshein 2018;
Dao et al., FlashAttention 1/2) and saves only the row log-sum-exp ``lse``, in base 2 of the
pre-scaled scores ``c log2(e) q.k``, so the backward recomputes ``P = exp2(S' - lse)`` per tile:
``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - delta)`` with ``delta = rowsum(dO * O)``,
``dQ = c dS K``, ``dK = c dS^T Q``. Nothing of size T x T is ever stored.

Tiling: one program per (query block, q head, sequence) in the forward and for dQ, one per
(key block, k/v head, sequence) for dK/dV, which loops over the ``Hq / Hkv`` query heads of its
group so grouped-query attention needs no atomics. The backward is one launch: its dK/dV
programs come first and its dQ programs fill the SMs their tail leaves idle. The grids are 1-D,
longest blocks first within groups of 16 heads (``_program``). Only the blocks that intersect
the band are visited, so cost is O(T W) for a window. The visited range splits into blocks cut by
the band's edges (masked) and blocks wholly inside it (no mask work); see ``_block_ranges``.
Packed sequences: every tensor is viewed as ``[T_total, H, D]`` and each program reads its
sequence bounds from ``cu_seqlens``; a plain batch passes none (``VARLEN`` off, bounds ``i T``).
A packed grid is compact (``COMPACT``, up to ``COMPACT_MAX_SEQS`` sequences): one program per
block that exists, ``sum_i cdiv(L_i, B)`` per head, rather than ``cdiv(max L, B)`` per sequence,
which for documents much shorter than the longest one is mostly programs that only exit.
Head dims up to 256: the block dim ``BD`` is the next power of two and the rest is masked.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ttr.kernels.common.index import cdiv, next_power_of_2, prepare_packing
from ttr.kernels.utils import SUPPORTED_DTYPES, interpreter_active

LOG2E = math.log2(math.e)

# Autotune spaces stay small (device minutes cost), keyed on the block head dim. Every config
# below compiles for sm_90 (Triton 3.6, bf16) within shared memory, spills at most 56 bytes and
# has no serialised wgmma (ptxas -v, C7515); above a head dim of 128 the tiles shrink so the fp32
# accumulators ([BM or BN, 256]) still fit the register file.
FWD_CONFIGS = [
    triton.Config({"BM": 128, "BN": 64}, num_warps=8, num_stages=3),
    triton.Config({"BM": 128, "BN": 64}, num_warps=8, num_stages=4),
    triton.Config({"BM": 64, "BN": 64}, num_warps=4, num_stages=3),
]
FWD_CONFIGS_WIDE = [
    triton.Config({"BM": 64, "BN": 32}, num_warps=8, num_stages=2),
    triton.Config({"BM": 128, "BN": 32}, num_warps=8, num_stages=2),
]
# The candidates are the configs that came out ahead when each was timed alone at the layer
# shapes (`python -m ttr.scripts.bench_attention --configs`; docs/benchmarks.md). The backward is
# one launch of dK/dV programs (tiles BM1 x BN1) followed by dQ programs (BM2 x BN2), so a config
# pairs tiles that share warps and stages; wider dK/dV tiles (64 x 128) spill registers and are
# left out.
BWD_CONFIGS = [
    triton.Config({"BM1": 32, "BN1": 64, "BM2": 64, "BN2": 32}, num_warps=4, num_stages=3),
    triton.Config({"BM1": 32, "BN1": 128, "BM2": 128, "BN2": 64}, num_warps=8, num_stages=3),
]
BWD_CONFIGS_WIDE = [
    triton.Config({"BM1": 32, "BN1": 32, "BM2": 32, "BN2": 32}, num_warps=8, num_stages=2),
    triton.Config({"BM1": 32, "BN1": 32, "BM2": 64, "BN2": 32}, num_warps=8, num_stages=3),
    triton.Config({"BM1": 16, "BN1": 32, "BM2": 64, "BN2": 32}, num_warps=8, num_stages=2),
]
# Packed grids are compact up to this many sequences (the program map holds one vector of that
# length); above it, and with 0, every sequence gets cdiv(max_len, B) blocks.
COMPACT_MAX_SEQS = 1024
# Under the interpreter (no driver, so no autotune) one small config is launched; BM != BN so
# the tests exercise block ranges whose edges do not line up.
INTERPRET_META = {"fwd": {"BM": 64, "BN": 32}, "bwd": {"BM1": 32, "BN1": 64, "BM2": 64, "BN2": 32}}


def _autotune(configs, wide_configs):
    """``triton.autotune`` keyed on the block head dim ``BD``, ``wide_configs`` for BD > 128;
    under the interpreter the bare kernel (autotune needs a driver)."""
    wide = {id(c) for c in wide_configs}

    def prune(configs, named_args, **kwargs):
        keep_wide = {**named_args, **kwargs}["BD"] > 128
        return [c for c in configs if (id(c) in wide) == keep_wide]

    def wrap(fn):
        if interpreter_active():
            return fn
        return triton.autotune(configs=configs + wide_configs, key=["BD"],
                               prune_configs_by={"early_config_prune": prune})(fn)

    return wrap


# Programs are ordered in groups of GROUP_HEADS (sequence, head) rows, longest blocks first within
# a group: a causal block row's work grows with its position, so a grid ordered row by row ends
# with a tail of long programs (+7 % over the ideal makespan in a list-scheduling simulation of
# 128 heads x 16 blocks on 132 SMs; groups of 16: +1.7 %), while the K/V of the 16 rows in flight
# stay in L2 (16 MiB at T = 2048, D = 128, bf16).
GROUP_HEADS = 16


@triton.jit
def _program(pid, n_programs, NH, GH: tl.constexpr):
    """(rank, row) of program ``pid`` of ``n_programs = NB * NH``: ``row`` indexes the NH
    (sequence, head) rows, ``rank`` 0 is the row's longest block. Rows go in groups of GH and
    each group's programs in rank order, so every group starts with its longest blocks."""
    nb = n_programs // NH
    grp = pid // (GH * nb)
    r = pid - grp * (GH * nb)
    gh = tl.minimum(GH, NH - grp * GH)
    return r // gh, grp * GH + r % gh


@triton.jit
def _packed_blocks(cu_seqlens, N, B: tl.constexpr, NP: tl.constexpr):
    """First token, length and block count ``cdiv(L, B)`` of each of the N <= NP packed
    sequences, as ``[NP]`` vectors (zero past N)."""
    o_i = tl.arange(0, NP)
    m_i = o_i < N
    b_bos = tl.load(cu_seqlens + o_i, mask=m_i, other=0)
    b_len = tl.load(cu_seqlens + o_i + 1, mask=m_i, other=0) - b_bos
    return b_bos, b_len, (b_len + B - 1) // B


@triton.jit
def _work(pid, n_programs, cu_seqlens, N, max_len, H: tl.constexpr, B: tl.constexpr, GH: tl.constexpr,
          NP: tl.constexpr, VARLEN: tl.constexpr, COMPACT: tl.constexpr, LAST_FIRST: tl.constexpr):
    """(sequence, head, block index, first token, length) of program ``pid`` over blocks of B.

    ``LAST_FIRST``: a sequence's last block has the most work (query blocks), else its first
    (key blocks). Plain batches and padded packed grids: ``_program`` over the N * H rows of
    ``cdiv(max_len, B)`` blocks each. Compact packed grid (``COMPACT``): sequence by sequence, each
    sequence's blocks from the most work to the least, the H heads of a block next to each other.
    """
    if COMPACT:
        item = pid // H
        i_h = pid % H
        b_bos, b_len, b_nb = _packed_blocks(cu_seqlens, N, B, NP)
        b_end = tl.cumsum(b_nb, 0)  # [NP] blocks up to the end of each sequence
        i_n = tl.sum((b_end <= item).to(tl.int32))
        m_n = tl.arange(0, NP) == i_n
        nb = tl.sum(tl.where(m_n, b_nb, 0))
        rank = item - tl.sum(tl.where(m_n, b_end, 0)) + nb
        bos = tl.sum(tl.where(m_n, b_bos, 0))
        L = tl.sum(tl.where(m_n, b_len, 0))
    else:
        rank, i_nh = _program(pid, n_programs, N * H, GH)
        nb = n_programs // (N * H)
        i_n, i_h = i_nh // H, i_nh % H
        bos, L = _bounds(cu_seqlens, i_n, max_len, VARLEN)
    if LAST_FIRST:
        i_b = nb - 1 - rank
    else:
        i_b = rank
    return i_n, i_h, i_b, bos, L


@triton.jit
def _bounds(cu_seqlens, i_n, max_len, VARLEN: tl.constexpr):
    """(first token, length) of sequence ``i_n``: read from ``cu_seqlens`` for packed documents;
    a plain batch (``VARLEN`` False, ``cu_seqlens`` None) has ``max_len`` tokens per sequence."""
    if VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int32)
        L = tl.load(cu_seqlens + i_n + 1).to(tl.int32) - bos
    else:
        bos = i_n * max_len
        L = max_len
    return bos, L


@triton.jit
def _block_ranges(first, last, cs, ce, B: tl.constexpr):
    """Block indices over ``[first, last)`` split as [masked | whole | masked].

    A block ``j`` (elements ``[jB, jB + B)``) needs no mask when ``jB >= cs`` and ``jB + B <= ce``;
    those blocks form one contiguous run ``[j_f0, j_f1)`` inside ``[j0, j1)``.
    """
    j0 = first // B
    j1 = tl.cdiv(last, B)
    j_f0 = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(cs, 0), B), j0), j1)
    j_f1 = tl.maximum(tl.minimum(tl.maximum(ce, 0) // B, j1), j_f0)
    return j0, j_f0, j_f1, j1


@triton.jit
def _fwd_inner(b_acc, b_l, b_m, b_q, p_k, p_v, o_m, o_d, j_lo, j_hi, L, W, stride_kt, qk_scale,
               D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, MASK: tl.constexpr):
    # the 64-bit block base advances as a scalar; in-block offsets stay 32-bit tiles
    p_kj = p_k + j_lo.to(tl.int64) * (BN * stride_kt)
    p_vj = p_v + j_lo.to(tl.int64) * (BN * stride_kt)
    p_off = tl.arange(0, BN)[:, None] * stride_kt + o_d[None, :]
    for j in tl.range(j_lo, j_hi):
        o_n = j * BN + tl.arange(0, BN)
        if MASK:
            m_kv = (o_n[:, None] < L) & (o_d[None, :] < D)
            b_k = tl.load(p_kj + p_off, mask=m_kv, other=0.0)  # [BN, BD]
            b_v = tl.load(p_vj + p_off, mask=m_kv, other=0.0)  # [BN, BD]
        elif D == BD:  # whole blocks lie inside the sequence: no mask at all
            b_k = tl.load(p_kj + p_off)
            b_v = tl.load(p_vj + p_off)
        else:
            b_k = tl.load(p_kj + p_off, mask=o_d[None, :] < D, other=0.0)
            b_v = tl.load(p_vj + p_off, mask=o_d[None, :] < D, other=0.0)
        b_s = tl.dot(b_q, tl.trans(b_k)) * qk_scale  # [BM, BN]
        if MASK:
            m_s = (o_n[None, :] <= o_m[:, None]) & (o_n[None, :] > o_m[:, None] - W) & (o_n[None, :] < L)
            b_s = tl.where(m_s, b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_p = tl.exp2(b_s - b_m_new[:, None])  # [BM, BN]
        b_alpha = tl.exp2(b_m - b_m_new)
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v)
        b_m = b_m_new
        p_kj += BN * stride_kt
        p_vj += BN * stride_kt
    return b_acc, b_l, b_m


@_autotune(FWD_CONFIGS, FWD_CONFIGS_WIDE)
@triton.jit
def attn_fwd_kernel(q, k, v, o, lse, cu_seqlens, T_total, max_len, W, qk_scale, N,
                    HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, GH: tl.constexpr, NP: tl.constexpr,
                    VARLEN: tl.constexpr, COMPACT: tl.constexpr):
    # the last query block sees the most keys
    _, i_hq, i_m, bos, L = _work(tl.program_id(0), tl.num_programs(0), cu_seqlens, N, max_len, HQ, BM, GH, NP,
                                 VARLEN, COMPACT, True)
    i_hk = i_hq // G
    m0 = i_m * BM
    if m0 >= L:
        return
    stride_qt = HQ * D
    stride_kt = HQ // G * D
    o_m = m0 + tl.arange(0, BM)
    o_d = tl.arange(0, BD)
    m_q = (o_m[:, None] < L) & (o_d[None, :] < D)
    p_q = q + bos.to(tl.int64) * stride_qt + i_hq * D
    p_k = k + bos.to(tl.int64) * stride_kt + i_hk * D
    p_v = v + bos.to(tl.int64) * stride_kt + i_hk * D
    o_qt = m0.to(tl.int64) * stride_qt + (tl.arange(0, BM)[:, None] * stride_qt + o_d[None, :])
    b_q = tl.load(p_q + o_qt, mask=m_q, other=0.0)  # [BM, BD]

    b_acc = tl.zeros([BM, BD], dtype=tl.float32)
    b_l = tl.zeros([BM], dtype=tl.float32)
    # finite start: a row whose first visited block is all masked must not produce inf - inf
    b_m = tl.full([BM], -1.0e30, dtype=tl.float32)
    # keys s in [m0 - W + 1, m0 + BM); a block is whole when every (t, s) pair is in the band:
    # s + BN - 1 <= m0 (first row) and s >= m0 + BM - W (last row)
    j0, j_f0, j_f1, j1 = _block_ranges(tl.maximum(m0 - W + 1, 0), tl.minimum(m0 + BM, L), m0 + BM - W, m0 + 1, BN)
    b_acc, b_l, b_m = _fwd_inner(b_acc, b_l, b_m, b_q, p_k, p_v, o_m, o_d, j0, j_f0, L, W, stride_kt,
                                 qk_scale, D, BD, BN, True)
    b_acc, b_l, b_m = _fwd_inner(b_acc, b_l, b_m, b_q, p_k, p_v, o_m, o_d, j_f0, j_f1, L, W, stride_kt,
                                 qk_scale, D, BD, BN, False)
    b_acc, b_l, b_m = _fwd_inner(b_acc, b_l, b_m, b_q, p_k, p_v, o_m, o_d, j_f1, j1, L, W, stride_kt,
                                 qk_scale, D, BD, BN, True)

    b_l = tl.where(b_l == 0.0, 1.0, b_l)  # rows past the sequence end only
    b_o = b_acc / b_l[:, None]
    p_o = o + bos.to(tl.int64) * stride_qt + i_hq * D
    tl.store(p_o + o_qt, b_o.to(o.dtype.element_ty), mask=m_q)
    tl.store(lse + i_hq.to(tl.int64) * T_total + bos + o_m, b_m + tl.log2(b_l), mask=o_m < L)


@triton.jit
def attn_bwd_delta_kernel(o, do, delta, T_total, HQ: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                          BT: tl.constexpr):
    i_t, i_hq = tl.program_id(0), tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m_t = o_t < T_total
    p_off = o_t[:, None].to(tl.int64) * (HQ * D) + i_hq * D + o_d[None, :]
    m_o = m_t[:, None] & (o_d[None, :] < D)
    b_o = tl.load(o + p_off, mask=m_o, other=0.0).to(tl.float32)  # [BT, BD]
    b_do = tl.load(do + p_off, mask=m_o, other=0.0).to(tl.float32)  # [BT, BD]
    tl.store(delta + i_hq.to(tl.int64) * T_total + o_t, tl.sum(b_o * b_do, 1), mask=m_t)


@triton.jit
def _dkdv_inner(b_dk, b_dv, b_k, b_v, p_q, p_do, p_lse, p_delta, o_n, o_d, j_lo, j_hi, L, W, stride_qt,
                qk_scale, D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, MASK: tl.constexpr):
    p_qj = p_q + j_lo.to(tl.int64) * (BM * stride_qt)
    p_doj = p_do + j_lo.to(tl.int64) * (BM * stride_qt)
    p_off = tl.arange(0, BM)[:, None] * stride_qt + o_d[None, :]
    # Loop-invariant code stays in the loop: with LICM, ptxas serialises this loop's wgmma
    # (C7515: accumulator registers defined by other instructions inside the pipeline stage), and
    # the four products of a step then run one after another instead of overlapping.
    for j in tl.range(j_lo, j_hi, disable_licm=True):
        o_m = j * BM + tl.arange(0, BM)
        m_t = o_m < L
        if MASK:
            m_q = m_t[:, None] & (o_d[None, :] < D)
            b_q = tl.load(p_qj + p_off, mask=m_q, other=0.0)  # [BM, BD]
            b_do = tl.load(p_doj + p_off, mask=m_q, other=0.0)  # [BM, BD]
            b_lse = tl.load(p_lse + o_m, mask=m_t, other=0.0)  # [BM]
            b_delta = tl.load(p_delta + o_m, mask=m_t, other=0.0)  # [BM]
        else:  # whole blocks lie inside the sequence
            if D == BD:
                b_q = tl.load(p_qj + p_off)
                b_do = tl.load(p_doj + p_off)
            else:
                b_q = tl.load(p_qj + p_off, mask=o_d[None, :] < D, other=0.0)
                b_do = tl.load(p_doj + p_off, mask=o_d[None, :] < D, other=0.0)
            b_lse = tl.load(p_lse + o_m)
            b_delta = tl.load(p_delta + o_m)
        # both products that read only loads are issued before the exp, so dP^T's MMA overlaps it
        b_st = tl.dot(b_k, tl.trans(b_q))  # [BN, BM]
        b_dpt = tl.dot(b_v, tl.trans(b_do))  # [BN, BM]
        b_pt = tl.exp2(b_st * qk_scale - b_lse[None, :])
        if MASK:
            m_s = (o_n[:, None] <= o_m[None, :]) & (o_n[:, None] > o_m[None, :] - W) & m_t[None, :]
            b_pt = tl.where(m_s, b_pt, 0.0)
        b_dv += tl.dot(b_pt.to(b_do.dtype), b_do)
        b_dst = b_pt * (b_dpt - b_delta[None, :])
        b_dk += tl.dot(b_dst.to(b_q.dtype), b_q)
        p_qj += BM * stride_qt
        p_doj += BM * stride_qt
    return b_dk, b_dv


@triton.jit
def _dkdv_program(pid, n_programs, q, k, v, do, lse, delta, dk, dv, cu_seqlens, T_total, max_len, W, qk_scale,
                  scale, N, HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, GH: tl.constexpr, NP: tl.constexpr, VARLEN: tl.constexpr,
                  COMPACT: tl.constexpr):
    HK: tl.constexpr = HQ // G
    # the first key block is seen by the most queries
    _, i_hk, i_j, bos, L = _work(pid, n_programs, cu_seqlens, N, max_len, HK, BN, GH, NP, VARLEN, COMPACT, False)
    n0 = i_j * BN
    if n0 >= L:
        return
    stride_qt = HQ * D
    stride_kt = HK * D
    o_n = n0 + tl.arange(0, BN)
    o_d = tl.arange(0, BD)
    m_k = (o_n[:, None] < L) & (o_d[None, :] < D)
    p_off = (bos + n0).to(tl.int64) * stride_kt + i_hk * D + (tl.arange(0, BN)[:, None] * stride_kt + o_d[None, :])
    b_k = tl.load(k + p_off, mask=m_k, other=0.0)  # [BN, BD]
    b_v = tl.load(v + p_off, mask=m_k, other=0.0)  # [BN, BD]
    b_dk = tl.zeros([BN, BD], dtype=tl.float32)
    b_dv = tl.zeros([BN, BD], dtype=tl.float32)
    # queries t in [n0, n0 + BN - 1 + W); a block is whole when t >= n0 + BN - 1 for its first row
    # and t <= n0 + W - 1, t < L for its last row
    j0, j_f0, j_f1, j1 = _block_ranges(n0, tl.minimum(n0 + BN - 1 + W, L), n0 + BN - 1,
                                       tl.minimum(n0 + W, L), BM)
    for i_g in range(G):
        i_hq = i_hk * G + i_g
        p_q = q + bos.to(tl.int64) * stride_qt + i_hq * D
        p_do = do + bos.to(tl.int64) * stride_qt + i_hq * D
        p_lse = lse + i_hq.to(tl.int64) * T_total + bos
        p_delta = delta + i_hq.to(tl.int64) * T_total + bos
        b_dk, b_dv = _dkdv_inner(b_dk, b_dv, b_k, b_v, p_q, p_do, p_lse, p_delta, o_n, o_d, j0, j_f0, L, W,
                                 stride_qt, qk_scale, D, BD, BM, True)
        b_dk, b_dv = _dkdv_inner(b_dk, b_dv, b_k, b_v, p_q, p_do, p_lse, p_delta, o_n, o_d, j_f0, j_f1, L, W,
                                 stride_qt, qk_scale, D, BD, BM, False)
        b_dk, b_dv = _dkdv_inner(b_dk, b_dv, b_k, b_v, p_q, p_do, p_lse, p_delta, o_n, o_d, j_f1, j1, L, W,
                                 stride_qt, qk_scale, D, BD, BM, True)
    tl.store(dk + p_off, (b_dk * scale).to(dk.dtype.element_ty), mask=m_k)
    tl.store(dv + p_off, b_dv.to(dv.dtype.element_ty), mask=m_k)


@triton.jit
def _dq_inner(b_dq, b_q, b_do, b_lse, b_delta, p_k, p_v, o_m, o_d, j_lo, j_hi, L, W, stride_kt, qk_scale,
              D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, MASK: tl.constexpr):
    # the 64-bit block base advances as a scalar; in-block offsets stay 32-bit tiles
    p_kj = p_k + j_lo.to(tl.int64) * (BN * stride_kt)
    p_vj = p_v + j_lo.to(tl.int64) * (BN * stride_kt)
    p_off = tl.arange(0, BN)[:, None] * stride_kt + o_d[None, :]
    for j in tl.range(j_lo, j_hi):
        o_n = j * BN + tl.arange(0, BN)
        if MASK:
            m_kv = (o_n[:, None] < L) & (o_d[None, :] < D)
            b_k = tl.load(p_kj + p_off, mask=m_kv, other=0.0)  # [BN, BD]
            b_v = tl.load(p_vj + p_off, mask=m_kv, other=0.0)  # [BN, BD]
        elif D == BD:  # whole blocks lie inside the sequence: no mask at all
            b_k = tl.load(p_kj + p_off)
            b_v = tl.load(p_vj + p_off)
        else:
            b_k = tl.load(p_kj + p_off, mask=o_d[None, :] < D, other=0.0)
            b_v = tl.load(p_vj + p_off, mask=o_d[None, :] < D, other=0.0)
        b_p = tl.exp2(tl.dot(b_q, tl.trans(b_k)) * qk_scale - b_lse[:, None])  # [BM, BN]
        if MASK:
            m_s = (o_n[None, :] <= o_m[:, None]) & (o_n[None, :] > o_m[:, None] - W) & (o_n[None, :] < L)
            b_p = tl.where(m_s, b_p, 0.0)
        b_dp = tl.dot(b_do, tl.trans(b_v))  # [BM, BN]
        b_ds = b_p * (b_dp - b_delta[:, None])
        b_dq += tl.dot(b_ds.to(b_k.dtype), b_k)
        p_kj += BN * stride_kt
        p_vj += BN * stride_kt
    return b_dq


@triton.jit
def _dq_program(pid, n_programs, q, k, v, do, lse, delta, dq, cu_seqlens, T_total, max_len, W, qk_scale, scale,
                N, HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, GH: tl.constexpr, NP: tl.constexpr, VARLEN: tl.constexpr, COMPACT: tl.constexpr):
    _, i_hq, i_m, bos, L = _work(pid, n_programs, cu_seqlens, N, max_len, HQ, BM, GH, NP, VARLEN, COMPACT, True)
    i_hk = i_hq // G
    m0 = i_m * BM
    if m0 >= L:
        return
    stride_qt = HQ * D
    stride_kt = HQ // G * D
    o_m = m0 + tl.arange(0, BM)
    o_d = tl.arange(0, BD)
    m_t = o_m < L
    m_q = m_t[:, None] & (o_d[None, :] < D)
    p_off = (bos + m0).to(tl.int64) * stride_qt + i_hq * D + (tl.arange(0, BM)[:, None] * stride_qt + o_d[None, :])
    b_q = tl.load(q + p_off, mask=m_q, other=0.0)  # [BM, BD]
    b_do = tl.load(do + p_off, mask=m_q, other=0.0)  # [BM, BD]
    b_lse = tl.load(lse + i_hq.to(tl.int64) * T_total + bos + o_m, mask=m_t, other=0.0)  # [BM]
    b_delta = tl.load(delta + i_hq.to(tl.int64) * T_total + bos + o_m, mask=m_t, other=0.0)  # [BM]
    p_k = k + bos.to(tl.int64) * stride_kt + i_hk * D
    p_v = v + bos.to(tl.int64) * stride_kt + i_hk * D
    b_dq = tl.zeros([BM, BD], dtype=tl.float32)
    j0, j_f0, j_f1, j1 = _block_ranges(tl.maximum(m0 - W + 1, 0), tl.minimum(m0 + BM, L), m0 + BM - W, m0 + 1, BN)
    b_dq = _dq_inner(b_dq, b_q, b_do, b_lse, b_delta, p_k, p_v, o_m, o_d, j0, j_f0, L, W, stride_kt, qk_scale,
                     D, BD, BN, True)
    b_dq = _dq_inner(b_dq, b_q, b_do, b_lse, b_delta, p_k, p_v, o_m, o_d, j_f0, j_f1, L, W, stride_kt, qk_scale,
                     D, BD, BN, False)
    b_dq = _dq_inner(b_dq, b_q, b_do, b_lse, b_delta, p_k, p_v, o_m, o_d, j_f1, j1, L, W, stride_kt, qk_scale,
                     D, BD, BN, True)
    tl.store(dq + p_off, (b_dq * scale).to(dq.dtype.element_ty), mask=m_q)


@_autotune(BWD_CONFIGS, BWD_CONFIGS_WIDE)
@triton.jit
def attn_bwd_kernel(q, k, v, do, lse, delta, dq, dk, dv, cu_seqlens, T_total, max_len, W, qk_scale, scale, N,
                    HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BM1: tl.constexpr,
                    BN1: tl.constexpr, BM2: tl.constexpr, BN2: tl.constexpr, GH: tl.constexpr,
                    NP: tl.constexpr, VARLEN: tl.constexpr, COMPACT: tl.constexpr):
    """The whole backward in one launch: the first programs, one per key block of BN1 and k/v head,
    are dK/dV programs (longest first), the rest dQ programs, so dQ work fills the SMs that the
    dK/dV programs' tail leaves idle."""
    pid = tl.program_id(0)
    if COMPACT:
        _, _, b_nb = _packed_blocks(cu_seqlens, N, BN1, NP)
        n_kv = tl.sum(b_nb) * (HQ // G)
    else:
        n_kv = tl.cdiv(max_len, BN1) * N * (HQ // G)
    if pid < n_kv:
        _dkdv_program(pid, n_kv, q, k, v, do, lse, delta, dk, dv, cu_seqlens, T_total, max_len, W, qk_scale,
                      scale, N, HQ, G, D, BD, BM1, BN1, GH, NP, VARLEN, COMPACT)
    else:
        _dq_program(pid - n_kv, tl.num_programs(0) - n_kv, q, k, v, do, lse, delta, dq, cu_seqlens, T_total,
                    max_len, W, qk_scale, scale, N, HQ, G, D, BD, BM2, BN2, GH, NP, VARLEN, COMPACT)


# (kernel name, block head dim, dtype) -> the Config the autotuner chose; later calls launch the
# jitted kernel with it directly. The autotuner's own per-call work (a key from every argument,
# its cache lookup) is host time that short sequences cannot hide behind the GPU.
_TUNED: dict = {}


def _launch(kernel, name, grid, *args, **consts):
    """Launch an autotuned kernel (``args[0]`` sets the dtype); under the interpreter with the
    fixed small config."""
    if interpreter_active():
        meta = INTERPRET_META[name]
        kernel[grid(meta)](*args, **consts, **meta)
        return
    key = (name, consts["BD"], args[0].dtype)
    config = _TUNED.get(key)
    try:
        if config is None:
            kernel[grid](*args, **consts)
            # `best_config` is the autotuner's pick for this call's key; without it, keep autotuning
            if getattr(kernel, "best_config", None) is not None:
                _TUNED[key] = kernel.best_config
        else:
            kernel.fn[grid](*args, **consts, **config.all_kwargs())
    except OutOfResources as err:
        raise ValueError(f"attention head dim D={consts['D']} does not fit this GPU's shared memory or "
                         f"registers in the {name} kernel ({err}); use D <= 128 or the torch backend") from err


class SequencePlan(NamedTuple):
    """The sequences of a call: ``cu`` int32 bounds on the device (None for a plain batch of
    ``n`` sequences of ``max_len``), ``lengths`` int64 on the host (packed only)."""

    cu: torch.Tensor | None
    n: int
    max_len: int
    lengths: torch.Tensor | None

    @property
    def compact(self) -> bool:
        return self.lengths is not None and 0 < self.n <= COMPACT_MAX_SEQS

    def blocks(self, size: int) -> int:
        """Programs per head of a grid over blocks of ``size``."""
        if self.compact:
            return int(((self.lengths + size - 1) // size).sum())
        return cdiv(self.max_len, size) * self.n

    def consts(self) -> dict:
        np_ = max(16, next_power_of_2(self.n)) if self.compact else 16
        return dict(NP=np_, VARLEN=self.cu is not None, COMPACT=self.compact)


def sequence_plan(q, cu_seqlens) -> SequencePlan:
    """The ``SequencePlan`` of q ``[B, T, ...]`` and ``cu_seqlens`` (a tensor or a ``Packing``). A
    ``Packing`` carries the bounds on the host already; a tensor is indexed by ``prepare_packing``
    (one host copy of the bounds, which waits for the GPU when they live there)."""
    b, t = q.shape[:2]
    if cu_seqlens is None:
        return SequencePlan(None, b, t, None)
    packing = prepare_packing(cu_seqlens, t, device=q.device)
    lengths = torch.tensor(packing.bounds, dtype=torch.int64).diff()
    return SequencePlan(packing.cu_seqlens, packing.num_seqs, packing.max_len, lengths)


def attention_fwd(q, k, v, plan, window, scale):
    """q ``[T_total, Hq, D]``, k/v ``[T_total, Hkv, D]`` contiguous, sequences of ``plan``
    -> (o, lse ``[Hq, T_total]`` fp32)."""
    t_total, hq, d = q.shape
    o = torch.empty_like(q)
    lse = torch.empty(hq, t_total, device=q.device, dtype=torch.float32)
    grid = lambda meta: (plan.blocks(meta["BM"]) * hq,)
    _launch(attn_fwd_kernel, "fwd", grid, q, k, v, o, lse, plan.cu, t_total, plan.max_len, window, scale * LOG2E,
            plan.n, HQ=hq, G=hq // k.shape[1], D=d, BD=next_power_of_2(d), GH=GROUP_HEADS, **plan.consts())
    return o, lse


def attention_bwd(q, k, v, o, lse, do, plan, window, scale):
    t_total, hq, d = q.shape
    hkv = k.shape[1]
    bd = next_power_of_2(d)
    delta = torch.empty_like(lse)
    bt = max(16, 4096 // bd)
    attn_bwd_delta_kernel[(cdiv(t_total, bt), hq)](o, do, delta, t_total, HQ=hq, D=d, BD=bd, BT=bt)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    grid = lambda meta: (plan.blocks(meta["BN1"]) * hkv + plan.blocks(meta["BM2"]) * hq,)
    _launch(attn_bwd_kernel, "bwd", grid, q, k, v, do, lse, delta, dq, dk, dv, plan.cu, t_total, plan.max_len,
            window, scale * LOG2E, scale, plan.n, HQ=hq, G=hq // hkv, D=d, BD=bd, GH=GROUP_HEADS, **plan.consts())
    return dq, dk, dv


class FlashAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, window, scale):
        o, lse = attention_fwd(q, k, v, plan, window, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.plan, ctx.window, ctx.scale = plan, window, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = attention_bwd(q, k, v, o, lse, do.contiguous(), ctx.plan, ctx.window, ctx.scale)
        return dq, dk, dv, None, None, None


def triton_attention(q, k, v, *, window, scale, cu_seqlens, plan=None):
    """Triton path for validated inputs (see ``ttr.kernels.attention.attention``); ``plan`` is
    ``sequence_plan(q, cu_seqlens)`` where the caller has it already."""
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q dtype {q.dtype} is not supported by the Triton backend; expected one of "
                        f"{SUPPORTED_DTYPES} (use TTR_KERNEL_BACKEND=torch for float64)")
    b, t, hq, d = q.shape
    if b == 0 or t == 0:
        return torch.zeros_like(q)
    plan = sequence_plan(q, cu_seqlens) if plan is None else plan
    if plan.max_len == 0:
        return torch.zeros_like(q)
    win = plan.max_len if window is None else min(window, plan.max_len)
    flat = lambda x: x.reshape(b * t, x.shape[2], d).contiguous()
    o = FlashAttentionFunction.apply(flat(q), flat(k), flat(v), plan, win, scale)
    return o.view(b, t, hq, d)
