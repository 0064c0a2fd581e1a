"""Chunked (gated) delta rule in plain torch: the CPU backend, differentiable through torch ops.

Same math as the Triton engine (WY representation per 64-token chunk, then a loop over chunks),
batched over sequences: packed documents are gathered into a padded ``[N, NC*64, H, D]`` layout
with zeros after each document's end (zero k, v, beta and g change neither the state nor any
valid output), so nothing crosses a document boundary. Computes in fp32 (fp64 for fp64 inputs).
"""

from __future__ import annotations

import torch

from ttr.kernels.common.index import CHUNK_SIZE


def _pack_index(cu_seqlens: torch.Tensor | None, B: int, T: int, chunk: int, device):
    """Flat token index per padded slot ``[N, L]`` (-1 for padding) and L."""
    if cu_seqlens is None:
        starts = torch.arange(B, device=device) * T
        lens = torch.full((B,), T, device=device)
    else:
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        starts, lens = cu[:-1], cu[1:] - cu[:-1]
    L = max(chunk, -(-int(lens.max()) // chunk) * chunk) if lens.numel() else chunk
    pos = torch.arange(L, device=device)
    idx = torch.where(pos[None, :] < lens[:, None], starts[:, None] + pos[None, :], -1)
    return idx, L


def _gather(x: torch.Tensor, idx: torch.Tensor, dtype) -> torch.Tensor:
    flat = x.reshape(-1, *x.shape[2:]).to(dtype)
    flat = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])
    return flat[idx]  # index -1 reads the zero row


def chunk_delta_torch(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                      chunk_size: int = CHUNK_SIZE):
    B, T, H, K = q.shape
    V = v.shape[-1]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    idx, L = _pack_index(cu_seqlens, B, T, chunk_size, q.device)
    N, NC, C = idx.shape[0], L // chunk_size, chunk_size

    def chunks(x):  # [N, L, H, ...] -> [N, H, NC, C, ...]
        x = x.reshape(N, NC, C, H, *x.shape[3:])
        return x.movedim(3, 1)

    qc, kc, vc = (chunks(_gather(x, idx, dtype)) for x in (q, k, v))
    bc = chunks(_gather(beta, idx, dtype))
    if g is not None:
        gc = chunks(_gather(g, idx, dtype)).cumsum(-1)
    else:
        gc = torch.zeros_like(bc)
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    diff = gc[..., :, None] - gc[..., None, :]
    gam_strict = diff.masked_fill(~strict, float("-inf")).exp()
    gam_causal = diff.masked_fill(~causal, float("-inf")).exp()
    A = bc[..., :, None] * (kc @ kc.transpose(-1, -2)) * gam_strict
    eye = torch.eye(C, dtype=dtype, device=q.device)
    Ainv = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    Tm = Ainv * bc[..., None, :]
    w = Tm @ (kc * gc.exp()[..., None])
    u = Tm @ vc
    attn = (qc @ kc.transpose(-1, -2)) * gam_causal
    qg = qc * gc.exp()[..., None]
    g_last = gc[..., -1]  # [N, H, NC]
    kd = kc * (g_last[..., None] - gc).exp()[..., None]

    if initial_state is not None:
        S = initial_state.to(dtype)
    else:
        S = q.new_zeros(N, H, K, V, dtype=dtype)
    outs = []
    for c in range(NC):
        v_new = u[:, :, c] - w[:, :, c] @ S
        outs.append((qg[:, :, c] @ S + attn[:, :, c] @ v_new) * scale)
        S = g_last[:, :, c, None, None].exp() * S + kd[:, :, c].transpose(-1, -2) @ v_new
    o = torch.stack(outs, 2)  # [N, H, NC, C, V]
    o = o.movedim(1, 3).reshape(N * L, H, V)
    valid = idx.reshape(-1) >= 0
    o = o[valid].reshape(B, T, H, V).to(v.dtype)
    return o, (S if output_final_state else None)
