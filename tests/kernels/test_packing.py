"""``Packing``: packed-document offsets validated and indexed once (``prepare_packing``), taken by
every op in place of ``cu_seqlens`` with the results of the plain tensor and without re-indexing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ttr.kernels import (
    Packing,
    attention,
    causal_conv1d,
    chunk_delta_rule,
    chunk_gated_delta_rule,
    chunk_gla,
    chunk_simple_gla,
    chunk_ssd,
    prepare_packing,
    recurrent_delta_rule,
    recurrent_gated_delta_rule,
    recurrent_gla,
    recurrent_simple_gla,
    recurrent_ssd,
    reference_attention,
    reference_causal_conv1d,
    reference_delta_rule,
    reference_gated_delta_rule,
    reference_gla,
    reference_simple_gla,
    reference_ssd,
)
from ttr.kernels import utils as kernel_utils
from ttr.kernels.common import index, state
from ttr.kernels.common.index import prepare_chunks

from .conftest import op_leaves

T, H, D = 70, 2, 16
CU = [0, 1, 5, 5, 70]  # a one-token document, an empty one, one across a chunk boundary


def expected_index(cu, chunk=64):
    seq, idx, offsets, seq_ids = [], [], [0], []
    for n, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        count = -(-(e - s) // chunk)
        seq += [n] * count
        idx += list(range(count))
        offsets.append(offsets[-1] + count)
        seq_ids += [n] * (e - s)
    return [list(p) for p in zip(seq, idx)], offsets, seq_ids


@pytest.mark.parametrize("cu", [CU, [0, 128], [0, 0, 64, 64, 200], [0, 0]])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_prepare_packing_indexes_the_documents(cu, dtype):
    p = prepare_packing(torch.tensor(cu, dtype=dtype), cu[-1])
    indices, offsets, seq_ids = expected_index(cu)
    assert p.bounds == tuple(cu) and p.num_seqs == len(cu) - 1 and p.seqlen == cu[-1]
    assert p.max_len == max(e - s for s, e in zip(cu[:-1], cu[1:]))
    assert p.cu_seqlens.dtype == torch.int32 and p.cu_seqlens.tolist() == cu
    assert p.seq_ids.dtype == torch.int32 and p.seq_ids.tolist() == seq_ids
    assert p.plan.chunk_indices.tolist() == indices and p.plan.chunk_offsets.tolist() == offsets
    assert (p.plan.num_seqs, p.plan.num_chunks, p.plan.chunk_size) == (len(cu) - 1, offsets[-1], 64)
    assert p.plan.cu_seqlens is p.cu_seqlens
    # every index starts 16-byte aligned, as Triton's pointer specialisation sees separate tensors
    assert all(x.data_ptr() % 16 == 0 for x in (p.cu_seqlens, p.seq_ids, *p.plan[1:3]))
    # a Packing passes through as it is: same device, same plan
    assert prepare_packing(p, cu[-1]) is p and p.to("cpu") is p
    assert prepare_chunks(p, 1, cu[-1], device="cpu") is p.plan


@pytest.mark.parametrize("cu,seq_len", [(CU, 0), ([0, 128], 128), ([0, 100, 200, 300], 100), ([0, 0], 0)])
def test_plan_keeps_a_common_sequence_length(cu, seq_len):
    assert prepare_packing(torch.tensor(cu), cu[-1]).plan.seq_len == seq_len
    assert prepare_chunks(None, 3, 100, device="cpu").seq_len == 100


CHUNK_OPS = {"gla": chunk_gla, "simple_gla": chunk_simple_gla, "delta": chunk_delta_rule,
             "gated_delta": chunk_gated_delta_rule, "ssd": chunk_ssd}


@pytest.mark.parametrize("two_level", [False, True], ids=["walks", "two_level"])
@pytest.mark.parametrize("op", list(CHUNK_OPS))
def test_common_length_finds_chunks_by_arithmetic(monkeypatch, op, two_level):
    """Documents of one length (100 tokens: a full chunk and a partial one each) give the bits of the
    same plan read through its index (``seq_len`` 0), in the output and every input's gradient."""
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    monkeypatch.setattr(state, "_two_level", lambda *a, **k: two_level)
    packing = prepare_packing(torch.tensor([0, 100, 200, 300]), 300)
    assert packing.plan.seq_len == 100
    results = []
    for p in (packing, packing._replace(plan=packing.plan._replace(seq_len=0))):
        leaves = op_leaves(op, 300)
        y = CHUNK_OPS[op](**leaves, cu_seqlens=p)[0]
        y.sum().backward()
        results.append([y.detach()] + [t.grad for t in leaves.values()])
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    "cu, error, match",
    [
        (torch.tensor([1, 5, 70]), ValueError, "start at 0"),
        (torch.tensor([0, 40, 30, 70]), ValueError, "non-decreasing"),
        (torch.tensor([0, 5, 60]), ValueError, "end at T=70"),
        (torch.tensor([0.0, 70.0]), TypeError, "int32 or int64"),
        (torch.tensor([[0, 70]]), ValueError, "1-D"),
        ([0, 70], TypeError, "cu_seqlens must be a torch.Tensor or a Packing"),
    ],
)
def test_bad_cu_seqlens_raise_when_packing_and_in_every_op(cu, error, match):
    with pytest.raises(error, match=match):
        prepare_packing(cu, T)
    q = torch.randn(1, T, H, D)
    with pytest.raises(error, match=match):
        chunk_gated_delta_rule(q, q, q, -torch.rand(1, T, H), torch.rand(1, T, H), cu_seqlens=cu)
    with pytest.raises(error, match=match):
        attention(q, q, q, cu_seqlens=cu)


def test_a_packing_of_another_length_or_a_batch_is_refused():
    packing = prepare_packing(torch.tensor([0, 10, 60]), 60)
    q = torch.randn(1, T, H, D)
    with pytest.raises(ValueError, match="end at T=70"):
        chunk_gla(q, q, q, -torch.rand(1, T, H, D), cu_seqlens=packing)
    with pytest.raises(ValueError, match="end at T=70"):
        prepare_packing(packing, T)
    x = torch.randn(2, 60, 8)
    with pytest.raises(ValueError, match="batch size 1"):
        causal_conv1d(x, torch.randn(8, 4), cu_seqlens=packing)


def _inputs(family: str):
    """Positional inputs of the family's ops ``[1, T, ...]`` and the initial state (N = 4 documents)."""
    n = len(CU) - 1
    q, v = torch.randn(1, T, H, D), torch.randn(1, T, H, D)
    k = F.normalize(torch.randn(1, T, H, D), dim=-1)
    g, beta = -torch.rand(1, T, H), torch.rand(1, T, H)
    h0 = torch.randn(n, H, D, D)
    return {
        "delta": ((q, k, v, beta), h0),
        "gated_delta": ((q, k, v, g, beta), h0),
        "gla": ((q, k, v, -torch.rand(1, T, H, D)), h0),
        "simple_gla": ((q, k, v, g), h0),
        "ssd": ((torch.randn(1, T, H, D), torch.rand(1, T, H), -torch.rand(H) - 0.5, torch.randn(1, T, 1, D),
                 torch.randn(1, T, 1, D)), torch.randn(n, H, D, D)),
        "conv": ((torch.randn(1, T, 8), torch.randn(8, 4), torch.randn(8)), torch.randn(n, 8, 3)),
        "attention": ((q, k, v), None),
    }[family]


OPS = {  # family -> (chunk op, recurrent op or None, reference op, keyword arguments)
    "delta": (chunk_delta_rule, recurrent_delta_rule, reference_delta_rule, {}),
    "gated_delta": (chunk_gated_delta_rule, recurrent_gated_delta_rule, reference_gated_delta_rule, {}),
    "gla": (chunk_gla, recurrent_gla, reference_gla, {}),
    "simple_gla": (chunk_simple_gla, recurrent_simple_gla, reference_simple_gla, {}),
    "ssd": (chunk_ssd, recurrent_ssd, reference_ssd, {}),
    "conv": (causal_conv1d, None, reference_causal_conv1d, {"activation": "silu"}),
    "attention": (attention, None, reference_attention, {"window": 8}),
}


def _run(op, inputs, h0, kwargs, cu_seqlens, grad: bool):
    inputs = [x.clone().requires_grad_(grad and x.is_floating_point()) for x in inputs]
    h0 = None if h0 is None else h0.clone().requires_grad_(grad)
    if h0 is not None:
        kwargs = {**kwargs, "initial_state": h0, "output_final_state": True}
    out = op(*inputs, cu_seqlens=cu_seqlens, **kwargs)
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    if not grad:
        return outs
    torch.manual_seed(1)
    sum((o.float() * torch.randn(o.shape)).sum() for o in outs).backward()
    return outs + [x.grad for x in inputs if x.grad is not None] + ([h0.grad] if h0 is not None else [])


@pytest.mark.parametrize("family", list(OPS))
def test_ops_take_a_packing_with_the_results_of_the_tensor(backend, monkeypatch, family):
    """Outputs, final states and every gradient are those of the plain tensor; given the Packing,
    no op re-validates the offsets on the host or builds an index."""
    chunk, recurrent, reference, kwargs = OPS[family]
    inputs, h0 = _inputs(family)
    cu = torch.tensor(CU, dtype=torch.int32)
    packing = prepare_packing(cu, T)
    calls = []
    for module in (index, kernel_utils):
        monkeypatch.setattr(module, "host_cu_seqlens", lambda *a, _f=module.host_cu_seqlens: calls.append(1) or _f(*a))
    monkeypatch.setattr(index, "_build_packing", lambda *a, _f=index._build_packing: calls.append(2) or _f(*a))
    for op, grad in ((chunk, True), (recurrent, False), (reference, True)):
        if op is None:
            continue
        want = _run(op, inputs, h0, kwargs, cu, grad)
        calls.clear()
        got = _run(op, inputs, h0, kwargs, packing, grad)
        assert calls == [], op.__name__
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert torch.equal(a, b), op.__name__


def test_packing_moves_like_a_tensor():
    p = prepare_packing(torch.tensor(CU), T)
    assert isinstance(p, Packing) and p.to(torch.device("cpu"), non_blocking=True) is p
    # DDP and FSDP move forward arguments field by field, NamedTuples included
    from torch.distributed.utils import _recursive_to

    (moved,) = _recursive_to((p,), torch.device("cpu"), False)[0]
    assert isinstance(moved, Packing) and moved.bounds == p.bounds and moved.cu_seqlens is p.cu_seqlens


def test_chunk_states_choice(monkeypatch):
    """``keep_states`` (whether h is kept): by default long sequences keep it
    (``KEEP_STATES_MIN_CHUNKS``), short ones form it again; ``TTR_CHUNK_STATES`` forces either; a
    bad value is refused by name."""
    short = prepare_chunks(None, 2, 64 * 4, device="cpu")
    long = prepare_chunks(None, 1, 64 * index.KEEP_STATES_MIN_CHUNKS, device="cpu")
    monkeypatch.delenv("TTR_CHUNK_STATES", raising=False)
    assert not index.keep_states(short) and index.keep_states(long)
    monkeypatch.setenv("TTR_CHUNK_STATES", "keep")
    assert index.keep_states(short) and index.keep_states(long)
    monkeypatch.setenv("TTR_CHUNK_STATES", "Recompute")
    assert not index.keep_states(short) and not index.keep_states(long)
    monkeypatch.setenv("TTR_CHUNK_STATES", "always")
    with pytest.raises(ValueError, match="TTR_CHUNK_STATES"):
        index.keep_states(short)


@pytest.mark.parametrize("choice,more", [("keep", 3), ("auto", 2), ("recompute", 0)])
def test_ops_keep_states_when_asked(monkeypatch, choice, more):
    """A delta-rule op keeps its forward's w, h and v_new (three more saved tensors than
    ``recompute``) when asked, and by default for short sequences w and v_new (two more)."""
    from ttr.kernels.delta import chunk_delta_rule

    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    monkeypatch.setenv("TTR_CHUNK_STATES", choice)
    q, k, v = (torch.randn(1, 70, 2, 16, requires_grad=True) for _ in range(3))
    beta = torch.rand(1, 70, 2, requires_grad=True)
    k = F.normalize(k, dim=-1)

    def saved_by_forward():
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            o, _ = chunk_delta_rule(q, k, v, beta)
        return o, len(saved)

    o, count = saved_by_forward()
    monkeypatch.setenv("TTR_CHUNK_STATES", "recompute")
    assert count - saved_by_forward()[1] == more
    o.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, v, beta))


@pytest.mark.parametrize("choice,more", [("keep", 1), ("auto", 1), ("recompute", 0)])
def test_gla_keeps_its_states_at_any_length(monkeypatch, choice, more):
    """GLA's op keeps its forward's states h (one saved tensor more than ``recompute``) by default
    even for a short sequence, where the other ops form theirs again, and its gradients are those
    of the op that forms them again."""
    from ttr.kernels.gla import chunk_gla

    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 70, 2, n, requires_grad=True) for n in (16, 16, 32))
    g = (-torch.rand(1, 70, 2, 16) / 4).requires_grad_()
    assert not index.keep_states(prepare_chunks(None, 1, 70, device="cpu"))

    def run(states):
        monkeypatch.setenv("TTR_CHUNK_STATES", states)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            o, _ = chunk_gla(q, k, v, g)
        return len(saved), torch.autograd.grad(o, (q, k, v, g), torch.ones_like(o))

    count, grads = run(choice)
    base, grads_recomputed = run("recompute")
    assert count - base == more
    for a, b in zip(grads, grads_recomputed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
