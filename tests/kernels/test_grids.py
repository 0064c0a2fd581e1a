"""Launches past the grid's bounds. CUDA bounds a launch grid's second and third dimensions at
65,535 blocks, which the chunks of one call pass at 4.19M tokens, and the (sequence, head) pairs of
a walk at, say, 1,024 packed documents of 64 heads; there the stages that hold those rows in
dimension 1 fold them into dimension 0 (``index.rows_grid``) and SSD's row stage runs chunks first.
Under the interpreter the bound is lowered below a short packed call's chunk and pair counts: every
launch must then stay within it, and give the bits of the unfolded launches."""

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

from .conftest import rel_rms

# the stages that hold chunks or (sequence, head) pairs in dimension 1 where the grid allows it
FOLDING = {"output_fwd_kernel", "output_bwd_dqk_kernel", "state_chunk_kernel", "state_dv_kernel",
           "output_bwd_dcb_kernel", "rows_bwd_kernel", "state_fwd_kernel", "state_bwd_kernel",
           "output_bwd_dqk_walk_kernel", "recurrent_kernel", "recurrent_delta_kernel"}
# three documents of 2 chunks each: 6 chunks and 6 (sequence, head) pairs against a bound of 4
CU = torch.tensor([0, 100, 190, 300])


def _inputs(op, T, H=2, K=32, V=32):
    torch.manual_seed(0)
    r = lambda *s: torch.randn(*s, requires_grad=True)  # noqa: E731
    if op == "ssd":
        x, dt = r(1, T, H, V), (torch.rand(1, T, H) * 0.5 + 0.1).requires_grad_()
        A = (-torch.rand(H) - 0.5).requires_grad_()
        return (x, dt, A, r(1, T, 1, 64), r(1, T, 1, 64)), lambda *a: chunk_ssd(*a, cu_seqlens=CU)[0]
    q = r(1, T, H, K)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K), dim=-1).requires_grad_()
    v = r(1, T, H, V)
    g = (-torch.rand(1, T, H) * 0.1).requires_grad_()
    beta = torch.rand(1, T, H).requires_grad_()
    gk = (-torch.rand(1, T, H, K) * 0.1).requires_grad_()
    fn, args = {"gla": (chunk_gla, (q, k, v, gk)), "simple_gla": (chunk_simple_gla, (q, k, v, g)),
                "delta": (chunk_delta_rule, (q, k, v, beta)), "gated_delta": (chunk_gated_delta_rule, (q, k, v, g, beta)),
                "recurrent_gla": (recurrent_gla, (q, k, v, gk)),
                "recurrent_delta": (recurrent_delta_rule, (q, k, v, beta))}[op]
    return args, lambda *a: fn(*a, cu_seqlens=CU)[0]


def _run(monkeypatch, op, T, two_level, limit):
    """The op's output and input gradients, and each kernel's launch grids."""
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
        args, fn = _inputs(op, T)
        y = fn(*args)
        if y.requires_grad:  # the recurrent ops run forward only
            y.sum().backward()
    return [y.detach()] + [a.grad for a in args], grids


def test_chunk_stages_fold_past_the_grid_limit(monkeypatch):
    launched = set()
    for op in ("gla", "simple_gla", "delta", "gated_delta", "ssd", "recurrent_gla", "recurrent_delta"):
        for two_level in (False, True) if "recurrent" not in op else (False,):
            # 4 is also the widest later dimension of any other launch here
            plain, _ = _run(monkeypatch, op, 300, two_level, index.MAX_GRID_Y)
            folded, grids = _run(monkeypatch, op, 300, two_level, 4)
            for name, shapes in grids.items():
                assert all(d <= 4 for grid in shapes for d in grid[1:]), (op, two_level, name, shapes)
            for got, want in zip(folded, plain, strict=True):
                assert (got is None and want is None) or torch.equal(got, want), (op, two_level)
            launched |= grids.keys()
    assert FOLDING <= launched, FOLDING - launched


def _long_inputs(op, T, H=2, D=32):
    """bf16 inputs of T tokens on the GPU (fp32 gates), as leaves."""
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s, dtype=torch.bfloat16: torch.randn(*s, device="cuda", generator=g).to(dtype)  # noqa: E731
    if op == "ssd":
        return dict(x=r(1, T, H, D), dt=torch.rand(1, T, H, device="cuda", generator=g) * 0.5 + 0.05,
                    A=-torch.rand(H, device="cuda", generator=g) - 0.5, B=r(1, T, 1, D), C=r(1, T, 1, D))
    k = torch.nn.functional.normalize(r(1, T, H, D, dtype=torch.float32), dim=-1).to(torch.bfloat16)
    out = dict(q=r(1, T, H, D), k=k, v=r(1, T, H, D), g=-torch.rand(1, T, H, device="cuda", generator=g) * 0.05)
    if op == "gated_delta":
        out["beta"] = torch.rand(1, T, H, device="cuda", generator=g).to(torch.bfloat16)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["simple_gla", "gated_delta", "ssd"])
def test_gpu_one_call_past_65535_chunks(op):
    """One sequence of 65,600 chunks (4.2M tokens) in one call, against the same tokens in two calls
    of 32,800 chunks joined by the first call's final state: output and every gradient agree (bf16)."""
    fn = {"simple_gla": chunk_simple_gla, "gated_delta": chunk_gated_delta_rule, "ssd": chunk_ssd}[op]
    T = 65_600 * 64
    leaves = {n: t.requires_grad_() for n, t in _long_inputs(op, T).items()}
    per_token = [n for n, t in leaves.items() if t.dim() > 1]
    w = torch.randn(1, T, 2, 32, device="cuda")

    def grads(y):
        return torch.autograd.grad((y.float() * w).sum(), list(leaves.values()))

    y_one = fn(**leaves)[0]
    g_one = grads(y_one)
    half = T // 2
    first = {n: (t[:, :half] if n in per_token else t) for n, t in leaves.items()}
    second = {n: (t[:, half:] if n in per_token else t) for n, t in leaves.items()}
    y1, s = fn(**first, output_final_state=True)
    y2, _ = fn(**second, initial_state=s)
    y_two = torch.cat([y1, y2], dim=1)
    g_two = grads(y_two)
    assert rel_rms(y_one, y_two) < 1e-2
    for name, a, b in zip(leaves, g_one, g_two, strict=True):
        assert rel_rms(a, b) < 1e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["gated_delta", "ssd", "recurrent_gated_delta"])
def test_gpu_walks_past_65535_pairs(op):
    """1,030 packed documents of 64 heads (65,920 (sequence, head) pairs) in one call, against the
    same documents in two calls of 515: output and every gradient agree (bf16)."""
    docs, L, H = 1030, 64, 64
    T = docs * L
    fn = {"gated_delta": chunk_gated_delta_rule, "ssd": chunk_ssd,
          "recurrent_gated_delta": recurrent_gated_delta_rule}[op]
    leaves = {n: t.requires_grad_() for n, t in _long_inputs(op.replace("recurrent_", ""), T, H=H).items()}
    per_token = [n for n, t in leaves.items() if t.dim() > 1]
    cu = torch.arange(0, T + 1, L, device="cuda", dtype=torch.int32)
    w = torch.randn(1, T, H, 32, device="cuda")

    def grads(y):
        if op.startswith("recurrent"):
            return []
        return torch.autograd.grad((y.float() * w).sum(), list(leaves.values()))

    y_one = fn(**leaves, cu_seqlens=cu)[0]
    g_one = grads(y_one)
    half = T // 2
    first = {n: (t[:, :half] if n in per_token else t) for n, t in leaves.items()}
    second = {n: (t[:, half:] if n in per_token else t) for n, t in leaves.items()}
    y_two = torch.cat([fn(**first, cu_seqlens=cu[: docs // 2 + 1])[0],
                       fn(**second, cu_seqlens=cu[docs // 2:] - half)[0]], dim=1)
    g_two = grads(y_two)
    assert rel_rms(y_one, y_two) < 1e-2
    for name, a, b in zip(leaves, g_one, g_two, strict=False):
        assert rel_rms(a, b) < 1e-2, name
