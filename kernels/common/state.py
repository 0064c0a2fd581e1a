"""Inter-chunk state passing, forward and backward (the only sequential stage).

Per sequence and head, with ``h`` the ``[K, V]`` state before chunk c (``h[c]``, stored in the
input dtype; the running state is fp32 in registers):

- forward: ``v_new = u - w h`` (delta rules; ``v_new = u`` without ``w``),
  ``h <- exp(g_last) h + (k ⊙ exp(g_last - g))^T v_new`` for a scalar cumulative gate g,
  ``h <- diag(exp(gk_last)) h + (k ⊙ exp(gk_last - gk))^T v_new`` for a per-key gate gk.
- backward (chunks in reverse): ``dh[c]`` is the gradient of the state *after* chunk c;
  ``dv2 = dv + (k ⊙ decay) dh[c]``, then
  ``dh <- decay(h) dh + scale (q ⊙ exp(g))^T do - w^T dv2``.

Each program owns one (sequence, head, V-block); splitting V fills the SMs when B*H is small
(fla's state pass is the bottleneck at B = 1). The K axis is whole (``BK = next_pow2(K)``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttr.kernels.common.index import ChunkPlan, tuned
from ttr.kernels.common.tile import tile


@triton.jit
def state_fwd_kernel(k, u, w, g, gk, h, v_new, h0, ht, cu_seqlens, chunk_offsets, H: tl.constexpr,
                     K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     USE_W: tl.constexpr, USE_G: tl.constexpr, USE_GK: tl.constexpr, USE_H0: tl.constexpr,
                     STORE_HT: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = eos - bos
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    o_i = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        p_h0, m_h0 = tile(h0 + i_nh.to(tl.int64) * K * V, 0, i_v * BV, K, V, V, 1, BK, BV)
        b_h += tl.load(p_h0, mask=m_h0, other=0.).to(tl.float32)
    for i_c in range(tl.cdiv(T, BT)):
        p_h, m_h = tile(h + ((boh + i_c) * H + i_h) * K * V, 0, i_v * BV, K, V, V, 1, BK, BV)
        tl.store(p_h, b_h.to(p_h.dtype.element_ty), mask=m_h)
        p_u, m_u = tile(u + (bos * H + i_h) * V, i_c * BT, i_v * BV, T, V, H * V, 1, BT, BV)
        p_k, m_k = tile(k + (bos * H + i_h) * K, 0, i_c * BT, K, T, 1, H * K, BK, BT)
        b_v = tl.load(p_u, mask=m_u, other=0.).to(tl.float32)  # [BT, BV]
        b_k = tl.load(p_k, mask=m_k, other=0.)  # [BK, BT]
        if USE_W:
            p_w, m_w = tile(w + (bos * H + i_h) * K, i_c * BT, 0, T, K, H * K, 1, BT, BK)
            b_w = tl.load(p_w, mask=m_w, other=0.)
            b_v -= tl.dot(b_w, b_h.to(b_w.dtype))
            p_vn, m_vn = tile(v_new + (bos * H + i_h) * V, i_c * BT, i_v * BV, T, V, H * V, 1, BT, BV)
            tl.store(p_vn, b_v.to(p_vn.dtype.element_ty), mask=m_vn)
        last = tl.minimum((i_c + 1) * BT, T) - 1
        m_t = i_c * BT + o_i < T
        if USE_G:
            b_gl = tl.load(g + (bos + last) * H + i_h)
            b_g = tl.load(g + (bos + i_c * BT + o_i) * H + i_h, mask=m_t, other=0.)
            b_v *= tl.exp(tl.where(m_t, b_gl - b_g, 0.))[:, None]
            b_h *= tl.exp(b_gl)
        if USE_GK:
            b_gkl = tl.load(gk + ((bos + last) * H + i_h) * K + o_k, mask=o_k < K, other=0.)
            p_gk, m_gk = tile(gk + (bos * H + i_h) * K, 0, i_c * BT, K, T, 1, H * K, BK, BT)
            b_gk = tl.load(p_gk, mask=m_gk, other=0.)
            b_k = (b_k * tl.exp(tl.where(m_t[None, :], b_gkl[:, None] - b_gk, 0.))).to(b_k.dtype)
            b_h *= tl.exp(b_gkl)[:, None]
        b_h += tl.dot(b_k, b_v.to(b_k.dtype))
    if STORE_HT:
        p_ht, m_ht = tile(ht + i_nh.to(tl.int64) * K * V, 0, i_v * BV, K, V, V, 1, BK, BV)
        tl.store(p_ht, b_h.to(p_ht.dtype.element_ty), mask=m_ht)


@triton.jit
def state_bwd_kernel(q, k, w, g, gk, do, dv, dh, dv2, dht, dh0, cu_seqlens, chunk_offsets, scale,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                     BV: tl.constexpr, USE_W: tl.constexpr, USE_G: tl.constexpr, USE_GK: tl.constexpr,
                     USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = eos - bos
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    o_i = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        p_dht, m_dht = tile(dht + i_nh.to(tl.int64) * K * V, 0, i_v * BV, K, V, V, 1, BK, BV)
        b_dh += tl.load(p_dht, mask=m_dht, other=0.).to(tl.float32)
    NC = tl.cdiv(T, BT)
    for i_r in range(NC):
        i_c = NC - 1 - i_r
        p_dh, m_dh = tile(dh + ((boh + i_c) * H + i_h) * K * V, 0, i_v * BV, K, V, V, 1, BK, BV)
        tl.store(p_dh, b_dh.to(p_dh.dtype.element_ty), mask=m_dh)
        last = tl.minimum((i_c + 1) * BT, T) - 1
        m_t = i_c * BT + o_i < T
        p_k, m_k = tile(k + (bos * H + i_h) * K, i_c * BT, 0, T, K, H * K, 1, BT, BK)
        p_q, m_q = tile(q + (bos * H + i_h) * K, 0, i_c * BT, K, T, 1, H * K, BK, BT)
        p_do, m_do = tile(do + (bos * H + i_h) * V, i_c * BT, i_v * BV, T, V, H * V, 1, BT, BV)
        p_dv, m_dv = tile(dv + (bos * H + i_h) * V, i_c * BT, i_v * BV, T, V, H * V, 1, BT, BV)
        p_dv2, m_dv2 = tile(dv2 + (bos * H + i_h) * V, i_c * BT, i_v * BV, T, V, H * V, 1, BT, BV)
        b_k = tl.load(p_k, mask=m_k, other=0.)  # [BT, BK]
        b_q = tl.load(p_q, mask=m_q, other=0.)  # [BK, BT]
        b_do = tl.load(p_do, mask=m_do, other=0.)  # [BT, BV]
        b_dv = tl.load(p_dv, mask=m_dv, other=0.).to(tl.float32)
        if USE_G:
            b_gl = tl.load(g + (bos + last) * H + i_h)
            b_g = tl.load(g + (bos + i_c * BT + o_i) * H + i_h, mask=m_t, other=0.)
            b_dv += tl.dot(b_k, b_dh.to(b_k.dtype)) * tl.exp(tl.where(m_t, b_gl - b_g, 0.))[:, None]
            b_q = (b_q * tl.exp(b_g)[None, :]).to(b_q.dtype)
            b_dh *= tl.exp(b_gl)
        elif USE_GK:
            b_gkl = tl.load(gk + ((bos + last) * H + i_h) * K + o_k, mask=o_k < K, other=0.)
            p_gk, m_gk = tile(gk + (bos * H + i_h) * K, i_c * BT, 0, T, K, H * K, 1, BT, BK)
            b_gk = tl.load(p_gk, mask=m_gk, other=0.)  # [BT, BK]
            b_kd = (b_k * tl.exp(tl.where(m_t[:, None], b_gkl[None, :] - b_gk, 0.))).to(b_k.dtype)
            b_dv += tl.dot(b_kd, b_dh.to(b_k.dtype))
            b_q = (b_q * tl.exp(tl.trans(b_gk))).to(b_q.dtype)
            b_dh *= tl.exp(b_gkl)[:, None]
        else:
            b_dv += tl.dot(b_k, b_dh.to(b_k.dtype))
        tl.store(p_dv2, b_dv.to(p_dv2.dtype.element_ty), mask=m_dv2)
        b_dh += tl.dot(b_q, b_do.to(b_q.dtype)) * scale
        if USE_W:
            p_w, m_w = tile(w + (bos * H + i_h) * K, 0, i_c * BT, K, T, 1, H * K, BK, BT)
            b_w = tl.load(p_w, mask=m_w, other=0.)
            b_dh -= tl.dot(b_w, b_dv.to(b_w.dtype))
    if STORE_DH0:
        p_dh0, m_dh0 = tile(dh0 + i_nh.to(tl.int64) * K * V, 0, i_v * BV, K, V, V, 1, BK, BV)
        tl.store(p_dh0, b_dh.to(p_dh0.dtype.element_ty), mask=m_dh0)


def _state_blocks(K: int, V: int, programs_per_vblock: int, device, elem: int) -> tuple[int, int, int, int]:
    """BK covers K; BV is the largest block that still gives about one program per SM; the
    software-pipelining depth is what the per-chunk tiles (3 of [BT, BK], 2 of [BT, BV]) leave
    room for in shared memory (measured on the H200: bf16 K=128 fits 3 stages, fp32 or K=256 not)."""
    BK = max(16, triton.next_power_of_2(K))
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    BV = min(64, max(16, triton.next_power_of_2(V)))
    while BV > 16 and programs_per_vblock * triton.cdiv(V, BV) < sms:
        BV //= 2
    if BK >= 256:
        BV = min(BV, 32)
    num_warps = 8 if BK * BV >= 128 * 64 else 4
    stage_bytes = elem * 64 * (3 * BK + 2 * BV)
    num_stages = 3 if stage_bytes <= 64 * 1024 else (2 if stage_bytes <= 96 * 1024 else 1)
    return BK, BV, num_warps, num_stages


def state_fwd(k: torch.Tensor, u: torch.Tensor, plan: ChunkPlan, *, w: torch.Tensor | None = None,
              g: torch.Tensor | None = None, gk: torch.Tensor | None = None,
              initial_state: torch.Tensor | None = None, output_final_state: bool = False):
    """Returns ``(h [NT,H,K,V] in k.dtype, v_new (u itself without w), final_state fp32 or None)``."""
    B, T, H, K = k.shape
    V = u.shape[-1]
    N = plan.num_seqs
    BK, BV, num_warps, num_stages = _state_blocks(K, V, N * H, k.device, k.element_size())
    cfg = tuned("state_fwd", BV=BV, num_warps=num_warps, num_stages=num_stages)
    h = k.new_empty(plan.num_chunks, H, K, V)
    v_new = torch.empty_like(u) if w is not None else u
    ht = k.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else None
    state_fwd_kernel[(triton.cdiv(V, cfg['BV']), N * H)](
        k, u, w, g, gk, h, v_new, initial_state, ht, plan.cu_seqlens, plan.chunk_offsets, H=H, K=K, V=V,
        BT=plan.chunk_size, BK=BK, USE_W=w is not None, USE_G=g is not None, USE_GK=gk is not None,
        USE_H0=initial_state is not None, STORE_HT=output_final_state, **cfg)
    return h, v_new, ht


def state_bwd(q: torch.Tensor, k: torch.Tensor, do: torch.Tensor, dv: torch.Tensor, plan: ChunkPlan, *,
              scale: float, w: torch.Tensor | None = None, g: torch.Tensor | None = None,
              gk: torch.Tensor | None = None, dht: torch.Tensor | None = None, need_dh0: bool = False):
    """Returns ``(dh [NT,H,K,V] in k.dtype, dh0 fp32 or None, dv2)``."""
    B, T, H, K = k.shape
    V = do.shape[-1]
    N = plan.num_seqs
    BK, BV, num_warps, num_stages = _state_blocks(K, V, N * H, k.device, k.element_size())
    cfg = tuned("state_bwd", BV=BV, num_warps=num_warps, num_stages=num_stages)
    dh = k.new_empty(plan.num_chunks, H, K, V)
    dv2 = torch.empty_like(dv)
    dh0 = k.new_empty(N, H, K, V, dtype=torch.float32) if need_dh0 else None
    state_bwd_kernel[(triton.cdiv(V, cfg['BV']), N * H)](
        q, k, w, g, gk, do, dv, dh, dv2, dht, dh0, plan.cu_seqlens, plan.chunk_offsets, scale, H=H, K=K, V=V,
        BT=plan.chunk_size, BK=BK, USE_W=w is not None, USE_G=g is not None, USE_GK=gk is not None,
        USE_DHT=dht is not None, STORE_DH0=need_dh0, **cfg)
    return dh, dh0, dv2
