"""The short conv's backward in one pass (``conv.py`` holds the op, its forward and the decoding
step). ``_conv_bwd_kernel`` walks each segment of tokens from its last token down and keeps every
token's pre-activation gradient in registers for the W-1 tokens before it; steps of four tokens
away from a sequence's edges skip the edges' masks (``_walk_step``'s ``EDGE``). ``conv_bwd``
launches it, in walks that fill whole waves of the GPU, and sums the walks' partial dw and db.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttr.kernels.common.approx import fast_sigmoid
from ttr.kernels.common.index import cdiv, next_power_of_2, sm_count, tuned
from ttr.kernels.utils import interpreter_active, resident_programs


def _launch_bwd(d: int, l2: int) -> dict:
    """Launch parameters of ``conv_bwd`` (``index.tuned``): walks of SEG tokens by BD channels, one
    warp each, under a cap of 128 registers; SEG None (the default on a GPU) sizes the walks so that
    they fill whole waves of the GPU (``wave_segment``). A walk is bound by its steps' latency, so a
    grid of 1.1 - 1.3 waves takes about as long as two, and more walks per SM pay more than a
    few spilled registers: on an H200 at B = 8, T = 4096, q and k with the norm compile to 138
    registers (12 walks per SM) and took 0.226 ms in walks of 256 tokens (2048 walks), 0.253 in
    walks of 296, and 0.158 under the cap (16 per SM, one wave of 2048 walks; 16 bytes of spill).
    v and xBC compile to 128 registers either way, where the cap changes ptxas's schedule only.
    Loading the next step's rows ahead of the current one lost in every case but v packed. The
    times are in docs/benchmarks.md (the short conv's kernels, and launch choices)."""
    if interpreter_active():
        cfg = tuned("conv_bwd", SEG=16, BD=min(64, next_power_of_2(d)))
    else:
        cfg = tuned("conv_bwd", SEG=None, BD=min(128, next_power_of_2(d)), num_warps=1, maxnreg=128)
    return {**cfg, "BD": max(cfg["BD"], l2)}


def wave_segment(t: int, rows: int, slots: int, seg: int = 256, least: int = 64) -> int:
    """Tokens per walk for ``rows`` walks over ``t`` tokens (batch times channel blocks) on a GPU that
    holds ``slots`` walks at once: walks of ``seg`` tokens would take some number of waves, which is
    rounded to the nearest (at least one) and filled by as many walks per row as fit, at least
    ``least`` tokens each and a multiple of the walk's four-token step."""
    waves = max(1, round(rows * cdiv(t, seg) / slots))
    per_row = max(1, waves * slots // rows)
    return max(least, cdiv(cdiv(t, per_row), 4) * 4)


@triton.jit
def silu_and_sigmoid(b_a, SILU: tl.constexpr):
    """(act(a), sigmoid(a)): SiLU and the sigmoid its derivative reuses, or (a, a) without it. The
    backward walk is bound by the instructions it issues (a few loads per element against dozens of
    fp32 operations), hence ``approx.fast_sigmoid``."""
    b_u, b_sig = b_a, b_a
    if SILU:
        b_sig = fast_sigmoid(b_a)
        b_u = b_a * b_sig
    return b_u, b_sig


@triton.jit
def _cols_if(o_d, D, cond):
    """The channel mask o_d < D where the scalar ``cond`` holds, else none (one vector compare; the
    interpreter turns a vector mask & a scalar bool into integers). # [BD]"""
    return o_d < tl.where(cond, D, 0)


@triton.jit
def _row(p, t, o_d, D, T, s_t):
    """Row t of a [T, D] tensor whose rows are s_t elements apart, zeros outside 0 <= t < T. # [BD]"""
    return tl.load(p + t.to(tl.int64) * s_t + o_d, mask=_cols_if(o_d, D, (t >= 0) & (t < T)), other=0.0).to(
        tl.float32
    )


@triton.jit
def _group_sum_row(b_t, BD: tl.constexpr, L2: tl.constexpr):
    """Sums of b_t over each run of L2 channels, broadcast back over the run. # [BD]"""
    b_g = tl.sum(tl.reshape(b_t, [BD // L2, L2]), axis=1)
    return tl.reshape(tl.broadcast_to(b_g[:, None], [BD // L2, L2]), [BD])


@triton.jit
def _token_span(seq_idx, cu, t, T, IS_VARLEN: tl.constexpr):
    """(sequence id, first token, end) of token t (t outside 0..T-1: a sequence that ends at T)."""
    if IS_VARLEN:
        i_n = tl.load(seq_idx + tl.minimum(tl.maximum(t, 0), T - 1))
        return i_n, tl.load(cu + i_n).to(tl.int32), tl.load(cu + i_n + 1).to(tl.int32)
    else:
        # tensors of t's type, as the packed case returns: the walk casts the id (``.to``)
        return t * 0, t * 0, t * 0 + T


@triton.jit
def _fetch(p_x, p_dy, p_r, t, u: tl.constexpr, o_d, o_g, D, T, s_xt, NG, L2: tl.constexpr, BD: tl.constexpr):
    """The rows the walk loads for token t - u: x(t - u - 3), dy(t - u) and, with the norm, the
    forward's 1/norm of each of its groups o_g (broadcast over the group). p_x, p_dy and p_r point at
    token t's rows: a row u tokens back is a constant offset from them, where a row's own address
    would take a 64-bit product per row."""
    b_x = tl.load(p_x - u * s_xt, mask=_cols_if(o_d, D, (t - u - 3 >= 0) & (t - u - 3 < T)), other=0.0)
    m_t = (t - u >= 0) & (t - u < T)
    b_dy = tl.load(p_dy - u * D, mask=_cols_if(o_d, D, m_t), other=0.0)
    b_r = b_x.to(tl.float32)
    if L2 > 0:
        b_g = tl.load(p_r - u * NG, mask=_cols_if(o_g, NG, m_t), other=0.0)  # [BD // L2]
        b_r = tl.reshape(tl.broadcast_to(b_g[:, None], [BD // L2, L2]), [BD])
    return b_x.to(tl.float32), b_dy.to(tl.float32), b_r


@triton.jit
def _walk_token(t, t_lo, t_hi, i_n, bos, eos, b_xn, b_dy, b_r, b_x0, b_x1, b_x2, b_d1, b_d2, b_d3,
                b_w0, b_w1, b_w2, b_w3, b_bias, init, dfinal, dinit, o_d, m_d, D,
                W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_DFINAL: tl.constexpr,
                IS_VARLEN: tl.constexpr, SILU: tl.constexpr, L2: tl.constexpr, BD: tl.constexpr,
                EDGE: tl.constexpr):
    """One token of the backward walk (``_conv_bwd_kernel``): the pre-activation's gradient
    da(t) from dy(t), the inputs x(t-3..t) (b_x0..b_x2 carried, b_xn = x(t-3) loaded) and, with the
    norm, the forward's 1/norm b_r of each group (so that only the norm's backward sums over a
    group), and dx(t) = sum_s w[W-1-s] da(t+s) from the da of the W-1 tokens after t (b_d1..b_d3,
    carried).
    Returns da(t), dx(t), the sources s = 0..3 that dw's taps multiply (zero where unused) and the
    carried da(t+1), da(t+2), zeroed where they belong to the next sequence. Without ``EDGE`` the
    caller has checked that t lies inside the walk's segment, at least 3 tokens past its sequence's
    start and 4 before its end, so none of that applies: no selects, no state slots, no final
    state's gradient."""
    pos = t - bos
    if EDGE and IS_VARLEN:
        # t is the last token of its sequence: the carried da belong to the next one
        b_d1 = tl.where(t + 1 < eos, b_d1, 0.0)
        b_d2 = tl.where(t + 1 < eos, b_d2, 0.0)
        b_d3 = tl.where(t + 1 < eos, b_d3, 0.0)
    # the inputs tap s reads: x(t - s) inside the sequence, else the initial state's slot W-1-s+pos
    b_s1, b_s2, b_s3 = b_x1, b_x2, b_xn
    if EDGE:
        b_s1 = tl.where(pos >= 1, b_x1, 0.0)
        b_s2 = tl.where(pos >= 2, b_x2, 0.0)
        b_s3 = tl.where(pos >= 3, b_xn, 0.0)
    if EDGE and HAS_INIT:
        # the walk's last tokens before the first segment (t < 0, so pos < 0) belong to no sequence:
        # their slots would lie before the state's row, outside the tensor for the first channel
        p_h = init + i_n.to(tl.int64) * D * (W - 1) + o_d * (W - 1)
        real = pos >= 0
        b_s1 += tl.load(p_h + (W - 2 + pos), mask=_cols_if(o_d, D, real & (pos < 1)), other=0.0).to(tl.float32)
        if W > 2:
            b_s2 += tl.load(p_h + (W - 3 + pos), mask=_cols_if(o_d, D, real & (pos < 2)), other=0.0).to(tl.float32)
        if W > 3:
            b_s3 += tl.load(p_h + (W - 4 + pos), mask=_cols_if(o_d, D, real & (pos < 3)), other=0.0).to(tl.float32)
    b_a = b_w0 * b_x0 + b_w1 * b_s1 + b_w2 * b_s2 + b_w3 * b_s3
    if HAS_BIAS:
        b_a += b_bias
    b_g = b_dy
    b_u, b_sig = silu_and_sigmoid(b_a, SILU)
    if L2 > 0:
        b_yn = b_u * b_r
        b_g = b_r * (b_g - b_yn * _group_sum_row(b_g * b_yn, BD, L2))
    if SILU:
        b_g = b_g * b_sig * (1.0 + b_a * (1.0 - b_sig))
    b_dx = b_w0 * b_g + b_w1 * b_d1 + b_w2 * b_d2 + b_w3 * b_d3
    inside = (t >= t_lo) & (t < t_hi)
    if EDGE and HAS_DFINAL:
        # the last W-1 tokens of a sequence are also its final state, slot j = t - (eos - (W-1))
        j = t - (eos - (W - 1))
        p_f = dfinal + i_n.to(tl.int64) * D * (W - 1) + o_d * (W - 1) + j
        b_dx += tl.load(p_f, mask=_cols_if(o_d, D, (j >= 0) & inside), other=0.0).to(tl.float32)
    if EDGE and HAS_INIT:
        # tokens with pos < s read state slot W-1-s+pos (at most W-1 tokens per sequence)
        p_h = dinit + i_n.to(tl.int64) * D * (W - 1) + o_d * (W - 1)
        tl.atomic_add(p_h + (W - 2 + pos), b_g * b_w1, mask=_cols_if(o_d, D, (pos < 1) & inside))
        if W > 2:
            tl.atomic_add(p_h + (W - 3 + pos), b_g * b_w2, mask=_cols_if(o_d, D, (pos < 2) & inside))
        if W > 3:
            tl.atomic_add(p_h + (W - 4 + pos), b_g * b_w3, mask=_cols_if(o_d, D, (pos < 3) & inside))
    return b_g, b_dx, b_s1, b_s2, b_s3, b_d1, b_d2


@triton.jit
def _walk_step(t, t_lo, t_hi, f_a, f_b, f_c, f_d, b_x0, b_x1, b_x2, b_d1, b_d2, b_d3,
               b_dw0, b_dw1, b_dw2, b_dw3, b_db, b_w0, b_w1, b_w2, b_w3, b_bias, init, dfinal, dinit, p_dx, s_dxt,
               seq_idx, cu, i_b, T, o_d, m_d, D, W: tl.constexpr, HAS_BIAS: tl.constexpr,
               HAS_INIT: tl.constexpr, HAS_DFINAL: tl.constexpr, IS_VARLEN: tl.constexpr, SILU: tl.constexpr,
               L2: tl.constexpr, BD: tl.constexpr, EDGE: tl.constexpr):
    """Tokens t, t-1, t-2, t-3 of the walk (``_walk_token``) from their fetched rows: dx stored (p_dx
    points at token t's row), dw's and db's sums and the carried rows and da returned. Only a step
    at an edge reads its tokens' sequences (id, first token, end): in packed input two dependent
    loads per token."""
    for u in tl.static_range(4):
        if u == 0:
            b_xn, b_dy, b_r = f_a
        elif u == 1:
            b_xn, b_dy, b_r = f_b
        elif u == 2:
            b_xn, b_dy, b_r = f_c
        else:
            b_xn, b_dy, b_r = f_d
        i_n, bos, eos = i_b, t * 0, t * 0 + T
        if EDGE:
            i_n, bos, eos = _token_span(seq_idx, cu, t - u, T, IS_VARLEN)
            if not IS_VARLEN:
                i_n += i_b
        b_g, b_dx, b_s1, b_s2, b_s3, b_d1, b_d2 = _walk_token(
            t - u, t_lo, t_hi, i_n, bos, eos, b_xn, b_dy, b_r, b_x0, b_x1, b_x2, b_d1, b_d2, b_d3,
            b_w0, b_w1, b_w2, b_w3, b_bias, init, dfinal, dinit, o_d, m_d, D,
            W, HAS_BIAS, HAS_INIT, HAS_DFINAL, IS_VARLEN, SILU, L2, BD, EDGE,
        )  # fmt: skip
        if EDGE:
            inside = (t - u >= t_lo) & (t - u < t_hi)
            tl.store(p_dx - u * s_dxt, b_dx.to(p_dx.dtype.element_ty), mask=_cols_if(o_d, D, inside))
            # the W-1 tokens past the segment only hand their da to the tokens before them
            b_gi = tl.where(inside, b_g, 0.0)
        else:
            tl.store(p_dx - u * s_dxt, b_dx.to(p_dx.dtype.element_ty), mask=m_d)
            b_gi = b_g
        b_dw0 += b_gi * b_x0
        b_dw1 += b_gi * b_s1
        b_dw2 += b_gi * b_s2
        b_dw3 += b_gi * b_s3
        b_db += b_gi
        b_d3, b_d2, b_d1 = b_d2, b_d1, b_g
        b_x0, b_x1, b_x2 = b_x1, b_x2, b_xn
    return b_x0, b_x1, b_x2, b_d1, b_d2, b_d3, b_dw0, b_dw1, b_dw2, b_dw3, b_db


@triton.jit(do_not_specialize=["SEG"])
def _conv_bwd_kernel(x, w, bias, init, dy, rstd, dfinal, dx, dw, db, dinit, seq_idx, cu, T, D, s_xb, s_xt, s_dxb,
                     s_dxt, SEG, W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr,
                     HAS_DFINAL: tl.constexpr, IS_VARLEN: tl.constexpr, SILU: tl.constexpr, L2: tl.constexpr,
                     BD: tl.constexpr):
    """The whole backward in one pass: each program walks SEG tokens of BD channels from the last
    token down, so every token's da is formed once and kept in registers for the W-1 tokens before
    it, and x, dy and dx pass through memory once (6 bytes per element in bf16; two passes with da
    stored between them move 10). The walk starts W-1 tokens after its segment to form the da its
    last tokens need. Partial dw/db per program ([B * NS, W, D], [B * NS, D], NS the walks per
    row) are summed by the launcher. With the norm (L2 > 0), rstd ``[B, T, D // L2]`` holds the
    forward's 1/norm of every group."""
    i_s, i_d, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    x += i_b.to(tl.int64) * s_xb
    dy += i_b.to(tl.int64) * T * D
    dx += i_b.to(tl.int64) * s_dxb
    # tap s multiplies x(t - s): w[:, W-1-s] (zero for s >= W)
    b_w0 = tl.load(w + o_d * W + (W - 1), mask=m_d, other=0.0).to(tl.float32)
    b_w1 = tl.load(w + o_d * W + (W - 2), mask=m_d, other=0.0).to(tl.float32)
    b_w2 = tl.zeros([BD], dtype=tl.float32)
    b_w3 = tl.zeros([BD], dtype=tl.float32)
    if W > 2:
        b_w2 = tl.load(w + o_d * W + (W - 3), mask=m_d, other=0.0).to(tl.float32)
    if W > 3:
        b_w3 = tl.load(w + o_d * W + (W - 4), mask=m_d, other=0.0).to(tl.float32)
    b_bias = tl.zeros([BD], dtype=tl.float32)
    if HAS_BIAS:
        b_bias = tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)
    t_lo = i_s * SEG
    t_hi = tl.minimum(t_lo + SEG, T)
    t0 = t_hi + W - 2
    # the rows of the walk's first token t0: x(t0 - 3), dy(t0), dx(t0) and the groups' 1/norm,
    # moved back four tokens a step
    p_x = x + (t0 - 3).to(tl.int64) * s_xt + o_d
    p_dy = dy + t0.to(tl.int64) * D + o_d
    p_dx = dx + t0.to(tl.int64) * s_dxt + o_d
    NG = D
    p_r = rstd
    o_g = o_d
    if L2 > 0:
        NG = D // L2
        o_g = i_d * (BD // L2) + tl.arange(0, BD // L2)
        p_r = rstd + (i_b.to(tl.int64) * T + t0) * NG + o_g
    b_x0 = _row(x, t0, o_d, D, T, s_xt)
    b_x1 = _row(x, t0 - 1, o_d, D, T, s_xt)
    b_x2 = _row(x, t0 - 2, o_d, D, T, s_xt)
    b_d1 = tl.zeros([BD], dtype=tl.float32)
    b_d2 = tl.zeros([BD], dtype=tl.float32)
    b_d3 = tl.zeros([BD], dtype=tl.float32)
    b_dw0 = tl.zeros([BD], dtype=tl.float32)
    b_dw1 = tl.zeros([BD], dtype=tl.float32)
    b_dw2 = tl.zeros([BD], dtype=tl.float32)
    b_dw3 = tl.zeros([BD], dtype=tl.float32)
    b_db = tl.zeros([BD], dtype=tl.float32)
    # four tokens per step, their rows loaded first: the stores of dx would otherwise keep the
    # next token's loads from being issued before them
    for k in range(0, t0 - t_lo + 1, 4):
        t = t0 - k
        f_a = _fetch(p_x, p_dy, p_r, t, 0, o_d, o_g, D, T, s_xt, NG, L2, BD)
        f_b = _fetch(p_x, p_dy, p_r, t, 1, o_d, o_g, D, T, s_xt, NG, L2, BD)
        f_c = _fetch(p_x, p_dy, p_r, t, 2, o_d, o_g, D, T, s_xt, NG, L2, BD)
        f_d = _fetch(p_x, p_dy, p_r, t, 3, o_d, o_g, D, T, s_xt, NG, L2, BD)
        # most steps lie inside the segment and one sequence, away from its first and last tokens:
        # those take the walk without the masks of the edges (selects on every element otherwise).
        # Tokens t-6 .. t+3 lie in one sequence where the ids at both ends agree (ids never
        # decrease along the row): two independent loads, where a token's bounds are two dependent ones
        plain = (t - 3 >= t_lo) & (t < t_hi) & (t - 6 >= 0) & (t + 3 < T)
        if IS_VARLEN:
            plain = plain & (tl.load(seq_idx + tl.maximum(t - 6, 0)) == tl.load(seq_idx + tl.minimum(t + 3, T - 1)))
        if plain:
            b_x0, b_x1, b_x2, b_d1, b_d2, b_d3, b_dw0, b_dw1, b_dw2, b_dw3, b_db = _walk_step(
                t, t_lo, t_hi, f_a, f_b, f_c, f_d, b_x0, b_x1, b_x2, b_d1, b_d2, b_d3,
                b_dw0, b_dw1, b_dw2, b_dw3, b_db, b_w0, b_w1, b_w2, b_w3, b_bias, init, dfinal, dinit, p_dx, s_dxt,
                seq_idx, cu, i_b, T, o_d, m_d, D, W, HAS_BIAS, HAS_INIT, HAS_DFINAL, IS_VARLEN, SILU, L2, BD,
                False,
            )  # fmt: skip
        else:
            b_x0, b_x1, b_x2, b_d1, b_d2, b_d3, b_dw0, b_dw1, b_dw2, b_dw3, b_db = _walk_step(
                t, t_lo, t_hi, f_a, f_b, f_c, f_d, b_x0, b_x1, b_x2, b_d1, b_d2, b_d3,
                b_dw0, b_dw1, b_dw2, b_dw3, b_db, b_w0, b_w1, b_w2, b_w3, b_bias, init, dfinal, dinit, p_dx, s_dxt,
                seq_idx, cu, i_b, T, o_d, m_d, D, W, HAS_BIAS, HAS_INIT, HAS_DFINAL, IS_VARLEN, SILU, L2, BD,
                True,
            )  # fmt: skip
        p_x -= 4 * s_xt
        p_dy -= 4 * D
        p_dx -= 4 * s_dxt
        if L2 > 0:
            p_r -= 4 * NG
    i_p = (i_b * tl.num_programs(0) + i_s).to(tl.int64)
    tl.store(dw + (i_p * W + (W - 1)) * D + o_d, b_dw0, mask=m_d)
    tl.store(dw + (i_p * W + (W - 2)) * D + o_d, b_dw1, mask=m_d)
    if W > 2:
        tl.store(dw + (i_p * W + (W - 3)) * D + o_d, b_dw2, mask=m_d)
    if W > 3:
        tl.store(dw + (i_p * W + (W - 4)) * D + o_d, b_dw3, mask=m_d)
    if HAS_BIAS:
        tl.store(db + i_p * D + o_d, b_db, mask=m_d)


def varlen_meta(packing):
    """Per-token sequence id (int32 [T]) and cu_seqlens (int32), or (None, None) when not packed."""
    return (None, None) if packing is None else (packing.seq_ids, packing.cu_seqlens)


def conv_bwd(x, weight, bias, init, dy, dfinal, activation, packing, l2=0, rstd=None, dx=None):
    """The Triton backward, one pass (``_conv_bwd_kernel``): ``(dx, dweight, dbias, dinit)`` from the
    output gradient dy (contiguous) and the final state's dfinal (or None); ``l2`` as in ``conv_fwd``,
    and with it ``rstd``, the 1/norm of every group that ``conv_fwd`` wrote. ``dx``: where to write
    x's gradient (x's shape and dtype, unit stride over D: a column block of a wider tensor, as
    ``conv.causal_conv1d_columns`` gives), else a new contiguous tensor."""
    if l2 and rstd is None:
        raise ValueError("conv_bwd: l2 > 0 needs rstd, the 1/norm of each group that conv_fwd wrote")
    b, t, d = x.shape
    w = weight.shape[1]
    seq_idx, cu = varlen_meta(packing)
    cfg = _launch_bwd(d, l2)
    seg = cfg.pop("SEG")
    if dx is None:
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)

    consts = dict(W=w, HAS_BIAS=bias is not None, HAS_INIT=init is not None, HAS_DFINAL=dfinal is not None,
                  IS_VARLEN=cu is not None, SILU=activation == "silu", L2=l2, **cfg)

    def args(dw, db, dinit, seg):
        return (x, weight, bias if bias is not None else weight, init if init is not None else weight, dy,
                rstd if rstd is not None else dw, dfinal if dfinal is not None else dy, dx, dw,
                db if db is not None else dw, dinit if dinit is not None else dw,
                seq_idx if seq_idx is not None else x, cu if cu is not None else x, t, d, x.stride(0), x.stride(1),
                dx.stride(0), dx.stride(1), seg)

    def compile_args():
        # dw, db and dinit are sized by the walk length being chosen: an fp32 stand-in of the same
        # kind compiles the same kernel
        scratch = torch.empty(1, dtype=torch.float32, device=x.device)
        return args(scratch, scratch if bias is not None else None, scratch if init is not None else None, 256)

    rows = b * cdiv(d, cfg["BD"])
    if seg is None and t:
        key = ("conv_bwd", x.dtype, weight.dtype, dy.dtype, None if bias is None else bias.dtype,
               None if init is None else init.dtype, None if dfinal is None else dfinal.dtype, *sorted(consts.items()))
        per_sm = resident_programs(_conv_bwd_kernel, key, compile_args, **consts)
        seg = wave_segment(t, rows, per_sm * sm_count(x.device))
    ns = cdiv(t, seg) if t else 0
    dw = torch.empty(b * ns, w, d, dtype=torch.float32, device=x.device)
    db = torch.empty(b * ns, d, dtype=torch.float32, device=x.device) if bias is not None else None
    dinit = torch.zeros(init.shape, dtype=torch.float32, device=x.device) if init is not None else None
    if t:
        _conv_bwd_kernel[(ns, cdiv(d, cfg["BD"]), b)](*args(dw, db, dinit, seg), **consts)
    if dinit is not None and dfinal is not None:
        dinit += _dfinal_to_init(dfinal.float(), packing, t, w)
    dw = dw.sum(0).t().to(weight.dtype)
    db = db.sum(0).to(bias.dtype) if db is not None else None
    return dx, dw, db, dinit.to(init.dtype) if dinit is not None else None


def _dfinal_to_init(dfinal, packing, t: int, w: int):
    """Grad of the final state w.r.t. the initial state: slot k of a sequence of length L < W-1
    survives into final slot k - L."""
    n = dfinal.shape[0]
    if packing is None:
        lens = torch.full((n,), t, device=dfinal.device, dtype=torch.long)
    else:
        cu = packing.cu_seqlens.long()
        lens = cu[1:] - cu[:-1]
    k = torch.arange(w - 1, device=dfinal.device)
    src = k[None] - lens[:, None]  # [N, W-1]
    got = dfinal.gather(2, src.clamp_min(0)[:, None, :].expand(-1, dfinal.shape[1], -1))
    return torch.where((src >= 0)[:, None, :], got, 0.0)
