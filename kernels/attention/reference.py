"""Causal (optionally sliding-window) softmax attention: input checks, float64 oracle, torch backend.

Query ``t`` of a sequence attends keys ``s`` with ``s <= t`` and, when ``window = W`` is given,
``t - s < W`` (keys ``t-W+1 .. t``; ``W = 1`` is the token itself). Packed input (``B == 1`` plus
``cu_seqlens``) restarts the band at every document start, so no query sees another document.

Shapes: q ``[B, T, Hq, D]``, k and v ``[B, T, Hkv, D]`` with ``Hq % Hkv == 0``; query head ``h``
reads key/value head ``h // (Hq // Hkv)`` (grouped-query attention, Ainslie et al. 2023).
The output has q's shape and dtype. ``scale`` defaults to ``D ** -0.5``.

``reference_attention`` is the oracle: explicit boolean mask, softmax and products in the input
dtype (float64-capable), one sequence at a time. ``torch_attention`` is the CPU backend:
``scaled_dot_product_attention`` with the same explicit mask, per document for packed input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ttr.kernels.common.index import segments
from ttr.kernels.utils import check_cu_seqlens, check_dtype, check_head_dim, check_rank


def check_attention_inputs(q, k, v, window, scale, cu_seqlens) -> tuple[int, float]:
    """Validate the public arguments; return ``(N, scale)`` with N the number of sequences."""
    check_rank("q", q, 4, "[B, T, Hq, D]")
    check_rank("k", k, 4, "[B, T, Hkv, D]")
    check_rank("v", v, 4, "[B, T, Hkv, D]")
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_dtype(name, x)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    b, t, hq, d = q.shape
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape [B, T, Hkv, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    if tuple(k.shape[:2]) != (b, t) or k.shape[3] != d:
        raise ValueError(f"k must have shape [B, T, Hkv, D] = [{b}, {t}, Hkv, {d}] to match q, got {tuple(k.shape)}")
    hkv = k.shape[2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"the number of q heads ({hq}) must be a multiple of the number of k/v heads ({hkv})")
    if d == 0:
        raise ValueError("q head dim D must be at least 1, got 0")
    check_head_dim("q", d)
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int):
            raise TypeError(f"window must be an int or None, got {type(window).__name__}")
        if window < 1:
            raise ValueError(f"window must be >= 1 (keys t-W+1 .. t), got {window}")
    if scale is None:
        scale = d**-0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    n = check_cu_seqlens(cu_seqlens, b, t)
    return n, float(scale)


def band_mask(length: int, window: int | None, device) -> torch.Tensor:
    """``[L, L]`` boolean, True where query row t may attend key column s."""
    o_t = torch.arange(length, device=device)
    diff = o_t[:, None] - o_t[None, :]
    allowed = diff >= 0
    if window is not None:
        allowed &= diff < window
    return allowed


def reference_attention(q, k, v, *, window=None, scale=None, cu_seqlens=None):
    """Float64-capable oracle: explicit mask and softmax per sequence (see module docstring).

    Args:
        q, k, v, window, scale, cu_seqlens: as in ``ttr.kernels.attention.attention``.

    Returns:
        o ``[B, T, Hq, D]`` in q's dtype, computed in that dtype; differentiable.
    """
    _, scale = check_attention_inputs(q, k, v, window, scale, cu_seqlens)
    b, t, hq, _ = q.shape
    if b == 0 or t == 0:
        return torch.zeros_like(q)
    group = hq // k.shape[2]
    pieces = []
    for i_b, bos, eos in segments(cu_seqlens, b, t):
        if eos == bos:
            continue
        b_q = q[i_b, bos:eos].transpose(0, 1)  # [Hq, L, D]
        b_k = k[i_b, bos:eos].transpose(0, 1).repeat_interleave(group, dim=0)
        b_v = v[i_b, bos:eos].transpose(0, 1).repeat_interleave(group, dim=0)
        b_s = (b_q @ b_k.transpose(1, 2)) * scale  # [Hq, L, L]
        b_s = b_s.masked_fill(~band_mask(eos - bos, window, q.device), float("-inf"))
        pieces.append((torch.softmax(b_s, dim=-1) @ b_v).transpose(0, 1))  # [L, Hq, D]
    if cu_seqlens is None:
        return torch.stack(pieces)
    return torch.cat(pieces, dim=0)[None]


def torch_attention(q, k, v, *, window=None, scale=None, cu_seqlens=None):
    """CPU backend: SDPA with an explicit boolean band mask, per document for packed input."""
    _, scale = check_attention_inputs(q, k, v, window, scale, cu_seqlens)
    b, t, hq, _ = q.shape
    gqa = hq != k.shape[2]
    if b == 0 or t == 0:
        return torch.zeros_like(q)
    if cu_seqlens is None:
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=band_mask(t, window, q.device), scale=scale, enable_gqa=gqa,
        )
        return o.transpose(1, 2)
    pieces = []
    for _, bos, eos in segments(cu_seqlens, b, t):
        if eos == bos:
            continue
        b_o = F.scaled_dot_product_attention(
            q[:, bos:eos].transpose(1, 2), k[:, bos:eos].transpose(1, 2), v[:, bos:eos].transpose(1, 2),
            attn_mask=band_mask(eos - bos, window, q.device), scale=scale, enable_gqa=gqa,
        )
        pieces.append(b_o.transpose(1, 2))
    return torch.cat(pieces, dim=1)
