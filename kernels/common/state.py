"""Inter-chunk state passing, forward and backward (the only sequential stage).

Per sequence and head, with ``h`` the ``[K, V]`` state before chunk c (``h[c]``, stored in the
input dtype; the running state is fp32 in registers):

- forward: ``v_new = u - w h`` (delta rules; ``v_new = u`` without ``w``),
  ``h <- exp(g_last) h + (k ⊙ exp(g_last - g))^T v_new`` for a scalar cumulative gate g,
  ``h <- diag(exp(gk_last)) h + (k ⊙ exp(gk_last - gk))^T v_new`` for a per-key gate gk.
- backward (chunks in reverse): ``dh[c]`` is the gradient of the state *after* chunk c;
  ``dv2 = dv + (k ⊙ decay) dh[c]``, then
  ``dh <- decay(h) dh + scale (q ⊙ exp(g))^T do - w^T dv2``.

Two implementations:

- Sequential (``state_fwd_kernel`` / ``state_bwd_kernel``; always for the delta rules, whose
  update ``(I - w^T k) h`` mixes the rows of the state). Each program owns one (sequence, head,
  V-block) and walks the chunks, a ``[K, 64] x [64, BV]`` product per step; splitting V fills the
  SMs when B*H is small (fla's state pass is the bottleneck at B = 1). The K axis is whole
  (``BK = next_pow2(K)``, two halves of 128 beyond 128). Per step every program re-reads the
  chunk's k (and gate) tile, so the walk's time grows with the chunks of the longest sequence
  and, at small B*H, is latency- rather than bandwidth-bound.
- Two-level (``two_level.py``; without ``w``, for long sequences: GLA, simple GLA / SSD, no gate),
  as Mamba2's SSD does it (chunk_state + state_passing). Without ``w`` the recursion is element-wise
  in the state, ``h[c+1] = a_c ⊙ h[c] + ΔS_c`` with ``a_c = exp(g_last)`` (a scalar) or
  ``exp(gk_last)`` (per key row) and ``ΔS_c = (k ⊙ exp(g_last - g))^T v`` (no matrix product
  depends on the chain), so (1) ``state_chunk_kernel`` computes every ``ΔS_c`` in parallel over
  chunks, heads and K/V blocks (fp32 ``[NT, H, K, V]``, transient), and (2) ``state_scan_kernel``
  walks the chunks per (sequence, head, small K x V tile) with only an fma per step; its loads do
  not depend on the chain, so the loop is software-pipelined (``tl.range(num_stages=...)``). The backward is the
  same pair in reverse, ``ΔD_c = scale (q ⊙ exp(g))^T do`` and ``dh[c-1] = a_c ⊙ dh[c] + ΔD_c``,
  then ``state_dv_kernel`` forms ``dv2 = dv + (k ⊙ exp(g_last - g)) dh[c]`` chunk-parallel.
  It moves more bytes (the fp32 terms are written and read once: 2 - 3x the sequential
  pass's HBM traffic at K = V = 128 in bf16) but no step of the chain waits on a matrix product or
  on a re-read of k; it is bandwidth-bound at any B*H, where the sequential pass is
  latency-bound once B*H * V / BV falls below the number of SMs.

Choosing the path: without ``w``, the two-level pass runs when the sequences average at least
``TWO_LEVEL_MIN_CHUNKS`` chunks (where it starts to win; shorter sequences fill the GPU with the
sequential walk, which moves 2 - 3x fewer bytes), except with a scalar gate (or none): its forward
walks at every length, its backward unless few (sequence, head) pairs share the GPU
(``_two_level``); ``index.TUNING["state_fwd"] = {"two_level": False or True}`` (and ``"state_bwd"``)
forces either (both paths agree to rounding). Launch parameters of the two-level kernels are tuned
under "state_fwd_chunk", "state_fwd_scan", "state_bwd_chunk", "state_bwd_scan" ({"BK", "BV",
"num_warps", "num_stages"}; the scan tile is ``[BK, BV]``) and "state_bwd_dv"; those of the
sequential kernels under "state_fwd", "state_fwd_again" (a backward's walk forming the states
again) and "state_bwd" ({"BV", "num_warps", "num_stages"}).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttr.kernels.common import two_level as two_level_pass
from ttr.kernels.common.approx import fast_exp
from ttr.kernels.common.index import (
    ChunkPlan,
    block_size,
    cdiv,
    next_power_of_2,
    rows_grid,
    sm_count,
    token_stride,
    tuned,
)
from ttr.kernels.common.output import chunk_output, dv_scores, output_bwd_dv, output_fwd
from ttr.kernels.common.tile import (
    chunk_gate,
    chunk_gate_last,
    decay_kT,
    grid_ids,
    load_tile,
    qk_rows,
    store_tile,
)


@triton.jit
def state_fwd_kernel(k, u, us, w, g, gk, h, v_new, h0, ht, q, s, o, skip, scale, cu_seqlens, chunk_offsets,
                     H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, SPLIT: tl.constexpr, USE_W: tl.constexpr, USE_G: tl.constexpr,
                     USE_GK: tl.constexpr, USE_US: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr,
                     STORE_H: tl.constexpr, OUTPUT: tl.constexpr, KEPT_S: tl.constexpr, USE_SKIP: tl.constexpr,
                     FOLD: tl.constexpr):
    # With SPLIT (K > 128) the state is two [BK, BV] halves, rows 0..BK and BK..2BK (see
    # _state_blocks for the one launch shape that is right on Hopper). OUTPUT: the walk also forms
    # the output stage's o (``output.output_fwd``'s products) from the state it holds and the chunk's
    # q, k and v_new tiles; KEPT_S: it reads the chunk's scores ``q k^T ⊙ causal ⊙ Γ`` from ``s``
    # (``wy.wy_fwd``'s) instead of forming them (USE_GK: GLA's scaled A, o = scale (q ⊙ exp(gk)) h + s v);
    # USE_SKIP: o also gets ``skip[h] u`` (SSD's ``D x``, of the unscaled values), in fp32 before its
    # one rounding; STORE_H off: the states are not written (nothing reads them).
    i_v, i_nh, _ = grid_ids(tl.cdiv(V, BV), FOLD)
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
        b_h += load_tile(p_h0, 0, i_v * BV, K, V, V, 1, BK, BV).to(tl.float32)
        if SPLIT:
            b_h2 += load_tile(p_h0, BK, i_v * BV, K, V, V, 1, BK, BV).to(tl.float32)
    if not USE_G:
        b_g = None  # chunk_output's gate
    for i_c in range(tl.cdiv(T, BT)):
        if USE_W and USE_G:
            # the delta rules' walks read the chunk's gate at the head of the step, so that its loads
            # (not among the pipelined tiles) are in flight during the products; SSD's walks timed
            # no faster so on an H200, and the other walks read it where it is first used
            # (docs/benchmarks.md, the choices table)
            b_g, b_gl = chunk_gate_last(g, bos + i_c * BT, T - i_c * BT, i_h, H, BT)
        if STORE_H:
            p_h = h + ((boh + i_c) * H + i_h) * K * V
            store_tile(p_h, b_h, 0, i_v * BV, K, V, V, 1, BK, BV)
            if SPLIT:
                store_tile(p_h, b_h2, BK, i_v * BV, K, V, V, 1, BK, BV)
        p_kb = qk_rows(k, bos, i_h, H, HK, K)
        b_v = load_tile(u + (bos * H + i_h) * V, i_c * BT, i_v * BV, T, V, H * V, 1, BT, BV).to(tl.float32)
        b_k = load_tile(p_kb, 0, i_c * BT, K, T, 1, HK * K, BK, BT)  # [BK, BT]
        last = tl.minimum((i_c + 1) * BT, T) - 1
        m_t = i_c * BT + o_i < T
        if USE_US:
            # the values are u's rows times a scale (SSD: x dt), formed here in fp32 before the
            # products' one rounding instead of as a tensor of their own
            b_v *= tl.load(us + (bos + i_c * BT + o_i) * H + i_h, mask=m_t, other=0.)[:, None]
        if SPLIT:
            b_k2 = load_tile(p_kb, BK, i_c * BT, K, T, 1, HK * K, BK, BT)
        if USE_GK:
            # before the output's products: its q ⊙ exp(gk) takes the gate's tile from here
            b_kd, b_dec, b_gkT = decay_kT(b_k, gk, bos, last, i_c, m_t, i_h, 0, T, H, K, BT, BK)
            if SPLIT:
                b_kd2, b_dec2, _ = decay_kT(b_k2, gk, bos, last, i_c, m_t, i_h, BK, T, H, K, BT, BK)
        if OUTPUT:
            # q h with the state before the chunk (rounded as a stored h would be) and q k^T
            tl.static_assert(not SPLIT, "the walk forms the output at K <= 128 (state_fwd)")
            b_q = load_tile(qk_rows(q, bos, i_h, H, HK, K), i_c * BT, 0, T, K, HK * K, 1, BT, BK)  # [BT, BK]
            if USE_GK:
                tl.static_assert(KEPT_S, "with a per-key gate the walk reads the kept scores (state_fwd)")
                b_q = (b_q.to(tl.float32) * fast_exp(tl.trans(b_gkT))).to(b_q.dtype)  # as vector_gate_output
            b_o = tl.dot(b_q, b_h.to(b_q.dtype))
            if KEPT_S:
                b_A = load_tile(s + (bos * H + i_h) * BT, i_c * BT, 0, T, BT, H * BT, 1, BT, BT)
            else:
                b_A = tl.dot(b_q, b_k)
        if USE_W:
            p_wb = w + (bos * H + i_h) * K
            b_w = load_tile(p_wb, i_c * BT, 0, T, K, H * K, 1, BT, BK)  # [BT, BK]
            b_v -= tl.dot(b_w, b_h.to(b_w.dtype))
            if SPLIT:
                b_w2 = load_tile(p_wb, i_c * BT, BK, T, K, H * K, 1, BT, BK)
                b_v -= tl.dot(b_w2, b_h2.to(b_w2.dtype))
            store_tile(v_new + (bos * H + i_h) * V, b_v, i_c * BT, i_v * BV, T, V, H * V, 1, BT, BV)
            # the update reads v_new as stored (rounded to its dtype), so that a backward that
            # keeps v_new and walks the chunks again without w forms these states from the same
            # operands (bit for bit where its launch sums the products in the same order)
            b_v = b_v.to(v_new.dtype.element_ty).to(tl.float32)
        if OUTPUT:
            if USE_GK:
                b_o = b_o * scale + tl.dot(b_A.to(b_k.dtype), b_v.to(b_k.dtype))
            else:
                if USE_G and not USE_W:
                    b_g = chunk_gate(g, bos + i_c * BT, T - i_c * BT, i_h, H, BT)
                b_o = chunk_output(b_o, b_A, b_v.to(b_k.dtype), b_g, scale, BT, USE_G, KEPT_S)
            if USE_SKIP:
                # u's tile as loaded (a cache hit) rather than held unscaled beside b_v
                b_o += tl.load(skip + i_h) * load_tile(u + (bos * H + i_h) * V, i_c * BT, i_v * BV, T, V, H * V, 1,
                                                        BT, BV).to(tl.float32)
            store_tile(o + (bos * H + i_h) * V, b_o, i_c * BT, i_v * BV, T, V, H * V, 1, BT, BV)
        if USE_G:
            if not USE_W:
                b_gl = tl.load(g + (bos + last) * H + i_h)
                b_g = tl.load(g + (bos + i_c * BT + o_i) * H + i_h, mask=m_t, other=0.)
            b_v *= fast_exp(tl.where(m_t, b_gl - b_g, 0.))[:, None]
            b_h *= fast_exp(b_gl)
            if SPLIT:
                b_h2 *= fast_exp(b_gl)
        if USE_GK:
            b_k = b_kd
            b_h *= b_dec[:, None]
            if SPLIT:
                b_k2 = b_kd2
                b_h2 *= b_dec2[:, None]
        b_h += tl.dot(b_k, b_v.to(b_k.dtype))
        if SPLIT:
            b_h2 += tl.dot(b_k2, b_v.to(b_k2.dtype))
    if STORE_HT:
        p_ht = ht + i_nh.to(tl.int64) * K * V
        store_tile(p_ht, b_h, 0, i_v * BV, K, V, V, 1, BK, BV)
        if SPLIT:
            store_tile(p_ht, b_h2, BK, i_v * BV, K, V, V, 1, BK, BV)


@triton.jit
def state_bwd_kernel(q, k, w, g, gk, s, do, dv, dh, dv2, dht, dh0, v, dA, cu_seqlens, chunk_offsets, scale, SDV,
                     H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, SPLIT: tl.constexpr, USE_W: tl.constexpr, USE_G: tl.constexpr,
                     USE_GK: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, USE_DV: tl.constexpr,
                     INTRA_DV: tl.constexpr, KEPT_S: tl.constexpr, FORM_DA: tl.constexpr, FOLD: tl.constexpr):
    # INTRA_DV: the output's intra-chunk dv, scale (q k^T ⊙ causal ⊙ Γ)^T do, is formed here from the
    # q, k and do tiles the step loads anyway (``output.output_bwd_dv``'s product) instead of read;
    # KEPT_S: from the kept scores ``q k^T ⊙ causal ⊙ Γ`` in ``s`` (``wy.wy_fwd``'s) and do; with a
    # per-key gate (USE_GK) s is GLA's scaled A, so dv = A^T do; FORM_DA (one value block over all of
    # V): also GLA's ``dA = scale tril(do v^T)`` (``intra_vector_gate.vector_gate_dv_dA``'s), fp32
    i_v, i_nh, _ = grid_ids(tl.cdiv(V, BV), FOLD)
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
        b_dh += load_tile(p_dht, 0, i_v * BV, K, V, V, 1, BK, BV).to(tl.float32)
        if SPLIT:
            b_dh2 += load_tile(p_dht, BK, i_v * BV, K, V, V, 1, BK, BV).to(tl.float32)
    NC = tl.cdiv(T, BT)
    for i_r in range(NC):
        i_c = NC - 1 - i_r
        if USE_W and USE_G:
            # at the head of the step, as in the forward walk
            b_g, b_gl = chunk_gate_last(g, bos + i_c * BT, T - i_c * BT, i_h, H, BT)
        p_dh = dh + ((boh + i_c) * H + i_h) * K * V
        store_tile(p_dh, b_dh, 0, i_v * BV, K, V, V, 1, BK, BV)
        if SPLIT:
            store_tile(p_dh, b_dh2, BK, i_v * BV, K, V, V, 1, BK, BV)
        last = tl.minimum((i_c + 1) * BT, T) - 1
        m_t = i_c * BT + o_i < T
        p_kb = qk_rows(k, bos, i_h, H, HK, K)
        p_qb = qk_rows(q, bos, i_h, H, HK, K)
        b_kT = load_tile(p_kb, 0, i_c * BT, K, T, 1, HK * K, BK, BT)  # [BK, BT]
        b_q = load_tile(p_qb, 0, i_c * BT, K, T, 1, HK * K, BK, BT)  # [BK, BT]
        if SPLIT:
            b_kT2 = load_tile(p_kb, BK, i_c * BT, K, T, 1, HK * K, BK, BT)
            b_q2 = load_tile(p_qb, BK, i_c * BT, K, T, 1, HK * K, BK, BT)
        b_do = load_tile(do + (bos * H + i_h) * V, i_c * BT, i_v * BV, T, V, H * V, 1, BT, BV)  # [BT, BV]
        if INTRA_DV:
            # [j, i] = k_j . q_i, off the chain of dh: only its sum with k dh waits for the chain
            tl.static_assert(not SPLIT, "the walk forms dv at K <= 128 (state_bwd)")
            if KEPT_S:
                b_S = load_tile(s + (bos * H + i_h) * BT, i_c * BT, 0, T, BT, H * BT, 1, BT, BT)
                b_dv = tl.dot(tl.trans(b_S), b_do)
                if not USE_GK:
                    b_dv *= scale
            else:
                b_A = tl.dot(tl.trans(b_kT), b_q)
                b_dv = tl.dot(dv_scores(b_A, g, bos, i_c, T, i_h, scale, H, BT, USE_G).to(b_do.dtype), b_do)
        if FORM_DA:
            # off the chain of dh, from the do tile the step loads anyway and the chunk's values
            tl.static_assert(BV >= V and USE_GK, "dA is formed over whole value rows, with a per-key gate")
            b_vc = load_tile(v + (bos * H + i_h) * V, i_c * BT, 0, T, V, H * V, 1, BT, BV)  # [BT, BV]
            b_dA = tl.where(o_i[:, None] >= o_i[None, :], tl.dot(b_do, tl.trans(b_vc)) * scale, 0.)
            store_tile(dA + (bos * H + i_h) * BT, b_dA, i_c * BT, 0, T, BT, H * BT, 1, BT, BT)
        if USE_G:
            # a scalar gate scales the chunk's rows: it goes on the [BT, BV] side of each product
            # (do's rows, k dh's rows), BV / K of the element-wise work of scaling q's and k's tiles
            if not USE_W:
                b_gl = tl.load(g + (bos + last) * H + i_h)
                b_g = tl.load(g + (bos + i_c * BT + o_i) * H + i_h, mask=m_t, other=0.)
            b_dec = fast_exp(tl.where(m_t, b_gl - b_g, 0.))
            b_do = (b_do * fast_exp(b_g)[:, None]).to(b_do.dtype)
        if USE_GK:
            b_kT, b_e, b_gk = decay_kT(b_kT, gk, bos, last, i_c, m_t, i_h, 0, T, H, K, BT, BK)
            b_q = (b_q * fast_exp(b_gk)).to(b_q.dtype)
            if SPLIT:
                b_kT2, b_e2, b_gk2 = decay_kT(b_kT2, gk, bos, last, i_c, m_t, i_h, BK, T, H, K, BT, BK)
                b_q2 = (b_q2 * fast_exp(b_gk2)).to(b_q2.dtype)
        if USE_DV:
            # dv2 = dv + (k ⊙ decay) dh: the k^T tile is loaded transposed, so k = trans(load)
            if not INTRA_DV:
                b_dv = load_tile(dv + (bos * H + i_h) * V, i_c * BT, i_v * BV, T, V, H * V, 1, BT, BV).to(tl.float32)
            b_kdh = tl.dot(tl.trans(b_kT), b_dh.to(b_kT.dtype))
            if SPLIT:
                b_kdh += tl.dot(tl.trans(b_kT2), b_dh2.to(b_kT2.dtype))
            # k dh must not be added to dv straight from the product: Triton folds x + dot(a, b)
            # into a product that accumulates onto x, so the chain's product would wait for dv's
            # load. The gate's row scale keeps the two apart; without a gate a row mask does (a
            # no-op: k's padded rows are zero). Both timed faster in the state backward on an H200
            # (docs/benchmarks.md); GLA's walk, bound by its per-key decay of k's tile, timed slower
            # with the mask.
            if USE_G:
                b_kdh *= b_dec[:, None]
            elif not USE_GK:
                b_kdh = tl.where(m_t[:, None], b_kdh, 0.)
            b_dv += b_kdh
            store_tile(dv2 + bos * SDV + i_h * V, b_dv, i_c * BT, i_v * BV, T, V, SDV, 1, BT, BV)
        if USE_G:
            b_dh *= fast_exp(b_gl)
            if SPLIT:
                b_dh2 *= fast_exp(b_gl)
        if USE_GK:
            b_dh *= b_e[:, None]
            if SPLIT:
                b_dh2 *= b_e2[:, None]
        b_dh += tl.dot(b_q, b_do.to(b_q.dtype)) * scale
        if SPLIT:
            b_dh2 += tl.dot(b_q2, b_do.to(b_q2.dtype)) * scale
        if USE_W:
            p_wb = w + (bos * H + i_h) * K
            b_w = load_tile(p_wb, 0, i_c * BT, K, T, 1, H * K, BK, BT)  # [BK, BT]
            b_dh -= tl.dot(b_w, b_dv.to(b_w.dtype))
            if SPLIT:
                b_w2 = load_tile(p_wb, BK, i_c * BT, K, T, 1, H * K, BK, BT)
                b_dh2 -= tl.dot(b_w2, b_dv.to(b_w2.dtype))
    if STORE_DH0:
        p_dh0 = dh0 + i_nh.to(tl.int64) * K * V
        store_tile(p_dh0, b_dh, 0, i_v * BV, K, V, V, 1, BK, BV)
        if SPLIT:
            store_tile(p_dh0, b_dh2, BK, i_v * BV, K, V, V, 1, BK, BV)


def _walk(w, gk) -> str:
    """The kind of state walk ``_state_blocks`` picks launches for: "delta" (with ``w``), "vector"
    (a per-key gate ``gk``) or "scalar" (a per-head gate, or none)."""
    return "delta" if w is not None else "vector" if gk is not None else "scalar"


def _state_blocks(K: int, V: int, programs_per_vblock: int, device, elem: int, backward: bool,
                  walk: str, gate: bool = False, forms: bool = False):
    """BK covers K (two halves of 128 beyond 128); BV is the largest block that still gives about
    one program per SM (B*H = 64 -> BV 64, B*H = 16 -> BV 16 on 132 SMs); the
    software-pipelining depth is what the per-chunk tiles (3 of [BT, K], 2 of [BT, BV]) leave room
    for in shared memory (bf16 K = 128 fits 3 stages, fp32 or K = 256 not). Warps: 4, except the
    backward at K * BV >= 128 * 64, whose wider tiles need the registers of 8, and the forward
    without ``w`` (``walk`` "scalar" or "vector" gate rather than "delta") at K >= 128, whose
    running state takes 139 registers per thread on 4 warps and 80 on 8 (SSD, Triton 3.6, sm_90a):
    on an H200, bf16, 8 warps timed faster for SSD's forward (K = 128, V = 64, H = 64) and GLA's
    (K = V = 128, H = 16, two stages); with ``w`` 4 warps stay faster (Gated DeltaNet), and at
    GLA-1.3B's K = 64 too. The vector gate's forward on 8 warps runs 2 stages, which timed faster
    than 3 (docs/benchmarks.md, launch alternatives and launch choices). The vector gate's walk that
    forms the output (``forms``) loads q's and A's tiles too, 48 KB a stage at GLA-1.3B's K = 64, BV =
    64: it runs 2 stages (two programs per SM) where the grid needs them, else 3 (H200: 2 faster at 8 x
    2048 and 8 x 4096, 3 at 4 x 4096). Its backward walk forming dv and dA takes whole value rows on 2
    stages (3 timed faster alone, not in gla-1.3b's step; docs/benchmarks.md, launch choices). A scalar
    gate's forward walk of the states alone at K <= 64 runs 2 stages where the grid holds three
    programs per SM or more, so that two share an SM (H200: SSD's at N = 64, 8 x 2048, not 4 x 4096).

    K > 128 (the split state) runs only as BV = 64, 4 warps, 1 stage: on the H200 with Triton 3.6
    every split launch with BV = 16 or 32, or with 8 warps, gave wrong bf16 states or an illegal
    address, while this one matched float64 at K = V = 256, K = 192 / V = 160 and K = 136 / V = 64
    in bf16 and fp32, forward and backward (docs/benchmarks.md, "Known caveats").

    The backward with a scalar gate at K <= 64 walks on 8 warps with BV <= 32 while the grid is
    small (fewer than 1.5 programs of BV = 64 per SM): its steps are short, and the sequential walk
    is bound by each step's latency, which more warps over narrower tiles hide. On an H200 (SSD at
    H = 64, K = V = 64, bf16) it timed faster at 1 x 16384 and 2 x 8192, where at 4 x 4096 and 8 x
    2048 (256 and 512 programs) BV 64 on 4 warps is ahead; at K = 128 the 8-warp launch measured no
    better. That backward (a scalar gate, any K up to 128) also launches under a register cap of 168,
    timed faster where few programs walk long sequences (SSD at 1 x 16384, K = 128 and 64; unchanged
    at 8 x 2048; docs/benchmarks.md, launch choices); the delta rules' and GLA's walks lose under it.
    It compiles to 100 - 120 registers with or without the cap (``kernel_resources``), so the cap
    changes ptxas's schedule, not the programs per SM.

    DeltaNet's backward (``w``, no gate, 16-bit inputs, one key block of 128) walks rows of 128
    values (8 warps, 2 stages) wherever one program per (sequence, head) and value row already
    fills the GPU: each step then reads the chunk's q, k, w and do tiles once rather than once per
    value block, and at a full grid the walk is bound by those reads. On an H200 (16 heads of
    K = V = 128, 8 x 2048: 128 programs) it timed faster than BV = 64; with half a grid (4 x 4096)
    it lost. The delta rules' other walks over whole rows were slower at 8 x 2048 (the forward's,
    which also forms the output, and the gated backward's) or no faster (the walk that forms h
    again) (docs/benchmarks.md, launch choices).

    Returns ``(BK, split, launch)``, the launch a dict of BV, num_warps, num_stages (and maxnreg)."""
    split = K > 128
    BK = 128 if split else block_size(K, 128)
    KP = 2 * BK if split else BK
    sms = sm_count(device)
    BV = block_size(V, 64)
    if (backward and walk == "delta" and not gate and elem == 2 and KP == 128 and V >= 128
            and programs_per_vblock * cdiv(V, 128) >= 0.9 * sms):
        BV = 128  # 8 warps and 2 stages below
    rows = backward and walk == "vector" and forms
    if rows:
        BV = next_power_of_2(V)  # GLA's walk forming dA takes whole value rows
    while not rows and BV > 16 and programs_per_vblock * cdiv(V, BV) < 0.9 * sms:
        BV //= 2
    if split:
        return BK, split, dict(BV=64, num_warps=4, num_stages=1)
    num_warps = 8 if (KP * BV >= 128 * 64 if backward else walk != "delta" and KP >= 128) else 4
    if backward and walk == "scalar" and KP <= 64 and programs_per_vblock * cdiv(V, 64) < 1.5 * sms:
        BV, num_warps = min(BV, 32), 8
    stage_bytes = elem * 64 * (3 * KP + 2 * BV)
    num_stages = 3 if stage_bytes <= 64 * 1024 else (2 if stage_bytes <= 96 * 1024 else 1)
    programs = programs_per_vblock * cdiv(V, BV)
    states_only = not backward and walk == "scalar" and not forms and KP <= 64 and programs >= 3 * sms
    # the backward walk forming dA (rows) loads A's and v's tiles too: 72 KB a stage at K = 64, V = 128
    if rows or states_only or not backward and walk == "vector" and (num_warps == 8 or forms and programs > sms):
        num_stages = min(num_stages, 2)
    cap = {"maxnreg": 168} if backward and walk == "scalar" else {}
    return BK, split, dict(BV=BV, num_warps=num_warps, num_stages=num_stages, **cap)


def _walk_launch(stage: str, k: torch.Tensor, V: int, programs_per_vblock: int, walk: str, gate: bool,
                 forms: bool = False):
    """``(BK, split, launch)`` of the sequential pass ``stage``: ``_state_blocks``' heuristic under
    ``TUNING[stage]``, the one wrong launch refused (``_checked``) except the split state's."""
    BK, split, cfg = _state_blocks(k.shape[3], V, programs_per_vblock, k.device, k.element_size(),
                                   stage == "state_bwd", walk, gate, forms)
    return BK, split, (cfg if split else _checked(_sequential_cfg(stage, **cfg), k.element_size()))


def _checked(cfg: dict, elem: int) -> dict:
    """Refuse the launch shape that is wrong on the H200 (Triton 3.6): 16-bit inputs, one pipeline
    stage and BV < 64 gave states off by ~90 % at K = 128 and 256 (the defaults never pick it; a
    TUNING override or sweep might)."""
    if elem == 2 and cfg["num_stages"] == 1 and cfg["BV"] < 64:
        raise ValueError(f"state pass launch {cfg}: with 16-bit inputs num_stages=1 needs BV >= 64 "
                         "(smaller BV gives wrong states on the H200 with Triton 3.6)")
    return cfg


# The two-level pass runs (without w) when the sequences average at least this many chunks. The
# sequential walk costs a fixed time per chunk of the longest sequence, the two-level pass a fixed
# time per token (it is bandwidth-bound), so the walk wins on short sequences (many sequences fill
# the GPU) and loses on long ones; timed on GLA at H = 16, K = V = 128, bf16, the two cross between
# 80 and 95 chunks per sequence. The forward with a scalar gate walks at any length: its 8-warp walk
# stayed ahead up to 256 chunks per sequence on an H200 (SSD, H = 64, K = 128, V = 64; simple GLA,
# H = 16, K = V = 128), where the vector gate's two-level forward wins from 128 chunks on (GLA,
# H = 16, K = V = 128).
# The backward with a scalar gate (or none) walks at long sequences too unless at most
# SCALAR_BWD_TWO_LEVEL_MAX_HEADS (sequence, head) pairs share the GPU: on an H200 at 128 and 256
# chunks per sequence the walk stayed ahead for SSD (H = 64, K = 128, V = 64) at both lengths and
# for simple GLA (H = 16, K = V = 128) at 2 x 8192, but lost to the two-level pass at 1 x 16384
# (16 pairs). The times are in docs/benchmarks.md (launch alternatives, launch choices).
TWO_LEVEL_MIN_CHUNKS = 96
SCALAR_FWD_TWO_LEVEL_MIN_CHUNKS: int | None = None  # the scalar-gate forward: never
SCALAR_BWD_TWO_LEVEL_MAX_HEADS = 16


def _two_level(stage: str, w: torch.Tensor | None, plan: ChunkPlan, gk: torch.Tensor | None, *,
               heads: int) -> bool:
    """Two-level without ``w`` for long sequences (``TWO_LEVEL_MIN_CHUNKS``; the forward without a
    vector gate ``gk``: ``SCALAR_FWD_TWO_LEVEL_MIN_CHUNKS``; the backward without it only for at most
    ``SCALAR_BWD_TWO_LEVEL_MAX_HEADS`` sequences times ``heads``); ``TUNING[stage]["two_level"]``
    overrides the choice."""
    if w is not None:
        return False
    least = SCALAR_FWD_TWO_LEVEL_MIN_CHUNKS if stage == "state_fwd" and gk is None else TWO_LEVEL_MIN_CHUNKS
    long_seqs = least is not None and plan.num_chunks >= least * plan.num_seqs
    if stage == "state_bwd" and gk is None:
        long_seqs = long_seqs and plan.num_seqs * heads <= SCALAR_BWD_TWO_LEVEL_MAX_HEADS
    return bool(tuned(stage, two_level=long_seqs)["two_level"])


def _sequential_cfg(stage: str, **defaults) -> dict:
    """The sequential kernels' launch parameters (the path switches are not among them)."""
    cfg = tuned(stage, **defaults)
    for switch in ("two_level", "intra_dv", "output", "scores"):
        cfg.pop(switch, None)
    return cfg


def walk_reads_scores(gated: bool, walks: int, K: int, V: int, device) -> bool:
    """Whether the delta rules' forward has ``wy.wy_fwd`` form the chunks' scores ``q k^T ⊙ causal ⊙
    Γ`` (in q's dtype, kept for the backward) for the state walks to read (``state_fwd(...,
    scores=)``, ``state_bwd(..., scores=)``) instead of the output's launches forming them;
    ``walks`` is the (sequence, head) pairs, ``TUNING["state_fwd"]["scores"]`` overrides. Never at
    K > 128, where the output's launches form the scores (``state_fwd``); by default with a gate,
    where those walks fill the GPU with value blocks of 64. Each walk's step then holds
    neither the scores' fp32 tile nor the gate's ``[BT, BT]`` tile and masks, which spilled the gated
    walks that formed them, and the w, u launch, which loads k and the gate anyway, adds q's tile,
    one product and the scores' store. On narrower value blocks every block's program loads q's and
    the scores' tiles and forms its share of ``q h`` again, where the launches do that once per
    chunk: on an H200 (bf16, 16 heads of K = V = 128) Gated DeltaNet's op timed faster with the kept
    scores at 8 x 2048 and 4 x 4096 and slower at 2 x 8192 and 1 x 16384 (docs/benchmarks.md).
    Without a gate the walks form their own ``q k^T``, off their chains: DeltaNet's step timed
    slower with kept scores (docs/benchmarks.md)."""
    full = walks * cdiv(V, 64) >= 0.9 * sm_count(device)
    return K <= 128 and bool(tuned("state_fwd", scores=gated and full)["scores"])


def walk_can_form_output(K: int, plan: ChunkPlan, heads: int, *, w: torch.Tensor | None = None,
                         gk: torch.Tensor | None = None) -> bool:
    """Whether ``state_fwd(..., q=)`` forms the output in its walk: a sequential walk (not the
    two-level pass, ``_two_level``, which a per-key gate ``gk`` takes on long sequences) over one key
    block (K <= 128)."""
    return K <= 128 and not _two_level("state_fwd", w, plan, gk, heads=heads)


def walk_forms_output(gated: bool, scores: bool = False) -> bool:
    """Whether the forward has the state walk form the output (``state_fwd(..., q=q)``) rather than
    launching ``output.output_fwd`` (GLA, which always keeps its scores: ``vector_gate_output``) after it;
    ``TUNING["state_fwd"]["output"]`` overrides. By default without a gate, and with one where the walk
    reads the kept scores (``scores``: ``walk_reads_scores``). On an H200 (bf16, 16 heads of K = V = 128, 8
    x 2048 to 1 x 16384) DeltaNet's walk forming the output timed faster than its walk and the output
    launch (254 registers on 4 warps, no spill; Triton 3.6), and Gated DeltaNet's forming its scores itself
    slower: the scores' gate tile spills (255 registers, 112 bytes of stack on 4 warps; 8 bytes on 8, and
    no faster), and written not to spill (scores cast to bf16 at once, value blocks of 32) it still lost to
    the launch (docs/benchmarks.md): the gate's tile and masks nearly double each step's instructions.
    GLA's walk reading its A timed faster than its walk and the launch."""
    return bool(tuned("state_fwd", output=not gated or scores)["output"])


def walk_forms_dv(gated: bool, scores: bool = False) -> bool:
    """Whether the delta rules' backward hands the output's intra-chunk dv to the state walk to form
    (``state_bwd(..., intra_dv=True)``) rather than launching ``output.output_bwd_dv`` for it first;
    ``TUNING["state_bwd"]["intra_dv"]`` overrides. By default without a gate, and with one where the
    walk reads the kept scores (``scores``: ``walk_reads_scores``). On an H200 (bf16, 16 heads of
    K = V = 128, the walk with the dv it needs, 8 x 2048 to 1 x 16384) DeltaNet's one launch timed
    faster than two. With a gate the walk forming its scores itself loses: their gate tile takes the
    walk from 236 registers to 255 and a spill stack (72 bytes, 18 local loads per step; Triton 3.6,
    ``kernel_resources``), and on 4 warps over value blocks of 32 it still lost (docs/benchmarks.md)."""
    return bool(tuned("state_bwd", intra_dv=not gated or scores)["intra_dv"])


def walk_forms_dv_dA(K: int, plan: ChunkPlan, heads: int, device, *, gk: torch.Tensor) -> bool:
    """Whether GLA's state walk forms dv and dA (``state_bwd(..., values=v)``, not ``vector_gate_dv_dA``):
    a sequential walk at K <= 128 where one program per (sequence, head) fills the GPU (TUNING)."""
    walks = K <= 128 and not _two_level("state_bwd", None, plan, gk, heads=heads)
    full = plan.num_seqs * heads >= 0.9 * sm_count(device)
    return walks and bool(tuned("state_bwd", intra_dv=full)["intra_dv"])


def state_fwd(k: torch.Tensor, u: torch.Tensor, plan: ChunkPlan, *, w: torch.Tensor | None = None,
              g: torch.Tensor | None = None, gk: torch.Tensor | None = None, u_scale: torch.Tensor | None = None,
              initial_state: torch.Tensor | None = None, output_final_state: bool = False,
              q: torch.Tensor | None = None, scale: float = 1.0, keep_h: bool = True,
              scores: torch.Tensor | None = None, skip: torch.Tensor | None = None, again: bool = False):
    """Returns ``(h [NT,H,K,V] in k.dtype, v_new (u itself without w), final_state fp32 or None)``; k may
    have fewer heads than u, each shared by H / HK consecutive heads (``tile.qk_rows``).
    ``u_scale`` (``[B, T, H]`` fp32, not with ``w``): the values are ``u * u_scale[..., None]``, scaled
    in fp32 inside the pass (SSD's ``x dt``, which then never exists as a tensor); v_new is then None.
    Without ``w`` and with long sequences the two-level pass (module docstring, ``_two_level``).

    With ``q`` (a scalar gate or none) the pass also forms the output,
    ``output.output_fwd(q, k, v_new, h, plan, scale=scale, g=g)`` (its values scaled by ``u_scale``
    where given, plus ``skip[h] u`` with ``skip`` ``[H]`` fp32: SSD's ``D x``), and returns ``(h,
    v_new, final, o)``: the walk holds each chunk's state and loads its k and values anyway, so it
    adds q's tile and three products per step instead of a launch that reads the states back
    (sequential walk only, ``walk_can_form_output``; elsewhere that launch, which takes neither
    ``u_scale`` nor ``skip``). ``keep_h=False``: h is not needed after the call and is not written
    (None). ``scores`` (with ``q``): the chunks' ``q k^T ⊙ causal ⊙ Γ`` that ``wy.wy_fwd(..., q=q)``
    formed, which the walk then reads instead of forming them (``walk_reads_scores``). With ``gk``
    (GLA) ``scores`` is ``vector_gate_scores``' A and o ``vector_gate_output``'s, by the walk only.
    ``again``: a backward's walk forming the states again, launched as TUNING's ``state_fwd_again``."""
    if u_scale is not None and w is not None:
        raise ValueError("state_fwd: u_scale is for passes without w (the delta rule's v_new is u - w h)")
    if q is not None and gk is not None and scores is None:
        raise ValueError("state_fwd: q with a per-key gate gk needs scores (vector_gate_scores's A)")
    if scores is not None and q is None:
        raise ValueError("state_fwd: scores are read by the walk that forms the output (pass q)")
    if skip is not None and q is None:
        raise ValueError("state_fwd: skip is a term of the output (pass q)")
    if q is not None and not walk_can_form_output(k.shape[3], plan, u.shape[2], w=w, gk=gk):
        if gk is not None or u_scale is not None or skip is not None:
            raise ValueError("state_fwd: the output with gk, u_scale or skip is formed by the walk only "
                             "(walk_can_form_output)")
        h, v_new, ht = state_fwd(k, u, plan, w=w, g=g, initial_state=initial_state,
                                 output_final_state=output_final_state)
        return h, v_new, ht, output_fwd(q, k, v_new, h, plan, scale=scale, g=g)
    two_level = _two_level("state_fwd", w, plan, gk, heads=u.shape[2])
    if two_level:
        dS = two_level_pass.chunk_terms(k, u, plan, g=g, gk=gk, scale=1.0, decay=True, stage="state_fwd_chunk",
                                        y_scale=u_scale)
        h, ht = two_level_pass.scan(dS, plan, g=g, gk=gk, start=initial_state, need_end=output_final_state,
                                    dtype=k.dtype, reverse=False, stage="state_fwd_scan")
        return h, (u if u_scale is None else None), ht
    B, T, HK, K = k.shape
    H, V = u.shape[2:]
    N = plan.num_seqs
    BK, split, cfg = _walk_launch("state_fwd_again" if again else "state_fwd", k, V, N * H, _walk(w, gk),
                                  g is not None, q is not None)
    store_h = keep_h or q is None
    h = k.new_empty(plan.num_chunks, H, K, V) if store_h else None
    v_new = torch.empty_like(u) if w is not None else u
    ht = k.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else None
    o = torch.empty_like(u) if q is not None else None
    grid, fold = rows_grid(cdiv(V, cfg['BV']), N * H)
    state_fwd_kernel[grid](
        k, u, u_scale, w, g, gk, h, v_new, initial_state, ht, q, scores, o, skip, scale, plan.cu_seqlens,
        plan.chunk_offsets, H=H, HK=HK, K=K, V=V, BT=plan.chunk_size, BK=BK, SPLIT=split, USE_W=w is not None,
        USE_G=g is not None, USE_GK=gk is not None, USE_US=u_scale is not None, USE_H0=initial_state is not None,
        STORE_HT=output_final_state, STORE_H=store_h, OUTPUT=q is not None, KEPT_S=scores is not None,
        USE_SKIP=skip is not None, FOLD=fold, **cfg)
    if q is not None:
        return h, (v_new if u_scale is None else None), ht, o
    return h, (v_new if u_scale is None else None), ht


def state_bwd(q: torch.Tensor, k: torch.Tensor, do: torch.Tensor, dv: torch.Tensor | None, plan: ChunkPlan, *,
              scale: float, w: torch.Tensor | None = None, g: torch.Tensor | None = None,
              gk: torch.Tensor | None = None, dht: torch.Tensor | None = None, need_dh0: bool = False,
              intra_dv: bool = False, scores: torch.Tensor | None = None, dv_out: torch.Tensor | None = None,
              values: torch.Tensor | None = None):
    """Returns ``(dh [NT,H,K,V] in k.dtype, dh0 fp32 or None, dv2)`` (``dv2`` a new tensor in dv's
    dtype; None when ``dv`` is None, for a caller that forms the state's share of dv itself, which
    the delta rule, whose ``dh`` reads ``dv2``, cannot). With ``intra_dv`` (``dv`` None, a scalar
    gate or none) ``dv`` is the output stage's intra-chunk gradient, ``output.output_bwd_dv(q, k, do,
    plan, scale=scale, g=g)``, which the walk forms from the tiles it loads anyway: one launch and
    one round trip of a ``v``-sized tensor less (at K <= 128; beyond, and before the two-level
    pass, it is that launch). ``scores`` (with ``intra_dv``): the chunks' kept ``q k^T ⊙ causal ⊙ Γ``
    (``wy.wy_fwd(..., q=q)``), from which the walk forms that dv instead of from q and k. Without
    ``w`` and with long sequences the two-level pass (``_two_level``). ``dv_out``: where dv2 is
    written (do's shape and dv's dtype, any token stride: ``index.token_stride``), in place of a new
    tensor; the caller's gradient buffer.

    GLA (``gk``, ``intra_dv``, ``scores`` its A, ``values`` its v; ``walk_forms_dv_dA``): the walk also
    forms ``dA = scale tril(do v^T)`` (fp32 ``[B, T, H, BT]``, returned fourth) over whole value rows."""
    if values is not None and (gk is None or not intra_dv or scores is None or w is not None
                               or g is not None):
        raise ValueError("state_bwd: values (GLA's walk forming dv and dA) take gk, intra_dv=True and "
                         "scores (A)")
    if dv_out is not None and dv is None and not intra_dv:
        raise ValueError("state_bwd: dv_out is dv2's buffer, and without dv (or intra_dv) there is no dv2")
    if scores is not None and not intra_dv:
        raise ValueError("state_bwd: scores are read by the walk that forms the intra-chunk dv (intra_dv=True)")
    if intra_dv:
        if dv is not None or (gk is not None and values is None):
            raise ValueError("state_bwd: intra_dv forms dv itself (dv must be None) and takes a scalar gate, "
                             "not gk (GLA's walk: pass values)")
    elif dv is None and w is not None:
        raise ValueError("state_bwd: the delta rule (w) needs dv")
    two_level = _two_level("state_bwd", w, plan, gk, heads=do.shape[2])
    if values is not None and (k.shape[3] > 128 or two_level):
        raise ValueError("state_bwd: values: only a walk at K <= 128 forms dv and dA, not the two-level pass "
                         "(walk_forms_dv_dA)")
    if intra_dv and (k.shape[3] > 128 or two_level):
        # the two-level pass has no walk to form it in; the split state's walk (K > 128) formed it
        # wrong with fp32 inputs on the H200 (Triton 3.6: the float64 oracle missed at K = 256)
        dv, intra_dv, scores = output_bwd_dv(q, k, do, plan, scale=scale, g=g), False, None
    if two_level:
        dD = two_level_pass.chunk_terms(q, do, plan, g=g, gk=gk, scale=scale, decay=False, stage="state_bwd_chunk")
        dh, dh0 = two_level_pass.scan(dD, plan, g=g, gk=gk, start=dht, need_end=need_dh0, dtype=k.dtype,
                                      reverse=True, stage="state_bwd_scan")
        del dD  # fp32 [NT, H, K, V]: free before dv2 is allocated
        if dv is None:
            return dh, dh0, None
        return dh, dh0, two_level_pass.dv_with_states(k, dh, dv, plan, g=g, gk=gk, out=dv_out)
    B, T, HK, K = k.shape
    H, V = do.shape[2:]
    N = plan.num_seqs
    BK, split, cfg = _walk_launch("state_bwd", k, V, N * H, _walk(w, gk), g is not None, values is not None)
    if values is not None and cfg["BV"] < V:
        raise ValueError(f"state_bwd: the walk forming dA takes whole value rows, BV >= {V}; TUNING gave "
                         f"{cfg['BV']}")
    dh = k.new_empty(plan.num_chunks, H, K, V)
    dA = None if values is None else torch.empty(B, T, H, plan.chunk_size, device=k.device,
                                                 dtype=torch.float32)
    dv2 = dv_out if dv_out is not None else torch.empty_like(do) if intra_dv else None if dv is None else (
        torch.empty_like(dv))
    sdv = H * V if dv2 is None else token_stride("dv_out", dv2, do.shape)
    dh0 = k.new_empty(N, H, K, V, dtype=torch.float32) if need_dh0 else None
    grid, fold = rows_grid(cdiv(V, cfg['BV']), N * H)
    state_bwd_kernel[grid](
        q, k, w, g, gk, scores, do, dv, dh, dv2, dht, dh0, values, dA, plan.cu_seqlens, plan.chunk_offsets,
        scale, sdv, H=H, HK=HK, K=K, V=V, BT=plan.chunk_size, BK=BK, SPLIT=split, USE_W=w is not None,
        USE_G=g is not None, USE_GK=gk is not None, USE_DHT=dht is not None, STORE_DH0=need_dh0,
        USE_DV=dv2 is not None, INTRA_DV=intra_dv, KEPT_S=scores is not None, FORM_DA=values is not None,
        FOLD=fold, **cfg)
    return (dh, dh0, dv2) if values is None else (dh, dh0, dv2, dA)
