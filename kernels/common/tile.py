"""Pointer tiles with bounds masks (Triton 3.9 removed block pointers while 3.6 still has them, so
the engine uses plain pointer arithmetic, which both accept)."""

import triton
import triton.language as tl

from ttr.kernels.common.approx import fast_exp


@triton.jit
def tile(base, r0, c0, n_r, n_c, s_r, s_c, BR: tl.constexpr, BC: tl.constexpr):
    """Pointers ``[BR, BC]`` to ``base[r0 + i, c0 + j]`` (strides s_r, s_c) and the mask of the
    in-bounds part (``r < n_r``, ``c < n_c``)."""
    o_r = r0 + tl.arange(0, BR)
    o_c = c0 + tl.arange(0, BC)
    p = base + o_r[:, None].to(tl.int64) * s_r + o_c[None, :].to(tl.int64) * s_c
    m = (o_r < n_r)[:, None] & (o_c < n_c)[None, :]
    return p, m


@triton.jit
def chunk_span(chunk_indices, cu_seqlens, seq_len, i_t, BT: tl.constexpr):
    """Global chunk ``i_t``'s sequence ``i_n``, chunk index ``i_c`` within it, and the sequence's token
    bounds ``bos``, ``eos`` (int64) in the flattened ``[B*T]`` axis (see ``index.ChunkPlan``).

    With ``seq_len > 0`` (``ChunkPlan.seq_len``: every sequence that long) they follow from ``i_t``
    by arithmetic. Else they are read from the plan: a load, then a load at an address that depends
    on it, which a chunk's program waits out before it can address its first tile."""
    if seq_len > 0:
        nt = tl.cdiv(seq_len, BT)
        i_n = i_t // nt
        i_c = i_t - i_n * nt
        bos = i_n.to(tl.int64) * seq_len
        eos = bos + seq_len
    else:
        i_n, i_c = tl.load(chunk_indices + i_t * 2), tl.load(chunk_indices + i_t * 2 + 1)
        bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    return i_n, i_c, bos, eos


@triton.jit
def grid_ids(NX: tl.constexpr, FOLD: tl.constexpr):
    """A program's block ``i_x`` of ``NX``, row ``i_r`` (a global chunk, or a walk's sequence and
    head) and head ``i_h`` on ``index.rows_grid``'s grid (``FOLD``: its fold)."""
    if FOLD:
        i_x, i_r, i_h = tl.program_id(0) % NX, tl.program_id(0) // NX, tl.program_id(1)
    else:
        i_x, i_r, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    return i_x, i_r, i_h


@triton.jit
def chunk_gate(g, t0, n_valid, i_h, H: tl.constexpr, BT: tl.constexpr):
    """``chunk_gate_last``'s gate alone."""
    return chunk_gate_last(g, t0, n_valid, i_h, H, BT)[0]


@triton.jit
def chunk_gate_last(g, t0, n_valid, i_h, H: tl.constexpr, BT: tl.constexpr):
    """The chunk's cumulative scalar gate ``g[t0 + i]`` (``[BT]``, fp32), padded rows (``i >=
    n_valid``) set to the last valid row's value. A padded row must not read 0: under strong decay
    ``exp(0 - g_j)`` overflows and ``0 * inf`` turns its (masked-out) products into NaN that column
    sums carry into valid rows; with the last valid value every ``exp(g_i - g_j)``, ``j <= i``, stays
    <= 1. (A [BT, BT] validity mask does the same at the cost of registers in the widest kernels.)
    Returns ``(g, g_last)``, the last valid value apart as well."""
    o_i = tl.arange(0, BT)
    b_g = tl.load(g + (t0 + o_i) * H + i_h, mask=o_i < n_valid, other=0.)
    b_gl = tl.load(g + (t0 + tl.minimum(n_valid, BT) - 1) * H + i_h)
    return tl.where(o_i < n_valid, b_g, b_gl), b_gl


@triton.jit
def qk_rows(x, bos, i_h, H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr):
    """Head ``i_h``'s first row of q or k ``[T_total, HK, K]`` (row stride ``HK * K``): ``HK`` heads, each
    shared by ``H // HK`` consecutive value heads (Mamba2's groups of B and C; ``HK = H`` otherwise)."""
    return x + (bos * HK + i_h // (H // HK)) * K


@triton.jit
def load_tile(p, r0, c0, n_r, n_c, s_r, s_c, BR: tl.constexpr, BC: tl.constexpr):
    """The ``[BR, BC]`` tile of ``tile``'s pointers, zeros outside the bounds."""
    p_x, m_x = tile(p, r0, c0, n_r, n_c, s_r, s_c, BR, BC)
    return tl.load(p_x, mask=m_x, other=0.)


@triton.jit
def store_tile(p, b, r0, c0, n_r, n_c, s_r, s_c, BR: tl.constexpr, BC: tl.constexpr):
    """Stores ``b`` (``[BR, BC]``) in the pointers' dtype, inside the bounds only."""
    p_x, m_x = tile(p, r0, c0, n_r, n_c, s_r, s_c, BR, BC)
    tl.store(p_x, b.to(p_x.dtype.element_ty), mask=m_x)


@triton.jit
def decay_kT(b_k, gk, bos, last, i_c, m_t, i_h, k0, T, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
             BK: tl.constexpr):
    """GLA's per-key decay of a chunk's ``k^T`` tile (``[BK, BT]``, key rows k0 .. k0+BK): returns
    ``(k^T ⊙ exp(gk_last - gk), exp(gk_last), gk^T)``."""
    o_k = k0 + tl.arange(0, BK)
    b_gkl = tl.load(gk + ((bos + last) * H + i_h) * K + o_k, mask=o_k < K, other=0.)
    b_gk = load_tile(gk + (bos * H + i_h) * K, k0, i_c * BT, K, T, 1, H * K, BK, BT)  # [BK, BT]
    b_kd = (b_k * fast_exp(tl.where(m_t[None, :], b_gkl[:, None] - b_gk, 0.))).to(b_k.dtype)
    return b_kd, fast_exp(b_gkl), b_gk
