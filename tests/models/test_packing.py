"""The model resolves packed documents once per forward: one ``Packing`` built from the caller's
``cu_seqlens`` (or restarting ``position_ids``) serves every layer's kernels, forward and backward,
and a ``Packing`` passed in is used as it is. Layers reach their kernels in a few frames."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

import ttr
from ttr.kernels import prepare_packing
from ttr.kernels import utils as kernel_utils
from ttr.kernels.common import index
from ttr.kernels.delta.chunk import ChunkDeltaRuleFunction
from ttr.models import TTRForCausalLM, get_preset

VOCAB, T = 64, 70
CU = [0, 1, 30, 30, 70]
HYBRID = dict(
    num_hidden_layers=5,
    layer_types=["gated_deltanet", "gla", "delta_net", "mamba2", "swa"],
    vocab_size=VOCAB, hidden_size=16, num_heads=2, intermediate_size=16, window_size=4,
    mamba_head_dim=8, mamba_state_size=8,
)


@pytest.fixture
def counts(monkeypatch):
    """How often packing offsets are read on the host (validated) and indexed (built)."""
    seen = {"host": 0, "build": 0}

    def counting(key, fn):
        def wrapped(*args, **kwargs):
            seen[key] += 1
            return fn(*args, **kwargs)
        return wrapped

    for module in (index, kernel_utils):
        monkeypatch.setattr(module, "host_cu_seqlens", counting("host", index.host_cu_seqlens))
    monkeypatch.setattr(index, "_build_packing", counting("build", index._build_packing))
    return seen


def _step(model, ids, **kwargs):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids, **kwargs).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize(
    "backend, neg_eigval",
    [("torch", False), ("torch", True), pytest.param("triton", False, marks=pytest.mark.slow)],
)
def test_packing_is_resolved_once_per_forward(monkeypatch, counts, backend, neg_eigval):
    monkeypatch.setenv("TTR_KERNEL_BACKEND", backend)
    torch.manual_seed(0)
    model = TTRForCausalLM(get_preset("gated_deltanet-debug", allow_neg_eigval=neg_eigval, **HYBRID)).train()
    ids = torch.randint(0, VOCAB, (1, T))
    cu = torch.tensor(CU, dtype=torch.int32)
    loss, grads = _step(model, ids, cu_seqlens=cu)
    # 3 short convs + mixer per delta-rule layer, the GLA and Mamba2 mixers, attention, the loss
    # targets, and the backward of each: all from the one packing of this forward
    assert counts == {"host": 1, "build": 1}
    packing = prepare_packing(cu, T)
    counts.update(host=0, build=0)
    loss_p, grads_p = _step(model, ids, cu_seqlens=packing)
    assert counts == {"host": 0, "build": 0}
    assert torch.equal(loss_p, loss) and all(torch.equal(a, b) for a, b in zip(grads_p, grads))
    # restarting position_ids give the same packing, read once
    counts.update(host=0, build=0)
    positions = torch.cat([torch.arange(e - s) for s, e in zip(CU[:-1], CU[1:])])[None]
    loss_pos, _ = _step(model, ids, position_ids=positions)
    assert counts == {"host": 1, "build": 1} and torch.allclose(loss_pos, loss, rtol=1e-6, atol=0)


def test_unpacked_batches_build_no_packing(counts):
    model = TTRForCausalLM(get_preset("gated_deltanet-debug", **HYBRID)).train()
    ids = torch.randint(0, VOCAB, (2, 40))
    _step(model, ids)
    assert counts["host"] == 0


def test_layer_reaches_its_kernel_in_few_frames(monkeypatch):
    """GatedDeltaNet.forward -> run_kernel -> the public op (behind its device guard) -> the autograd
    Function: no lazy-import hop between models and kernels."""
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    root = Path(ttr.__file__).resolve().parent

    class Reached(Exception):
        pass

    def spy(ctx, *args):
        frames = [f for f in inspect.stack(0) if Path(f.filename).resolve().is_relative_to(root)]
        raise Reached([(Path(f.filename).resolve().relative_to(root).as_posix(), f.function) for f in frames])

    monkeypatch.setattr(ChunkDeltaRuleFunction, "forward", staticmethod(spy))
    model = TTRForCausalLM(get_preset("gated_deltanet-debug", **HYBRID))
    with pytest.raises(Reached) as err:
        model(torch.randint(0, VOCAB, (1, 8)))
    frames = err.value.args[0]
    layer = frames.index(("models/layers/gated_deltanet.py", "forward"))
    assert frames[: layer + 1] == [
        ("tests/models/test_packing.py", "spy"),
        ("kernels/gated_delta/__init__.py", "chunk_gated_delta_rule"),
        ("kernels/utils.py", "guarded"),
        ("models/layers/linear.py", "run_kernel"),
        ("models/layers/gated_deltanet.py", "forward"),
    ]
