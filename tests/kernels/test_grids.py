"""Launches past the grid's bounds. CUDA bounds a launch grid's second and third dimensions at
65,535 blocks, which the chunks of one call pass at 4.19M tokens, and the (sequence, head) pairs of
a walk at, say, 1,024 packed documents of 64 heads; there the stages that hold those rows in
dimension 1 fold them into dimension 0 (``index.rows_grid``) and SSD's row stage runs chunks first.
Under the interpreter the bound is lowered below a short packed call's chunk and pair counts: every
launch must then stay within it, and give the bits of the unfolded launches. On the GPU one call
past the bound must agree with the same tokens in two calls within it."""

import pytest
import torch
from triton.runtime.jit import KernelInterface

from ttr.kernels import (
    chunk_delta_rule,
    chunk_gated_delta_rule,
    chunk_gla,
    chunk_simple_gla,
    chunk_ssd,
    recurrent_delta_rule,
    recurrent_gated_delta_rule,
    recurrent_gla,
)
from ttr.kernels.common import index, state

from .conftest import op_leaves, rel_rms

OPS = {"gla": chunk_gla, "simple_gla": chunk_simple_gla, "delta": chunk_delta_rule,
       "gated_delta": chunk_gated_delta_rule, "ssd": chunk_ssd, "recurrent_gla": recurrent_gla,
       "recurrent_delta": recurrent_delta_rule, "recurrent_gated_delta": recurrent_gated_delta_rule}
# the stages that hold chunks or (sequence, head) pairs in dimension 1 where the grid allows it
FOLDING = {"output_fwd_kernel", "output_bwd_dqk_kernel", "state_chunk_kernel", "state_dv_kernel",
           "output_bwd_dcb_kernel", "rows_bwd_kernel", "state_fwd_kernel", "state_bwd_kernel",
           "output_bwd_dqk_walk_kernel", "recurrent_kernel", "recurrent_delta_kernel"}
# three documents of 2 chunks each: 6 chunks and 6 (sequence, head) pairs against a bound of 4
CU = torch.tensor([0, 100, 190, 300])


def _run(monkeypatch, op, two_level, limit):
    """The op's output and input gradients on the three documents of ``CU``, and each kernel's launch
    grids."""
    grids = {}
    launch = KernelInterface.__getitem__

    def spy(self, grid):
        if not callable(grid):
            grids.setdefault(getattr(getattr(self, "fn", self), "__name__", repr(self)), set()).add(tuple(grid))
        return launch(self, grid)

    with monkeypatch.context() as m:
        m.setenv("TTR_KERNEL_BACKEND", "triton")
        m.setattr(KernelInterface, "__getitem__", spy)
        m.setattr(state, "_two_level", lambda *a, **k: two_level)
        m.setattr(index, "MAX_GRID_Y", limit)
        leaves = op_leaves(op, int(CU[-1]))
        y = OPS[op](**leaves, cu_seqlens=CU)[0]
        if y.requires_grad:  # the recurrent ops run forward only
            y.sum().backward()
    return [y.detach()] + [t.grad for t in leaves.values()], grids


def test_chunk_stages_fold_past_the_grid_limit(monkeypatch):
    launched = set()
    for op in ("gla", "simple_gla", "delta", "gated_delta", "ssd", "recurrent_gla", "recurrent_delta"):
        for two_level in (False, True) if "recurrent" not in op else (False,):
            plain, _ = _run(monkeypatch, op, two_level, index.MAX_GRID_Y)
            # 4 is also the widest later dimension of any other launch here
            folded, grids = _run(monkeypatch, op, two_level, 4)
            for name, shapes in grids.items():
                assert all(d <= 4 for grid in shapes for d in grid[1:]), (op, two_level, name, shapes)
            for got, want in zip(folded, plain, strict=True):
                assert (got is None and want is None) or torch.equal(got, want), (op, two_level)
            launched |= grids.keys()
    assert FOLDING <= launched, FOLDING - launched


def _one_against_two(op, leaves, y_one, y_two):
    """The output of one call and of two joined (bf16), and every input's gradient through each, agree."""
    assert rel_rms(y_one, y_two) < 1e-2
    if op.startswith("recurrent"):
        return
    w = torch.randn(y_one.shape, device=y_one.device)
    g_one, g_two = (torch.autograd.grad((y.float() * w).sum(), list(leaves.values())) for y in (y_one, y_two))
    for name, a, b in zip(leaves, g_one, g_two, strict=True):
        assert rel_rms(a, b) < 1e-2, name


def _halves(leaves, half):
    """The leaves' first and last tokens from ``half`` on (per-head tensors such as A whole)."""
    return ({n: t[:, :half] if t.dim() > 1 else t for n, t in leaves.items()},
            {n: t[:, half:] if t.dim() > 1 else t for n, t in leaves.items()})


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["simple_gla", "gated_delta", "ssd"])
def test_gpu_one_call_past_65535_chunks(op):
    """One sequence of 65,600 chunks (4.2M tokens) in one call, against the same tokens in two calls
    of 32,800 chunks joined by the first call's final state."""
    T = 65_600 * 64
    leaves = op_leaves(op, T, device="cuda", dtype=torch.bfloat16)
    first, second = _halves(leaves, T // 2)
    y1, s = OPS[op](**first, output_final_state=True)
    y2, _ = OPS[op](**second, initial_state=s)
    _one_against_two(op, leaves, OPS[op](**leaves)[0], torch.cat([y1, y2], dim=1))


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["gated_delta", "ssd", "recurrent_gated_delta"])
def test_gpu_walks_past_65535_pairs(op):
    """1,030 packed documents of 64 heads (65,920 (sequence, head) pairs) in one call, against the
    same documents in two calls of 515."""
    docs, L = 1030, 64
    T = docs * L
    leaves = op_leaves(op, T, H=64, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, T + 1, L, device="cuda", dtype=torch.int32)
    first, second = _halves(leaves, T // 2)
    y_two = torch.cat([OPS[op](**first, cu_seqlens=cu[: docs // 2 + 1])[0],
                       OPS[op](**second, cu_seqlens=cu[docs // 2:] - T // 2)[0]], dim=1)
    _one_against_two(op, leaves, OPS[op](**leaves, cu_seqlens=cu)[0], y_two)
