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

# tiles of BR rows by BC columns: the rows of gate and up may be column blocks of one wider
# product (``swiglu_linear`` of both halves), so each row starts at its own stride
BR, BC = 4, 512


@triton.jit
def _rows_tile(R, I, BR: tl.constexpr, BC: tl.constexpr):
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    return o_r[:, None], o_c[None, :], (o_r < R)[:, None] & (o_c < I)[None, :]


@triton.jit
def _swiglu_fwd_kernel(g, u, y, R, I, s_g, s_u, BR: tl.constexpr, BC: tl.constexpr):
    o_r, o_c, m = _rows_tile(R, I, BR, BC)
    b_g = tl.load(g + o_r * s_g + o_c, mask=m, other=0.0).to(tl.float32)
    b_u = tl.load(u + o_r * s_u + o_c, mask=m, other=0.0).to(tl.float32)
    tl.store(y + o_r * I + o_c, (b_g * tl.sigmoid(b_g) * b_u).to(y.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_bwd_kernel(g, u, dy, dg, du, y, R, I, s_g, s_u, s_d, BR: tl.constexpr, BC: tl.constexpr,
                       STORE_Y: tl.constexpr):
    o_r, o_c, m = _rows_tile(R, I, BR, BC)
    b_g = tl.load(g + o_r * s_g + o_c, mask=m, other=0.0).to(tl.float32)
    b_u = tl.load(u + o_r * s_u + o_c, mask=m, other=0.0).to(tl.float32)
    b_dy = tl.load(dy + o_r * I + o_c, mask=m, other=0.0).to(tl.float32)
    b_s = tl.sigmoid(b_g)
    tl.store(du + o_r * s_d + o_c, (b_dy * b_g * b_s).to(du.dtype.element_ty), mask=m)
    tl.store(dg + o_r * s_d + o_c, (b_dy * b_u * b_s * (1.0 + b_g * (1.0 - b_s))).to(dg.dtype.element_ty), mask=m)
    if STORE_Y:  # the forward's product again, for swiglu_linear's weight gradient
        tl.store(y + o_r * I + o_c, (b_g * b_s * b_u).to(y.dtype.element_ty), mask=m)


def _row_stride(t: torch.Tensor) -> int | None:
    """The stride between the rows of t taken as ``[numel / I, I]`` (unit stride along I), or None
    where its leading dims do not lay the rows out evenly: a contiguous tensor's is I, a column
    block's of one wider product the product's width."""
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        return None
    step = expect = None
    for n, st in reversed(list(zip(t.shape[:-1], t.stride()[:-1]))):
        if n == 1:
            continue
        if step is None:
            step = st
        elif st != expect:
            return None
        expect = st * n
    return t.shape[-1] if step is None else step


def _rows_of(t: torch.Tensor) -> torch.Tensor:
    """t if the kernels can read it in place (``_row_stride``), else a contiguous copy."""
    return t if _row_stride(t) is not None else t.contiguous()


def _swiglu_fwd(gate, up):
    """``y [..., I]`` (contiguous) of gate and up as ``_rows_of`` gives them."""
    i = gate.shape[-1]
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    r = gate.numel() // i if i else 0
    if r and i:
        _swiglu_fwd_kernel[(cdiv(r, BR), cdiv(i, BC))](gate, up, y, r, i, _row_stride(gate), _row_stride(up), BR=BR,
                                                        BC=BC, num_warps=8)
    return y


def _swiglu_bwd(gate, up, dy, store_y: bool, dgu=None):
    """``(d_gate, d_up, y or None)``, gate and up as ``_rows_of`` gives them, dy contiguous; with
    ``dgu [..., 2I]`` d_gate and d_up are written into its two halves (and returned as its views)."""
    i = gate.shape[-1]
    if dgu is None:
        dg, du = (torch.empty(gate.shape, dtype=gate.dtype, device=gate.device) for _ in range(2))
    else:
        dg, du = dgu[..., :i], dgu[..., i:]
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device) if store_y else None
    r = gate.numel() // i if i else 0
    if r and i:
        _swiglu_bwd_kernel[(cdiv(r, BR), cdiv(i, BC))](
            gate, up, dy, dg, du, y if store_y else dg, r, i, _row_stride(gate), _row_stride(up), _row_stride(dg),
            BR=BR, BC=BC, STORE_Y=store_y, num_warps=8)
    return dg, du, y


def _swiglu_bwd_torch(gate, up, dy, store_y: bool):
    """``_swiglu_bwd`` in torch ops: autograd's own arithmetic of ``silu(gate) * up``."""
    silu = torch.nn.functional.silu(gate)
    return torch.ops.aten.silu_backward(dy * up, gate), dy * silu, (silu * up if store_y else None)


class _SwiGLUTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = _rows_of(gate), _rows_of(up)
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
    their own dtypes (``weight_grad``). With ``up`` None, gate holds gate and up as its two halves
    (one product of both maps), read in place, and their gradient comes back as one tensor."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, triton_path):
        ctx.joined = up is None
        if triton_path:
            gate, up = _rows_of(gate), (None if up is None else _rows_of(up))
        g, u = _halves(gate) if ctx.joined else (gate, up)
        y = _swiglu_fwd(g, u) if triton_path else torch.nn.functional.silu(g) * u
        out, w = cast_linear(y, weight, bias)
        ctx.save_for_backward(gate, up, w)
        ctx.triton_path = triton_path
        ctx.dtypes = weight.dtype, (bias.dtype if bias is not None else None)
        return out

    @staticmethod
    def backward(ctx, dout):
        gate, up, w = ctx.saved_tensors
        need = ctx.needs_input_grad
        g, u = _halves(gate) if ctx.joined else (gate, up)
        dout2 = dout.reshape(-1, w.shape[0])
        dy = (dout2 @ w).view(g.shape)
        if ctx.triton_path:
            dgu = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device) if ctx.joined else None
            dg, du, y = _swiglu_bwd(g, u, dy, store_y=need[2], dgu=dgu)
        else:
            dg, du, y = _swiglu_bwd_torch(g, u, dy, store_y=need[2])
            dgu = torch.cat([dg, du], -1) if ctx.joined else None
        del dy
        dw = weight_grad(dout2, y.reshape(-1, w.shape[1]), ctx.dtypes[0]) if need[2] else None
        db = bias_grad(dout2, ctx.dtypes[1]) if need[3] else None
        grads = (dgu, None) if ctx.joined else (dg, du)
        return *grads, dw, db, None


def _halves(gate_up: torch.Tensor):
    """Views of the gate and up halves of ``[..., 2I]``."""
    i = gate_up.shape[-1] // 2
    return gate_up[..., :i], gate_up[..., i:]


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
def swiglu_linear(gate: torch.Tensor, up: torch.Tensor | None, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(silu(gate) * up, weight, bias)``: SwiGLU's product and the projection after it,
    without keeping the product for the backward (module docstring).

    Args:
        gate, up: ``[..., I]``, as in ``swiglu``; or up None and gate ``[..., 2I]``, gate and up
            as its two halves (the one product of an MLP's two maps), read in place, their
            gradient one tensor of gate's shape, so the product takes it whole.
        weight: ``[O, I]``; cast to gate's dtype for the product (as autocast casts a weight),
            its gradient returned in its own dtype.
        bias: ``[O]`` or None, the same.

    Returns:
        ``[..., O]`` in gate's dtype; gradients flow to gate, up, weight and bias.
    """
    if up is None:
        check_dtype("gate", gate)
        if gate.dim() < 1 or gate.shape[-1] % 2:
            raise ValueError(f"gate with up None must be [..., 2I] (an even last dim), got {tuple(gate.shape)}")
        width = gate.shape[-1] // 2
    else:
        _check(gate, up)
        width = gate.shape[-1]
    check_projection("weight", weight, "bias", bias, width, "I, gate's last dim" + (" / 2" if up is None else ""), gate)
    triton_path = kernel_backend(gate) == "triton" and gate.dtype != torch.float64
    return _SwiGLULinear.apply(gate, up, weight, bias, triton_path)
