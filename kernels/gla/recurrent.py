"""Recurrent (decoding) GLA: a few tokens against a state."""

from __future__ import annotations

import torch

from ttr.kernels.gla.reference import check_gla_inputs, recurrence


def recurrent_gla(
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
    """GLA token by token, for decoding; same arguments and result as ``chunk_gla``. Forward only."""
    _, scale = check_gla_inputs(
        q, k, v, g, vector_gate=True, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens
    )
    return recurrence(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens)
