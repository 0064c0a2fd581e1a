"""Causal depthwise short convolution (Mamba / Gated DeltaNet "short conv"), width 2..4.

For every channel ``d`` and token ``t`` of one sequence (W = kernel width)::

    y[t, d] = act( bias[d] + sum_{w=0}^{W-1} weight[d, w] * x[t - (W-1) + w, d] )

Inputs before the start of a sequence are taken from ``initial_state`` (``[N, D, W-1]``, the
last W-1 inputs that preceded the sequence, oldest first) or are zero. In packed input
(``B == 1`` plus ``cu_seqlens``) every document starts afresh: no tap reaches across a boundary.
The final state of a sequence is the last W-1 entries of ``concat(initial_state, x_seq)`` along
time (zeros where neither exists), i.e. exactly the ``initial_state`` that continues it.

Shapes: x ``[B, T, D]``, weight ``[D, W]``, bias ``[D]``, states ``[N, D, W-1]`` with N = B
(or the number of documents when packed); the final state has x's dtype (it holds inputs).
``activation`` is None or ``"silu"``. Arithmetic is fp32 (fp64 for fp64 inputs) in every backend.
``l2_group`` also scales every run of that many output channels (a head) to unit L2 norm, as the
delta rules do to q and k, inside the same kernels.

``causal_conv1d_update`` is the decoding step: one token ``x [B, D]`` against ``conv_state
[B, D, W-1]``; it returns ``(y [B, D], new_conv_state)`` with the state shifted by one token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ttr.kernels.common.approx import fast_sigmoid
from ttr.kernels.common.index import cdiv, next_power_of_2, prepare_packing, segments, tuned
from ttr.kernels.norm import l2_norm, reference_l2_norm
from ttr.kernels.utils import (
    check_cu_seqlens,
    check_dtype,
    check_rank,
    interpreter_active,
    kernel_backend,
    on_input_device,
)

ACTIVATIONS = (None, "silu")
# Largest channel group the fused L2 norm takes (a block holds whole groups); larger or
# non-power-of-2 groups are normed after the conv.
MAX_L2_GROUP = 256


def _check_l2_group(l2_group, d: int) -> None:
    if l2_group is not None and (
        isinstance(l2_group, bool) or not isinstance(l2_group, int) or l2_group < 1 or d % l2_group
    ):
        raise ValueError(f"l2_group must be a positive int dividing D={d}, got {l2_group!r}")


def _norm_groups(y: torch.Tensor, group: int | None, eps: float, norm=l2_norm) -> torch.Tensor:
    """y ``[..., D]`` with every run of ``group`` channels scaled to unit L2 norm (None: y): by
    ``l2_norm`` for the groups the fused kernels do not take and the decoding step, by the norm's
    oracle (``norm=reference_l2_norm``) in the conv's own oracle and torch backend."""
    return norm(y.unflatten(-1, (-1, group)), eps=eps).flatten(-2) if group else y


def check_conv_inputs(x, weight, bias, activation, cu_seqlens, initial_state, l2_group=None) -> int:
    """Validate causal_conv1d's arguments; return the number of sequences N."""
    check_rank("x", x, 3, "[B, T, D]")
    check_dtype("x", x)
    check_rank("weight", weight, 2, "[D, W]")
    check_dtype("weight", weight)
    b, t, d = x.shape
    if weight.shape[0] != d:
        raise ValueError(f"weight must have shape [D, W] with D={d}, got {tuple(weight.shape)}")
    w = weight.shape[1]
    if not 2 <= w <= 4:
        raise ValueError(f"weight width W must be in 2..4, got W={w}")
    if bias is not None:
        check_rank("bias", bias, 1, "[D]")
        check_dtype("bias", bias)
        if bias.shape[0] != d:
            raise ValueError(f"bias must have shape [D] = [{d}], got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    _check_l2_group(l2_group, d)
    n = check_cu_seqlens(cu_seqlens, b, t)
    if initial_state is not None:
        check_rank("initial_state", initial_state, 3, "[N, D, W-1]")
        check_dtype("initial_state", initial_state)
        if tuple(initial_state.shape) != (n, d, w - 1):
            raise ValueError(
                f"initial_state must have shape [N, D, W-1] = {(n, d, w - 1)}, got {tuple(initial_state.shape)}"
            )
    for name, other in (("weight", weight), ("bias", bias), ("initial_state", initial_state)):
        if other is not None and other.device != x.device:
            raise ValueError(f"{name} is on {other.device} but x is on {x.device}")
    return n


@triton.jit
def _load_src(x, init, i_n, o_t, pos, o_d, m_t, m_d, D, s_xt, s, W: tl.constexpr, HAS_INIT: tl.constexpr):
    """Input seen by tap offset s at tokens o_t: x[t - s] inside the sequence, else the state. # [BT, BD]
    x's rows are ``s_xt`` elements apart (a column slice of a wider projection is read in place)."""
    m_x = m_t & (pos >= s)
    o_x = (o_t - s).to(tl.int64) * s_xt
    b_x = tl.load(x + o_x[:, None] + o_d[None, :], mask=m_x[:, None] & m_d[None, :], other=0.0).to(tl.float32)
    if HAS_INIT:
        m_h = m_t & (pos < s)
        o_h = i_n.to(tl.int64) * D * (W - 1) + (W - 1 - s + pos)
        p_h = init + o_h[:, None] + o_d[None, :] * (W - 1)
        b_x += tl.load(p_h, mask=m_h[:, None] & m_d[None, :], other=0.0).to(tl.float32)
    return b_x


@triton.jit
def _preact(
    x,
    w,
    bias,
    init,
    i_n,
    o_t,
    pos,
    o_d,
    m_t,
    m_d,
    D,
    s_xt,
    W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_INIT: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
):
    """bias + sum_s w[:, W-1-s] * src(t - s) at tokens o_t. # [BT, BD]"""
    b_a = tl.zeros([BT, BD], dtype=tl.float32)
    for s in tl.static_range(W):
        b_w = tl.load(w + o_d * W + (W - 1 - s), mask=m_d, other=0.0).to(tl.float32)  # [BD]
        b_a += _load_src(x, init, i_n, o_t, pos, o_d, m_t, m_d, D, s_xt, s, W, HAS_INIT) * b_w[None, :]
    if HAS_BIAS:
        b_a += tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
    return b_a


@triton.jit
def _seq_of(seq_idx, cu, o_t, m_t, i_b, T, IS_VARLEN: tl.constexpr):
    """Sequence id, start and end of every token in o_t. # [BT] each"""
    if IS_VARLEN:
        i_n = tl.load(seq_idx + o_t, mask=m_t, other=0)
        bos = tl.load(cu + i_n, mask=m_t, other=0).to(tl.int32)
        eos = tl.load(cu + i_n + 1, mask=m_t, other=0).to(tl.int32)
    else:
        # o_t * 0 rather than tl.zeros_like, which the interpreter rejects in nested helpers at times
        i_n = o_t * 0 + i_b
        bos = o_t * 0
        eos = o_t * 0 + T
    return i_n, bos, eos


@triton.jit
def _group_sum(b_t, BT: tl.constexpr, BD: tl.constexpr, L2: tl.constexpr):
    """Sums of b_t over each run of L2 channels, broadcast back over the run. # [BT, BD]"""
    b_g = tl.sum(tl.reshape(b_t, [BT, BD // L2, L2]), axis=2)  # [BT, BD // L2]
    return tl.reshape(tl.broadcast_to(b_g[:, :, None], [BT, BD // L2, L2]), [BT, BD])


@triton.jit
def _activation(b_a, SILU: tl.constexpr):
    """(act(a), sigmoid(a)): SiLU and the sigmoid its derivative reuses, or (a, a) without it. The
    backward walk is bound by the instructions it issues (a few loads per element against dozens of
    fp32 operations), hence ``approx.fast_sigmoid``."""
    b_u, b_sig = b_a, b_a
    if SILU:
        b_sig = fast_sigmoid(b_a)
        b_u = b_a * b_sig
    return b_u, b_sig


@triton.jit
def _conv_fwd_kernel(x, w, bias, init, y, seq_idx, cu, T, D, s_xb, s_xt, W: tl.constexpr, HAS_BIAS: tl.constexpr,
                     HAS_INIT: tl.constexpr, IS_VARLEN: tl.constexpr, SILU: tl.constexpr, BT: tl.constexpr,
                     BD: tl.constexpr, eps=1e-6, L2: tl.constexpr = 0):
    """y = act(conv(x)). With L2 > 0 the output is normalised to unit L2 norm over each run of L2
    channels (a head): y = u / sqrt(sum u^2 + eps) with u = act(conv(x)) in fp32."""
    i_t, i_d, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m_t, m_d = o_t < T, o_d < D
    i_n, bos, _ = _seq_of(seq_idx, cu, o_t, m_t, i_b, T, IS_VARLEN)
    x += i_b.to(tl.int64) * s_xb
    y += i_b.to(tl.int64) * T * D
    b_a = _preact(x, w, bias, init, i_n, o_t, o_t - bos, o_d, m_t, m_d, D, s_xt, W, HAS_BIAS, HAS_INIT, BT, BD)
    p_y = y + o_t.to(tl.int64)[:, None] * D + o_d[None, :]
    m_td = m_t[:, None] & m_d[None, :]
    b_u, _ = _activation(b_a, SILU)
    if L2 > 0:
        b_u = b_u * tl.math.rsqrt(_group_sum(b_u * b_u, BT, BD, L2) + eps)
    tl.store(p_y, b_u.to(y.dtype.element_ty), mask=m_td)


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
def _fetch(x, dy, seq_idx, cu, t, i_b, o_d, D, T, s_xt, IS_VARLEN: tl.constexpr):
    """What the walk loads for token t: x(t - 3), dy(t) and t's sequence (id, first token, end)."""
    i_n, bos, eos = _token_span(seq_idx, cu, t, T, IS_VARLEN)
    if not IS_VARLEN:
        i_n += i_b
    return _row(x, t - 3, o_d, D, T, s_xt), _row(dy, t, o_d, D, T, D), i_n, bos, eos


@triton.jit
def _walk_token(t, t_lo, t_hi, i_n, bos, eos, b_xn, b_dy, b_x0, b_x1, b_x2, b_d1, b_d2, b_d3,
                b_w0, b_w1, b_w2, b_w3, b_bias, init, dfinal, dinit, o_d, m_d, D, eps,
                W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_DFINAL: tl.constexpr,
                IS_VARLEN: tl.constexpr, SILU: tl.constexpr, L2: tl.constexpr, BD: tl.constexpr,
                EDGE: tl.constexpr):
    """One token of the backward walk (``_conv_bwd_kernel``): the pre-activation's gradient
    da(t) from dy(t) and the inputs x(t-3..t) (b_x0..b_x2 carried, b_xn = x(t-3) loaded), and
    dx(t) = sum_s w[W-1-s] da(t+s) from the da of the W-1 tokens after t (b_d1..b_d3, carried).
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
        p_h = init + i_n.to(tl.int64) * D * (W - 1) + o_d * (W - 1)
        b_s1 += tl.load(p_h + (W - 2 + pos), mask=_cols_if(o_d, D, pos < 1), other=0.0).to(tl.float32)
        if W > 2:
            b_s2 += tl.load(p_h + (W - 3 + pos), mask=_cols_if(o_d, D, pos < 2), other=0.0).to(tl.float32)
        if W > 3:
            b_s3 += tl.load(p_h + (W - 4 + pos), mask=_cols_if(o_d, D, pos < 3), other=0.0).to(tl.float32)
    b_a = b_w0 * b_x0 + b_w1 * b_s1 + b_w2 * b_s2 + b_w3 * b_s3
    if HAS_BIAS:
        b_a += b_bias
    b_g = b_dy
    b_u, b_sig = _activation(b_a, SILU)
    if L2 > 0:
        b_rstd = tl.math.rsqrt(_group_sum_row(b_u * b_u, BD, L2) + eps)
        b_yn = b_u * b_rstd
        b_g = b_rstd * (b_g - b_yn * _group_sum_row(b_g * b_yn, BD, L2))
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
               b_dw0, b_dw1, b_dw2, b_dw3, b_db, b_w0, b_w1, b_w2, b_w3, b_bias, init, dfinal, dinit, dx,
               o_d, m_d, D, eps, W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr,
               HAS_DFINAL: tl.constexpr, IS_VARLEN: tl.constexpr, SILU: tl.constexpr, L2: tl.constexpr,
               BD: tl.constexpr, EDGE: tl.constexpr):
    """Tokens t, t-1, t-2, t-3 of the walk (``_walk_token``) from their fetched rows: dx stored,
    dw's and db's sums and the carried rows and da returned."""
    for u in tl.static_range(4):
        if u == 0:
            b_xn, b_dy, i_n, bos, eos = f_a
        elif u == 1:
            b_xn, b_dy, i_n, bos, eos = f_b
        elif u == 2:
            b_xn, b_dy, i_n, bos, eos = f_c
        else:
            b_xn, b_dy, i_n, bos, eos = f_d
        b_g, b_dx, b_s1, b_s2, b_s3, b_d1, b_d2 = _walk_token(
            t - u, t_lo, t_hi, i_n, bos, eos, b_xn, b_dy, b_x0, b_x1, b_x2, b_d1, b_d2, b_d3,
            b_w0, b_w1, b_w2, b_w3, b_bias, init, dfinal, dinit, o_d, m_d, D, eps,
            W, HAS_BIAS, HAS_INIT, HAS_DFINAL, IS_VARLEN, SILU, L2, BD, EDGE,
        )  # fmt: skip
        if EDGE:
            inside = (t - u >= t_lo) & (t - u < t_hi)
            tl.store(dx + (t - u).to(tl.int64) * D + o_d, b_dx.to(dx.dtype.element_ty), mask=_cols_if(o_d, D, inside))
            # the W-1 tokens past the segment only hand their da to the tokens before them
            b_gi = tl.where(inside, b_g, 0.0)
        else:
            tl.store(dx + (t - u).to(tl.int64) * D + o_d, b_dx.to(dx.dtype.element_ty), mask=m_d)
            b_gi = b_g
        b_dw0 += b_gi * b_x0
        b_dw1 += b_gi * b_s1
        b_dw2 += b_gi * b_s2
        b_dw3 += b_gi * b_s3
        b_db += b_gi
        b_d3, b_d2, b_d1 = b_d2, b_d1, b_g
        b_x0, b_x1, b_x2 = b_x1, b_x2, b_xn
    return b_x0, b_x1, b_x2, b_d1, b_d2, b_d3, b_dw0, b_dw1, b_dw2, b_dw3, b_db


@triton.jit
def _conv_bwd_kernel(x, w, bias, init, dy, dfinal, dx, dw, db, dinit, seq_idx, cu, T, D, s_xb, s_xt, NS, eps,
                     W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_DFINAL: tl.constexpr,
                     IS_VARLEN: tl.constexpr, SILU: tl.constexpr, L2: tl.constexpr, SEG: tl.constexpr,
                     BD: tl.constexpr):
    """The whole backward in one pass: each program walks SEG tokens of BD channels from the last
    token down, so every token's da is formed once and kept in registers for the W-1 tokens before
    it, and x, dy and dx pass through memory once (6 bytes per element in bf16; two passes with da
    stored between them move 10). The walk starts W-1 tokens after its segment to form the da its last tokens
    need. Partial dw/db per program ([B * NS, W, D], [B * NS, D]) are summed by the launcher."""
    i_s, i_d, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    x += i_b.to(tl.int64) * s_xb
    dy += i_b.to(tl.int64) * T * D
    dx += i_b.to(tl.int64) * T * D
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
        f_a = _fetch(x, dy, seq_idx, cu, t, i_b, o_d, D, T, s_xt, IS_VARLEN)
        f_b = _fetch(x, dy, seq_idx, cu, t - 1, i_b, o_d, D, T, s_xt, IS_VARLEN)
        f_c = _fetch(x, dy, seq_idx, cu, t - 2, i_b, o_d, D, T, s_xt, IS_VARLEN)
        f_d = _fetch(x, dy, seq_idx, cu, t - 3, i_b, o_d, D, T, s_xt, IS_VARLEN)
        # most steps lie inside the segment and one sequence, away from its first and last tokens:
        # those take the walk without the masks of the edges (selects on every element otherwise).
        # Packed input keeps the masked walk: its steps would wait for each token's sequence bounds
        # (two dependent loads) to choose, and measured slower for it with v and xBC.
        _, _, _, bos, eos = f_a
        if (not IS_VARLEN) & (t - 3 >= t_lo) & (t < t_hi) & (t - 6 >= bos) & (t + 3 < eos):
            b_x0, b_x1, b_x2, b_d1, b_d2, b_d3, b_dw0, b_dw1, b_dw2, b_dw3, b_db = _walk_step(
                t, t_lo, t_hi, f_a, f_b, f_c, f_d, b_x0, b_x1, b_x2, b_d1, b_d2, b_d3,
                b_dw0, b_dw1, b_dw2, b_dw3, b_db, b_w0, b_w1, b_w2, b_w3, b_bias, init, dfinal, dinit, dx,
                o_d, m_d, D, eps, W, HAS_BIAS, HAS_INIT, HAS_DFINAL, IS_VARLEN, SILU, L2, BD, False,
            )  # fmt: skip
        else:
            b_x0, b_x1, b_x2, b_d1, b_d2, b_d3, b_dw0, b_dw1, b_dw2, b_dw3, b_db = _walk_step(
                t, t_lo, t_hi, f_a, f_b, f_c, f_d, b_x0, b_x1, b_x2, b_d1, b_d2, b_d3,
                b_dw0, b_dw1, b_dw2, b_dw3, b_db, b_w0, b_w1, b_w2, b_w3, b_bias, init, dfinal, dinit, dx,
                o_d, m_d, D, eps, W, HAS_BIAS, HAS_INIT, HAS_DFINAL, IS_VARLEN, SILU, L2, BD, True,
            )  # fmt: skip
    i_p = (i_b * NS + i_s).to(tl.int64)
    tl.store(dw + (i_p * W + (W - 1)) * D + o_d, b_dw0, mask=m_d)
    tl.store(dw + (i_p * W + (W - 2)) * D + o_d, b_dw1, mask=m_d)
    if W > 2:
        tl.store(dw + (i_p * W + (W - 3)) * D + o_d, b_dw2, mask=m_d)
    if W > 3:
        tl.store(dw + (i_p * W + (W - 4)) * D + o_d, b_dw3, mask=m_d)
    if HAS_BIAS:
        tl.store(db + i_p * D + o_d, b_db, mask=m_d)


@triton.jit
def _conv_update_kernel(
    x,
    state,
    w,
    bias,
    y,
    new_state,
    D,
    W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BD: tl.constexpr,
):
    i_b, i_d = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    b_x = tl.load(x + i_b * D + o_d, mask=m_d, other=0.0).to(tl.float32)  # [BD]
    b_a = b_x * tl.load(w + o_d * W + (W - 1), mask=m_d, other=0.0).to(tl.float32)
    p_s = state + i_b * D * (W - 1) + o_d * (W - 1)
    p_n = new_state + i_b * D * (W - 1) + o_d * (W - 1)
    for j in tl.static_range(W - 1):
        b_h = tl.load(p_s + j, mask=m_d, other=0.0)
        b_a += b_h.to(tl.float32) * tl.load(w + o_d * W + j, mask=m_d, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(p_n + (j - 1), b_h.to(new_state.dtype.element_ty), mask=m_d)
    tl.store(p_n + (W - 2), b_x.to(new_state.dtype.element_ty), mask=m_d)
    if HAS_BIAS:
        b_a += tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)
    if SILU:
        b_a = b_a * tl.sigmoid(b_a)
    tl.store(y + i_b * D + o_d, b_a.to(y.dtype.element_ty), mask=m_d)


def _launch_fwd(t: int, d: int, l2: int) -> dict:
    """Launch parameters of ``conv_fwd`` (``index.tuned``): BT tokens by BD channels per block, the
    fastest of ``bench_fused --sweep`` on an H200; a block holds whole groups of ``l2`` channels."""
    if interpreter_active():
        cfg = tuned("conv_fwd", BT=min(64, next_power_of_2(max(t, 1))), BD=min(64, next_power_of_2(d)))
    else:
        cfg = tuned("conv_fwd", BT=16, BD=min(256, next_power_of_2(d)), num_warps=4)
    return {**cfg, "BD": max(cfg["BD"], l2)}


def _launch_bwd(d: int, l2: int, packed: bool) -> dict:
    """Launch parameters of ``conv_bwd`` (``index.tuned``): walks of SEG tokens by BD channels, one
    warp each. On an H200 at B = 8, T = 4096 and at 32,768 tokens packed (bf16, the presets' convs,
    ``bench_fused --sweep``): walks of 256 tokens of 128 channels were the fastest length for q and
    k and for xBC (D = 4352), and within 4 - 6 % of 352 or 512 tokens for v. In packed input
    (each token's document is two dependent loads) the walk compiles to 168 registers and a cap of
    120 lets 17 walks share an SM instead of 12: 0.280 -> 0.237 ms for q and k. Unpacked, it
    compiles to 128 registers with or without a cap of 128 (``kernel_resources``): capped, v and
    xBC timed faster (xBC 0.436 -> 0.396, together with dropping the prefetch below), q and k with
    the norm slower (0.235 against 0.224), so only the former keep it. Loading the next step's rows
    ahead of the current one, which the walk did before, lost in every case but v packed (2 %)."""
    if interpreter_active():
        cfg = tuned("conv_bwd", SEG=16, BD=min(64, next_power_of_2(d)))
    else:
        cap = {"maxnreg": 120} if packed else {} if l2 else {"maxnreg": 128}
        cfg = tuned("conv_bwd", SEG=256, BD=min(128, next_power_of_2(d)), num_warps=1, **cap)
    return {**cfg, "BD": max(cfg["BD"], l2)}


def _varlen_meta(packing):
    """Per-token sequence id (int32 [T]) and cu_seqlens (int32), or (None, None) when not packed."""
    return (None, None) if packing is None else (packing.seq_ids, packing.cu_seqlens)


def rows_in_place(x: torch.Tensor) -> torch.Tensor:
    """x ``[B, T, D]`` as the kernels read it: unit stride over D, any batch and token strides."""
    return x if x.stride(2) == 1 or x.shape[2] == 1 else x.contiguous()


def conv_fwd(x, weight, bias, init, activation, packing, l2=0, l2_eps=1e-6):
    """The Triton forward: y ``[B, T, D]`` (contiguous, x's dtype) of checked inputs, x as
    ``rows_in_place`` gives it, ``packing`` a ``Packing`` or None; ``l2`` > 0 (a power of 2
    dividing D) normalises every run of ``l2`` channels of y. Also a stage of ops that fuse the
    conv (``kernels.ssd``'s ``chunk_conv_ssd``)."""
    b, t, d = x.shape
    w = weight.shape[1]
    seq_idx, cu = _varlen_meta(packing)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    cfg = _launch_fwd(t, d, l2)
    grid = (cdiv(t, cfg["BT"]), cdiv(d, cfg["BD"]), b)
    if t:
        _conv_fwd_kernel[grid](
            x, weight, bias if bias is not None else weight, init if init is not None else weight, y,
            seq_idx if seq_idx is not None else x, cu if cu is not None else x, t, d, x.stride(0), x.stride(1),
            W=w, HAS_BIAS=bias is not None, HAS_INIT=init is not None, IS_VARLEN=cu is not None,
            SILU=activation == "silu", eps=l2_eps, L2=l2, **cfg,
        )  # fmt: skip
    return y


def conv_bwd(x, weight, bias, init, dy, dfinal, activation, packing, l2=0, l2_eps=1e-6):
    """The Triton backward, one pass (``_conv_bwd_kernel``): ``(dx, dweight, dbias, dinit)`` from the
    output gradient dy (contiguous) and the final state's dfinal (or None); ``l2`` as in ``conv_fwd``."""
    b, t, d = x.shape
    w = weight.shape[1]
    seq_idx, cu = _varlen_meta(packing)
    cfg = _launch_bwd(d, l2, packing is not None)
    ns = cdiv(t, cfg["SEG"])
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dw = torch.empty(b * ns, w, d, dtype=torch.float32, device=x.device)
    db = torch.empty(b * ns, d, dtype=torch.float32, device=x.device) if bias is not None else None
    dinit = torch.zeros(init.shape, dtype=torch.float32, device=x.device) if init is not None else None
    if t:
        _conv_bwd_kernel[(ns, cdiv(d, cfg["BD"]), b)](
            x, weight, bias if bias is not None else weight, init if init is not None else weight, dy,
            dfinal if dfinal is not None else dy, dx, dw, db if db is not None else dw,
            dinit if dinit is not None else dw, seq_idx if seq_idx is not None else x,
            cu if cu is not None else x, t, d, x.stride(0), x.stride(1), ns, l2_eps,
            W=w, HAS_BIAS=bias is not None, HAS_INIT=init is not None, HAS_DFINAL=dfinal is not None,
            IS_VARLEN=cu is not None, SILU=activation == "silu", L2=l2, **cfg,
        )  # fmt: skip
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


class _CausalConv1dFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, initial_state, packing, activation, l2=0, l2_eps=1e-6):
        # x may be a column slice of a wider projection (Mamba2's xBC): read in place, and saved
        # as that view, so the backward keeps no copy of it. With l2 nothing else is kept: the
        # backward recomputes the output before its norm from x.
        x, weight = rows_in_place(x), weight.contiguous()
        init = initial_state.contiguous() if initial_state is not None else None
        y = conv_fwd(x, weight, bias, init, activation, packing, l2, l2_eps)
        final = _final_state(x, init, packing, weight.shape[1])
        ctx.save_for_backward(x, weight, bias, init)
        ctx.packing, ctx.activation, ctx.l2 = packing, activation, (l2, l2_eps)
        ctx.set_materialize_grads(False)
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        x, weight, bias, init = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(x)
        dfinal = dfinal.contiguous() if dfinal is not None else None
        dx, dw, db, dinit = conv_bwd(
            x, weight, bias, init, dy.contiguous(), dfinal, ctx.activation, ctx.packing, *ctx.l2
        )
        return dx, dw, db, dinit, None, None, None, None


def reference_causal_conv1d(
    x, weight, bias=None, *, activation=None, cu_seqlens=None, initial_state=None, output_final_state=False,
    l2_group=None, l2_eps=1e-6,
):
    """Per-token oracle: loops over sequences and tokens; computes in x's dtype promoted to fp32.

    Args:
        x, weight, bias, activation, cu_seqlens, initial_state, output_final_state, l2_group,
            l2_eps: as in ``causal_conv1d``.

    Returns:
        ``(y [B, T, D] in x's dtype, final_state [N, D, W-1] in x's dtype or None)``; differentiable.
    """
    check_conv_inputs(x, weight, bias, activation, cu_seqlens, initial_state, l2_group)
    b, t, d = x.shape
    w = weight.shape[1]
    dt = torch.promote_types(x.dtype, torch.float32)
    y = torch.zeros(b, t, d, dtype=dt, device=x.device)
    final = []
    for i_n, (i_b, bos, eos) in enumerate(segments(cu_seqlens, b, t)):
        if initial_state is not None:
            past = initial_state[i_n].to(dt).transpose(0, 1)
        else:
            past = torch.zeros(w - 1, d, dtype=dt, device=x.device)
        seq = torch.cat([past, x[i_b, bos:eos].to(dt)], dim=0)  # [W-1+L, D]
        rows = []
        for i_t in range(eos - bos):
            acc = (seq[i_t : i_t + w] * weight.to(dt).transpose(0, 1)).sum(0)
            if bias is not None:
                acc = acc + bias.to(dt)
            if activation == "silu":
                acc = F.silu(acc)
            rows.append(_norm_groups(acc, l2_group, l2_eps, reference_l2_norm))
        if rows:
            y[i_b, bos:eos] = torch.stack(rows)
        final.append(seq[seq.shape[0] - (w - 1) :].transpose(0, 1))
    y = y.to(x.dtype)
    if not output_final_state:
        return y, None
    return y, torch.stack(final).to(x.dtype)


def _shift_index(packing, b: int, t: int, device):
    """For the packed/batched layout, position of every token inside its sequence and its sequence id."""
    if packing is None:
        pos = torch.arange(t, device=device).expand(b, t)
        seq = torch.arange(b, device=device)[:, None].expand(b, t)
        return pos, seq
    seq = packing.seq_ids.long()[None]  # [1, T]
    pos = torch.arange(t, device=device)[None] - packing.cu_seqlens.long()[seq]  # [1, T]
    return pos, seq


def torch_causal_conv1d(
    x, weight, bias, activation, packing, initial_state, output_final_state, l2_group=None, l2_eps=1e-6
):
    """Vectorised torch version (autograd through gathers)."""
    b, t, d = x.shape
    w = weight.shape[1]
    dt = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(dt)
    wf = weight.to(dt)
    pos, seq = _shift_index(packing, b, t, x.device)
    flat = xf.reshape(b * t, d)
    row = torch.arange(b, device=x.device)[:, None] * t + torch.arange(t, device=x.device)[None]  # [B, T]
    acc = xf * wf[:, w - 1]
    for s in range(1, w):
        inside = pos >= s  # [B, T]
        shifted = flat[(row - s).clamp_min(0)]  # [B, T, D]
        if initial_state is not None:
            j = (w - 1 - s + pos).clamp(0, w - 2)
            before = initial_state.to(dt)[seq, :, j]  # [B, T, D]
        else:
            before = torch.zeros((), dtype=dt, device=x.device)
        acc = acc + torch.where(inside[..., None], shifted, before) * wf[:, w - 1 - s]
    if bias is not None:
        acc = acc + bias.to(dt)
    if activation == "silu":
        acc = F.silu(acc)
    y = _norm_groups(acc, l2_group, l2_eps, reference_l2_norm).to(x.dtype)
    if not output_final_state:
        return y, None
    return y, _final_state(x, initial_state, packing, w)


def _final_state(x, initial_state, packing, w: int) -> torch.Tensor:
    """Last W-1 entries of concat(initial_state, x_seq) per sequence, in x's dtype."""
    b, t, d = x.shape
    n = b if packing is None else packing.num_seqs
    if packing is None:
        ends = torch.full((n,), t, device=x.device, dtype=torch.long)
        lens = ends.clone()
        rows = torch.arange(n, device=x.device)
    else:
        cu = packing.cu_seqlens.long()
        ends, lens = cu[1:], cu[1:] - cu[:-1]
        rows = torch.zeros(n, dtype=torch.long, device=x.device)
    j = torch.arange(w - 1, device=x.device)  # state slot j holds the input at offset j - (W-1) from the end
    back = (w - 1) - j  # [W-1]: how many tokens before the end
    src_t = ends[:, None] - back[None]  # [N, W-1]
    inside = back[None] <= lens[:, None]
    from_x = x[rows[:, None], src_t.clamp_min(0)]  # [N, W-1, D]
    if initial_state is not None:
        k = (j[None] + lens[:, None]).clamp_max(w - 2)  # slot in the initial state
        from_init = initial_state.to(x.dtype)[torch.arange(n, device=x.device)[:, None], :, k]  # [N, W-1, D]
    else:
        from_init = torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.where(inside[..., None], from_x, from_init).transpose(1, 2).contiguous()


@on_input_device
def causal_conv1d(
    x, weight, bias=None, *, activation=None, cu_seqlens=None, initial_state=None, output_final_state=False,
    l2_group=None, l2_eps=1e-6,
):
    """Causal depthwise convolution over time (see the module docstring for the formula).

    Args:
        x: ``[B, T, D]`` inputs (fp32, fp16 or bf16; float64 on the torch backend).
        weight: ``[D, W]`` taps, W in 2..4; the last tap multiplies the current token.
        bias: ``[D]`` or None.
        activation: None or ``"silu"``, applied after the bias.
        cu_seqlens: ``[N + 1]`` int32/int64 document offsets for packed input (B must be 1; no tap
            crosses a document start), or a ``Packing`` from ``prepare_packing`` (no host copy).
        initial_state: ``[N, D, W-1]``: the W-1 inputs before each sequence, oldest first; None
            reads zeros there.
        output_final_state: also return each sequence's last W-1 inputs (its next initial state).
        l2_group: scale every run of ``l2_group`` channels of the output (a head of the delta
            rules' q and k) to unit L2 norm, ``u / sqrt(sum u^2 + l2_eps)`` after the
            activation, in fp32: one kernel each way instead of a conv and a norm, and the
            output before the norm is never stored. None: no norm.
        l2_eps: added to the sum of squares.

    Returns:
        ``(y, final_state)``: y ``[B, T, D]`` in x's dtype; final_state ``[N, D, W-1]`` in x's dtype,
        or None without ``output_final_state``. Gradients flow to x, weight, bias and
        initial_state.
    """
    check_conv_inputs(x, weight, bias, activation, cu_seqlens, initial_state, l2_group)
    packing = None if cu_seqlens is None else prepare_packing(cu_seqlens, x.shape[1], device=x.device)
    if kernel_backend(x) == "torch":
        return torch_causal_conv1d(
            x, weight, bias, activation, packing, initial_state, output_final_state, l2_group, l2_eps
        )
    l2 = l2_group or 0
    if l2 & (l2 - 1) or l2 > MAX_L2_GROUP:
        # the kernel's blocks hold whole groups of a power-of-2 size: norm the conv's output apart
        y, final = _CausalConv1dFunction.apply(x, weight, bias, initial_state, packing, activation)
        y = _norm_groups(y, l2, l2_eps)
    else:
        y, final = _CausalConv1dFunction.apply(
            x, weight, bias, initial_state, packing, activation, l2, float(l2_eps)
        )
    return y, final if output_final_state else None


def _check_update(x, conv_state, weight, bias, activation, l2_group=None) -> None:
    check_rank("x", x, 2, "[B, D]")
    check_dtype("x", x)
    check_rank("weight", weight, 2, "[D, W]")
    b, d = x.shape
    if weight.shape[0] != d or not 2 <= weight.shape[1] <= 4:
        raise ValueError(f"weight must have shape [D, W] with D={d}, W in 2..4, got {tuple(weight.shape)}")
    check_rank("conv_state", conv_state, 3, "[B, D, W-1]")
    check_dtype("conv_state", conv_state)
    if tuple(conv_state.shape) != (b, d, weight.shape[1] - 1):
        raise ValueError(
            f"conv_state must have shape [B, D, W-1] = {(b, d, weight.shape[1] - 1)}, got {tuple(conv_state.shape)}"
        )
    if bias is not None:
        check_rank("bias", bias, 1, "[D]")
        if bias.shape[0] != d:
            raise ValueError(f"bias must have shape [D] = [{d}], got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    _check_l2_group(l2_group, d)


def _torch_causal_conv1d_update(x, conv_state, weight, bias, activation):
    dt = torch.promote_types(x.dtype, torch.float32)
    window = torch.cat([conv_state.to(dt), x.to(dt)[..., None]], dim=-1)  # [B, D, W]
    acc = (window * weight.to(dt)).sum(-1)
    if bias is not None:
        acc = acc + bias.to(dt)
    if activation == "silu":
        acc = F.silu(acc)
    return acc.to(x.dtype), window[..., 1:].to(conv_state.dtype)


def _conv_update(x, conv_state, weight, bias, activation):
    """The decoding step's conv: the Triton kernel, or the torch version when a gradient is needed."""
    needs_grad = torch.is_grad_enabled() and any(
        a is not None and a.requires_grad for a in (x, conv_state, weight, bias)
    )
    if kernel_backend(x) == "torch" or needs_grad:
        return _torch_causal_conv1d_update(x, conv_state, weight, bias, activation)
    b, d = x.shape
    x, conv_state, weight = x.contiguous(), conv_state.contiguous(), weight.contiguous()
    y = torch.empty_like(x)
    new_state = torch.empty_like(conv_state)
    bd = min(256, next_power_of_2(d))
    _conv_update_kernel[(b, cdiv(d, bd))](
        x, conv_state, weight, bias if bias is not None else weight, y, new_state, d,
        W=weight.shape[1], HAS_BIAS=bias is not None, SILU=activation == "silu", BD=bd,
    )  # fmt: skip
    return y, new_state


@on_input_device
def causal_conv1d_update(x, conv_state, weight, bias=None, *, activation=None, l2_group=None, l2_eps=1e-6):
    """One decoding step of ``causal_conv1d``: one token against the last W-1 inputs.

    The Triton kernel is forward-only (decoding); when a gradient is needed the torch
    implementation runs instead (same fp32 arithmetic).

    Args:
        x: ``[B, D]``, the new token of each sequence.
        conv_state: ``[B, D, W-1]``, the W-1 inputs before it, oldest first; not modified.
        weight, bias, activation, l2_group, l2_eps: as in ``causal_conv1d`` (the norm runs after
            the step's kernel).

    Returns:
        ``(y [B, D] in x's dtype, new_conv_state [B, D, W-1] in conv_state's dtype)``, the state
        shifted by one token.
    """
    _check_update(x, conv_state, weight, bias, activation, l2_group)
    y, new_state = _conv_update(x, conv_state, weight, bias, activation)
    return _norm_groups(y, l2_group, l2_eps), new_state
