"""Per-token (gated) delta rule in torch: the test oracle (float64 capable) and the decoding fallback.

``S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T`` with ``a_t = exp(g_t)`` (1 without g),
``o_t = S_t^T q_t * scale``; computed as ``S <- a S``, ``S <- S + k (b (v - S^T k))^T``.
Computes in fp32 for half inputs, in the input dtype otherwise; differentiable.
"""

from __future__ import annotations

import torch

from ttr.kernels.common.index import segments


def delta_reference_core(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
    B, T, H, K = q.shape
    V = v.shape[-1]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    spans = segments(cu_seqlens, B, T)
    outs = [[] for _ in range(B)]
    finals = []
    for n, (b, s, e) in enumerate(spans):
        S = initial_state[n].to(dtype) if initial_state is not None else q.new_zeros(H, K, V, dtype=dtype)
        for t in range(s, e):
            if g is not None:
                S = S * g[b, t].to(dtype).exp()[:, None, None]
            k_t, v_t, q_t = k[b, t].to(dtype), v[b, t].to(dtype), q[b, t].to(dtype)
            err = v_t - torch.einsum("hk,hkv->hv", k_t, S)
            S = S + torch.einsum("hk,hv->hkv", k_t, beta[b, t].to(dtype)[:, None] * err)
            outs[b].append(torch.einsum("hk,hkv->hv", q_t * scale, S))
        finals.append(S)
    o = torch.stack([torch.stack(x, 0) if x else q.new_zeros(0, H, V, dtype=dtype) for x in outs], 0)
    o = o.to(v.dtype)
    final = torch.stack(finals, 0) if output_final_state else None
    return o, final
