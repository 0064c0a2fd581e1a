"""Causal / sliding-window softmax attention (flash-style Triton kernels, torch references).

``attention(q, k, v, *, window=None, scale=None, cu_seqlens=None) -> o`` dispatches on
``ttr.kernels.utils.kernel_backend``: the torch form, or on the GPU the path ``dispatch.py``
chooses (SDPA or ``varlen_attn`` where they are faster, ttr's Triton kernel elsewhere;
``TTR_ATTENTION=triton`` forces the Triton kernel). ``reference_attention`` has the identical
signature. Math, shapes and the masking rule: ``reference.py``; kernels and tiling: ``flash.py``.
"""

from ttr.kernels.attention.dispatch import dispatch_attention
from ttr.kernels.attention.reference import check_attention_inputs, reference_attention, torch_attention
from ttr.kernels.utils import kernel_backend


def attention(q, k, v, *, window=None, scale=None, cu_seqlens=None):
    """Causal softmax attention; with ``window = W`` query t sees keys t-W+1 .. t.

    q ``[B, T, Hq, D]``, k/v ``[B, T, Hkv, D]`` (``Hq % Hkv == 0``, D <= 256), packed documents via
    ``cu_seqlens`` (``B == 1``). ``scale`` defaults to ``D ** -0.5``. Returns o ``[B, T, Hq, D]``.
    """
    _, scale = check_attention_inputs(q, k, v, window, scale, cu_seqlens)
    if kernel_backend(q) == "torch":
        return torch_attention(q, k, v, window=window, scale=scale, cu_seqlens=cu_seqlens)
    return dispatch_attention(q, k, v, window=window, scale=scale, cu_seqlens=cu_seqlens)


__all__ = ["attention", "reference_attention"]
