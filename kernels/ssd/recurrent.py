"""Recurrent (decoding) simple GLA and Mamba2 SSD: a few tokens against a state (the fused kernel of
``ttr.kernels.gla.recurrent`` with a scalar gate). Forward only."""

from __future__ import annotations

import torch

from ttr.kernels.gla.recurrent import recurrent_forward
from ttr.kernels.gla.reference import check_gla_inputs
from ttr.kernels.ssd.reference import check_ssd_inputs, skip, ssd_as_simple_gla
from ttr.kernels.utils import on_input_device


@on_input_device
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
    """Simple GLA token by token, for decoding (a few tokens against a state). Forward only.

    Args:
        q, k, v, g, scale, initial_state, output_final_state, cu_seqlens: as in
            ``chunk_simple_gla``.

    Returns:
        ``(o [B, T, H, V] in v's dtype, final_state [N, H, K, V] fp32 or None)``.
    """
    _, scale = check_gla_inputs(
        q, k, v, g, vector_gate=False, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens
    )
    return recurrent_forward(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens)


@on_input_device
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
    """Mamba2's SSD token by token, for decoding (a few tokens against a state). Forward only.

    Args:
        x, dt, A, B, C, D, initial_state, output_final_state, cu_seqlens: as in ``chunk_ssd``.

    Returns:
        ``(y [B, T, H, P] in x's dtype, final_state [N_seq, H, N, P] fp32 or None)``.
    """
    check_ssd_inputs(x, dt, A, B, C, initial_state=initial_state, cu_seqlens=cu_seqlens, D=D)
    q, k, v, g = ssd_as_simple_gla(x, dt, A, B, C)
    y, final = recurrent_forward(q, k, v, g, 1.0, initial_state, output_final_state, cu_seqlens)
    return skip(y, x, D), final
