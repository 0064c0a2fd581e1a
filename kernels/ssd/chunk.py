"""Public chunkwise simple GLA and Mamba2 SSD: validation and backend dispatch."""

from __future__ import annotations

import torch

from ttr.kernels.gla.reference import check_gla_inputs, chunked
from ttr.kernels.ssd.reference import check_ssd_inputs, ssd_as_simple_gla
from ttr.kernels.utils import kernel_backend


def _simple_gla(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens):
    kernel_backend(q)
    return chunked(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens)


def chunk_simple_gla(
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
    """Linear attention with one log decay per head, chunkwise (training and prefill).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]`` (fp32, fp16 or bf16, one dtype).
        g: ``[B, T, H]`` log decay (fp32, <= 0).
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` fp32, N = B (or the number of packed sequences).
        output_final_state: also return the final states ``[N, H, K, V]`` fp32.
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of packed sequences (B must be 1).

    Returns:
        ``(o [B, T, H, V] in v's dtype, final_state or None)``.
    """
    _, scale = check_gla_inputs(
        q, k, v, g, vector_gate=False, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens
    )
    return _simple_gla(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens)


def chunk_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
):
    """Mamba2's state space duality (SSD) mixer, chunkwise: ``S_t = exp(dt_t A) S_{t-1} + B_t (dt_t x_t)^T``, ``y_t = S_t^T C_t``.

    Args:
        x: ``[B, T, H, P]`` (fp32, fp16 or bf16).
        dt: ``[B, T, H]`` fp32 step sizes, already ``softplus(dt + dt_bias)``.
        A: ``[H]`` fp32, negative.
        B, C: ``[B, T, G, N]`` in x's dtype, G groups shared by H / G consecutive heads.
        initial_state: ``[N_seq, H, N, P]`` fp32.
        output_final_state: also return the final states ``[N_seq, H, N, P]`` fp32.
        cu_seqlens: ``[N_seq + 1]`` offsets of packed sequences (batch must be 1).

    Returns:
        ``(y [B, T, H, P] in x's dtype, final_state or None)``. No D skip, no gating, no scale:
        those belong to the layer. Gradients flow to x, dt, A, B, C and initial_state.
    """
    check_ssd_inputs(x, dt, A, B, C, initial_state=initial_state, cu_seqlens=cu_seqlens)
    q, k, v, g = ssd_as_simple_gla(x, dt, A, B, C)
    return _simple_gla(q, k, v, g, 1.0, initial_state, output_final_state, cu_seqlens)
