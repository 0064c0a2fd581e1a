"""Gated DeltaNet's per-head gates from their projections, one Triton kernel in each direction::

    g    = -exp(A_log) * softplus(a + dt_bias)     (the log decay, fp32, <= 0)
    beta = beta_scale * sigmoid(b)                 (fp32; beta_scale 2 allows negative eigenvalues)

a and b are ``[..., H]`` (a view of a wider product is read in place), A_log and dt_bias ``[H]``.
In torch ops these are about 8 kernels forward and 10 backward on ``[tokens, H]`` tensors (casts,
the sum, softplus, the product, sigmoid, their backwards and the two per-head sums), each moving
a few MB in a few microseconds, so a layer's gates cost launches, not bandwidth. Here the forward
reads a and b once and writes g and beta; the backward reads a, b, dg and dbeta, writes da and db
in their dtypes, and each program's per-head sums of ``dA_log`` and ``ddt_bias``, which one torch
sum reduces.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttr.kernels.common.cumsum import log_sigmoid
from ttr.kernels.common.index import cdiv, next_power_of_2
from ttr.kernels.utils import check_dtype, check_like, kernel_backend, on_input_device

BLOCK_ROWS = 256


@triton.jit
def _load(a, b, A_log, dt_bias, M, stride_a, stride_b, H: tl.constexpr, BH: tl.constexpr, BM: tl.constexpr):
    """A program's rows: ``(A = -exp(A_log), z = a + dt_bias, b, the mask, the [rows, H] offsets)``,
    fp32."""
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    cols = tl.arange(0, BH)
    m = (rows < M)[:, None] & (cols < H)[None, :]
    b_A = -tl.exp(tl.load(A_log + cols, mask=cols < H, other=0.0).to(tl.float32))
    b_dt = tl.load(dt_bias + cols, mask=cols < H, other=0.0).to(tl.float32)
    b_z = tl.load(a + rows[:, None] * stride_a + cols[None, :], mask=m, other=0.0).to(tl.float32) + b_dt[None, :]
    b_b = tl.load(b + rows[:, None] * stride_b + cols[None, :], mask=m, other=0.0).to(tl.float32)
    return b_A, b_z, b_b, m, rows[:, None] * H + cols[None, :]


@triton.jit
def _gate_fwd_kernel(a, b, A_log, dt_bias, g, beta, M, stride_a, stride_b, beta_scale, H: tl.constexpr,
                     BH: tl.constexpr, BM: tl.constexpr):
    b_A, b_z, b_b, m, o = _load(a, b, A_log, dt_bias, M, stride_a, stride_b, H, BH, BM)
    tl.store(g + o, -log_sigmoid(-b_z) * b_A[None, :], mask=m)  # softplus(z) = -logsigmoid(-z)
    tl.store(beta + o, beta_scale * tl.sigmoid(b_b), mask=m)


@triton.jit
def _gate_bwd_kernel(a, b, A_log, dt_bias, dg, dbeta, da, db, dA_part, ddt_part, M, stride_a, stride_b, beta_scale,
                     H: tl.constexpr, BH: tl.constexpr, BM: tl.constexpr):
    b_A, b_z, b_b, m, o = _load(a, b, A_log, dt_bias, M, stride_a, stride_b, H, BH, BM)
    b_dg = tl.load(dg + o, mask=m, other=0.0)
    b_dbeta = tl.load(dbeta + o, mask=m, other=0.0)
    # g = A softplus(z): dg/dz = A sigmoid(z), and dg/dA_log = g (A = -exp(A_log))
    b_dz = b_dg * b_A[None, :] * tl.sigmoid(b_z)
    b_dA = b_dg * (-log_sigmoid(-b_z) * b_A[None, :])
    s = tl.sigmoid(b_b)
    tl.store(da + o, b_dz.to(da.dtype.element_ty), mask=m)
    tl.store(db + o, (b_dbeta * beta_scale * s * (1.0 - s)).to(db.dtype.element_ty), mask=m)
    # per-head sums of this program's rows (masked rows hold 0); one torch sum adds the programs'
    cols = tl.arange(0, BH)
    tl.store(dA_part + tl.program_id(0) * BH + cols, tl.sum(tl.where(m, b_dA, 0.0), 0))
    tl.store(ddt_part + tl.program_id(0) * BH + cols, tl.sum(tl.where(m, b_dz, 0.0), 0))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as ``[rows, H]`` with a unit last stride, viewed in place where its layout allows."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


class _GatedDeltaGateTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, A_log, dt_bias, beta_scale):
        a2, b2 = _rows(a), _rows(b)
        M, H = a2.shape
        g = torch.empty(a.shape, dtype=torch.float32, device=a.device)
        beta = torch.empty(a.shape, dtype=torch.float32, device=a.device)
        BH = max(16, next_power_of_2(H))
        if M:
            _gate_fwd_kernel[(cdiv(M, BLOCK_ROWS),)](a2, b2, A_log, dt_bias, g, beta, M, a2.stride(0),
                                                            b2.stride(0), beta_scale, H=H, BH=BH, BM=BLOCK_ROWS)
        ctx.save_for_backward(a2, b2, A_log, dt_bias)
        ctx.shapes = a.shape, b.shape
        ctx.beta_scale = beta_scale
        return g, beta

    @staticmethod
    def backward(ctx, dg, dbeta):
        a2, b2, A_log, dt_bias = ctx.saved_tensors
        M, H = a2.shape
        BH = max(16, next_power_of_2(H))
        n = cdiv(M, BLOCK_ROWS)
        da, db = torch.empty(M, H, dtype=a2.dtype, device=a2.device), torch.empty(M, H, dtype=b2.dtype, device=b2.device)
        parts = torch.zeros(2, max(n, 1), BH, dtype=torch.float32, device=a2.device)
        if M:
            _gate_bwd_kernel[(n,)](a2, b2, A_log, dt_bias, dg.contiguous(), dbeta.contiguous(), da, db, parts[0],
                                   parts[1], M, a2.stride(0), b2.stride(0), ctx.beta_scale, H=H, BH=BH, BM=BLOCK_ROWS)
        sums = parts.sum(1)[:, :H]
        return (da.view(ctx.shapes[0]), db.view(ctx.shapes[1]), sums[0].to(A_log.dtype), sums[1].to(dt_bias.dtype),
                None)


def reference_gated_delta_gate(a, b, A_log, dt_bias, beta_scale: float = 1.0):
    """The torch expression in fp32 (float64 stays float64); differentiable by autograd."""
    dt = torch.promote_types(a.dtype, torch.float32)
    g = -A_log.to(dt).exp() * torch.nn.functional.softplus(a.to(dt) + dt_bias.to(dt))
    return g, beta_scale * torch.sigmoid(b.to(dt))


@on_input_device
def gated_delta_gate(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                     beta_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's ``(g, beta)`` from its gate projections (module docstring).

    Args:
        a: ``[..., H]`` decay projection (fp32, fp16 or bf16; float64 takes the torch path).
        b: a's shape and device, any of those dtypes: the beta projection.
        A_log, dt_bias: ``[H]``, on a's device.
        beta_scale: 1, or 2 to let beta reach 2 (negative eigenvalues).

    Returns:
        ``(g, beta)``, a's shape, fp32 (float64 for float64 a); gradients flow to every input.
    """
    check_dtype("a", a)
    if a.ndim == 0:
        raise ValueError("a must be [..., H], got a scalar")
    check_like("b", b, "a", a)
    for name, p in (("A_log", A_log), ("dt_bias", dt_bias)):
        check_dtype(name, p)
        if p.shape != a.shape[-1:] or p.device != a.device:
            raise ValueError(f"{name} must be [{a.shape[-1]}] on {a.device} (a's heads), got {tuple(p.shape)} "
                             f"on {p.device}")
    if kernel_backend(a) == "torch" or torch.float64 in (a.dtype, b.dtype, A_log.dtype, dt_bias.dtype):
        return reference_gated_delta_gate(a, b, A_log, dt_bias, beta_scale)
    return _GatedDeltaGateTriton.apply(a, b, A_log, dt_bias, float(beta_scale))
