"""Gated DeltaNet (Yang, Kautz, Hatamizadeh 2025, "Gated Delta Networks: Improving Mamba2 with Delta Rule").

``S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T`` with ``a_t = exp(g_t)``,
``o_t = S_t^T q_t * scale``. g ``[B, T, H]`` is the log decay (fp32, <= 0); everything else as in
``ttr.kernels.delta``. Returns ``(o, final_state or None)``.

- ``chunk_gated_delta_rule``: training / prefill (Triton on CUDA, chunked torch on CPU).
- ``recurrent_gated_delta_rule``: decoding, a fused Triton step kernel.
- ``reference_gated_delta_rule``: the per-token torch recurrence (the float64 oracle).
"""

from __future__ import annotations

from ttr.kernels.delta.api import chunk_dispatch, recurrent_dispatch, validate
from ttr.kernels.delta.reference import delta_reference_core

__all__ = ["chunk_gated_delta_rule", "recurrent_gated_delta_rule", "reference_gated_delta_rule"]


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None):
    scale = validate(q, k, v, g, beta, scale, initial_state, cu_seqlens, gated=True)
    return chunk_dispatch(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)


def recurrent_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None):
    scale = validate(q, k, v, g, beta, scale, initial_state, cu_seqlens, gated=True)
    return recurrent_dispatch(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)


def reference_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None):
    scale = validate(q, k, v, g, beta, scale, initial_state, cu_seqlens, gated=True)
    return delta_reference_core(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
