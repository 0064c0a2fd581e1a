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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttr.kernels.utils import check_dtype, check_like, kernel_backend, on_input_device

BLOCK = 2048


@triton.jit
def _swiglu_fwd_kernel(g, u, y, N, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    b_g = tl.load(g + o, mask=m, other=0.0).to(tl.float32)
    b_u = tl.load(u + o, mask=m, other=0.0).to(tl.float32)
    tl.store(y + o, (b_g * tl.sigmoid(b_g) * b_u).to(y.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_bwd_kernel(g, u, dy, dg, du, N, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    b_g = tl.load(g + o, mask=m, other=0.0).to(tl.float32)
    b_u = tl.load(u + o, mask=m, other=0.0).to(tl.float32)
    b_dy = tl.load(dy + o, mask=m, other=0.0).to(tl.float32)
    b_s = tl.sigmoid(b_g)
    tl.store(du + o, (b_dy * b_g * b_s).to(du.dtype.element_ty), mask=m)
    tl.store(dg + o, (b_dy * b_u * b_s * (1.0 + b_g * (1.0 - b_s))).to(dg.dtype.element_ty), mask=m)


class _SwiGLUTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty_like(gate)
        n = gate.numel()
        if n:
            _swiglu_fwd_kernel[(triton.cdiv(n, BLOCK),)](gate, up, y, n, BLOCK=BLOCK, num_warps=8)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dy = dy.contiguous()
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if n:
            _swiglu_bwd_kernel[(triton.cdiv(n, BLOCK),)](gate, up, dy, dg, du, n, BLOCK=BLOCK, num_warps=8)
        return dg, du


class _SwiGLUTorch(torch.autograd.Function):
    """The torch backend: the same saved tensors (``gate``, ``up``), autograd's own arithmetic."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return torch.nn.functional.silu(gate) * up

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        return torch.ops.aten.silu_backward(dy * up, gate), dy * torch.nn.functional.silu(gate)


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
