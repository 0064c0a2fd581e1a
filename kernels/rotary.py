"""Rotary position embedding (RoPE, Su et al. 2021, arXiv:2104.09864), rotate-half layout: one
elementwise Triton kernel each way.

A head vector x of even size D is split into halves x1 = x[:D/2], x2 = x[D/2:]; with the angle
``a_i = pos * theta^(-2i/D)`` of position ``pos`` and frequency i::

    y1 = x1 cos a - x2 sin a
    y2 = x2 cos a + x1 sin a

a rotation of every pair (x1_i, x2_i). Its backward is the inverse rotation, the same kernel with
the sine negated, so nothing of x is kept for it.

The angles' cos and sin come in as tables (``rope_tables``: ``[P, T, D/2]`` fp32, P = 1 or B),
formed once per layer by torch for q and k together; both backends read the same tables, so they
rotate by the same angles. The kernel reads x once and writes y once (4 bytes per element in
bf16) in fp32 arithmetic; the same formula in torch ops (fp32 copy, negated half, concatenation,
two products and a sum, cast back) makes several passes over an fp32 copy of x each way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttr.kernels.common.index import cdiv, next_power_of_2
from ttr.kernels.utils import check_dtype, check_rank, kernel_backend, on_input_device

# Elements of x per program (32 rows of D = 128); not swept: at D = 128 the kernel already moves its
# bytes near the memory's rate (docs/benchmarks.md, the rope table)
ELEMS = 4096


@triton.jit
def _rotary_kernel(x, y, cos, sin, N, T, H, s_xb, s_xt, s_xh, s_pb, SIGN: tl.constexpr, HALF: tl.constexpr,
                   BH: tl.constexpr, BR: tl.constexpr):
    """Rows r of the output ``[N = B * T * H, 2 * HALF]`` (contiguous); x's rows at any strides."""
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = r < N
    tok = r // H
    h = r - tok * H
    b = tok // T
    t = tok - b * T
    o_c = tl.arange(0, BH)
    m = m_r[:, None] & (o_c < HALF)[None, :]
    p_tab = (b * s_pb + t)[:, None] * HALF + o_c[None, :]
    b_cos = tl.load(cos + p_tab, mask=m, other=0.0)
    b_sin = tl.load(sin + p_tab, mask=m, other=0.0) * SIGN
    p_x = x + (b * s_xb + t * s_xt + h * s_xh)[:, None] + o_c[None, :]
    b_x1 = tl.load(p_x, mask=m, other=0.0).to(tl.float32)
    b_x2 = tl.load(p_x + HALF, mask=m, other=0.0).to(tl.float32)
    p_y = y + r[:, None] * (2 * HALF) + o_c[None, :]
    tl.store(p_y, (b_x1 * b_cos - b_x2 * b_sin).to(y.dtype.element_ty), mask=m)
    tl.store(p_y + HALF, (b_x2 * b_cos + b_x1 * b_sin).to(y.dtype.element_ty), mask=m)


def _rotate_triton(x, cos, sin, sign: int):
    """x ``[B, T, H, D]`` (unit stride over D) rotated by the tables' angles times ``sign``:
    a contiguous tensor of x's shape and dtype."""
    b, t, h, d = x.shape
    if x.stride(3) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = b * t * h
    if n:
        half = d // 2
        bh = next_power_of_2(half)
        br = max(1, ELEMS // (2 * bh))
        _rotary_kernel[(cdiv(n, br),)](x, y, cos, sin, n, t, h, x.stride(0), x.stride(1), x.stride(2),
                                       0 if cos.shape[0] == 1 else t, SIGN=sign, HALF=half, BH=bh, BR=br,
                                       num_warps=4)
    return y


def _rotate_torch(x, cos, sin, sign: int):
    """``_rotate_triton`` in torch ops, in the tables' precision (fp32, or float64)."""
    xf = x.to(cos.dtype)
    x1, x2 = xf.chunk(2, dim=-1)
    c, s = cos[:, :, None], sign * sin[:, :, None]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).to(x.dtype)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, triton_path):
        ctx.save_for_backward(cos, sin)
        ctx.rotate = _rotate_triton if triton_path else _rotate_torch
        return ctx.rotate(x, cos, sin, 1)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return ctx.rotate(dy, cos, sin, -1), None, None, None


def rope_tables(position_ids: torch.Tensor, dim: int, theta: float, dtype: torch.dtype = torch.float32):
    """The cos and sin tables of the angles ``position_ids[..., None] * theta^(-2i/dim)``, i < dim / 2.

    Args:
        position_ids: ``[P, T]`` integers (P = 1: the same positions in every row).
        dim: the head dim D (even).
        theta: the base of the frequencies (``rope_theta``).
        dtype: fp32, or float64 for a float64 oracle.

    Returns:
        ``(cos, sin)``, each ``[P, T, dim/2]`` in ``dtype`` on position_ids' device.
    """
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2:
        raise ValueError("position_ids must be a [B, T] or [1, T] tensor")
    if position_ids.dtype.is_floating_point or position_ids.dtype.is_complex:
        raise TypeError(f"position_ids must hold integers, got {position_ids.dtype}")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2 or dim % 2:
        raise ValueError(f"dim must be a positive even int, got {dim!r}")
    if not theta > 0:
        raise ValueError(f"theta must be positive, got {theta!r}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=position_ids.device, dtype=dtype) / dim))
    angles = position_ids.to(dtype)[..., None] * inv_freq
    return angles.cos(), angles.sin()


def _check(x, cos, sin) -> None:
    check_rank("x", x, 4, "[B, T, H, D]")
    check_dtype("x", x)
    b, t, _, d = x.shape
    if d % 2:
        raise ValueError(f"x's head dim D must be even for the rotate-half layout, got D={d}")
    for name, tab in (("cos", cos), ("sin", sin)):
        check_rank(name, tab, 3, "[P, T, D/2]")
        if tab.shape[0] not in (1, b) or tuple(tab.shape[1:]) != (t, d // 2):
            raise ValueError(f"{name} must have shape [1 or B, T, D/2] = [1 or {b}, {t}, {d // 2}], "
                             f"got {tuple(tab.shape)}")
        if tab.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{name} must be float32 or float64 (rope_tables), got {tab.dtype}")
        if tab.device != x.device:
            raise ValueError(f"{name} is on {tab.device} but x is on {x.device}")
    if cos.shape != sin.shape or cos.dtype != sin.dtype:
        raise ValueError(f"cos and sin must match: {tuple(cos.shape)} {cos.dtype} against "
                         f"{tuple(sin.shape)} {sin.dtype}")


@on_input_device
def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Every head vector of x rotated by its position's angles (module docstring).

    Args:
        x: ``[B, T, H, D]``, D even (fp32, fp16 or bf16; float64 takes the torch path); any
            strides with unit stride over D.
        cos, sin: ``rope_tables(position_ids, D, theta)``, ``[1 or B, T, D/2]``, fp32 (float64
            with a float64 x for an oracle's precision).

    Returns:
        x's shape and dtype (contiguous); fp32 arithmetic (the tables' precision on the torch
        path); the gradient flows to x only.
    """
    _check(x, cos, sin)
    cos, sin = cos.detach().contiguous(), sin.detach().contiguous()
    triton_path = kernel_backend(x) == "triton" and x.dtype != torch.float64 and cos.dtype == torch.float32
    return _Rotary.apply(x, cos, sin, triton_path)


def reference_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Oracle: the rotation of each pair as a 2 x 2 matrix product.

    Args:
        x, cos, sin: as in ``rotary``.

    Returns:
        x's shape and dtype, computed in float64 for a float64 x (else fp32); differentiable.
    """
    _check(x, cos, sin)
    dt = torch.promote_types(x.dtype, torch.float32)
    c, s = cos.to(dt)[:, :, None], sin.to(dt)[:, :, None]
    rot = torch.stack([torch.stack([c, -s], -1), torch.stack([s, c], -1)], -2)  # [P, T, 1, D/2, 2, 2]
    pairs = torch.stack(x.to(dt).chunk(2, dim=-1), -1)  # [B, T, H, D/2, 2]: (x1_i, x2_i)
    out = (rot @ pairs[..., None])[..., 0]
    return torch.cat([out[..., 0], out[..., 1]], -1).to(x.dtype)
