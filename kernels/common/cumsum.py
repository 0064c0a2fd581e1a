"""Chunk-local cumulative sum of log gates (scalar ``[B,T,H]`` or per-key ``[B,T,H,K]``).

Inside chunk c of a sequence, ``g_cum[t] = sum_{s in chunk, s <= t} g[s]`` (``reverse=True``:
``s >= t``, which is the backward of the forward sum). fp32 out, whatever the input dtype.
With ``scale`` (``[H]``, fp32) the summed terms are ``g[s] * scale[h]``: Mamba2's gate ``A dt``
without a separate product pass. With ``logits`` the input holds GLA's gate logits z and the summed
terms are the log gate ``max(logsigmoid(z) / normalizer, clamp_min)`` (``logit_gate``), so the fp32
gate is never a tensor; ``logit_gate_grad`` is its backward, which the stage forming the gate's
gradient applies before it stores (``intra_vector_gate.vector_gate_bwd_dqkg``).

A program sums one chunk of a ``[BT, BK]`` tile of contiguous columns: a per-key gate's keys of one
head, or a scalar gate's heads (its ``[B, T, H]`` rows are read whole rather than one column of
stride H per head and chunk).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttr.kernels.common.index import ChunkPlan, cdiv, next_power_of_2
from ttr.kernels.common.tile import chunk_span


@triton.jit
def log_sigmoid(z):
    # min(z, 0) - log1p(e^-|z|): no overflow for either sign. log1p(x) as log(u) x / (u - 1) with
    # u = 1 + x (Goldberg's form): log(1 + x) alone loses x's digits when the gate is near 0 (z large)
    x = tl.exp(-tl.abs(z))
    u = 1.0 + x
    exact = u == 1.0
    return tl.minimum(z, 0.0) - tl.where(exact, x, tl.log(u) * x / tl.where(exact, 1.0, u - 1.0))


@triton.jit
def logit_gate(z, inv_norm, clamp, CLAMP: tl.constexpr):
    """GLA's log forget gate from fp32 logits: ``logsigmoid(z) * inv_norm``, at least ``clamp`` with CLAMP."""
    g = log_sigmoid(z) * inv_norm
    if CLAMP:
        g = tl.maximum(g, clamp)
    return g


@triton.jit
def logit_gate_grad(z, dg, inv_norm, clamp, CLAMP: tl.constexpr):
    """The logits' gradient from the gate's: ``dg sigmoid(-z) inv_norm``, zero where the clamp holds
    (as torch's ``clamp_min`` gives it)."""
    dz = dg * tl.sigmoid(-z) * inv_norm
    if CLAMP:
        dz = tl.where(log_sigmoid(z) * inv_norm >= clamp, dz, 0.0)
    return dz


@triton.jit
def chunk_cumsum_kernel(g, scale, out, cu_seqlens, chunk_indices, seq_len, inv_norm, clamp, H: tl.constexpr,
                        K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, REVERSE: tl.constexpr,
                        USE_SCALE: tl.constexpr, HEAD_COLS: tl.constexpr, LOGITS: tl.constexpr,
                        CLAMP: tl.constexpr):
    """One chunk of g ``[rows, H, K]`` in ``[BT, BK]`` tiles; with HEAD_COLS the K columns are heads
    (a scalar gate seen as H = 1) and ``scale`` is read per column; with LOGITS g holds logits, each
    mapped by ``logit_gate`` first."""
    i_t, i_h, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_c, bos, eos = chunk_span(chunk_indices, cu_seqlens, seq_len, i_t, BT)
    o_t = bos + i_c * BT + tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m = (o_t < eos)[:, None] & (o_k < K)[None, :]
    p = (o_t.to(tl.int64) * H + i_h)[:, None] * K + o_k[None, :]
    b_g = tl.load(g + p, mask=m, other=0).to(tl.float32)  # [BT, BK]
    if LOGITS:
        b_g = tl.where(m, logit_gate(b_g, inv_norm, clamp, CLAMP), 0.0)
    if USE_SCALE:
        if HEAD_COLS:
            b_g *= tl.load(scale + o_k, mask=o_k < K, other=0.)[None, :]
        else:
            b_g *= tl.load(scale + i_h)
    b_c = tl.cumsum(b_g, axis=0)
    if REVERSE:
        b_c = tl.sum(b_g, axis=0)[None, :] - b_c + b_g
    tl.store(out + p, b_c, mask=m)


def chunk_local_cumsum(g: torch.Tensor, plan: ChunkPlan, *, reverse: bool = False,
                       scale: torch.Tensor | None = None, logits: tuple[float, float | None] | None = None
                       ) -> torch.Tensor:
    """``g``: ``[B,T,H]`` or ``[B,T,H,K]``; ``scale``: ``[H]`` fp32 factors or None; ``logits``:
    ``(normalizer, clamp_min)`` when g holds GLA's gate logits (module docstring); returns fp32 of
    g's shape."""
    g = g.contiguous()
    head_cols = g.dim() == 3  # a scalar gate: its heads are the tile's columns (module docstring)
    H, K = (1, g.shape[2]) if head_cols else g.shape[2:]
    BK = min(next_power_of_2(K), 64)
    out = torch.empty(g.shape, device=g.device, dtype=torch.float32)
    grid = (plan.num_chunks, H, cdiv(K, BK))
    inv_norm, clamp = logit_gate_args(logits)
    chunk_cumsum_kernel[grid](g, scale, out, plan.cu_seqlens, plan.chunk_indices, plan.seq_len, inv_norm, clamp,
                              H=H, K=K, BT=plan.chunk_size, BK=BK, REVERSE=reverse, USE_SCALE=scale is not None,
                              HEAD_COLS=head_cols, LOGITS=logits is not None,
                              CLAMP=logits is not None and logits[1] is not None)
    return out


def logit_gate_args(logits: tuple[float, float | None] | None) -> tuple[float, float]:
    """``(1 / normalizer, clamp_min or 0)`` of ``logits = (normalizer, clamp_min)``, the kernels'
    scalar arguments (ignored without logits)."""
    if logits is None:
        return 1.0, 0.0
    normalizer, clamp_min = logits
    return 1.0 / normalizer, 0.0 if clamp_min is None else clamp_min
