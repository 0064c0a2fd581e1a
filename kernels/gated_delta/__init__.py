"""Gated DeltaNet (Yang, Kautz, Hatamizadeh 2025, "Gated Delta Networks: Improving Mamba2 with Delta Rule").

``S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T`` with ``a_t = exp(g_t)``,
``o_t = S_t^T q_t * scale``. g ``[B, T, H]`` is the log decay (fp32, <= 0); everything else as in
``ttr.kernels.delta``. Returns ``(o, final_state or None)``.

- ``chunk_gated_delta_rule``: training / prefill (Triton on CUDA, chunked torch on CPU).
- ``recurrent_gated_delta_rule``: decoding, a fused Triton step kernel.
- ``reference_gated_delta_rule``: the per-token torch recurrence (the float64 oracle).
"""

from __future__ import annotations

from ttr.kernels.common.torch_chunk import chunk_torch
from ttr.kernels.delta.api import check_triton_dtype, validate
from ttr.kernels.delta.chunk import ChunkDeltaRuleFunction
from ttr.kernels.delta.recurrent import recurrent_delta_triton
from ttr.kernels.delta.reference import delta_reference_core
from ttr.kernels.utils import kernel_backend, on_input_device

__all__ = ["chunk_gated_delta_rule", "recurrent_gated_delta_rule", "reference_gated_delta_rule"]


@on_input_device
def chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None):
    """The gated delta rule, chunkwise (training and prefill).

    Args:
        q, k, v, beta, scale, initial_state, output_final_state, cu_seqlens: as in
            ``ttr.kernels.delta.chunk_delta_rule``.
        g: ``[B, T, H]`` fp32 log decay (<= 0): the state is multiplied by ``exp(g_t)`` before
            token t's update.

    Returns:
        ``(o, final_state)``: o ``[B, T, H, V]`` in v's dtype; final_state ``[N, H, K, V]`` fp32, or
        None without ``output_final_state``. Gradients flow to q, k, v, g, beta and initial_state.
    """
    scale = validate(q, k, v, g, beta, scale, initial_state, cu_seqlens, gated=True)
    if kernel_backend(q) == "torch":
        return chunk_torch(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    check_triton_dtype(q)
    return ChunkDeltaRuleFunction.apply(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)


@on_input_device
def recurrent_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None):
    """The gated delta rule token by token, for decoding (a few tokens against a state). Forward only.

    Args:
        q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens: as in
            ``chunk_gated_delta_rule``.

    Returns:
        ``(o [B, T, H, V] in v's dtype, final_state [N, H, K, V] fp32 or None)``.
    """
    scale = validate(q, k, v, g, beta, scale, initial_state, cu_seqlens, gated=True)
    if kernel_backend(q) == "torch":
        return delta_reference_core(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    check_triton_dtype(q)
    return recurrent_delta_triton(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)


def reference_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None):
    """The per-token recurrence in torch: the test oracle (computes in float64 for float64 inputs).

    Args:
        q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens: as in
            ``chunk_gated_delta_rule``.

    Returns:
        ``(o [B, T, H, V] in v's dtype, final_state [N, H, K, V] or None)``; differentiable.
    """
    scale = validate(q, k, v, g, beta, scale, initial_state, cu_seqlens, gated=True)
    return delta_reference_core(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
