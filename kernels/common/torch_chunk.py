"""The chunkwise form in plain torch: the CPU backend of every chunk op, differentiable by autograd.

One function for every mixer the Triton engine composes: no gate, a log decay per head
``g [B, T, H]`` (simple GLA, Mamba2's SSD, Gated DeltaNet) or per key dimension ``g [B, T, H, K]``
(GLA), with or without the delta rule's ``beta [B, T, H]`` (no gate or a per-head one). Within a
chunk of C tokens, with ``G`` the chunk-local cumulative gate, ``Γ_ij = exp(G_i - G_j)`` (per key
dimension for a per-key gate) and ``S`` the state before the chunk:

    delta rule:  A = tril(diag(beta) (K K^T ⊙ Γ), -1),  T = (I + A)^-1 diag(beta),
                 w = T (K ⊙ exp(G)),  u = T V,  v_new = u - w S        (without beta: v_new = V)
    o = scale ((Q ⊙ exp(G)) S + (Q K^T ⊙ Γ, causal) v_new)
    S <- exp(G_C) ⊙ S + (K ⊙ exp(G_C - G))^T v_new

Every exponent is <= 0 (``G`` is non-increasing and ``j <= i``), so nothing overflows however
strong the decay. A per-key gate's ``Γ`` is formed element-wise over ``[C, C, K]`` (masked to
``j <= i`` before the exponential), C times the memory of q: fine for the small models this
backend trains on a CPU.

Batched over sequences: packed documents are gathered into a padded ``[N, NC*C, H, D]`` layout
with zeros after each document's end (zero k, v, beta and g change neither the state nor any
valid output), so nothing crosses a document boundary. Computes in fp32 (fp64 for fp64 inputs)
with autocast off, like the Triton path.
"""

from __future__ import annotations

import torch

from ttr.kernels.common.index import CHUNK_SIZE, cdiv, prepare_packing


def _pack_index(cu_seqlens, B: int, T: int, chunk: int, device):
    """Flat token index per padded slot ``[N, L]`` (-1 for padding) and L."""
    if cu_seqlens is None:
        starts = torch.arange(B, device=device) * T
        lens = torch.full((B,), T, device=device)
        longest = T
    else:
        packing = prepare_packing(cu_seqlens, T, device=device)
        cu = packing.cu_seqlens.long()
        starts, lens, longest = cu[:-1], cu[1:] - cu[:-1], packing.max_len
    L = max(chunk, cdiv(longest, chunk) * chunk)
    pos = torch.arange(L, device=device)
    idx = torch.where(pos[None, :] < lens[:, None], starts[:, None] + pos[None, :], -1)
    return idx, L


def _gather(x: torch.Tensor, idx: torch.Tensor, dtype) -> torch.Tensor:
    flat = x.reshape(-1, *x.shape[2:]).to(dtype)
    flat = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])
    return flat[idx]  # index -1 reads the zero row


def chunk_torch(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                chunk_size: int = CHUNK_SIZE):
    """``(o [B, T, H, V] in v's dtype, final state [N, H, K, V] or None)`` for validated inputs:
    ``g`` None, ``[B, T, H]`` or ``[B, T, H, K]``; ``beta`` None (gated linear attention) or
    ``[B, T, H]`` (delta rule, with no gate or a per-head one)."""
    if beta is not None and g is not None and g.dim() == 4:
        raise ValueError("g: the delta rule takes a per-head gate [B, T, H], got a per-key gate [B, T, H, K]")
    with torch.autocast(q.device.type, enabled=False):
        return _chunk(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size)


def _chunk(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size):
    B, T, H, K = q.shape
    V = v.shape[-1]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    idx, L = _pack_index(cu_seqlens, B, T, chunk_size, q.device)
    N, NC, C = idx.shape[0], L // chunk_size, chunk_size

    def chunks(x):  # [B, T, H, ...] -> [N, H, NC, C, ...], zeros after each document's end
        x = _gather(x, idx, dtype)
        return x.reshape(N, NC, C, H, *x.shape[3:]).movedim(3, 1)

    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    per_key = g is not None and g.dim() == 4
    if g is None:
        gc = qc.new_zeros(N, H, NC, C, 1)
    else:  # [N, H, NC, C, K or 1]
        gc = chunks(g if per_key else g.unsqueeze(-1)).cumsum(3)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()

    def decayed(x, y, mask):
        """``sum_d x_id y_jd Γ_ijd`` where ``mask``, else 0: ``[N, H, NC, C, C]``."""
        if per_key:
            diff = (gc[..., :, None, :] - gc[..., None, :, :]).masked_fill(~mask[:, :, None], float("-inf"))
            return torch.einsum("...ik,...ijk,...jk->...ij", x, diff.exp(), y)
        diff = (gc[..., :, None, 0] - gc[..., None, :, 0]).masked_fill(~mask, float("-inf"))
        return (x @ y.transpose(-1, -2)) * diff.exp()

    if beta is not None:
        bc = chunks(beta)  # [N, H, NC, C]
        A = bc[..., :, None] * decayed(kc, kc, causal.tril(-1))
        eye = torch.eye(C, dtype=dtype, device=q.device)
        Ainv = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
        Tm = Ainv * bc[..., None, :]
        w, u = Tm @ (kc * gc.exp()), Tm @ vc
    scores = decayed(qc, kc, causal)
    q_dec = qc * gc.exp()
    g_last = gc[..., -1:, :]  # [N, H, NC, 1, K or 1]
    k_dec = kc * (g_last - gc).exp()

    S = q.new_zeros(N, H, K, V, dtype=dtype) if initial_state is None else initial_state.to(dtype)
    outs = []
    for c in range(NC):
        v_new = vc[:, :, c] if beta is None else u[:, :, c] - w[:, :, c] @ S
        outs.append(q_dec[:, :, c] @ S + scores[:, :, c] @ v_new)
        S = g_last[:, :, c].transpose(-1, -2).exp() * S + k_dec[:, :, c].transpose(-1, -2) @ v_new
    o = (torch.stack(outs, 2) * scale).movedim(1, 3).reshape(N * L, H, V)  # [N, NC, C, H, V] flattened
    o = o[idx.reshape(-1) >= 0].reshape(B, T, H, V).to(v.dtype)
    return o, (S if output_final_state else None)
