"""Gated linear attention in torch: validation and the per-token oracle.

Recurrence per head (GLA, Yang et al. 2024, "Gated Linear Attention Transformers with
Hardware-Efficient Training", arXiv:2312.06635), with a log gate ``g`` (fp32, <= 0):

    S_t = Diag(exp(g_t)) S_{t-1} + k_t v_t^T          S_t: [K, V]
    o_t = scale * S_t^T q_t

``g`` is ``[B, T, H, K]`` (GLA, one decay per key dimension) or ``[B, T, H]`` (simple GLA /
Mamba2's SSD, one decay per head; ``ttr.kernels.ssd``). Both share the code here. The chunked
CPU backend of both is the engine's torch form, ``ttr.kernels.common.torch_chunk``.
"""

from __future__ import annotations

import torch

from ttr.kernels.common.index import segments
from ttr.kernels.gla.gate import check_gate_args, gla_gate
from ttr.kernels.utils import (
    check_cu_seqlens,
    check_dtype,
    check_head_dim,
    check_initial_state,
    check_rank,
)


def check_gla_inputs(q, k, v, g, *, vector_gate: bool, scale, initial_state, cu_seqlens, gate_name="g",
                     gate_logits=None):
    """Validate (q, k, v, g, ...) of a gated linear attention op; return (N, scale). With
    ``gate_logits = (normalizer, clamp_min)`` g holds the gate's logits, of any floating dtype."""
    check_rank("q", q, 4, "[B, T, H, K]")
    check_rank("k", k, 4, "[B, T, H, K]")
    check_rank("v", v, 4, "[B, T, H, V]")
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_dtype(name, x)
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q {tuple(q.shape)}, got {tuple(k.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    b, t, h, dk = q.shape
    if v.shape[:3] != (b, t, h):
        raise ValueError(f"v must have shape [B, T, H, V] with B, T, H = {(b, t, h)}, got {tuple(v.shape)}")
    if vector_gate:
        check_rank(gate_name, g, 4, "[B, T, H, K]")
        expected = (b, t, h, dk)
    else:
        check_rank(gate_name, g, 3, "[B, T, H]")
        expected = (b, t, h)
    if tuple(g.shape) != expected:
        raise ValueError(f"{gate_name} must have shape {expected}, got {tuple(g.shape)}")
    if gate_logits is None:
        check_dtype(gate_name, g, (torch.float32,))
    else:
        check_dtype(gate_name, g)
        if not isinstance(gate_logits, tuple) or len(gate_logits) != 2:
            raise TypeError(f"gate_logits must be a (normalizer, clamp_min) tuple or None, got {gate_logits!r}")
        check_gate_args(*gate_logits, what="gate_logits' ")
    for name, x in (("k", k), ("v", v), (gate_name, g)):
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, q on {q.device}")
    check_head_dim("q/k", dk)
    check_head_dim("v", v.shape[-1])
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    n = check_cu_seqlens(cu_seqlens, b, t)
    check_initial_state(initial_state, n, h, dk, v.shape[-1])
    if initial_state is not None:
        check_dtype("initial_state", initial_state, (torch.float32,))
    return n, (dk**-0.5 if scale is None else float(scale))


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def recurrence(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens):
    """The per-token recurrence (no validation); g is [B, T, H, K] or [B, T, H]."""
    cdt = _compute_dtype(q)
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    gk = g if g.dim() == 4 else g.unsqueeze(-1)
    outs, finals = [], []
    for n, (i_b, s, e) in enumerate(segments(cu_seqlens, b, t)):
        if initial_state is None:
            state = q.new_zeros(h, dk, dv, dtype=cdt)
        else:
            state = initial_state[n].to(cdt)
        for i_t in range(s, e):
            decay = gk[i_b, i_t].to(cdt).exp()  # [H, K] or [H, 1]
            kv = k[i_b, i_t].to(cdt)[:, :, None] * v[i_b, i_t].to(cdt)[:, None, :]
            state = decay[:, :, None] * state + kv
            outs.append((i_b, i_t, scale * torch.einsum("hk,hkv->hv", q[i_b, i_t].to(cdt), state)))
        finals.append(state)
    o = _scatter(outs, (b, t, h, dv), cdt, q.device).to(v.dtype)
    return o, (_final(finals, cdt) if output_final_state else None)


def _scatter(rows, shape, dtype, device):
    """Stack per-token outputs [(b, t, [H, V])] into [B, T, H, V] without in-place writes (autograd)."""
    if not rows:
        return torch.zeros(shape, dtype=dtype, device=device)
    b, t = shape[:2]
    by_pos = {(i_b, i_t): x for i_b, i_t, x in rows}
    zero = torch.zeros(shape[2:], dtype=dtype, device=device)
    return torch.stack([torch.stack([by_pos.get((i_b, i_t), zero) for i_t in range(t)]) for i_b in range(b)])


def _final(states, cdt):
    """Final states: float32 (the state convention), float64 when computing in float64."""
    return torch.stack(states).to(torch.float64 if cdt == torch.float64 else torch.float32)


def reference_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    gate_logits: tuple[float, float | None] | None = None,
):
    """GLA as the per-token recurrence in torch: the test oracle (float64 when inputs are float64).

    Slow (a Python loop over tokens).

    Args:
        q, k, v, g, scale, initial_state, output_final_state, cu_seqlens, gate_logits: as in
            ``chunk_gla``.

    Returns:
        ``(o [B, T, H, V] in v's dtype, final_state [N, H, K, V] or None)``, as ``chunk_gla``;
        differentiable.
    """
    _, scale = check_gla_inputs(
        q, k, v, g, vector_gate=True, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
        gate_logits=gate_logits,
    )
    return recurrence(q, k, v, logit_gate_of(g, gate_logits), scale, initial_state, output_final_state, cu_seqlens)


def logit_gate_of(g: torch.Tensor, gate_logits: tuple[float, float | None] | None) -> torch.Tensor:
    """The log gate: ``gla_gate`` of the logits g under ``gate_logits = (normalizer, clamp_min)``,
    else g itself."""
    return g if gate_logits is None else gla_gate(g, *gate_logits)
