"""The token embedding's lookup, with a backward of its own for the table's gradient.

The forward is ``F.embedding``'s gather. The backward forms ``dW[v] = sum of dy[t] over the tokens t
with id v`` as one segmented sum: the ids sorted once (a stable sort, so each row's tokens keep
their order), each row's run of sorted tokens found by a binary search, and one kernel in which a
program per row and column block sums its run (fp32, in token order) and writes the row, zeros
where the id does not occur. Every row of ``dW`` is written exactly once, so there is neither a
zero fill before the sum nor an atomic, and the result is the same bits on every run.

A run is summed ``BT`` tokens at a time (a ``[BT, BD]`` tile per step), so a frequent id (a few per
cent of a batch's tokens in text) takes a few dozen steps rather than a thousand dependent loads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ttr.kernels.common.index import cdiv, tuned
from ttr.kernels.utils import check_dtype, kernel_backend, on_input_device


@triton.jit
def _embedding_bwd_kernel(dy, perm, starts, dw, D, s_dy, PAD, BD: tl.constexpr, BT: tl.constexpr):
    row = tl.program_id(0)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    m_d = o_d < D
    lo = tl.load(starts + row)
    # the padding row's gradient stays zero, as F.embedding's does: an empty run
    hi = tl.where(row == PAD, lo, tl.load(starts + row + 1))
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for i in range(lo, hi, BT):
        o_t = i + tl.arange(0, BT)
        m_t = o_t < hi
        tok = tl.load(perm + o_t, mask=m_t, other=0)
        acc += tl.load(dy + tok[:, None] * s_dy + o_d[None, :], mask=m_t[:, None] & m_d[None, :], other=0.0).to(
            tl.float32
        )
    tl.store(dw + row.to(tl.int64) * D + o_d, tl.sum(acc, 0).to(dw.dtype.element_ty), mask=m_d)


def embedding_weight_grad(ids: torch.Tensor, dy: torch.Tensor, num_rows: int, dtype: torch.dtype,
                          padding_idx: int | None = None) -> torch.Tensor:
    """``dW [num_rows, D]`` in ``dtype`` for ``y = W[ids]`` and ``dy [..., D]`` (rows of ``ids``'s
    shape): each row the fp32 sum of the ``dy`` rows of its id in token order; the padding row zero."""
    d = dy.shape[-1]
    dy = dy.reshape(-1, d)
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    sorted_ids, perm = torch.sort(ids.reshape(-1), stable=True)
    starts = torch.searchsorted(sorted_ids, torch.arange(num_rows + 1, device=ids.device, dtype=sorted_ids.dtype))
    dw = torch.empty(num_rows, d, device=dy.device, dtype=dtype)
    if num_rows and d:
        # a row's column block, and the tokens of its run summed per step
        launch = tuned("embedding", BD=256, BT=16, num_warps=4)
        pad = -1 if padding_idx is None else padding_idx
        _embedding_bwd_kernel[(num_rows, cdiv(d, launch["BD"]))](
            dy, perm, starts, dw, d, dy.stride(0), pad, BD=launch["BD"], BT=launch["BT"], num_warps=launch["num_warps"]
        )
    return dw


class EmbeddingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, padding_idx):
        ctx.save_for_backward(ids)
        ctx.rows, ctx.dtype, ctx.padding_idx = weight.shape[0], weight.dtype, padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        if not ctx.needs_input_grad[1]:
            return None, None, None
        return None, embedding_weight_grad(ids, dy, ctx.rows, ctx.dtype, ctx.padding_idx), None


@on_input_device
def embedding(weight: torch.Tensor, ids: torch.Tensor, padding_idx: int | None = None) -> torch.Tensor:
    """``F.embedding(ids, weight, padding_idx)`` (rows of ``weight [rows, D]`` gathered by the integer
    ``ids``), whose backward forms the table's gradient by this module's segmented sum on the triton
    backend; the torch backend is ``F.embedding`` itself. ``padding_idx`` may be negative (counted from
    the end), as in ``nn.Embedding``."""
    check_dtype("weight", weight)
    if weight.dim() != 2:
        raise ValueError(f"weight must have shape [rows, D], got {tuple(weight.shape)}")
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"ids must be an integer tensor, got {getattr(ids, 'dtype', type(ids).__name__)}")
    if ids.device != weight.device:
        raise ValueError(f"ids are on {ids.device} but weight is on {weight.device}")
    rows = weight.shape[0]
    if padding_idx is not None:
        if not -rows <= padding_idx < rows:
            raise ValueError(f"padding_idx must be in [-{rows}, {rows}) for a table of {rows} rows, got {padding_idx}")
        padding_idx %= rows
    if kernel_backend(weight) == "torch" or weight.dtype == torch.float64 or not weight.requires_grad:
        return F.embedding(ids, weight, padding_idx)
    return EmbeddingFunction.apply(ids, weight, padding_idx)
