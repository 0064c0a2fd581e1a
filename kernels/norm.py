"""RMSNorm, gated RMSNorm (the output norm of Mamba2 and Gated DeltaNet) and L2 normalisation
(DeltaNet's q/k normalisation).

Over the last dimension D of ``x [..., D]`` with fp32 statistics::

    rstd = 1 / sqrt(mean(x^2) + eps)
    rms_norm(x, w)          = x * rstd * w
    gated_rms_norm(x, z, w) = x * rstd * w * silu(z)      (norm before the gate: Gated DeltaNet, GLA)

``gated_rms_norm(..., norm_before_gate=False)`` gates first, ``u = x * silu(z)``, and normalises
``u``: ``u * rstd(u) * w``, the output norm of Mamba2 (arXiv:2405.21060, Sec. 7.3, mamba_ssm's
``norm_before_gate=False``). ``groups=G`` takes the statistics over each of G equal slices of D
(Mamba2 with ``n_groups > 1`` normalises per group of heads); the weight stays ``[D]``.

``l2_norm(x) = x / sqrt(sum(x^2) + eps)`` is ``rms_norm(x, w = 1/sqrt(D))`` with ``eps / D``, so it
runs through the same kernels (the constant weight's gradient is dropped).

Outputs have x's dtype (rms_norm: ``out_dtype`` when given). Backward, with ``u`` the normalised
input (x, or x * silu(z) when gating first), uhat = u * rstd and dy' the gradient reaching
``uhat * w`` (dy * silu(z) when the gate comes after the norm, else dy)::

    du = rstd * (w * dy' - uhat * mean(uhat * w * dy'))     (mean over the row's group)
    gate after:  dx = du,            dz = dy * uhat * w * silu'(z)
    gate first:  dx = du * silu(z),  dz = du * x * silu'(z)
    dw = sum over rows of dy' * uhat,     silu'(z) = sigmoid(z) * (1 + z * (1 - sigmoid(z)))

Only x, z and rstd are kept for the backward (``u`` is recomputed), and z is read in place when it
is a column slice of a wider tensor with unit stride over D (Mamba2's gate is a slice of its input
projection): a copy would be a second tensor of z's size kept alive until the backward.

The Triton kernels hold a block of rows x one group (about 4096 elements, so D up to 8192 is one
row per block and per-head norms of D = 128 take 32 rows); program axis 1 is the group. The
backward kernel walks a strided set of row blocks per program and writes one fp32 partial dw per
program, reduced with torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttr.kernels.common.index import cdiv, next_power_of_2, sm_count, tuned
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

MAX_D = 8192


def _launch(stage: str, bd: int) -> dict:
    """Launch parameters of ``norm_fwd`` / ``norm_bwd`` (``index.tuned``) for rows padded to
    ``bd``: ``BR`` rows per block, about ``ELEMS`` elements (so narrow rows, the per-head norms,
    share a block), ``num_warps`` (default one per 256 elements, at most 16), and for the backward
    ``SM_PROGS`` programs per SM walking the row blocks."""
    cfg = tuned(stage, ELEMS=4096, num_warps=None, SM_PROGS=2)
    br = max(1, cfg["ELEMS"] // bd)
    warps = cfg["num_warps"] or min(16, max(1, br * bd // 256))
    return dict(BR=br, num_warps=warps, SM_PROGS=cfg["SM_PROGS"])


@triton.jit
def _rms_norm_fwd_kernel(
    x, z, r, s, w, y, rstd, R, D, s_z, eps,
    HAS_Z: tl.constexpr, GATE_FIRST: tl.constexpr, HAS_RES: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
):
    """Rows of ``G * D`` elements (x, r, s, y contiguous; z's rows ``s_z`` apart), group
    ``program_id(1)`` of D elements; ``rstd`` is ``[R, G]``. With ``HAS_RES`` the normalised input
    is ``s = x + r``, stored in s's dtype and normalised as stored (what an add then a norm give)."""
    i_p, i_g, G = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    o_r = i_p * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m_r, m_d = o_r < R, o_d < D
    m_rd = m_r[:, None] & m_d[None, :]
    o_rd = o_r.to(tl.int64)[:, None] * (G * D) + i_g * D + o_d[None, :]  # [BR, BD]
    b_x = tl.load(x + o_rd, mask=m_rd, other=0.0).to(tl.float32)
    if HAS_RES:
        b_s = (b_x + tl.load(r + o_rd, mask=m_rd, other=0.0).to(tl.float32)).to(s.dtype.element_ty)
        tl.store(s + o_rd, b_s, mask=m_rd)
        b_x = b_s.to(tl.float32)
    if HAS_Z:
        o_z = o_r.to(tl.int64)[:, None] * s_z + i_g * D + o_d[None, :]
        b_z = tl.load(z + o_z, mask=m_rd, other=0.0).to(tl.float32)
        b_gate = b_z * tl.sigmoid(b_z)
        if GATE_FIRST:
            b_x = b_x * b_gate
    b_rstd = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) / D + eps)  # [BR]
    b_w = tl.load(w + i_g * D + o_d, mask=m_d, other=0.0).to(tl.float32)  # [BD]
    b_y = b_x * b_rstd[:, None] * b_w[None, :]
    if HAS_Z and not GATE_FIRST:
        b_y = b_y * b_gate
    tl.store(y + o_rd, b_y.to(y.dtype.element_ty), mask=m_rd)
    tl.store(rstd + o_r * G + i_g, b_rstd, mask=m_r)


@triton.jit
def _rms_norm_bwd_kernel(
    x, z, w, dy, rstd, ds, dx, dr, dz, dw, y, R, D, s_z, s_dz,
    HAS_Z: tl.constexpr, GATE_FIRST: tl.constexpr, HAS_DS: tl.constexpr, HAS_DR: tl.constexpr,
    HAS_Y: tl.constexpr, DZ_ROWS: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
):
    """Program (i_p, i_g) handles group i_g of row blocks i_p, i_p + P, ... (P programs on axis 0)
    and writes one dw partial of that group. ``HAS_DS`` adds the gradient ``ds`` that the
    normalised input gets from elsewhere (the residual stream) to dx; ``HAS_DR`` also stores dx in
    ``dr``'s dtype (the gradient of a lower-precision residual branch); ``HAS_Y`` stores the
    forward's output again (the same products in the same order), for ``norm_linear``. dz's rows
    come ``DZ_ROWS`` to a token (a per-head norm's heads), its tokens ``s_dz`` apart: a column block
    of a caller's gradient buffer (``DZ_ROWS = 1, s_dz = G * D`` where dz is dense)."""
    i_p, n_p = tl.program_id(0), tl.num_programs(0)
    i_g, G = tl.program_id(1), tl.num_programs(1)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_w = tl.load(w + i_g * D + o_d, mask=m_d, other=0.0).to(tl.float32)  # [BD]
    b_dw = tl.zeros([BR, BD], dtype=tl.float32)
    for i_blk in range(i_p, tl.cdiv(R, BR), n_p):
        o_r = i_blk * BR + tl.arange(0, BR)
        m_r = o_r < R
        m_rd = m_r[:, None] & m_d[None, :]
        o_rd = o_r.to(tl.int64)[:, None] * (G * D) + i_g * D + o_d[None, :]  # [BR, BD]
        b_x = tl.load(x + o_rd, mask=m_rd, other=0.0).to(tl.float32)
        b_dy = tl.load(dy + o_rd, mask=m_rd, other=0.0).to(tl.float32)
        b_rstd = tl.load(rstd + o_r * G + i_g, mask=m_r, other=0.0)  # [BR]
        if HAS_Z:
            o_z = o_r.to(tl.int64)[:, None] * s_z + i_g * D + o_d[None, :]
            b_z = tl.load(z + o_z, mask=m_rd, other=0.0).to(tl.float32)
            b_sig = tl.sigmoid(b_z)
            b_gate = b_z * b_sig
            b_dgate = b_sig * (1.0 + b_z * (1.0 - b_sig))  # silu'(z)
            o_dz = (o_r // DZ_ROWS).to(tl.int64)[:, None] * s_dz + (o_r % DZ_ROWS)[:, None] * (G * D) + i_g * D + \
                o_d[None, :]
        if HAS_Z and GATE_FIRST:
            b_uhat = b_x * b_gate * b_rstd[:, None]
        else:
            b_uhat = b_x * b_rstd[:, None]
        if HAS_Y:
            b_y = b_uhat * b_w[None, :]
            if HAS_Z and not GATE_FIRST:
                b_y = b_y * b_gate
            tl.store(y + o_rd, b_y.to(y.dtype.element_ty), mask=m_rd)
        if HAS_Z and not GATE_FIRST:
            tl.store(dz + o_dz, (b_dy * b_uhat * b_w[None, :] * b_dgate).to(dz.dtype.element_ty), mask=m_rd)
            b_dy = b_dy * b_gate
        b_dw += b_dy * b_uhat
        b_wdy = b_dy * b_w[None, :]
        b_c = tl.sum(b_wdy * b_uhat, axis=1) / D  # [BR]
        b_du = b_rstd[:, None] * (b_wdy - b_uhat * b_c[:, None])
        if HAS_Z and GATE_FIRST:
            tl.store(dz + o_dz, (b_du * b_x * b_dgate).to(dz.dtype.element_ty), mask=m_rd)
            b_du = b_du * b_gate
        if HAS_DS:
            b_du += tl.load(ds + o_rd, mask=m_rd, other=0.0).to(tl.float32)
        tl.store(dx + o_rd, b_du.to(dx.dtype.element_ty), mask=m_rd)
        if HAS_DR:
            tl.store(dr + o_rd, b_du.to(dr.dtype.element_ty), mask=m_rd)
    tl.store(dw + i_p * G * D + i_g * D + o_d, tl.sum(b_dw, axis=0), mask=m_d)


def _bwd_programs(blocks: int, device: torch.device, per_sm: int) -> int:
    if device.type == "cuda":
        return max(1, min(blocks, per_sm * sm_count(device)))
    return max(1, min(blocks, 4))


def _triton_fwd(x2, z2, w, eps, out_dtype=None, gate_first=False, groups=1, r2=None):
    """y and rstd; with ``r2`` (a residual branch) the norm is of ``s = x2 + r2``, returned third."""
    rows, d = x2.shape[0], x2.shape[1] // groups
    bd = next_power_of_2(d)
    cfg = _launch("norm_fwd", bd)
    y = torch.empty_like(x2, dtype=out_dtype or x2.dtype)
    rstd = torch.empty(rows, groups, dtype=torch.float32, device=x2.device)
    s2 = torch.empty_like(x2, dtype=torch.promote_types(x2.dtype, r2.dtype)) if r2 is not None else None
    if rows:
        _rms_norm_fwd_kernel[(cdiv(rows, cfg["BR"]), groups)](
            x2, z2 if z2 is not None else x2, r2 if r2 is not None else x2, s2 if s2 is not None else y,
            w, y, rstd, rows, d, z2.stride(0) if z2 is not None else 0, eps,
            HAS_Z=z2 is not None, GATE_FIRST=gate_first, HAS_RES=r2 is not None, BR=cfg["BR"], BD=bd,
            num_warps=cfg["num_warps"],
        )  # fmt: skip
    return y, rstd, s2


def _triton_bwd(x2, z2, w, dy2, rstd, gate_first=False, ds2=None, dr_dtype=None, store_y=False, dz_out=None):
    """dx, dz, dw, dr, y; ``ds2`` is added to dx, ``dr_dtype`` also returns dx in that dtype (dr),
    ``store_y`` the forward's output again in x's dtype (y; else None), ``dz_out = (dz, rows per
    token, token stride)`` where dz is written (``_dz_layout``)."""
    rows, groups = rstd.shape
    d = x2.shape[1] // groups
    bd = next_power_of_2(d)
    cfg = _launch("norm_bwd", bd)
    dx = torch.empty_like(x2)
    dr = torch.empty_like(x2, dtype=dr_dtype) if dr_dtype is not None else None
    dz = torch.empty(z2.shape, dtype=z2.dtype, device=z2.device) if z2 is not None and dz_out is None else None
    dz, dz_rows, s_dz = dz_out if dz_out is not None else (dz, 1, x2.shape[1])
    progs = _bwd_programs(cdiv(rows, cfg["BR"]), x2.device, cfg["SM_PROGS"])
    dw = torch.zeros(progs, groups * d, dtype=torch.float32, device=x2.device)
    y = torch.empty_like(x2) if store_y else None
    if rows:
        _rms_norm_bwd_kernel[(progs, groups)](
            x2, z2 if z2 is not None else x2, w, dy2, rstd, ds2 if ds2 is not None else dx, dx,
            dr if dr is not None else dx, dz if dz is not None else dx, dw, y if store_y else dx,
            rows, d, z2.stride(0) if z2 is not None else 0, s_dz,
            HAS_Z=z2 is not None, GATE_FIRST=gate_first, HAS_DS=ds2 is not None, HAS_DR=dr is not None,
            HAS_Y=store_y, DZ_ROWS=dz_rows, BR=cfg["BR"], BD=bd, num_warps=cfg["num_warps"],
        )  # fmt: skip
    return dx, dz, dw.sum(0).to(w.dtype), dr, y


def _rows(t: torch.Tensor, d: int) -> torch.Tensor:
    """``t [..., d]`` as ``[rows, d]`` with unit stride over d, a view where one exists."""
    t2 = t.reshape(-1, d)
    return t2 if t2.stride(1) == 1 or d == 1 else t2.contiguous()


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, z, weight, eps, out_dtype=None, norm_before_gate=True, groups=1):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        z2 = _rows(z, shape[-1]) if z is not None else None
        w = weight.contiguous()
        gate_first = z is not None and not norm_before_gate
        y, rstd, _ = _triton_fwd(x2, z2, w, eps, out_dtype, gate_first, groups)
        ctx.save_for_backward(x2, z2, w, rstd)
        ctx.shape, ctx.gate_first = shape, gate_first
        return y.reshape(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, z2, w, rstd = ctx.saved_tensors
        dy2 = dy.reshape(x2.shape).contiguous()
        dx, dz, dw, _, _ = _triton_bwd(x2, z2, w, dy2, rstd, ctx.gate_first)
        dz = dz.reshape(ctx.shape) if dz is not None else None
        return dx.reshape(ctx.shape), dz, dw, None, None, None, None


class _ResidualRMSNormFunction(torch.autograd.Function):
    """``s = h + branch``, ``y = rms_norm(s)``; the backward adds the residual stream's gradient
    ``ds`` to the norm's and writes it once per dtype (h's and the branch's)."""

    @staticmethod
    def forward(ctx, h, branch, weight, eps, out_dtype=None):
        shape = h.shape
        h2 = h.reshape(-1, shape[-1]).contiguous()
        r2 = branch.reshape(h2.shape).contiguous()
        w = weight.contiguous()
        y, rstd, s2 = _triton_fwd(h2, None, w, eps, out_dtype, r2=r2)
        ctx.save_for_backward(s2, w, rstd)
        ctx.shape, ctx.dtypes = shape, (h.dtype, branch.dtype)
        ctx.set_materialize_grads(False)
        return s2.reshape(shape), y.reshape(shape)

    @staticmethod
    def backward(ctx, ds, dy):
        s2, w, rstd = ctx.saved_tensors
        h_dtype, branch_dtype = ctx.dtypes
        ds2 = ds.reshape(s2.shape).contiguous() if ds is not None else None
        if dy is None:  # only the sum was used
            dx, dw, dr = ds2, None, None
            if dx is None:
                return None, None, None, None, None
        else:
            dy2 = dy.reshape(s2.shape).contiguous()
            other = branch_dtype if branch_dtype != s2.dtype else None
            dx, _, dw, dr, _ = _triton_bwd(s2, None, w, dy2, rstd, ds2=ds2, dr_dtype=other)
        dr = dr if dr is not None else dx.to(branch_dtype)
        return dx.to(h_dtype).reshape(ctx.shape), dr.reshape(ctx.shape), dw, None, None


class _NormLinearFunction(torch.autograd.Function):
    """``F.linear(norm(x[, z]), proj_weight, proj_bias)`` (``norm_linear``) on rows of x; the
    projection's weight and bias are cast to x's dtype inside, their gradients returned in their
    own dtypes (``weight_grad``). Saves what the norm alone saves and the cast weight: the norm's
    output, the projection's input, is written again by the norm's backward kernel."""

    @staticmethod
    def forward(ctx, x2, z, weight, eps, gate_first, groups, proj_weight, proj_bias, dz_into):
        # z in its own shape, so that its gradient goes back in it (a caller's buffer as well)
        z2 = _rows(z, x2.shape[1]) if z is not None else None
        ctx.z_shape = z.shape if z is not None else None
        y, rstd, _ = _triton_fwd(x2, z2, weight, eps, None, gate_first, groups)
        out, pw = cast_linear(y.view(-1, proj_weight.shape[1]), proj_weight, proj_bias)
        ctx.save_for_backward(x2, z2, weight, rstd, pw)
        ctx.gate_first, ctx.dz_into = gate_first, dz_into
        ctx.dtypes = proj_weight.dtype, (proj_bias.dtype if proj_bias is not None else None)
        return out

    @staticmethod
    def backward(ctx, dout):
        x2, z2, w, rstd, pw = ctx.saved_tensors
        need = ctx.needs_input_grad
        dout = dout.contiguous()
        dy = (dout @ pw).view(x2.shape)
        dz_out = ctx.dz_into() if ctx.dz_into is not None and need[1] else None
        dx, dz, dw, _, y = _triton_bwd(x2, z2, w, dy, rstd, ctx.gate_first, store_y=need[6],
                                       dz_out=dz_out)
        del dy
        dpw = weight_grad(dout, y.view(-1, pw.shape[1]), ctx.dtypes[0]) if need[6] else None
        dpb = bias_grad(dout, ctx.dtypes[1]) if need[7] else None
        dz = dz_out[0] if dz_out is not None else dz.view(ctx.z_shape) if dz is not None else None
        return dx, dz, dw, None, None, None, dpw, dpb, None


def _check(x, z, weight, eps, out_dtype=None, groups=1, norm_before_gate=True) -> None:
    check_dtype("x", x)
    if not isinstance(norm_before_gate, bool):
        raise TypeError(f"norm_before_gate must be a bool, got {type(norm_before_gate).__name__}")
    if out_dtype is not None and out_dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        raise TypeError(f"out_dtype must be a floating dtype, got {out_dtype!r}")
    check_dtype("weight", weight)
    if x.dim() < 1:
        raise ValueError("x must have at least 1 dim [..., D]")
    d = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != d:
        raise ValueError(f"weight must have shape [D] = [{d}], got {tuple(weight.shape)}")
    if d > MAX_D:
        raise ValueError(f"x last dim D={d} exceeds the supported maximum {MAX_D}")
    if z is not None:
        check_dtype("z", z)
        if z.shape != x.shape:
            raise ValueError(f"z must have x's shape {tuple(x.shape)}, got {tuple(z.shape)}")
    if not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or d % groups:
        raise ValueError(f"groups must be a positive integer dividing x's last dim D={d}, got {groups!r}")
    for name, other in (("weight", weight), ("z", z)):
        if other is not None and other.device != x.device:
            raise ValueError(f"{name} is on {other.device} but x is on {x.device}")


def _torch_norm(x, z, weight, eps, out_dtype=None, norm_before_gate=True, groups=1):
    """Autograd through plain torch ops, fp32 (fp64 for fp64 inputs) statistics."""
    dt = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(dt)
    if z is not None and not norm_before_gate:
        xf = xf * torch.nn.functional.silu(z.to(dt))
    if groups == 1:
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(dt)
    else:
        xg = xf.unflatten(-1, (groups, -1))
        y = (xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2) * weight.to(dt)
    if z is not None and norm_before_gate:
        y = y * torch.nn.functional.silu(z.to(dt))
    return y.to(out_dtype or x.dtype)


def reference_rms_norm(x, weight, *, eps=1e-6):
    """Oracle: the formula in x's dtype promoted to fp32.

    Args:
        x, weight, eps: as in ``rms_norm``.

    Returns:
        ``[..., D]`` in x's dtype; differentiable.
    """
    _check(x, None, weight, eps)
    dt = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(dt)
    return (xf / torch.sqrt((xf * xf).sum(-1, keepdim=True) / x.shape[-1] + eps) * weight.to(dt)).to(x.dtype)


def reference_residual_rms_norm(h, branch, weight, *, eps=1e-6):
    """Oracle: ``s = h + branch`` and ``reference_rms_norm(s)``, in h's dtype promoted to fp32.

    Args:
        h, branch, weight, eps: as in ``residual_rms_norm``.

    Returns:
        ``(s, y)``, ``[..., D]`` in ``promote_types(h.dtype, branch.dtype)``; differentiable.
    """
    _check_branch(h, branch)
    dt = torch.promote_types(h.dtype, torch.float32)
    s = (h.to(dt) + branch.to(dt)).to(torch.promote_types(h.dtype, branch.dtype))
    return s, reference_rms_norm(s, weight, eps=eps)


def reference_gated_rms_norm(x, z, weight, *, eps=1e-6, norm_before_gate=True, groups=1):
    """Oracle: ``rms_norm(x) * weight * z * sigmoid(z)`` (or ``rms_norm(x * z * sigmoid(z)) *
    weight`` without ``norm_before_gate``), statistics per group, in x's dtype promoted to fp32.

    Args:
        x, z, weight, eps, norm_before_gate, groups: as in ``gated_rms_norm``.

    Returns:
        ``[..., D]`` in x's dtype; differentiable.
    """
    _check(x, z, weight, eps, groups=groups)
    dt = torch.promote_types(x.dtype, torch.float32)
    xf, zf = x.to(dt), z.to(dt)
    gate = zf * torch.sigmoid(zf)
    u = xf if norm_before_gate else xf * gate
    ug = u.reshape(*u.shape[:-1], groups, u.shape[-1] // groups)
    normed = (ug / torch.sqrt((ug * ug).sum(-1, keepdim=True) / ug.shape[-1] + eps)).reshape(u.shape) * weight.to(dt)
    return (normed * gate if norm_before_gate else normed).to(x.dtype)


def reference_l2_norm(x, *, eps=1e-6):
    """Oracle: ``x / sqrt(sum(x^2) + eps)`` over the last dim, in x's dtype promoted to fp32.

    Args:
        x, eps: as in ``l2_norm``.

    Returns:
        ``[..., D]`` in x's dtype; differentiable.
    """
    check_dtype("x", x)
    dt = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(dt)
    return (xf / torch.sqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


@on_input_device
def l2_norm(x, *, eps=1e-6):
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (DeltaNet's q/k normalisation).

    Args:
        x: ``[..., D]`` (fp32, fp16 or bf16; float64 on the torch backend).
        eps: added to the sum of squares.

    Returns:
        ``[..., D]`` in x's dtype; gradients flow to x.
    """
    check_dtype("x", x)
    if x.dim() < 1:
        raise ValueError("x must have at least 1 dim [..., D]")
    d = x.shape[-1]
    weight = torch.full((d,), d ** -0.5, dtype=torch.float32, device=x.device)
    _check(x, None, weight, eps)
    if kernel_backend(x) == "torch":
        return _torch_norm(x, None, weight, eps / d)
    return _RMSNormFunction.apply(x, None, weight, float(eps) / d)


@on_input_device
def rms_norm(x, weight, *, eps=1e-6, out_dtype=None):
    """RMSNorm over the last dim: ``x / sqrt(mean(x^2) + eps) * weight``, fp32 statistics.

    Args:
        x: ``[..., D]`` (fp32, fp16 or bf16; float64 on the torch backend).
        weight: ``[D]``.
        eps: added to the mean square.
        out_dtype: the output's dtype (default x's). A pre-norm before bf16 projections asks for
            bf16 here: one cast inside the kernel instead of one fp32 -> bf16 copy per projection
            (and an fp32 gradient per projection).

    Returns:
        ``[..., D]`` in ``out_dtype``; gradients flow to x and weight.
    """
    _check(x, None, weight, eps, out_dtype)
    if kernel_backend(x) == "torch":
        return _torch_norm(x, None, weight, eps, out_dtype)
    return _RMSNormFunction.apply(x, None, weight, float(eps), out_dtype)


def _check_branch(h, branch) -> None:
    check_dtype("h", h)
    check_like("branch", branch, "h", h)


@on_input_device
def residual_rms_norm(h, branch, weight, *, eps=1e-6, out_dtype=None):
    """A pre-norm block's residual add and the next norm in one pass: ``s = h + branch`` and
    ``rms_norm(s, weight)``.

    Apart, the add reads h and the branch and writes s, and the norm reads s again; in the backward
    the norm's input gradient is written, read back and added to the residual stream's, then cast
    to the branch's dtype. Here each direction is one kernel. The sum is rounded to its dtype
    before it is normalised, so both outputs equal the add followed by ``rms_norm``.

    Args:
        h: the residual stream ``[..., D]`` (fp32, fp16 or bf16; float64 on the torch backend).
        branch: the block's output added to it, h's shape (may be of a lower precision: a bf16
            projection's output on an fp32 stream).
        weight: ``[D]``.
        eps: added to the mean square.
        out_dtype: the normalised output's dtype (default: the sum's), as in ``rms_norm``.

    Returns:
        ``(s, y)``: the new residual stream in ``promote_types(h.dtype, branch.dtype)`` and its
        norm; gradients flow to h, branch and weight.
    """
    _check_branch(h, branch)
    _check(h, None, weight, eps, out_dtype)
    if kernel_backend(h) == "torch":
        s = h + branch
        return s, _torch_norm(s, None, weight, eps, out_dtype)
    return _ResidualRMSNormFunction.apply(h, branch, weight, float(eps), out_dtype)


@on_input_device
def gated_rms_norm(x, z, weight, *, eps=1e-6, norm_before_gate=True, groups=1):
    """``rms_norm(x) * weight * silu(z)`` over the last dim (the output gate of Gated DeltaNet), or
    ``rms_norm(x * silu(z)) * weight`` (Mamba2's output norm, ``norm_before_gate=False``).

    Args:
        x: ``[..., D]`` (fp32, fp16 or bf16; float64 on the torch backend).
        z: the gate, x's shape; may be a column slice of a wider tensor (unit stride over the
            last dim): it is read in place.
        weight: ``[D]``.
        eps: added to the mean square.
        norm_before_gate: normalise x, then gate (True), or gate, then normalise (False).
        groups: statistics over each of ``groups`` equal slices of the last dim.

    Returns:
        ``[..., D]`` in x's dtype; gradients flow to x, z and weight.
    """
    _check(x, z, weight, eps, groups=groups, norm_before_gate=norm_before_gate)
    if kernel_backend(x) == "torch":
        return _torch_norm(x, z, weight, eps, None, norm_before_gate, groups)
    return _RMSNormFunction.apply(x, z, weight, float(eps), None, norm_before_gate, groups)


def _dz_layout(dz: torch.Tensor, shape, dtype, heads: bool) -> tuple[torch.Tensor, int, int]:
    """``(dz, rows per token, token stride)`` of a caller's buffer for z's gradient: z's shape and
    dtype, each token's rows (its heads, with ``heads``) dense, the tokens evenly spaced (a column
    block of a wider buffer is one)."""
    if tuple(dz.shape) != tuple(shape) or dz.dtype != dtype:
        raise ValueError(f"dz_into must give z's shape {tuple(shape)} and dtype {dtype}, got "
                         f"{tuple(dz.shape)} {dz.dtype}")
    d, per = shape[-1], shape[-2] if heads else 1
    try:
        t = dz.view(-1, per, d)
    except RuntimeError:
        t = None
    if t is None or t.stride(2) != 1 or (per > 1 and t.stride(1) != d):
        raise ValueError(f"dz_into must give dense rows of {d} channels{' per head' if heads else ''} with evenly "
                         f"spaced tokens, got strides {dz.stride()}")
    return dz, per, t.stride(0)


@on_input_device
def norm_linear(x, z, weight, proj_weight, proj_bias=None, *, eps=1e-6, norm_before_gate=True, groups=1,
                heads=False, dz_into=None):
    """A layer's output norm and the projection after it in one autograd node: ``F.linear(y,
    proj_weight, proj_bias)`` with ``y = gated_rms_norm(x, z, weight, ...)`` (``rms_norm`` when z is
    None) and, for per-head norms (``heads``), y's last two dims merged.

    Kept for the backward are what the norm keeps (x, z, its statistics) and the cast weight, not
    y: the norm's backward kernel writes y again (the forward's products, in its order) for the
    projection's weight gradient, one write where keeping y held a ``[tokens, F]`` tensor per
    layer until the backward.

    Args:
        x: ``[..., D]``, or with ``heads`` ``[..., H, D]`` (per-head norms, the heads merged for
            the projection); fp32, fp16 or bf16 (float64 on the torch backend).
        z: the gate, x's shape, or None (no gate).
        weight: the norm's ``[D]``.
        proj_weight: ``[O, F]`` with F = D (or H * D with ``heads``); cast to x's dtype for the
            product (as autocast casts a weight), its gradient returned in its own dtype.
        proj_bias: ``[O]`` or None, the same.
        eps, norm_before_gate, groups: as in ``gated_rms_norm``.
        heads: x's last two dims are heads and their channels (above).
        dz_into: with a gate, a callable giving the tensor the backward writes z's gradient into
            (z's shape and dtype, dense rows with evenly spaced tokens: a column block of a caller's
            gradient buffer), called once in the backward; None for a new tensor.

    Returns:
        ``[..., O]`` (x's dims before D, or before H and D) in x's dtype; gradients flow to x, z,
        weight, proj_weight and proj_bias.
    """
    _check(x, z, weight, eps, groups=groups, norm_before_gate=norm_before_gate)
    if heads and x.dim() < 2:
        raise ValueError(f"x must have shape [..., H, D] with heads=True, got {tuple(x.shape)}")
    d = x.shape[-1]
    f = x.shape[-2] * d if heads else d
    check_projection("proj_weight", proj_weight, "proj_bias", proj_bias, f,
                     f"{'H * D' if heads else 'D'} of x {tuple(x.shape)}", x)
    lead = x.shape[:-2] if heads else x.shape[:-1]
    if kernel_backend(x) == "torch":
        y = _torch_norm(x, z, weight, eps, None, norm_before_gate, groups).reshape(*lead, f)
        return cast_linear(y, proj_weight, proj_bias)[0]
    x2 = x.reshape(-1, d).contiguous()
    into = None
    if dz_into is not None and z is not None:
        # z's shape, not z: the node keeps this until the graph goes, and z only until its backward
        shape, dtype = z.shape, z.dtype

        def into():
            return _dz_layout(dz_into(), shape, dtype, heads)
    out = _NormLinearFunction.apply(x2, z, weight.contiguous(), float(eps), z is not None and not norm_before_gate,
                                    groups, proj_weight, proj_bias, into)
    return out.view(*lead, proj_weight.shape[0])
