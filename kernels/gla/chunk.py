"""Public chunkwise GLA (``chunk_gla``): validation and backend dispatch."""

from __future__ import annotations

import torch

from ttr.kernels.gla.reference import check_gla_inputs, chunked
from ttr.kernels.utils import kernel_backend


def chunk_gla(
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
    """Gated linear attention, chunkwise (training and prefill).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]`` (fp32, fp16 or bf16, one dtype).
        g: ``[B, T, H, K]`` log gate (fp32, <= 0), the per-key decay ``exp(g)``.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` fp32, N = B (or the number of packed sequences).
        output_final_state: also return the final states ``[N, H, K, V]`` fp32.
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of packed sequences (B must be 1).

    Returns:
        ``(o [B, T, H, V] in v's dtype, final_state or None)``.
    """
    _, scale = check_gla_inputs(
        q, k, v, g, vector_gate=True, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens
    )
    kernel_backend(q)
    return chunked(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens)
