"""``kernels/common/overlap.py``: GLA's backward forms its chunk states again on a second stream
beside its other stages. On the CPU ``beside`` runs at once; on a GPU the gradients are the same bits
with and without the second stream."""

import pytest
import torch
import torch.nn.functional as F

from ttr.kernels.common import overlap
from ttr.kernels.common.index import TUNING
from ttr.kernels.gla import chunk_gla


def test_beside_runs_at_once_off_the_gpu():
    calls = []
    join = overlap.beside(lambda: calls.append("ran") or torch.ones(2), torch.device("cpu"))
    assert calls == ["ran"]
    assert torch.equal(join(), torch.ones(2)) and calls == ["ran"]
    assert not overlap.overlapping(torch.device("cpu"))


def test_kept_or_beside_returns_what_was_kept():
    kept = torch.zeros(3)
    join = overlap.kept_or_beside(kept, lambda: pytest.fail("formed again although kept"), torch.device("cpu"))
    assert join() is kept
    assert torch.equal(overlap.kept_or_beside(None, lambda: torch.ones(1), torch.device("cpu"))(), torch.ones(1))


def test_overlap_can_be_turned_off(monkeypatch):
    monkeypatch.setitem(TUNING, "overlap", {"enabled": False})
    assert not overlap.overlapping(torch.device("cuda", 0))


@pytest.mark.gpu
def test_gpu_beside_runs_on_a_second_stream_and_joins():
    main = torch.cuda.current_stream()
    x = torch.randn(4096, 4096, device="cuda")
    seen = []

    def work():
        seen.append(torch.cuda.current_stream())
        return x @ x

    join = overlap.beside(work, x.device)
    assert seen[0] != main and torch.cuda.current_stream() == main
    y = join() + 1  # queued on the main stream after the join
    torch.testing.assert_close(y, x @ x + 1)


def _gla_inputs(b, t, h, d):
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    return [q, k, v, F.logsigmoid(torch.randn(b, t, h, d, device="cuda") + 3)]


@pytest.mark.gpu
@pytest.mark.parametrize("states", ["auto", "recompute"])
def test_gpu_gla_gradients_are_the_same_on_one_stream(monkeypatch, states):
    """At 8 chunks per sequence the forward keeps no states, so the backward forms them beside its
    other stages; serial (overlap off) it gives the same bits."""
    monkeypatch.setenv("TTR_CHUNK_STATES", states)
    fn = chunk_gla
    leaves = [x.requires_grad_() for x in _gla_inputs(2, 512, 4, 64)]
    do = torch.randn_like(fn(*leaves)[0])
    grads = {}
    for enabled in (True, False):
        monkeypatch.setitem(TUNING, "overlap", {"enabled": enabled})
        grads[enabled] = torch.autograd.grad(fn(*leaves)[0], leaves, do)
    for a, b in zip(grads[True], grads[False]):
        assert torch.equal(a, b)
