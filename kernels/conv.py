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
The backward's kernel, a walk over each segment of tokens, is in ``conv_backward.py``.

``causal_conv1d_columns`` convolves consecutive column blocks of one tensor (the delta rules' q, k
and v as one projection's output) and writes the blocks' input gradients into one tensor, which
the projection's backward takes whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ttr.kernels.common.index import cdiv, next_power_of_2, prepare_packing, segments, tuned
from ttr.kernels.conv_backward import conv_bwd, silu_and_sigmoid, varlen_meta
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
def _conv_fwd_kernel(x, w, bias, init, y, rstd, seq_idx, cu, T, D, s_xb, s_xt, W: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, IS_VARLEN: tl.constexpr, SILU: tl.constexpr,
                     BT: tl.constexpr, BD: tl.constexpr, eps=1e-6, L2: tl.constexpr = 0):
    """y = act(conv(x)). With L2 > 0 the output is normalised to unit L2 norm over each run of L2
    channels (a head): y = u * r with r = 1 / sqrt(sum u^2 + eps) and u = act(conv(x)) in fp32; r
    is stored to rstd ``[B, T, D // L2]`` for the backward, which then sums over a group once."""
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
    b_u, _ = silu_and_sigmoid(b_a, SILU)
    if L2 > 0:
        G: tl.constexpr = BD // L2
        b_r = tl.math.rsqrt(tl.sum(tl.reshape(b_u * b_u, [BT, G, L2]), axis=2) + eps)  # [BT, G]
        o_g = i_d * G + tl.arange(0, G)
        p_r = rstd + (i_b.to(tl.int64) * T + o_t)[:, None] * (D // L2) + o_g[None, :]
        tl.store(p_r, b_r, mask=m_t[:, None] & (o_g < D // L2)[None, :])
        b_u = tl.reshape(tl.reshape(b_u, [BT, G, L2]) * b_r[:, :, None], [BT, BD])
    tl.store(p_y, b_u.to(y.dtype.element_ty), mask=m_td)


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


def rows_in_place(x: torch.Tensor) -> torch.Tensor:
    """x ``[B, T, D]`` as the kernels read it: unit stride over D, any batch and token strides."""
    return x if x.stride(2) == 1 or x.shape[2] == 1 else x.contiguous()


def conv_fwd(x, weight, bias, init, activation, packing, l2=0, l2_eps=1e-6):
    """The Triton forward: ``(y, rstd)``, y ``[B, T, D]`` (contiguous, x's dtype) of checked inputs, x
    as ``rows_in_place`` gives it, ``packing`` a ``Packing`` or None; ``l2`` > 0 (a power of 2
    dividing D) normalises every run of ``l2`` channels of y, and rstd ``[B, T, D // l2]`` (fp32)
    holds each run's 1/norm, which ``conv_bwd`` takes (None without ``l2``). Also a stage of ops
    that fuse the conv (``kernels.ssd``'s ``chunk_conv_ssd``)."""
    b, t, d = x.shape
    w = weight.shape[1]
    seq_idx, cu = varlen_meta(packing)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(b, t, d // l2, dtype=torch.float32, device=x.device) if l2 else None
    cfg = _launch_fwd(t, d, l2)
    grid = (cdiv(t, cfg["BT"]), cdiv(d, cfg["BD"]), b)
    if t:
        _conv_fwd_kernel[grid](
            x, weight, bias if bias is not None else weight, init if init is not None else weight, y,
            rstd if rstd is not None else y, seq_idx if seq_idx is not None else x, cu if cu is not None else x,
            t, d, x.stride(0), x.stride(1),
            W=w, HAS_BIAS=bias is not None, HAS_INIT=init is not None, IS_VARLEN=cu is not None,
            SILU=activation == "silu", eps=l2_eps, L2=l2, **cfg,
        )  # fmt: skip
    return y, rstd


class _CausalConv1dFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, initial_state, packing, activation, l2=0, l2_eps=1e-6):
        # x may be a column slice of a wider projection (Mamba2's xBC): read in place, and saved
        # as that view, so the backward keeps no copy of it. With l2 it also keeps each group's
        # 1/norm (4 bytes a group and token) and forms the output before its norm again from x.
        x, weight = rows_in_place(x), weight.contiguous()
        init = initial_state.contiguous() if initial_state is not None else None
        y, rstd = conv_fwd(x, weight, bias, init, activation, packing, l2, l2_eps)
        final = _final_state(x, init, packing, weight.shape[1])
        ctx.save_for_backward(x, weight, bias, init, rstd)
        ctx.packing, ctx.activation, ctx.l2 = packing, activation, l2
        ctx.set_materialize_grads(False)
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        x, weight, bias, init, rstd = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(x)
        dfinal = dfinal.contiguous() if dfinal is not None else None
        dx, dw, db, dinit = conv_bwd(
            x, weight, bias, init, dy.contiguous(), dfinal, ctx.activation, ctx.packing, ctx.l2, rstd
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


class _ColumnsConv1dFunction(torch.autograd.Function):
    """``causal_conv1d`` of each column block of one x ``[B, T, sum D_i + R]`` (without states): the
    outputs are the blocks' own tensors (and the last R columns, copied), and the backward writes
    every block's input gradient, and the R columns', into one tensor of x's shape (``conv_bwd``'s
    ``dx``), so the product x came from takes it whole."""

    @staticmethod
    def forward(ctx, x, packing, activation, l2s, l2_eps, passthrough, *params):
        n = len(l2s)
        weights, biases = [w.contiguous() for w in params[:n]], params[n:]
        x = rows_in_place(x)
        ys, rstds, start = [], [], 0
        for w, b, l2 in zip(weights, biases, l2s):
            y, rstd = conv_fwd(x[..., start:start + w.shape[0]], w, b, None, activation, packing, l2, l2_eps)
            ys.append(y)
            rstds.append(rstd)
            start += w.shape[0]
        if passthrough:
            ys.append(x[..., start:].contiguous())
        ctx.save_for_backward(x, *weights, *biases, *rstds)
        ctx.packing, ctx.activation, ctx.l2s, ctx.passthrough = packing, activation, l2s, passthrough
        ctx.set_materialize_grads(False)
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys):
        x, *params = ctx.saved_tensors
        n = len(ctx.l2s)
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        dws, dbs, start = [], [], 0
        for w, b, rstd, l2, dy in zip(params[:n], params[n:2 * n], params[2 * n:], ctx.l2s, dys):
            cols = slice(start, start + w.shape[0])
            xi = x[..., cols]
            dy = torch.zeros_like(xi) if dy is None else dy.contiguous()
            _, dw, db, _ = conv_bwd(xi, w, b, None, dy, None, ctx.activation, ctx.packing, l2, rstd, dx=dx[..., cols])
            dws.append(dw)
            dbs.append(db)
            start += w.shape[0]
        if ctx.passthrough and dys[n] is not None:
            dx[..., start:].copy_(dys[n])
        elif ctx.passthrough:
            dx[..., start:].zero_()
        return dx, None, None, None, None, None, *dws, *dbs


@on_input_device
def causal_conv1d_columns(x, weights, biases=None, *, activation=None, cu_seqlens=None, l2_groups=None,
                          l2_eps=1e-6, passthrough: int = 0):
    """``causal_conv1d`` of consecutive column blocks of x, one block per weight: block i is
    ``x[..., o_i:o_i + D_i]`` with ``D_i = weights[i].shape[0]``, convolved with ``weights[i]``,
    ``biases[i]`` and ``l2_groups[i]``. Without states (training). The blocks' input gradients come
    back as one tensor of x's shape, written in place by each block's backward, so that the
    product x came from (the delta rules' q, k and v as one projection) takes its gradient
    without a copy.

    Args:
        x: ``[B, T, sum D_i + passthrough]``; a column block of a wider tensor is read in place.
        weights: ``[D_i, W]`` each; biases: None or a list of ``[D_i]`` or None.
        activation, cu_seqlens, l2_eps: as in ``causal_conv1d``.
        l2_groups: None or a list of ``causal_conv1d``'s ``l2_group`` per block.
        passthrough: x's last columns that are not convolved (the delta rules' narrow gate maps,
            which then share the one product each way instead of a product of their own that
            reads the layer's input again): returned as they are, their gradient placed in the
            one input gradient.

    Returns:
        a tuple of the blocks' outputs ``[B, T, D_i]`` in x's dtype, then with ``passthrough`` x's
        last ``passthrough`` columns ``[B, T, passthrough]``.
    """
    n = len(weights)
    biases = [None] * n if biases is None else list(biases)
    l2_groups = [None] * n if l2_groups is None else list(l2_groups)
    if not n or len(biases) != n or len(l2_groups) != n:
        raise ValueError(f"weights, biases and l2_groups must be lists of one length >= 1, got {n}, "
                         f"{len(biases)} and {len(l2_groups)}")
    if isinstance(passthrough, bool) or not isinstance(passthrough, int) or passthrough < 0:
        raise ValueError(f"passthrough must be an int >= 0, got {passthrough!r}")
    check_rank("x", x, 3, "[B, T, D]")
    widths = [w.shape[0] if isinstance(w, torch.Tensor) and w.dim() == 2 else -1 for w in weights]
    if sum(widths) + passthrough != x.shape[2] or min(widths) < 1:
        raise ValueError(f"weights must be [D_i, W] with the D_i and passthrough={passthrough} summing to x's "
                         f"D={x.shape[2]}, got widths {widths}")
    starts = [sum(widths[:i]) for i in range(n)]
    for i, (w, b, g) in enumerate(zip(weights, biases, l2_groups)):
        check_conv_inputs(x[..., starts[i]:starts[i] + widths[i]], w, b, activation, cu_seqlens, None, g)
    fused = all(g is None or not (g & (g - 1) or g > MAX_L2_GROUP) for g in l2_groups)
    if kernel_backend(x) == "torch" or not fused:
        ys = tuple(causal_conv1d(x[..., s:s + d], w, b, activation=activation, cu_seqlens=cu_seqlens, l2_group=g,
                                 l2_eps=l2_eps)[0] for s, d, w, b, g in zip(starts, widths, weights, biases, l2_groups))
        return ys + (x[..., sum(widths):],) if passthrough else ys
    packing = None if cu_seqlens is None else prepare_packing(cu_seqlens, x.shape[1], device=x.device)
    return _ColumnsConv1dFunction.apply(x, packing, activation, tuple(g or 0 for g in l2_groups), float(l2_eps),
                                        passthrough, *weights, *biases)


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
