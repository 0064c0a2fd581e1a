"""Causal / sliding-window softmax attention (flash-style Triton kernels, torch references).

``attention(q, k, v, *, window=None, scale=None, cu_seqlens=None) -> o`` dispatches on
``ttr.kernels.utils.kernel_backend``; ``reference_attention`` has the identical signature.
"""

from ttr.kernels.attention.reference import reference_attention, torch_attention

attention = torch_attention

__all__ = ["attention", "reference_attention"]
