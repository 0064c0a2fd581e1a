"""Pointer tiles with bounds masks (Triton 3.9 removed block pointers; 3.6 on the device has them,
so the engine uses plain pointer arithmetic everywhere)."""

import triton
import triton.language as tl


@triton.jit
def tile(base, r0, c0, n_r, n_c, s_r, s_c, BR: tl.constexpr, BC: tl.constexpr):
    """Pointers ``[BR, BC]`` to ``base[r0 + i, c0 + j]`` (strides s_r, s_c) and the mask of the
    in-bounds part (``r < n_r``, ``c < n_c``)."""
    o_r = r0 + tl.arange(0, BR)
    o_c = c0 + tl.arange(0, BC)
    p = base + o_r[:, None].to(tl.int64) * s_r + o_c[None, :].to(tl.int64) * s_c
    m = (o_r < n_r)[:, None] & (o_c < n_c)[None, :]
    return p, m
