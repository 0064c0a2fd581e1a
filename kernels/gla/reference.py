"""Gated linear attention in torch: validation, the per-token oracle and the chunked CPU backend.

Recurrence per head (GLA, Yang et al. 2024, "Gated Linear Attention Transformers with
Hardware-Efficient Training", arXiv:2312.06635), with a log gate ``g`` (fp32, <= 0):

    S_t = Diag(exp(g_t)) S_{t-1} + k_t v_t^T          S_t: [K, V]
    o_t = scale * S_t^T q_t

``g`` is ``[B, T, H, K]`` (GLA, one decay per key dimension) or ``[B, T, H]`` (simple GLA /
Mamba2's SSD, one decay per head; ``ttr.kernels.ssd``). Both share the code here.

The chunked torch backend (chunk size 64) is exact: within a chunk, with ``G`` the chunk-local
cumulative sum of ``g``,

    o_i = scale * (q_i * exp(G_i)) S_0 + scale * sum_{j <= i} (sum_d q_id k_jd exp(G_id - G_jd)) v_j
    S_C = exp(G_C) * S_0 + sum_j (k_j * exp(G_C - G_j)) v_j^T

and every exponent above is <= 0 (``G`` is non-increasing and ``j <= i``), so nothing overflows
however strong the decay. The intra-chunk scores are formed element-wise over ``[C, C, K]``
(masked to ``j <= i`` before the exponential), which costs ``C`` times the memory of ``q``: fine
for CPU training of small models, which is what this backend is for.
"""

from __future__ import annotations

import torch

from ttr.kernels.utils import (
    check_cu_seqlens,
    check_dtype,
    check_head_dim,
    check_initial_state,
    check_rank,
)

CHUNK = 64


def check_gla_inputs(q, k, v, g, *, vector_gate: bool, scale, initial_state, cu_seqlens, gate_name="g"):
    """Validate (q, k, v, g, ...) of a gated linear attention op; return (N, scale)."""
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
    check_dtype(gate_name, g, (torch.float32,))
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


def _segments(b: int, t: int, cu_seqlens):
    """(batch index, start, end) of every sequence."""
    if cu_seqlens is None:
        return [(i, 0, t) for i in range(b)]
    bounds = cu_seqlens.detach().to("cpu", torch.int64).tolist()
    return [(0, s, e) for s, e in zip(bounds[:-1], bounds[1:])]


def recurrence(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens):
    """The per-token recurrence (no validation); g is [B, T, H, K] or [B, T, H]."""
    cdt = _compute_dtype(q)
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    gk = g if g.dim() == 4 else g.unsqueeze(-1)
    outs, finals = [], []
    for n, (i_b, s, e) in enumerate(_segments(b, t, cu_seqlens)):
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


def chunked(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens):
    """The chunkwise form in torch (no validation); differentiable by autograd.

    Computes in fp32 (float64 for float64 inputs) even under autocast, like the Triton path.
    """
    with torch.autocast(q.device.type, enabled=False):
        return _chunked(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens)


def _chunked(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens):
    cdt = _compute_dtype(q)
    b, t, h, dk = q.shape
    if cu_seqlens is None:
        o, final = _chunked_batch(q, k, v, g, scale, initial_state, cdt)
        return o.to(v.dtype), (final if output_final_state else None)
    outs, finals = [], []
    for n, (_, s, e) in enumerate(_segments(b, t, cu_seqlens)):
        h0 = None if initial_state is None else initial_state[n : n + 1]
        o_n, f_n = _chunked_batch(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], scale, h0, cdt)
        outs.append(o_n)
        finals.append(f_n[0])
    o = torch.cat(outs, dim=1).to(v.dtype)
    return o, (_final(finals, cdt) if output_final_state else None)


def _chunked_batch(q, k, v, g, scale, initial_state, cdt):
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    state = q.new_zeros(b, h, dk, dv, dtype=cdt) if initial_state is None else initial_state.to(cdt)
    if t == 0:
        return v.new_zeros(b, 0, h, dv, dtype=cdt), _final(list(state), cdt)
    nc = (t + CHUNK - 1) // CHUNK
    pad = nc * CHUNK - t

    def blocks(x):
        # [B, T, H, D] -> [B, H, NC, C, D]; padded tokens have k = q = v = 0 and g = 0 (no decay).
        x = x.to(cdt)
        if pad:
            x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad))
        return x.reshape(b, nc, CHUNK, h, -1).permute(0, 3, 1, 2, 4)

    vector = g.dim() == 4
    qc, kc, vc = blocks(q), blocks(k), blocks(v)
    gc = blocks(g if vector else g.unsqueeze(-1)).cumsum(dim=3)  # [B, H, NC, C, K or 1]
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    if vector:
        diff = gc[..., :, None, :] - gc[..., None, :, :]  # [B, H, NC, C, C, K]
        diff = diff.masked_fill(~causal[:, :, None], float("-inf"))
        scores = torch.einsum("bhnik,bhnijk,bhnjk->bhnij", qc, diff.exp(), kc)
    else:
        diff = (gc[..., :, None, 0] - gc[..., None, :, 0]).masked_fill(~causal, float("-inf"))
        scores = (qc @ kc.transpose(-1, -2)) * diff.exp()
    o_intra = scores @ vc  # [B, H, NC, C, V]
    q_dec = qc * gc.exp()
    g_last = gc[:, :, :, -1:]  # [B, H, NC, 1, K or 1]
    k_dec = kc * (g_last - gc).exp()
    outs = []
    for i_c in range(nc):
        outs.append(q_dec[:, :, i_c] @ state)
        state = g_last[:, :, i_c, 0, :, None].exp() * state + k_dec[:, :, i_c].transpose(-1, -2) @ vc[:, :, i_c]
    o = (torch.stack(outs, dim=2) + o_intra) * scale  # [B, H, NC, C, V]
    o = o.permute(0, 2, 3, 1, 4).reshape(b, nc * CHUNK, h, dv)[:, :t]
    return o, state.to(torch.float64 if cdt == torch.float64 else torch.float32)


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
):
    """GLA as the per-token recurrence in torch: the test oracle (float64 when inputs are float64).

    Same signature and result as ``chunk_gla``; slow (a Python loop over tokens).
    """
    _, scale = check_gla_inputs(
        q, k, v, g, vector_gate=True, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens
    )
    return recurrence(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens)
