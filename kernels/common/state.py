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
def _load_half(p, r0, c0, n_r, n_c, s_r, s_c, BR: tl.constexpr, BC: tl.constexpr):
    p_x, m_x = tile(p, r0, c0, n_r, n_c, s_r, s_c, BR, BC)
    return tl.load(p_x, mask=m_x, other=0.)


@triton.jit
def _store_half(p, b, r0, c0, n_r, n_c, s_r, s_c, BR: tl.constexpr, BC: tl.constexpr):
    p_x, m_x = tile(p, r0, c0, n_r, n_c, s_r, s_c, BR, BC)
    tl.store(p_x, b.to(p_x.dtype.element_ty), mask=m_x)


@triton.jit
def _decay_kT(b_k, gk, bos, last, i_c, m_t, i_h, k0, T, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
              BK: tl.constexpr):
    """``k^T ⊙ exp(gk_last - gk)`` for rows k0 .. k0+BK of the key dim, and ``exp(gk_last)``."""
    o_k = k0 + tl.arange(0, BK)
    b_gkl = tl.load(gk + ((bos + last) * H + i_h) * K + o_k, mask=o_k < K, other=0.)
    b_gk = _load_half(gk + (bos * H + i_h) * K, k0, i_c * BT, K, T, 1, H * K, BK, BT)  # [BK, BT]
    b_kd = (b_k * tl.exp(tl.where(m_t[None, :], b_gkl[:, None] - b_gk, 0.))).to(b_k.dtype)
    return b_kd, tl.exp(b_gkl), b_gk


@triton.jit
def state_fwd_kernel(k, u, w, g, gk, h, v_new, h0, ht, cu_seqlens, chunk_offsets, H: tl.constexpr,
                     K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     SPLIT: tl.constexpr, USE_W: tl.constexpr, USE_G: tl.constexpr, USE_GK: tl.constexpr,
                     USE_H0: tl.constexpr, STORE_HT: tl.constexpr):
    # With SPLIT (K > 128) the state is two [BK, BV] halves, rows 0..BK and BK..2BK (see
    # _state_blocks for the one launch shape that is right on the H200).
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = eos - bos
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    o_i = tl.arange(0, BT)
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if SPLIT:
        b_h2 = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        p_h0 = h0 + i_nh.to(tl.int64) * K * V
        b_h += _load_half(p_h0, 0, i_v * BV, K, V, V, 1, BK, BV).to(tl.float32)
        if SPLIT:
            b_h2 += _load_half(p_h0, BK, i_v * BV, K, V, V, 1, BK, BV).to(tl.float32)
    for i_c in range(tl.cdiv(T, BT)):
        p_h = h + ((boh + i_c) * H + i_h) * K * V
        _store_half(p_h, b_h, 0, i_v * BV, K, V, V, 1, BK, BV)
        if SPLIT:
            _store_half(p_h, b_h2, BK, i_v * BV, K, V, V, 1, BK, BV)
        p_kb = k + (bos * H + i_h) * K
        b_v = _load_half(u + (bos * H + i_h) * V, i_c * BT, i_v * BV, T, V, H * V, 1, BT, BV).to(tl.float32)
        b_k = _load_half(p_kb, 0, i_c * BT, K, T, 1, H * K, BK, BT)  # [BK, BT]
        if SPLIT:
            b_k2 = _load_half(p_kb, BK, i_c * BT, K, T, 1, H * K, BK, BT)
        if USE_W:
            p_wb = w + (bos * H + i_h) * K
            b_w = _load_half(p_wb, i_c * BT, 0, T, K, H * K, 1, BT, BK)  # [BT, BK]
            b_v -= tl.dot(b_w, b_h.to(b_w.dtype))
            if SPLIT:
                b_w2 = _load_half(p_wb, i_c * BT, BK, T, K, H * K, 1, BT, BK)
                b_v -= tl.dot(b_w2, b_h2.to(b_w2.dtype))
            _store_half(v_new + (bos * H + i_h) * V, b_v, i_c * BT, i_v * BV, T, V, H * V, 1, BT, BV)
        last = tl.minimum((i_c + 1) * BT, T) - 1
        m_t = i_c * BT + o_i < T
        if USE_G:
            b_gl = tl.load(g + (bos + last) * H + i_h)
            b_g = tl.load(g + (bos + i_c * BT + o_i) * H + i_h, mask=m_t, other=0.)
            b_v *= tl.exp(tl.where(m_t, b_gl - b_g, 0.))[:, None]
            b_h *= tl.exp(b_gl)
            if SPLIT:
                b_h2 *= tl.exp(b_gl)
        if USE_GK:
            b_k, b_dec, _ = _decay_kT(b_k, gk, bos, last, i_c, m_t, i_h, 0, T, H, K, BT, BK)
            b_h *= b_dec[:, None]
            if SPLIT:
                b_k2, b_dec2, _ = _decay_kT(b_k2, gk, bos, last, i_c, m_t, i_h, BK, T, H, K, BT, BK)
                b_h2 *= b_dec2[:, None]
        b_h += tl.dot(b_k, b_v.to(b_k.dtype))
        if SPLIT:
            b_h2 += tl.dot(b_k2, b_v.to(b_k2.dtype))
    if STORE_HT:
        p_ht = ht + i_nh.to(tl.int64) * K * V
        _store_half(p_ht, b_h, 0, i_v * BV, K, V, V, 1, BK, BV)
        if SPLIT:
            _store_half(p_ht, b_h2, BK, i_v * BV, K, V, V, 1, BK, BV)


@triton.jit
def state_bwd_kernel(q, k, w, g, gk, do, dv, dh, dv2, dht, dh0, cu_seqlens, chunk_offsets, scale,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                     BV: tl.constexpr, SPLIT: tl.constexpr, USE_W: tl.constexpr, USE_G: tl.constexpr,
                     USE_GK: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = eos - bos
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    o_i = tl.arange(0, BT)
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if SPLIT:
        b_dh2 = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        p_dht = dht + i_nh.to(tl.int64) * K * V
        b_dh += _load_half(p_dht, 0, i_v * BV, K, V, V, 1, BK, BV).to(tl.float32)
        if SPLIT:
            b_dh2 += _load_half(p_dht, BK, i_v * BV, K, V, V, 1, BK, BV).to(tl.float32)
    NC = tl.cdiv(T, BT)
    for i_r in range(NC):
        i_c = NC - 1 - i_r
        p_dh = dh + ((boh + i_c) * H + i_h) * K * V
        _store_half(p_dh, b_dh, 0, i_v * BV, K, V, V, 1, BK, BV)
        if SPLIT:
            _store_half(p_dh, b_dh2, BK, i_v * BV, K, V, V, 1, BK, BV)
        last = tl.minimum((i_c + 1) * BT, T) - 1
        m_t = i_c * BT + o_i < T
        p_kb = k + (bos * H + i_h) * K
        p_qb = q + (bos * H + i_h) * K
        b_kT = _load_half(p_kb, 0, i_c * BT, K, T, 1, H * K, BK, BT)  # [BK, BT]
        b_q = _load_half(p_qb, 0, i_c * BT, K, T, 1, H * K, BK, BT)  # [BK, BT]
        if SPLIT:
            b_kT2 = _load_half(p_kb, BK, i_c * BT, K, T, 1, H * K, BK, BT)
            b_q2 = _load_half(p_qb, BK, i_c * BT, K, T, 1, H * K, BK, BT)
        b_do = _load_half(do + (bos * H + i_h) * V, i_c * BT, i_v * BV, T, V, H * V, 1, BT, BV)  # [BT, BV]
        b_dv = _load_half(dv + (bos * H + i_h) * V, i_c * BT, i_v * BV, T, V, H * V, 1, BT, BV).to(tl.float32)
        if USE_G:
            b_gl = tl.load(g + (bos + last) * H + i_h)
            b_g = tl.load(g + (bos + i_c * BT + o_i) * H + i_h, mask=m_t, other=0.)
            b_dec = tl.exp(tl.where(m_t, b_gl - b_g, 0.))
            b_kT = (b_kT * b_dec[None, :]).to(b_kT.dtype)
            b_q = (b_q * tl.exp(b_g)[None, :]).to(b_q.dtype)
            if SPLIT:
                b_kT2 = (b_kT2 * b_dec[None, :]).to(b_kT2.dtype)
                b_q2 = (b_q2 * tl.exp(b_g)[None, :]).to(b_q2.dtype)
        if USE_GK:
            b_kT, b_e, b_gk = _decay_kT(b_kT, gk, bos, last, i_c, m_t, i_h, 0, T, H, K, BT, BK)
            b_q = (b_q * tl.exp(b_gk)).to(b_q.dtype)
            if SPLIT:
                b_kT2, b_e2, b_gk2 = _decay_kT(b_kT2, gk, bos, last, i_c, m_t, i_h, BK, T, H, K, BT, BK)
                b_q2 = (b_q2 * tl.exp(b_gk2)).to(b_q2.dtype)
        # dv2 = dv + (k ⊙ decay) dh: the decayed k^T tile is loaded transposed, so k = trans(load)
        b_dv += tl.dot(tl.trans(b_kT), b_dh.to(b_kT.dtype))
        if SPLIT:
            b_dv += tl.dot(tl.trans(b_kT2), b_dh2.to(b_kT2.dtype))
        _store_half(dv2 + (bos * H + i_h) * V, b_dv, i_c * BT, i_v * BV, T, V, H * V, 1, BT, BV)
        if USE_G:
            b_dh *= tl.exp(b_gl)
            if SPLIT:
                b_dh2 *= tl.exp(b_gl)
        if USE_GK:
            b_dh *= b_e[:, None]
            if SPLIT:
                b_dh2 *= b_e2[:, None]
        b_dh += tl.dot(b_q, b_do.to(b_q.dtype)) * scale
        if SPLIT:
            b_dh2 += tl.dot(b_q2, b_do.to(b_q2.dtype)) * scale
        if USE_W:
            p_wb = w + (bos * H + i_h) * K
            b_w = _load_half(p_wb, 0, i_c * BT, K, T, 1, H * K, BK, BT)  # [BK, BT]
            b_dh -= tl.dot(b_w, b_dv.to(b_w.dtype))
            if SPLIT:
                b_w2 = _load_half(p_wb, BK, i_c * BT, K, T, 1, H * K, BK, BT)
                b_dh2 -= tl.dot(b_w2, b_dv.to(b_w2.dtype))
    if STORE_DH0:
        p_dh0 = dh0 + i_nh.to(tl.int64) * K * V
        _store_half(p_dh0, b_dh, 0, i_v * BV, K, V, V, 1, BK, BV)
        if SPLIT:
            _store_half(p_dh0, b_dh2, BK, i_v * BV, K, V, V, 1, BK, BV)


def _state_blocks(K: int, V: int, programs_per_vblock: int, device, elem: int, backward: bool):
    """BK covers K (two halves of 128 beyond 128); BV is the largest block that still gives about
    one program per SM (the H200 sweep: B*H = 64 -> BV 64, B*H = 16 -> BV 16); the
    software-pipelining depth is what the per-chunk tiles (3 of [BT, K], 2 of [BT, BV]) leave room
    for in shared memory (bf16 K = 128 fits 3 stages, fp32 or K = 256 not). Warps: 4, except the
    backward at K * BV >= 128 * 64 (8 measured faster there).

    K > 128 (the split state) runs only as BV = 64, 4 warps, 1 stage: on the H200 with Triton 3.6
    every split launch with BV = 16 or 32, or with 8 warps, gave wrong bf16 states or an illegal
    address, while this one matched float64 at K = V = 256, K = 192 / V = 160 and K = 136 / V = 64
    in bf16 and fp32, forward and backward (the launch matrix in docs/benchmarks.md)."""
    split = K > 128
    BK = 128 if split else max(16, triton.next_power_of_2(K))
    KP = 2 * BK if split else BK
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    BV = min(64, max(16, triton.next_power_of_2(V)))
    while BV > 16 and programs_per_vblock * triton.cdiv(V, BV) < 0.9 * sms:
        BV //= 2
    if split:
        return BK, 64, 4, 1, split
    num_warps = 8 if backward and KP * BV >= 128 * 64 else 4
    stage_bytes = elem * 64 * (3 * KP + 2 * BV)
    num_stages = 3 if stage_bytes <= 64 * 1024 else (2 if stage_bytes <= 96 * 1024 else 1)
    return BK, BV, num_warps, num_stages, split


def _checked(cfg: dict, elem: int) -> dict:
    """Refuse the launch shape that is wrong on the H200 (Triton 3.6): 16-bit inputs, one pipeline
    stage and BV < 64 gave states off by ~90 % at K = 128 and 256 (the defaults never pick it; a
    TUNING override or sweep might)."""
    if elem == 2 and cfg["num_stages"] == 1 and cfg["BV"] < 64:
        raise ValueError(f"state pass launch {cfg}: with 16-bit inputs num_stages=1 needs BV >= 64 "
                         "(smaller BV gives wrong states on the H200 with Triton 3.6)")
    return cfg


def state_fwd(k: torch.Tensor, u: torch.Tensor, plan: ChunkPlan, *, w: torch.Tensor | None = None,
              g: torch.Tensor | None = None, gk: torch.Tensor | None = None,
              initial_state: torch.Tensor | None = None, output_final_state: bool = False):
    """Returns ``(h [NT,H,K,V] in k.dtype, v_new (u itself without w), final_state fp32 or None)``."""
    B, T, H, K = k.shape
    V = u.shape[-1]
    N = plan.num_seqs
    BK, BV, num_warps, num_stages, split = _state_blocks(K, V, N * H, k.device, k.element_size(), False)
    cfg = dict(BV=BV, num_warps=num_warps, num_stages=num_stages)
    cfg = cfg if split else _checked(tuned("state_fwd", **cfg), k.element_size())
    h = k.new_empty(plan.num_chunks, H, K, V)
    v_new = torch.empty_like(u) if w is not None else u
    ht = k.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else None
    state_fwd_kernel[(triton.cdiv(V, cfg['BV']), N * H)](
        k, u, w, g, gk, h, v_new, initial_state, ht, plan.cu_seqlens, plan.chunk_offsets, H=H, K=K, V=V,
        BT=plan.chunk_size, BK=BK, SPLIT=split, USE_W=w is not None, USE_G=g is not None, USE_GK=gk is not None,
        USE_H0=initial_state is not None, STORE_HT=output_final_state, **cfg)
    return h, v_new, ht


def state_bwd(q: torch.Tensor, k: torch.Tensor, do: torch.Tensor, dv: torch.Tensor, plan: ChunkPlan, *,
              scale: float, w: torch.Tensor | None = None, g: torch.Tensor | None = None,
              gk: torch.Tensor | None = None, dht: torch.Tensor | None = None, need_dh0: bool = False):
    """Returns ``(dh [NT,H,K,V] in k.dtype, dh0 fp32 or None, dv2)``."""
    B, T, H, K = k.shape
    V = do.shape[-1]
    N = plan.num_seqs
    BK, BV, num_warps, num_stages, split = _state_blocks(K, V, N * H, k.device, k.element_size(), True)
    cfg = dict(BV=BV, num_warps=num_warps, num_stages=num_stages)
    cfg = cfg if split else _checked(tuned("state_bwd", **cfg), k.element_size())
    dh = k.new_empty(plan.num_chunks, H, K, V)
    dv2 = torch.empty_like(dv)
    dh0 = k.new_empty(N, H, K, V, dtype=torch.float32) if need_dh0 else None
    state_bwd_kernel[(triton.cdiv(V, cfg['BV']), N * H)](
        q, k, w, g, gk, do, dv, dh, dv2, dht, dh0, plan.cu_seqlens, plan.chunk_offsets, scale, H=H, K=K, V=V,
        BT=plan.chunk_size, BK=BK, SPLIT=split, USE_W=w is not None, USE_G=g is not None, USE_GK=gk is not None,
        USE_DHT=dht is not None, STORE_DH0=need_dh0, **cfg)
    return dh, dh0, dv2
