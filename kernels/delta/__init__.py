"""DeltaNet (Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule over Sequence Length").

``S_t = (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T``, ``o_t = S_t^T q_t * scale`` per head, with
``S`` a ``[K, V]`` matrix. q, k ``[B, T, H, K]``, v ``[B, T, H, V]``, beta ``[B, T, H]`` (in (0, 1),
or (0, 2) for negative eigenvalues), scale defaults to ``K ** -0.5``; states ``[N, H, K, V]`` fp32;
packed documents via ``cu_seqlens`` with B == 1. q/k normalisation is the layer's job.
Returns ``(o [B, T, H, V], final_state [N, H, K, V] fp32 or None)``.

- ``chunk_delta_rule``: training / prefill; Triton chunkwise kernels on CUDA, the chunked torch
  implementation on CPU (``TTR_KERNEL_BACKEND`` overrides).
- ``recurrent_delta_rule``: decoding (a few tokens against a state); a fused Triton step kernel.
- ``reference_delta_rule``: the per-token torch recurrence (float64 capable; the test oracle).
"""

from __future__ import annotations

from ttr.kernels.common.torch_chunk import chunk_torch
from ttr.kernels.delta.api import check_triton_dtype, validate
from ttr.kernels.delta.chunk import ChunkDeltaRuleFunction
from ttr.kernels.delta.recurrent import recurrent_delta_triton
from ttr.kernels.delta.reference import delta_reference_core
from ttr.kernels.utils import kernel_backend, on_input_device

__all__ = ["chunk_delta_rule", "recurrent_delta_rule", "reference_delta_rule"]


@on_input_device
def chunk_delta_rule(q, k, v, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """The delta rule, chunkwise (training and prefill).

    Args:
        q, k: ``[B, T, H, K]`` queries and keys (fp32, fp16 or bf16; float64 on the torch
            backend), L2-normalised by the caller.
        v: ``[B, T, H, V]`` values, q's dtype.
        beta: ``[B, T, H]`` write strengths, in (0, 1) (or (0, 2) for negative eigenvalues).
        scale: factor on ``q``, default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` fp32 states to start from (N = B, or the number of packed
            documents); None starts from zeros.
        output_final_state: also return each sequence's state after its last token.
        cu_seqlens: ``[N + 1]`` int32/int64 document offsets for packed input (B must be 1), or a
            ``Packing`` from ``prepare_packing`` (no host copy, no re-indexing).

    Returns:
        ``(o, final_state)``: o ``[B, T, H, V]`` in v's dtype; final_state ``[N, H, K, V]`` fp32, or
        None without ``output_final_state``. Gradients flow to q, k, v, beta and initial_state.
    """
    scale = validate(q, k, v, None, beta, scale, initial_state, cu_seqlens, gated=False)
    if kernel_backend(q) == "torch":
        return chunk_torch(q, k, v, None, beta, scale, initial_state, output_final_state, cu_seqlens)
    check_triton_dtype(q)
    return ChunkDeltaRuleFunction.apply(q, k, v, None, beta, scale, initial_state, output_final_state, cu_seqlens)


@on_input_device
def recurrent_delta_rule(q, k, v, beta, *, scale=None, initial_state=None, output_final_state=False,
                         cu_seqlens=None):
    """The delta rule token by token, for decoding (a few tokens against a state). Forward only.

    Args:
        q, k, v, beta, scale, initial_state, output_final_state, cu_seqlens: as in
            ``chunk_delta_rule``.

    Returns:
        ``(o [B, T, H, V] in v's dtype, final_state [N, H, K, V] fp32 or None)``.
    """
    scale = validate(q, k, v, None, beta, scale, initial_state, cu_seqlens, gated=False)
    if kernel_backend(q) == "torch":
        return delta_reference_core(q, k, v, None, beta, scale, initial_state, output_final_state, cu_seqlens)
    check_triton_dtype(q)
    return recurrent_delta_triton(q, k, v, None, beta, scale, initial_state, output_final_state, cu_seqlens)


def reference_delta_rule(q, k, v, beta, *, scale=None, initial_state=None, output_final_state=False,
                         cu_seqlens=None):
    """The per-token recurrence in torch: the test oracle (computes in float64 for float64 inputs).

    Args:
        q, k, v, beta, scale, initial_state, output_final_state, cu_seqlens: as in
            ``chunk_delta_rule``.

    Returns:
        ``(o [B, T, H, V] in v's dtype, final_state [N, H, K, V] or None)``; differentiable.
    """
    scale = validate(q, k, v, None, beta, scale, initial_state, cu_seqlens, gated=False)
    return delta_reference_core(q, k, v, None, beta, scale, initial_state, output_final_state, cu_seqlens)
