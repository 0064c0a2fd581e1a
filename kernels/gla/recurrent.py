"""Recurrent (decoding) GLA and simple GLA: a few tokens against a state, one fused Triton kernel.

Per program (sequence, head, V-block) the ``[K, BV]`` state stays in registers (fp32) while the
kernel walks the tokens: ``S <- exp(g_t) S + k_t v_t^T`` (``exp(g_t)`` per key row for a vector
gate, one scalar per head otherwise), ``o_t = scale * S^T q_t``. Forward only (decoding); training
uses the chunkwise kernels. ``ttr.kernels.ssd`` reuses it with a scalar gate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttr.kernels.common.index import cdiv, next_power_of_2, prepare_chunks, rows_grid
from ttr.kernels.common.tile import grid_ids
from ttr.kernels.gla.reference import check_gla_inputs, logit_gate_of, recurrence
from ttr.kernels.utils import kernel_backend, on_input_device


@triton.jit
def recurrent_kernel(q, k, v, g, o, h0, ht, cu_seqlens, scale, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, VECTOR_GATE: tl.constexpr, USE_H0: tl.constexpr,
                     STORE_HT: tl.constexpr, FOLD: tl.constexpr):
    i_v, i_nh, _ = grid_ids(tl.cdiv(V, BV), FOLD)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    p_state = (i_nh.to(tl.int64) * K + o_k[:, None]) * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(h0 + p_state, mask=m_kv, other=0)
    for t in range(bos, eos):
        b_q = tl.load(q + (t * H + i_h) * K + o_k, mask=m_k, other=0).to(tl.float32) * scale  # [BK]
        b_k = tl.load(k + (t * H + i_h) * K + o_k, mask=m_k, other=0).to(tl.float32)
        b_v = tl.load(v + (t * H + i_h) * V + o_v, mask=m_v, other=0).to(tl.float32)  # [BV]
        if VECTOR_GATE:
            b_g = tl.load(g + (t * H + i_h) * K + o_k, mask=m_k, other=0)
            b_h *= tl.exp(b_g)[:, None]
        else:
            b_h *= tl.exp(tl.load(g + t * H + i_h))
        b_h += b_k[:, None] * b_v[None, :]
        b_o = tl.sum(b_h * b_q[:, None], 0)
        tl.store(o + (t * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_HT:
        tl.store(ht + p_state, b_h, mask=m_kv)


def recurrent_forward(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens):
    """Validated inputs -> ``(o, final_state or None)``; Triton unless the backend is torch or float64."""
    # float64 (oracle inputs) and empty inputs take the torch path: no kernel handles either
    if kernel_backend(q) == "torch" or q.dtype == torch.float64 or q.shape[1] == 0:
        return recurrence(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    plan = prepare_chunks(cu_seqlens, B, T, device=q.device)
    N = plan.num_seqs
    q, k, v, g = (x.contiguous() for x in (q, k, v, g))
    o = torch.empty_like(v)
    ht = torch.empty(N, H, K, V, device=q.device, dtype=torch.float32) if output_final_state else None
    h0 = None if initial_state is None else initial_state.contiguous()
    BK = max(16, next_power_of_2(K))
    BV = min(max(16, next_power_of_2(V)), 32 if BK >= 128 else 64)
    grid, fold = rows_grid(cdiv(V, BV), N * H)
    recurrent_kernel[grid](
        q, k, v, g, o, h0, ht, plan.cu_seqlens, scale, H=H, K=K, V=V, BK=BK, BV=BV, VECTOR_GATE=g.dim() == 4,
        USE_H0=h0 is not None, STORE_HT=output_final_state, FOLD=fold)
    return o, ht


@on_input_device
def recurrent_gla(
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
    """GLA token by token, for decoding (a few tokens against a state). Forward only.

    Args:
        q, k, v, g, scale, initial_state, output_final_state, cu_seqlens, gate_logits: as in
            ``chunk_gla``.

    Returns:
        ``(o [B, T, H, V] in v's dtype, final_state [N, H, K, V] fp32 or None)``.
    """
    _, scale = check_gla_inputs(
        q, k, v, g, vector_gate=True, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
        gate_logits=gate_logits,
    )
    return recurrent_forward(q, k, v, logit_gate_of(g, gate_logits), scale, initial_state, output_final_state,
                             cu_seqlens)
