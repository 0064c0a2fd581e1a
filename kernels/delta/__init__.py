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

from ttr.kernels.delta.api import chunk_dispatch, recurrent_dispatch, validate
from ttr.kernels.delta.reference import delta_reference_core

__all__ = ["chunk_delta_rule", "recurrent_delta_rule", "reference_delta_rule"]


def chunk_delta_rule(q, k, v, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    scale = validate(q, k, v, None, beta, scale, initial_state, cu_seqlens, gated=False)
    return chunk_dispatch(q, k, v, None, beta, scale, initial_state, output_final_state, cu_seqlens)


def recurrent_delta_rule(q, k, v, beta, *, scale=None, initial_state=None, output_final_state=False,
                         cu_seqlens=None):
    scale = validate(q, k, v, None, beta, scale, initial_state, cu_seqlens, gated=False)
    return recurrent_dispatch(q, k, v, None, beta, scale, initial_state, output_final_state, cu_seqlens)


def reference_delta_rule(q, k, v, beta, *, scale=None, initial_state=None, output_final_state=False,
                         cu_seqlens=None):
    scale = validate(q, k, v, None, beta, scale, initial_state, cu_seqlens, gated=False)
    return delta_reference_core(q, k, v, None, beta, scale, initial_state, output_final_state, cu_seqlens)
