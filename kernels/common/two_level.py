"""The two-level state pass of long sequences without the delta term (``state``'s module docstring
says when it runs and why): every chunk's term of the element-wise recursion in parallel
(``chunk_terms``: ``ΔS`` forward, ``ΔD`` backward), a walk over the chunks with one fma a step
(``scan``), and the backward's state share of dv chunk-parallel (``dv_with_states``). Launches are
tuned under "state_fwd_chunk", "state_fwd_scan", "state_bwd_chunk", "state_bwd_scan" and
"state_bwd_dv"."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttr.kernels.common.approx import fast_exp
from ttr.kernels.common.index import (
    ChunkPlan,
    block_size,
    cdiv,
    next_power_of_2,
    rows_grid,
    token_stride,
    tuned,
)
from ttr.kernels.common.tile import (
    chunk_gate,
    chunk_span,
    decay_kT,
    grid_ids,
    load_tile,
    qk_rows,
    store_tile,
)


@triton.jit
def gated_xT(b_x, g, gk, bos, T, i_c, i_h, k0, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
             BK: tl.constexpr, USE_G: tl.constexpr, USE_GK: tl.constexpr, DECAY: tl.constexpr):
    """The chunk's transposed key or query tile ``b_x [BK, BT]`` (key rows k0 .. k0+BK) times
    ``exp(g_last - g)`` (DECAY: the decayed keys of the state update) or ``exp(g)`` (the gated
    queries of the state gradient). Every exponent is <= 0; padded tokens (zero columns of b_x)
    get a finite factor."""
    last = tl.minimum((i_c + 1) * BT, T) - 1
    if USE_G:
        b_g = chunk_gate(g, bos + i_c * BT, T - i_c * BT, i_h, H, BT)  # [BT]
        if DECAY:
            b_g = tl.load(g + (bos + last) * H + i_h) - b_g
        b_x = (b_x * fast_exp(b_g)[None, :]).to(b_x.dtype)
    if USE_GK:
        if DECAY:
            m_t = i_c * BT + tl.arange(0, BT) < T
            b_x, _, _ = decay_kT(b_x, gk, bos, last, i_c, m_t, i_h, k0, T, H, K, BT, BK)
        else:
            b_gk = load_tile(gk + (bos * H + i_h) * K, k0, i_c * BT, K, T, 1, H * K, BK, BT)  # [BK, BT]
            b_x = (b_x * fast_exp(b_gk)).to(b_x.dtype)
    return b_x


@triton.jit
def state_chunk_kernel(x, y, ys, g, gk, out, cu_seqlens, chunk_indices, seq_len, scale, H: tl.constexpr,
                       HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                       BV: tl.constexpr, USE_G: tl.constexpr, USE_GK: tl.constexpr, DECAY: tl.constexpr,
                       USE_YS: tl.constexpr, FOLD: tl.constexpr):
    """One chunk's term of the element-wise recursion, ``out[i_t] = scale (x ⊙ f)^T y`` (fp32):
    ``ΔS`` (x = k, y = v, f = exp(g_last - g), DECAY) or ``ΔD`` (x = q, y = do, f = exp(g)); with
    USE_YS the rows of y are scaled by ``ys [B, T, H]`` first (``state_fwd``'s ``u_scale``)."""
    i_kv, i_t, i_h = grid_ids(tl.cdiv(K, BK) * tl.cdiv(V, BV), FOLD)
    i_k, i_v = i_kv // tl.cdiv(V, BV), i_kv % tl.cdiv(V, BV)
    i_n, i_c, bos, eos = chunk_span(chunk_indices, cu_seqlens, seq_len, i_t, BT)
    T = eos - bos
    b_x = load_tile(qk_rows(x, bos, i_h, H, HK, K), i_k * BK, i_c * BT, K, T, 1, HK * K, BK, BT)  # [BK, BT]
    b_x = gated_xT(b_x, g, gk, bos, T, i_c, i_h, i_k * BK, H, K, BT, BK, USE_G, USE_GK, DECAY)
    b_y = load_tile(y + (bos * H + i_h) * V, i_c * BT, i_v * BV, T, V, H * V, 1, BT, BV)  # [BT, BV]
    if USE_YS:
        o_t = i_c * BT + tl.arange(0, BT)
        b_y = b_y * tl.load(ys + (bos + o_t) * H + i_h, mask=o_t < T, other=0.)[:, None]
    b_s = tl.dot(b_x, b_y.to(b_x.dtype)) * scale
    store_tile(out + (i_t.to(tl.int64) * H + i_h) * K * V, b_s, i_k * BK, i_v * BV, K, V, V, 1, BK, BV)


@triton.jit
def state_scan_kernel(d, g, gk, h, s0, sT, cu_seqlens, chunk_offsets, H: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr,
                      USE_GK: tl.constexpr, USE_S0: tl.constexpr, STORE_ST: tl.constexpr, REVERSE: tl.constexpr,
                      STAGES: tl.constexpr):
    """``s <- a_c ⊙ s + d[c]`` over the chunks of one sequence for one ``[BK, BV]`` tile, storing
    ``s`` *before* each step to ``h[c]``: the forward states (chunks in order, s0 the initial
    state, sT the final one) or, with REVERSE, the state gradients ``dh`` (s0 = dht, sT = dh0)."""
    i_nh, i_k, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = eos - bos
    NC = tl.cdiv(T, BT)
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    o_k = i_k * BK + tl.arange(0, BK)
    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_S0:
        b_s += load_tile(s0 + i_nh.to(tl.int64) * K * V, i_k * BK, i_v * BV, K, V, V, 1, BK, BV).to(tl.float32)
    # The software pipeliner prefetches the loads of later steps (they do not depend on s); it
    # skips loads of a scalar, so the scalar gate is read as a [BK, 1] tile of one address.
    for i_r in tl.range(0, NC, num_stages=STAGES):
        if REVERSE:
            i_c = NC - 1 - i_r
        else:
            i_c = i_r
        p_c = ((boh + i_c) * H + i_h) * K * V
        store_tile(h + p_c, b_s, i_k * BK, i_v * BV, K, V, V, 1, BK, BV)
        last = bos + tl.minimum((i_c + 1) * BT, T) - 1
        if USE_G:
            b_s *= fast_exp(tl.load(g + last * H + i_h + tl.zeros([BK, 1], dtype=tl.int32)))
        if USE_GK:
            b_s *= fast_exp(tl.load(gk + (last * H + i_h) * K + o_k, mask=o_k < K, other=0.))[:, None]
        b_s += load_tile(d + p_c, i_k * BK, i_v * BV, K, V, V, 1, BK, BV)
    if STORE_ST:
        store_tile(sT + i_nh.to(tl.int64) * K * V, b_s, i_k * BK, i_v * BV, K, V, V, 1, BK, BV)


@triton.jit
def state_dv_kernel(k, g, gk, dh, dv, dv2, cu_seqlens, chunk_indices, seq_len, SDV, H: tl.constexpr,
                    HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                    BV: tl.constexpr, USE_G: tl.constexpr, USE_GK: tl.constexpr, FOLD: tl.constexpr):
    """``dv2 = dv + (k ⊙ exp(g_last - g)) dh[c]``, chunk-parallel (``dh`` already known); ``SDV`` is
    dv2's token stride."""
    i_v, i_t, i_h = grid_ids(tl.cdiv(V, BV), FOLD)
    i_n, i_c, bos, eos = chunk_span(chunk_indices, cu_seqlens, seq_len, i_t, BT)
    T = eos - bos
    b_dv = load_tile(dv + (bos * H + i_h) * V, i_c * BT, i_v * BV, T, V, H * V, 1, BT, BV).to(tl.float32)
    p_dh = dh + (i_t.to(tl.int64) * H + i_h) * K * V
    for i_k in range(tl.cdiv(K, BK)):
        b_kT = load_tile(qk_rows(k, bos, i_h, H, HK, K), i_k * BK, i_c * BT, K, T, 1, HK * K, BK, BT)  # [BK, BT]
        b_kT = gated_xT(b_kT, g, gk, bos, T, i_c, i_h, i_k * BK, H, K, BT, BK, USE_G, USE_GK, True)
        b_dh = load_tile(p_dh, i_k * BK, i_v * BV, K, V, V, 1, BK, BV)  # [BK, BV]
        # the decayed k^T tile is loaded transposed (as in the sequential backward), so k = trans(load)
        b_dv += tl.dot(tl.trans(b_kT), b_dh.to(b_kT.dtype))
    store_tile(dv2 + bos * SDV + i_h * V, b_dv, i_c * BT, i_v * BV, T, V, SDV, 1, BT, BV)


def chunk_terms(x: torch.Tensor, y: torch.Tensor, plan: ChunkPlan, *, g, gk, scale: float, decay: bool,
                stage: str, y_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``ΔS`` (decay: x = k, y = v, the rows of v times ``y_scale`` when given) or ``ΔD`` (x = q,
    y = do), fp32 ``[NT, H, K, V]``."""
    B, T, HK, K = x.shape
    H, V = y.shape[2:]
    cfg = tuned(stage, BK=block_size(K, 64), BV=block_size(V, 64), num_warps=4)
    out = torch.empty(plan.num_chunks, H, K, V, device=x.device, dtype=torch.float32)
    grid, fold = rows_grid(cdiv(K, cfg["BK"]) * cdiv(V, cfg["BV"]), plan.num_chunks, H)
    state_chunk_kernel[grid](x, y, y_scale, g, gk, out, plan.cu_seqlens, plan.chunk_indices, plan.seq_len, scale,
                             H=H, HK=HK, K=K, V=V, BT=plan.chunk_size, USE_G=g is not None, USE_GK=gk is not None,
                             DECAY=decay, USE_YS=y_scale is not None, FOLD=fold, **cfg)
    return out


def scan(d: torch.Tensor, plan: ChunkPlan, *, g, gk, start, need_end: bool, dtype: torch.dtype, reverse: bool,
         stage: str):
    """Walks ``d`` (``chunk_terms``) over the chunks: ``(h or dh in dtype, final state fp32 or None)``.
    Small tiles (default ``[32, 32]``: 256 programs at B*H = 16, K = V = 128) so that many programs
    stream at once; each step is one fma on a tile, so the chain is bound by the loads, which the
    pipeliner keeps ``num_stages - 1`` steps ahead (4 KB of shared memory per stage at [32, 32])."""
    NT, H, K, V = d.shape
    N = plan.num_seqs
    cfg = tuned(stage, BK=min(32, next_power_of_2(K)), BV=min(32, next_power_of_2(V)), num_warps=4,
                num_stages=4)
    h = torch.empty(d.shape, device=d.device, dtype=dtype)
    end = torch.empty(N, H, K, V, device=d.device, dtype=torch.float32) if need_end else None
    grid = (N * H, cdiv(K, cfg["BK"]), cdiv(V, cfg["BV"]))
    state_scan_kernel[grid](d, g, gk, h, start, end, plan.cu_seqlens, plan.chunk_offsets, H=H, K=K, V=V,
                            BT=plan.chunk_size, USE_G=g is not None, USE_GK=gk is not None, USE_S0=start is not None,
                            STORE_ST=need_end, REVERSE=reverse, STAGES=cfg["num_stages"], **cfg)
    return h, end


def dv_with_states(k: torch.Tensor, dh: torch.Tensor, dv: torch.Tensor, plan: ChunkPlan, *, g, gk,
                   out: torch.Tensor | None) -> torch.Tensor:
    """``state_dv_kernel`` over every chunk: ``dv2`` (in ``out`` where given, at its token stride)."""
    B, T, HK, K = k.shape
    H, V = dv.shape[2:]
    # K / BK <= 4 steps: a deeper pipeline only takes shared memory (fp32 with gk: 131 KB at 3 stages)
    cfg = tuned("state_bwd_dv", BK=block_size(K, 64), BV=block_size(V, 64), num_warps=4, num_stages=2)
    dv2 = torch.empty_like(dv) if out is None else out
    grid, fold = rows_grid(cdiv(V, cfg["BV"]), plan.num_chunks, H)
    state_dv_kernel[grid](
        k, g, gk, dh, dv, dv2, plan.cu_seqlens, plan.chunk_indices, plan.seq_len,
        token_stride("dv_out", dv2, dv.shape), H=H, HK=HK, K=K, V=V, BT=plan.chunk_size, USE_G=g is not None,
        USE_GK=gk is not None, FOLD=fold, **cfg)
    return dv2
