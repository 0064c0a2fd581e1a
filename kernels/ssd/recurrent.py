"""Recurrent (decoding) simple GLA and Mamba2 SSD: a few tokens against a state (the fused kernel of
``ttr.kernels.gla.recurrent`` with a scalar gate). Forward only."""

from __future__ import annotations

import torch

from ttr.kernels.gla.recurrent import recurrent_forward
from ttr.kernels.gla.reference import check_gla_inputs
from ttr.kernels.ssd.reference import check_ssd_inputs, skip, ssd_as_simple_gla


def recurrent_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
):
    """Simple GLA token by token, for decoding; same arguments and result as ``chunk_simple_gla``."""
    _, scale = check_gla_inputs(
        q, k, v, g, vector_gate=False, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens
    )
    return recurrent_forward(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens)


def recurrent_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
):
    """Mamba2 SSD token by token, for decoding; same arguments and result as ``chunk_ssd``."""
    check_ssd_inputs(x, dt, A, B, C, initial_state=initial_state, cu_seqlens=cu_seqlens, D=D)
    q, k, v, g = ssd_as_simple_gla(x, dt, A, B, C)
    y, final = recurrent_forward(q, k, v, g, 1.0, initial_state, output_final_state, cu_seqlens)
    return skip(y, x, D), final
