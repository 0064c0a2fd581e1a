"""Simple GLA / Mamba2 SSD in torch: the per-token oracles and Mamba2's input map.

Simple GLA (one log decay per head, ``g [B, T, H]``, fp32, <= 0):

    S_t = exp(g_t) S_{t-1} + k_t v_t^T,    o_t = scale * S_t^T q_t

Mamba2's SSD layer (Dao & Gu 2024, "Transformers are SSMs", arXiv:2405.21060) is the same
recurrence under the map ``q = C, k = B, v = x * dt, g = A * dt, scale = 1``, where ``B`` and
``C`` have ``G`` groups shared by ``H / G`` consecutive heads each:

    S_t = exp(dt_t A) S_{t-1} + B_t (dt_t x_t)^T,    y_t = S_t^T C_t      S_t: [N, P]

The map is written in torch ops (``ssd_as_simple_gla``), so gradients of x, dt, A, B, C follow
from the simple-GLA gradients by autograd (group sums for B and C included).
"""

from __future__ import annotations

import torch

from ttr.kernels.gla.reference import check_gla_inputs, recurrence
from ttr.kernels.utils import check_cu_seqlens, check_dtype, check_head_dim, check_initial_state, check_rank


def check_ssd_inputs(x, dt, A, B, C, *, initial_state, cu_seqlens) -> int:
    """Validate Mamba2-form inputs; return the number of sequences N."""
    check_rank("x", x, 4, "[B, T, H, P]")
    check_rank("dt", dt, 3, "[B, T, H]")
    check_rank("A", A, 1, "[H]")
    check_rank("B", B, 4, "[B, T, G, N]")
    check_rank("C", C, 4, "[B, T, G, N]")
    check_dtype("x", x)
    check_dtype("B", B)
    check_dtype("C", C)
    check_dtype("dt", dt, (torch.float32,))
    check_dtype("A", A, (torch.float32,))
    batch, t, h, p = x.shape
    if B.dtype != x.dtype or C.dtype != x.dtype:
        raise TypeError(f"x, B, C must share one dtype, got {x.dtype}, {B.dtype}, {C.dtype}")
    if tuple(dt.shape) != (batch, t, h):
        raise ValueError(f"dt must have shape [B, T, H] = {(batch, t, h)}, got {tuple(dt.shape)}")
    if tuple(A.shape) != (h,):
        raise ValueError(f"A must have shape [H] = ({h},), got {tuple(A.shape)}")
    if B.shape[:2] != (batch, t):
        raise ValueError(f"B must have shape [B, T, G, N] with B, T = {(batch, t)}, got {tuple(B.shape)}")
    if C.shape != B.shape:
        raise ValueError(f"C must have the shape of B {tuple(B.shape)}, got {tuple(C.shape)}")
    groups = B.shape[2]
    if groups == 0 or h % groups != 0:
        raise ValueError(f"the number of heads H={h} must be a multiple of the groups G={groups} of B and C")
    for name, y in (("dt", dt), ("A", A), ("B", B), ("C", C)):
        if y.device != x.device:
            raise ValueError(f"{name} is on {y.device}, x on {x.device}")
    check_head_dim("B/C (state size N)", B.shape[-1])
    check_head_dim("x (head dim P)", p)
    n = check_cu_seqlens(cu_seqlens, batch, t)
    check_initial_state(initial_state, n, h, B.shape[-1], p)
    if initial_state is not None:
        check_dtype("initial_state", initial_state, (torch.float32,))
    return n


def ssd_as_simple_gla(x, dt, A, B, C):
    """(x, dt, A, B, C) -> (q, k, v, g) of simple GLA, with scale 1; differentiable torch ops."""
    rep = x.shape[2] // B.shape[2]
    q = C.repeat_interleave(rep, dim=2) if rep > 1 else C
    k = B.repeat_interleave(rep, dim=2) if rep > 1 else B
    v = (x * dt.unsqueeze(-1)).to(x.dtype)
    g = dt * A
    return q, k, v, g


def reference_simple_gla(
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
    """Simple GLA as the per-token recurrence in torch: the test oracle.

    Args:
        q, k, v, g, scale, initial_state, output_final_state, cu_seqlens: as in
            ``chunk_simple_gla``.

    Returns:
        ``(o [B, T, H, V] in v's dtype, final_state [N, H, K, V] or None)``; differentiable.
    """
    _, scale = check_gla_inputs(
        q, k, v, g, vector_gate=False, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens
    )
    return recurrence(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens)


def reference_ssd(
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
    """Mamba2's SSD as the per-token recurrence in torch: the test oracle.

    Args:
        x, dt, A, B, C, initial_state, output_final_state, cu_seqlens: as in ``chunk_ssd``.

    Returns:
        ``(y [B, T, H, P] in x's dtype, final_state [N_seq, H, N, P] or None)``; differentiable.
    """
    check_ssd_inputs(x, dt, A, B, C, initial_state=initial_state, cu_seqlens=cu_seqlens)
    q, k, v, g = ssd_as_simple_gla(x, dt, A, B, C)
    return recurrence(q, k, v, g, 1.0, initial_state, output_final_state, cu_seqlens)
