"""SwiGLU's gated product ``y = silu(gate) * up`` (Shazeer 2020, arXiv:2002.05202), forward and
backward in one elementwise Triton kernel each.

With ``s = sigmoid(gate)``::

    y      = gate * s * up
    d_up   = dy * gate * s
    d_gate = dy * up * s * (1 + gate * (1 - s))

Math in fp32, outputs in the inputs' dtype. Only ``gate`` and ``up`` are saved for the backward
(``silu(gate)`` is recomputed), and each direction reads and writes every element once: 3 passes
over the ``[tokens, intermediate]`` activations forward and 5 backward, where the torch ops take
5 and 11 (silu, mul; mul, silu_backward, silu again, mul).

``swiglu_linear`` is the product and the projection after it (an MLP's down projection) in one
autograd node. The projection's backward needs the product ``y`` for its weight's gradient; kept
from the forward it is one more ``[tokens, intermediate]`` tensor per layer (a third of what the
MLP saves). Here the backward's kernel writes ``y`` again next to ``d_gate`` and ``d_up``, from
the ``gate`` and ``up`` it reads anyway: one more write of the backward's 5 passes, and ``y`` lives
only between that kernel and the weight's product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttr.kernels.common.index import cdiv
from ttr.kernels.utils import (
    bias_grad,
    cast_linear,
    check_dtype,
    check_like,
    check_projection,
    kernel_backend,
    on_input_device,
    weight_grad,
)

BLOCK = 2048


@triton.jit
def _swiglu_fwd_kernel(g, u, y, N, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    b_g = tl.load(g + o, mask=m, other=0.0).to(tl.float32)
    b_u = tl.load(u + o, mask=m, other=0.0).to(tl.float32)
    tl.store(y + o, (b_g * tl.sigmoid(b_g) * b_u).to(y.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_bwd_kernel(g, u, dy, dg, du, y, N, BLOCK: tl.constexpr, STORE_Y: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    b_g = tl.load(g + o, mask=m, other=0.0).to(tl.float32)
    b_u = tl.load(u + o, mask=m, other=0.0).to(tl.float32)
    b_dy = tl.load(dy + o, mask=m, other=0.0).to(tl.float32)
    b_s = tl.sigmoid(b_g)
    tl.store(du + o, (b_dy * b_g * b_s).to(du.dtype.element_ty), mask=m)
    tl.store(dg + o, (b_dy * b_u * b_s * (1.0 + b_g * (1.0 - b_s))).to(dg.dtype.element_ty), mask=m)
    if STORE_Y:  # the forward's product again, for swiglu_linear's weight gradient
        tl.store(y + o, (b_g * b_s * b_u).to(y.dtype.element_ty), mask=m)


def _swiglu_fwd(gate, up):
    y = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _swiglu_fwd_kernel[(cdiv(n, BLOCK),)](gate, up, y, n, BLOCK=BLOCK, num_warps=8)
    return y


def _swiglu_bwd(gate, up, dy, store_y: bool):
    """``(d_gate, d_up, y or None)`` of contiguous tensors."""
    dg, du = torch.empty_like(gate), torch.empty_like(up)
    y = torch.empty_like(gate) if store_y else None
    n = gate.numel()
    if n:
        _swiglu_bwd_kernel[(cdiv(n, BLOCK),)](gate, up, dy, dg, du, y if store_y else dg, n, BLOCK=BLOCK,
                                                      STORE_Y=store_y, num_warps=8)
    return dg, du, y


def _swiglu_bwd_torch(gate, up, dy, store_y: bool):
    """``_swiglu_bwd`` in torch ops: autograd's own arithmetic of ``silu(gate) * up``."""
    silu = torch.nn.functional.silu(gate)
    return torch.ops.aten.silu_backward(dy * up, gate), dy * silu, (silu * up if store_y else None)


class _SwiGLUTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        return _swiglu_fwd(gate, up)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        return _swiglu_bwd(gate, up, dy.contiguous(), store_y=False)[:2]


class _SwiGLUTorch(torch.autograd.Function):
    """The torch backend: the same saved tensors (``gate``, ``up``), autograd's own arithmetic."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return torch.nn.functional.silu(gate) * up

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        return _swiglu_bwd_torch(gate, up, dy, store_y=False)[:2]


class _SwiGLULinear(torch.autograd.Function):
    """``F.linear(silu(gate) * up, weight, bias)``, the weight and bias cast to gate's dtype inside
    (autocast's cast), saving ``gate``, ``up`` and the cast weight; the backward forms the product
    again in its own kernel (module docstring) and returns the weight's and bias's gradients in
    their own dtypes (``weight_grad``)."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, triton_path):
        gate, up = gate.contiguous(), up.contiguous()
        y = _swiglu_fwd(gate, up) if triton_path else torch.nn.functional.silu(gate) * up
        out, w = cast_linear(y, weight, bias)
        ctx.save_for_backward(gate, up, w)
        ctx.triton_path = triton_path
        ctx.dtypes = weight.dtype, (bias.dtype if bias is not None else None)
        return out

    @staticmethod
    def backward(ctx, dout):
        gate, up, w = ctx.saved_tensors
        need = ctx.needs_input_grad
        dout2 = dout.reshape(-1, w.shape[0])
        dy = (dout2 @ w).view(gate.shape)
        bwd = _swiglu_bwd if ctx.triton_path else _swiglu_bwd_torch
        dg, du, y = bwd(gate, up, dy, store_y=need[2])
        del dy
        dw = weight_grad(dout2, y.view(-1, w.shape[1]), ctx.dtypes[0]) if need[2] else None
        db = bias_grad(dout2, ctx.dtypes[1]) if need[3] else None
        return dg, du, dw, db, None


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    check_dtype("gate", gate)
    check_like("up", up, "gate", gate, same_dtype=True)


def reference_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Oracle: the formula in the inputs' dtype promoted to fp32 (float64 stays float64).

    Args:
        gate, up: as in ``swiglu``.

    Returns:
        gate's shape and dtype; differentiable.
    """
    _check(gate, up)
    dt = torch.promote_types(gate.dtype, torch.float32)
    g = gate.to(dt)
    return (g * torch.sigmoid(g) * up.to(dt)).to(gate.dtype)


@on_input_device
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, elementwise: SwiGLU's gated product.

    Args:
        gate: any shape (fp32, fp16 or bf16; float64 takes the torch path).
        up: gate's shape, dtype and device.

    Returns:
        gate's shape and dtype, fp32 arithmetic; gradients flow to gate and up.
    """
    _check(gate, up)
    if kernel_backend(gate) == "torch" or gate.dtype == torch.float64:
        return _SwiGLUTorch.apply(gate, up)
    return _SwiGLUTriton.apply(gate, up)


@on_input_device
def swiglu_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(silu(gate) * up, weight, bias)``: SwiGLU's product and the projection after it,
    without keeping the product for the backward (module docstring).

    Args:
        gate, up: ``[..., I]``, as in ``swiglu``.
        weight: ``[O, I]``; cast to gate's dtype for the product (as autocast casts a weight),
            its gradient returned in its own dtype.
        bias: ``[O]`` or None, the same.

    Returns:
        ``[..., O]`` in gate's dtype; gradients flow to gate, up, weight and bias.
    """
    _check(gate, up)
    check_projection("weight", weight, "bias", bias, gate.shape[-1], "I, gate's last dim", gate)
    triton_path = kernel_backend(gate) == "triton" and gate.dtype != torch.float64
    return _SwiGLULinear.apply(gate, up, weight, bias, triton_path)
