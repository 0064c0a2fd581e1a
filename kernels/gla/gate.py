"""GLA's forget gate from its logits: ``g = max(logsigmoid(z) / normalizer, clamp_min)`` in fp32
(Yang et al. 2023, arXiv:2312.06635, Sec. 4.4: the gate's low-rank logits through a log-sigmoid
and divided by a temperature of 16; ``clamp_min`` optional), one elementwise Triton kernel in each
direction.

The gate is ``[B, T, H, K]``, as large as k. In torch ops the bf16 logits are cast to fp32, passed
through logsigmoid and divided (and clamped): 3 - 4 passes that each read and write fp32, and as
many backward. Here the forward reads the logits once and writes g; the backward reads the logits
and dg and writes the logits' gradient in their dtype (``sigmoid(-z) / normalizer``, zero where the
clamp holds, as torch's ``clamp_min`` gives it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttr.kernels.common.cumsum import logit_gate, logit_gate_args, logit_gate_grad
from ttr.kernels.common.index import cdiv
from ttr.kernels.utils import check_dtype, kernel_backend, on_input_device

BLOCK = 2048


@triton.jit
def _gate_fwd_kernel(z, g, N, inv_norm, clamp, CLAMP: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    tl.store(g + o, logit_gate(tl.load(z + o, mask=m, other=0.0).to(tl.float32), inv_norm, clamp, CLAMP), mask=m)


@triton.jit
def _gate_bwd_kernel(z, dg, dz, N, inv_norm, clamp, CLAMP: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    b_z = tl.load(z + o, mask=m, other=0.0).to(tl.float32)
    b_dz = logit_gate_grad(b_z, tl.load(dg + o, mask=m, other=0.0), inv_norm, clamp, CLAMP)
    tl.store(dz + o, b_dz.to(dz.dtype.element_ty), mask=m)


class _GLAGateTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, normalizer, clamp_min):
        z = z.contiguous()
        g = torch.empty(z.shape, dtype=torch.float32, device=z.device)
        n = z.numel()
        inv, clamp = logit_gate_args((normalizer, clamp_min))
        if n:
            _gate_fwd_kernel[(cdiv(n, BLOCK),)](z, g, n, inv, clamp, CLAMP=clamp_min is not None, BLOCK=BLOCK,
                                                       num_warps=8)
        ctx.save_for_backward(z)
        ctx.args = inv, clamp, clamp_min is not None
        return g

    @staticmethod
    def backward(ctx, dg):
        (z,) = ctx.saved_tensors
        inv, clamp, has_clamp = ctx.args
        dz = torch.empty_like(z)
        n = z.numel()
        if n:
            _gate_bwd_kernel[(cdiv(n, BLOCK),)](z, dg.contiguous(), dz, n, inv, clamp, CLAMP=has_clamp,
                                                       BLOCK=BLOCK, num_warps=8)
        return dz, None, None


def check_gate_args(normalizer: float, clamp_min: float | None, what: str = "") -> None:
    """The temperature a number > 0 and the floor None or a number < 0; ``what`` prefixes the names
    in the message."""
    for name, x, ok, need in (("normalizer", normalizer, lambda x: x > 0, "> 0"),
                              ("clamp_min", clamp_min, lambda x: x < 0, "< 0 (a log gate) or None")):
        if name == "clamp_min" and x is None:
            continue
        try:
            good = not isinstance(x, bool) and ok(float(x))
        except (TypeError, ValueError):
            good = False
        if not good:
            raise ValueError(f"{what}{name} must be a number {need}, got {x!r}")


def reference_gla_gate(z: torch.Tensor, normalizer: float = 16.0, clamp_min: float | None = None) -> torch.Tensor:
    """The torch expression: ``logsigmoid(z) / normalizer`` in fp32 (float64 stays float64),
    clamped below at ``clamp_min`` when given; differentiable by autograd."""
    g = torch.nn.functional.logsigmoid(z.to(torch.promote_types(z.dtype, torch.float32))) / normalizer
    return g.clamp_min(clamp_min) if clamp_min is not None else g


@on_input_device
def gla_gate(z: torch.Tensor, normalizer: float = 16.0, clamp_min: float | None = None) -> torch.Tensor:
    """GLA's log forget gate ``max(logsigmoid(z) / normalizer, clamp_min)`` (module docstring).

    Args:
        z: the gate's logits, any shape (fp32, fp16 or bf16; float64 takes the torch path).
        normalizer: the temperature, > 0.
        clamp_min: the gate's floor (< 0), or None.

    Returns:
        fp32 (float64 for float64 input), z's shape; the gradient flows to z in its dtype.
    """
    check_dtype("z", z)
    check_gate_args(normalizer, clamp_min)
    if kernel_backend(z) == "torch" or z.dtype == torch.float64:
        return reference_gla_gate(z, normalizer, clamp_min)
    return _GLAGateTriton.apply(z, float(normalizer), None if clamp_min is None else float(clamp_min))
