"""Simple GLA / Mamba2 SSD in torch: the per-token oracles and Mamba2's input map.

Simple GLA (one log decay per head, ``g [B, T, H]``, fp32, <= 0):

    S_t = exp(g_t) S_{t-1} + k_t v_t^T,    o_t = scale * S_t^T q_t

Mamba2's SSD layer (Dao & Gu 2024, "Transformers are SSMs", arXiv:2405.21060) is the same
recurrence under the map ``q = C, k = B, v = x * dt, g = A * dt, scale = 1``, where ``B`` and
``C`` have ``G`` groups shared by ``H / G`` consecutive heads each:

    S_t = exp(dt_t A) S_{t-1} + B_t (dt_t x_t)^T,    y_t = S_t^T C_t (+ D x_t)      S_t: [N, P]

with the optional skip ``D [H]`` of the Mamba2 layer. The map is written in torch ops
(``ssd_as_simple_gla``), so gradients of x, dt, A, B, C, D follow from the simple-GLA gradients
by autograd (group sums for B and C included).

``reference_conv_ssd`` is the same after Mamba2's causal short conv with SiLU over the
concatenation ``xBC = [x, B, C]`` (``ttr.kernels.conv``); ``chunk_conv_ssd`` fuses the two.
"""

from __future__ import annotations

import torch

from ttr.kernels.conv import check_conv_inputs, reference_causal_conv1d
from ttr.kernels.gla.reference import check_gla_inputs, recurrence
from ttr.kernels.utils import check_cu_seqlens, check_dtype, check_head_dim, check_initial_state, check_rank


def check_ssd_inputs(x, dt, A, B, C, *, initial_state, cu_seqlens, D=None) -> int:
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
    if D is not None:
        check_rank("D", D, 1, "[H]")
        check_dtype("D", D, (torch.float32,))
        if tuple(D.shape) != (h,):
            raise ValueError(f"D must have shape [H] = ({h},), got {tuple(D.shape)}")
        if D.device != x.device:
            raise ValueError(f"D is on {D.device}, x on {x.device}")
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


def check_conv_ssd_inputs(xBC, conv_weight, conv_bias, dt, A, D, *, groups, state_size, initial_state,
                          cu_seqlens):
    """Validate ``chunk_conv_ssd``'s inputs (B and C have x's dtype as views of xBC)."""
    check_conv_inputs(xBC, conv_weight, conv_bias, "silu", cu_seqlens, None)
    check_rank("dt", dt, 3, "[B, T, H]")
    for name, value in (("groups", groups), ("state_size", state_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    batch, t, width = xBC.shape
    h, gn = dt.shape[2], groups * state_size
    if width <= 2 * gn or (width - 2 * gn) % h:
        raise ValueError(f"xBC's last dim must be H * P + 2 * groups * state_size with H={h} (dt's heads), "
                         f"groups={groups}, state_size={state_size}; got {width}")
    x, B, C = xbc_views(xBC, h, groups, state_size)
    check_ssd_inputs(x, dt, A, B, C, initial_state=initial_state, cu_seqlens=cu_seqlens, D=D)


def xbc_views(xBC, heads: int, groups: int, state_size: int):
    """``xBC [batch, T, H P + 2 G N]`` -> views ``x [batch, T, H, P]``, ``B``, ``C [batch, T, G, N]``."""
    gn = groups * state_size
    x, B, C = xBC.split([xBC.shape[-1] - 2 * gn, gn, gn], dim=-1)
    return x.unflatten(-1, (heads, -1)), B.unflatten(-1, (groups, state_size)), C.unflatten(-1, (groups, state_size))


def skip(y, x, D):
    """``y + D x`` per head in x's dtype (y unchanged without D)."""
    return y if D is None else y + x * D.to(x.dtype)[:, None]


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
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
):
    """Mamba2's SSD as the per-token recurrence in torch: the test oracle.

    Args:
        x, dt, A, B, C, D, initial_state, output_final_state, cu_seqlens: as in ``chunk_ssd``.

    Returns:
        ``(y [B, T, H, P] in x's dtype, final_state [N_seq, H, N, P] or None)``; differentiable.
    """
    check_ssd_inputs(x, dt, A, B, C, initial_state=initial_state, cu_seqlens=cu_seqlens, D=D)
    q, k, v, g = ssd_as_simple_gla(x, dt, A, B, C)
    y, final = recurrence(q, k, v, g, 1.0, initial_state, output_final_state, cu_seqlens)
    return skip(y, x, D), final


def reference_conv_ssd(
    xBC: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    dt: torch.Tensor,
    A: torch.Tensor,
    *,
    groups: int,
    state_size: int,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
):
    """The per-token conv and SSD oracles one after the other: the test oracle of ``chunk_conv_ssd``.

    Args:
        xBC, conv_weight, conv_bias, dt, A, groups, state_size, D, initial_state,
        output_final_state, cu_seqlens: as in ``chunk_conv_ssd``.

    Returns:
        ``(y [B, T, H, P], final_state or None)``, as ``chunk_conv_ssd``; differentiable.
    """
    check_conv_ssd_inputs(xBC, conv_weight, conv_bias, dt, A, D, groups=groups, state_size=state_size,
                          initial_state=initial_state, cu_seqlens=cu_seqlens)
    y, _ = reference_causal_conv1d(xBC, conv_weight, conv_bias, activation="silu", cu_seqlens=cu_seqlens)
    x, B, C = xbc_views(y, dt.shape[2], groups, state_size)
    return reference_ssd(x, dt, A, B, C, D=D, initial_state=initial_state, output_final_state=output_final_state,
                         cu_seqlens=cu_seqlens)
