"""Fused linear + cross-entropy, chunked over tokens (the [tokens, vocab] logits never exist whole).

For hidden ``h [N, D]``, weight ``W [V, D]``, optional bias ``b [V]`` and labels ``y [N]``::

    z_i   = W h_i + b                       (logits of token i)
    loss  = sum_{i: y_i != ignore} (logsumexp(z_i) - z_i[y_i])   / n_valid  (reduction "mean")
    dz_i  = (softmax(z_i) - onehot(y_i)) * s,  s = 1 / n_valid or 1;  dz_i = 0 for ignored rows
    dh_i  = dz_i W,   dW = sum_i dz_i h_i^T,   db = sum_i dz_i

The forward walks the tokens in chunks of ``chunk_size``: one matmul gives the chunk's logits
(in the compute dtype, fp32 accumulation in cuBLAS), one Triton kernel turns them into the loss
and, in place, into ``softmax - onehot`` (fp32 arithmetic: two passes over the vocabulary, an
online max / sum-exp, then the gradient), and two more matmuls give the chunk's ``dh`` and its
share of ``dW``, which the product adds into an fp32 accumulator without rounding it to the
compute dtype. The backward only multiplies the stored grads by grad_output times ``s`` (one
pass); ``s`` stays out of the forward so that fp16 grads do not underflow before a loss scale
reaches them. This is the approach of Liger-Kernel's fused linear cross-entropy
(arXiv:2410.10989). Peak extra memory: one ``[chunk_size, V]`` logits buffer, ``dh`` and an fp32
``dW``. Under autocast the op casts hidden, weight and bias to the autocast dtype for its
products (as F.linear would) and returns each gradient in its input's own dtype: an fp32 master
weight's straight from the fp32 accumulator, not rounded to bf16 and cast back up.
When nothing requires grad only the loss is computed.

With ``reduction="mean"`` and every label ignored the loss is 0 with zero grads (not NaN).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttr.kernels.common.index import cdiv, next_power_of_2
from ttr.kernels.utils import add_weight_grad, check_dtype, kernel_backend, on_input_device, weight_grad

REDUCTIONS = ("mean", "sum")


@triton.jit
def _ce_fwd_bwd_kernel(
    logits, labels, loss, V, stride_l, ignore_index, COMPUTE_GRAD: tl.constexpr, BV: tl.constexpr
):
    """One row: loss = lse - z[y]; in place z <- softmax(z) - onehot(y) (0 if ignored)."""
    i_r = tl.program_id(0).to(tl.int64)
    p_row = logits + i_r * stride_l
    b_y = tl.load(labels + i_r).to(tl.int64)
    is_ignored = b_y == ignore_index
    o_v = tl.arange(0, BV)
    b_m = tl.full([BV], float("-inf"), dtype=tl.float32)
    b_s = tl.zeros([BV], dtype=tl.float32)
    # pass 1: per-lane running max and rescaled sum of exponentials
    for i_v in range(0, V, BV):
        m_v = i_v + o_v < V
        b_z = tl.load(p_row + i_v + o_v, mask=m_v, other=float("-inf")).to(tl.float32)  # [BV]
        b_m_new = tl.maximum(b_m, b_z)
        b_s = b_s * tl.exp(b_m - tl.where(b_m_new == float("-inf"), 0.0, b_m_new)) + tl.where(
            m_v, tl.exp(b_z - tl.where(b_m_new == float("-inf"), 0.0, b_m_new)), 0.0
        )
        b_m = b_m_new
    m_row = tl.max(b_m, axis=0)
    s_row = tl.sum(b_s * tl.exp(b_m - m_row), axis=0)
    lse = m_row + tl.log(s_row)
    b_zy = tl.load(p_row + tl.where(is_ignored, 0, b_y)).to(tl.float32)
    tl.store(loss + i_r, tl.where(is_ignored, 0.0, lse - b_zy))
    if COMPUTE_GRAD:
        s = tl.where(is_ignored, 0.0, 1.0)
        # pass 2: dz = softmax - onehot, written over the logits
        for i_v in range(0, V, BV):
            m_v = i_v + o_v < V
            b_z = tl.load(p_row + i_v + o_v, mask=m_v, other=0.0).to(tl.float32)
            b_p = tl.exp(b_z - lse) - tl.where(i_v + o_v == b_y, 1.0, 0.0)
            tl.store(p_row + i_v + o_v, (b_p * s).to(logits.dtype.element_ty), mask=m_v)


def _triton_ce_chunk(logits, labels, ignore_index, compute_grad):
    """Per-row loss (fp32) of a [C, V] logits chunk; with compute_grad the chunk becomes dz."""
    c, v = logits.shape
    loss = torch.empty(c, dtype=torch.float32, device=logits.device)
    if c:
        bv = min(next_power_of_2(v), 4096)
        _ce_fwd_bwd_kernel[(c,)](
            logits, labels, loss, v, logits.stride(0), ignore_index,
            COMPUTE_GRAD=compute_grad, BV=bv, num_warps=8 if bv >= 2048 else 4,
        )  # fmt: skip
    return loss


def _torch_ce_chunk(logits, labels, ignore_index, compute_grad):
    """Same contract as _triton_ce_chunk with torch ops (fp32 arithmetic, fp64 for fp64)."""
    dt = torch.promote_types(logits.dtype, torch.float32)
    z = logits.to(dt)
    ignored = labels == ignore_index
    safe = torch.where(ignored, torch.zeros_like(labels), labels)
    lse = torch.logsumexp(z, dim=-1)
    loss = torch.where(ignored, 0.0, lse - z.gather(1, safe[:, None])[:, 0])
    if compute_grad:
        p = torch.exp(z - lse[:, None])
        p.scatter_add_(1, safe[:, None], -torch.ones_like(p[:, :1]))
        p.mul_((~ignored).to(dt)[:, None])
        logits.copy_(p)
    return loss


def _default_chunk_size(n: int, d: int, v: int) -> int:
    """Tokens per chunk: the power of 2 at or above the count whose logits are twice hidden's size."""
    target = max(1, (2 * n * d) // max(v, 1))
    return max(256, min(next_power_of_2(target), 8192))


class _LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, reduction, chunk_size, backend, dtype):
        # the inputs are cast to the products' dtype here rather than by the caller, so that their
        # gradients come back in their own dtypes straight from the fp32 accumulators: the
        # weight's (fp32 under autocast) is not rounded to bf16 and cast back up
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
        n, d = hidden.shape
        v = weight.shape[0]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        need_grad = need_h or need_w or need_b
        ce_chunk = _triton_ce_chunk if backend == "triton" else _torch_ce_chunk
        acc_dt = torch.promote_types(dtype, torch.float32)
        scale = 1.0
        if reduction == "mean":  # a tensor: reading the count on the host would wait for the GPU
            scale = 1.0 / (labels != ignore_index).sum().clamp_min(1).to(acc_dt)
        dh = torch.empty_like(hidden) if need_h else None
        dw = None
        db = torch.zeros(v, dtype=acc_dt, device=hidden.device) if need_b else None
        total = torch.zeros((), dtype=acc_dt, device=hidden.device)
        for i0 in range(0, n, chunk_size):
            h_c = hidden[i0 : i0 + chunk_size]
            if bias is not None:
                z_c = torch.addmm(bias, h_c, weight.t())  # [C, V]
            else:
                z_c = torch.mm(h_c, weight.t())
            loss_c = ce_chunk(z_c, labels[i0 : i0 + chunk_size], ignore_index, need_grad)
            total += loss_c.sum()
            if not need_grad:
                continue
            if need_h:
                torch.mm(z_c, weight, out=dh[i0 : i0 + chunk_size])
            if need_w:
                dw = weight_grad(z_c, h_c, acc_dt) if dw is None else add_weight_grad(dw, z_c, h_c)
            if need_b:
                db += z_c.sum(0, dtype=db.dtype)
            del z_c
        if need_w and dw is None:  # no tokens
            dw = torch.zeros(v, d, dtype=acc_dt, device=hidden.device)
        # dh, dw, db are kept unscaled (softmax - onehot): the 1/n_valid of "mean" is applied in the
        # backward together with grad_output, so fp16 grads do not underflow before a loss scale
        ctx.save_for_backward(dh, dw, db)
        ctx.scale, ctx.chunk_size, ctx.backend = scale, chunk_size, backend
        return total * scale

    @staticmethod
    def backward(ctx, grad_loss):
        factor = grad_loss.to(torch.promote_types(grad_loss.dtype, torch.float32)) * ctx.scale
        grads = [
            None if g is None else _scaled(g, factor, dtype, ctx.chunk_size, ctx.backend)
            for g, dtype in zip(ctx.saved_tensors, ctx.dtypes)
        ]
        return (*grads, None, None, None, None, None, None)


@triton.jit
def _scale_kernel(x, factor, out, n, BLOCK: tl.constexpr):
    """``out = x * factor`` in fp32, rounded once to out's dtype."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    b_f = tl.load(factor).to(tl.float32)
    b_x = tl.load(x + o, mask=m, other=0.).to(tl.float32)
    tl.store(out + o, (b_x * b_f).to(out.dtype.element_ty), mask=m)


def _scaled(g, factor, dtype, rows: int, backend: str):
    """``g * factor`` in fp32 (fp64 for fp64), cast to ``dtype``: one pass over g on the triton
    backend, else ``rows`` rows at a time."""
    out = torch.empty(g.shape, dtype=dtype, device=g.device)
    if backend == "triton" and factor.dtype == torch.float32:
        n, block = g.numel(), 4096
        if n:
            _scale_kernel[(cdiv(n, block),)](g, factor, out, n, BLOCK=block, num_warps=8)
        return out
    for i0 in range(0, g.shape[0], rows):
        out[i0 : i0 + rows] = g[i0 : i0 + rows].to(factor.dtype) * factor
    return out


def _check(hidden, weight, labels, bias, ignore_index, reduction, chunk_size) -> None:
    check_dtype("hidden", hidden)
    check_dtype("weight", weight)
    if hidden.dim() != 2:
        raise ValueError(f"hidden must have shape [N, D] (2 dims), got {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must have shape [V, D] with D={hidden.shape[1]}, got {tuple(weight.shape)}")
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int32, torch.int64):
        raise TypeError("labels must be an int32/int64 torch.Tensor")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must have shape [N] = [{hidden.shape[0]}], got {tuple(labels.shape)}")
    if bias is not None:
        check_dtype("bias", bias)
        if bias.shape != weight.shape[:1]:
            raise ValueError(f"bias must have shape [V] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    for name, other in (("weight", weight), ("labels", labels), ("bias", bias)):
        if other is not None and other.device != hidden.device:
            raise ValueError(f"{name} is on {other.device} but hidden is on {hidden.device}")
    v = weight.shape[0]
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= v))
    message = f"labels must lie in [0, V={v}) or equal ignore_index={ignore_index}"
    if labels.is_cuda:
        # Reading the answer on the host would wait for the GPU at every training step; the
        # device-side assert fails the run at its next synchronisation instead, as torch's own
        # cross-entropy does with such labels.
        torch._assert_async(~bad.any(), message)
    elif bool(bad.any()):
        raise ValueError(message)


def reference_linear_cross_entropy(
    hidden, weight, labels, *, bias=None, ignore_index=-100, reduction="mean", chunk_size=None
):
    """Oracle: full logits in fp32 (fp64 for fp64 inputs) and a per-row logsumexp.

    Args:
        hidden, weight, labels, bias, ignore_index, reduction: as in ``linear_cross_entropy``.
        chunk_size: accepted for signature parity; no effect here.

    Returns:
        The scalar loss (fp32; fp64 for fp64 inputs); differentiable.
    """
    _check(hidden, weight, labels, bias, ignore_index, reduction, chunk_size)
    dt = torch.promote_types(hidden.dtype, torch.float32)
    logits = hidden.to(dt) @ weight.to(dt).t()
    if bias is not None:
        logits = logits + bias.to(dt)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels)).long()
    per_token = torch.logsumexp(logits, -1) - logits.gather(1, safe[:, None])[:, 0]
    total = (per_token * valid).sum()
    if reduction == "sum":
        return total
    return total / valid.sum().clamp_min(1)


@on_input_device
def linear_cross_entropy(
    hidden, weight, labels, *, bias=None, ignore_index=-100, reduction="mean", chunk_size=None
):
    """Cross-entropy of the logits ``hidden @ weight^T (+ bias)`` against ``labels``, chunked over tokens.

    The per-chunk softmax / loss / grad part runs on ``kernel_backend(hidden)``; the matmuls are
    torch's. Under autocast hidden, weight and bias are cast to the autocast dtype first.

    Args:
        hidden: ``[N, D]`` (fp32, fp16 or bf16; float64 on the torch backend).
        weight: ``[V, D]``, hidden's dtype outside autocast.
        labels: ``[N]`` int32/int64 in ``[0, V)`` or ``ignore_index``. Out-of-range labels raise
            ValueError on the CPU; on a GPU they fail a device-side assert (checking on the host
            would wait for the GPU).
        bias: ``[V]`` or None.
        ignore_index: the label of tokens that add no loss.
        reduction: ``"mean"`` over the non-ignored tokens (0 when there are none) or ``"sum"``.
        chunk_size: tokens per chunk (default: a logits chunk 2x to 4x the size of ``hidden``, a
            power of 2 in [256, 8192]).

    Returns:
        The scalar loss (fp32; fp64 for fp64 inputs); gradients flow to hidden, weight and bias.
    """
    _check(hidden, weight, labels, bias, ignore_index, reduction, chunk_size)
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dt = torch.get_autocast_dtype(device_type)
    elif hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise TypeError(
            f"hidden, weight and bias must share a dtype outside autocast, got {hidden.dtype}, {weight.dtype}"
            + (f", {bias.dtype}" if bias is not None else "")
        )
    else:
        dt = hidden.dtype
    n, d = hidden.shape
    chunk = chunk_size or _default_chunk_size(n, d, weight.shape[0])
    with torch.autocast(device_type, enabled=False):
        return _LinearCrossEntropyFunction.apply(
            hidden.contiguous(), weight.contiguous(), bias, labels.contiguous(), ignore_index, reduction,
            chunk, kernel_backend(hidden), dt,
        )  # fmt: skip
