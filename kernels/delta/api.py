"""Input validation shared by the delta-rule ops (``delta`` and ``gated_delta``)."""

from __future__ import annotations

import torch

from ttr.kernels.utils import (
    SUPPORTED_DTYPES,
    check_cu_seqlens,
    check_dtype,
    check_head_dim,
    check_initial_state,
    check_rank,
)


def validate(q, k, v, g, beta, scale, initial_state, cu_seqlens, *, gated: bool) -> float:
    """Check every input of a delta-rule op; return the scale (``K ** -0.5`` by default)."""
    check_rank("q", q, 4, "[B, T, H, K]")
    check_rank("k", k, 4, "[B, T, H, K]")
    check_rank("v", v, 4, "[B, T, H, V]")
    check_rank("beta", beta, 3, "[B, T, H]")
    if gated:
        check_rank("g", g, 3, "[B, T, H]")
    for name, x in (("q", q), ("k", k), ("v", v), ("beta", beta)):
        check_dtype(name, x)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if gated:
        check_dtype("g", g, (torch.float32,))
    B, T, H, K = q.shape
    if tuple(k.shape) != (B, T, H, K):
        raise ValueError(f"k must have the shape of q {tuple(q.shape)}, got {tuple(k.shape)}")
    if tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"v must have shape [B, T, H, V] with [B, T, H] = {(B, T, H)}, got {tuple(v.shape)}")
    if tuple(beta.shape) != (B, T, H):
        raise ValueError(f"beta must have shape [B, T, H] = {(B, T, H)}, got {tuple(beta.shape)}")
    if gated and tuple(g.shape) != (B, T, H):
        raise ValueError(f"g must have shape [B, T, H] = {(B, T, H)}, got {tuple(g.shape)}")
    V = v.shape[-1]
    check_head_dim("q/k", K)
    check_head_dim("v", V)
    n = check_cu_seqlens(cu_seqlens, B, T)
    check_initial_state(initial_state, n, H, K, V)
    if scale is None:
        return K ** -0.5
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    return float(scale)


def check_triton_dtype(q: torch.Tensor) -> None:
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; the Triton kernels take {SUPPORTED_DTYPES} "
                        "(use the reference_* functions or TTR_KERNEL_BACKEND=torch for float64)")
