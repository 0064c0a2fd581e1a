"""Causal / sliding-window softmax attention (flash-style Triton kernels, torch references).

``attention(q, k, v, *, window=None, scale=None, cu_seqlens=None) -> o`` dispatches on
``ttr.kernels.utils.kernel_backend``: the torch form, or on the GPU the path ``dispatch.py``
chooses (SDPA or ``varlen_attn`` where they are faster, ttr's Triton kernel elsewhere;
``TTR_ATTENTION=triton`` forces the Triton kernel). ``reference_attention`` has the identical
signature. Math, shapes and the masking rule: ``reference.py``; kernels and tiling: ``flash.py``.
"""

from ttr.kernels.attention.dispatch import dispatch_attention
from ttr.kernels.attention.reference import check_attention_inputs, reference_attention, torch_attention
from ttr.kernels.utils import kernel_backend, on_input_device


@on_input_device
def attention(q, k, v, *, window=None, scale=None, cu_seqlens=None):
    """Causal softmax attention; with ``window = W`` query t sees keys t-W+1 .. t.

    Args:
        q: ``[B, T, Hq, D]`` (fp32, fp16 or bf16; float64 on the torch backend), D <= 256.
        k, v: ``[B, T, Hkv, D]`` in q's dtype, ``Hq % Hkv == 0`` (query head h reads k/v head
            ``h // (Hq / Hkv)``).
        window: W, the number of keys a query sees (itself and the W-1 before it); None for
            full causal attention.
        scale: factor on the scores, default ``D ** -0.5``.
        cu_seqlens: ``[N + 1]`` int32/int64 document offsets for packed input (B must be 1; no
            query sees another document), or a ``Packing`` from ``prepare_packing`` (no host copy).

    Returns:
        o ``[B, T, Hq, D]`` in q's dtype; gradients flow to q, k and v.
    """
    _, scale = check_attention_inputs(q, k, v, window, scale, cu_seqlens)
    if kernel_backend(q) == "torch":
        return torch_attention(q, k, v, window=window, scale=scale, cu_seqlens=cu_seqlens)
    return dispatch_attention(q, k, v, window=window, scale=scale, cu_seqlens=cu_seqlens)


__all__ = ["attention", "reference_attention"]
