import math

import pytest
import torch

from ttr.optim import lr_multiplier, param_groups


class Mixer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(4, 4)
        self.A_log = torch.nn.Parameter(torch.zeros(2))
        self.dt_bias = torch.nn.Parameter(torch.zeros(2))
        self.o_norm = torch.nn.LayerNorm(4)
        self.conv = torch.nn.Parameter(torch.zeros(4, 3))


def test_param_groups_exclude_norms_biases_gates():
    m = Mixer()
    decay, plain = param_groups(m, 0.1)
    names = {id(p): n for n, p in m.named_parameters()}
    assert decay["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert sorted(names[id(p)] for p in decay["params"]) == ["conv", "q_proj.weight"]
    assert sorted(names[id(p)] for p in plain["params"]) == ["A_log", "dt_bias", "o_norm.bias", "o_norm.weight",
                                                             "q_proj.bias"]


def _lr(step, schedule, **kw):
    args = dict(max_steps=100, schedule=schedule, warmup_steps=10, min_lr_ratio=0.1, decay_fraction=0.2) | kw
    return lr_multiplier(step, **args)


def test_warmup_and_cosine():
    assert _lr(0, "cosine") == pytest.approx(1 / 11)
    assert _lr(9, "cosine") == pytest.approx(10 / 11)
    assert _lr(10, "cosine") == pytest.approx(1.0)
    assert _lr(99, "cosine") == pytest.approx(0.1)
    mid = 10 + 89 / 2
    assert _lr(mid, "cosine") == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    values = [_lr(s, "cosine") for s in range(10, 100)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_wsd_and_constant():
    assert _lr(50, "wsd") == 1.0 and _lr(79, "wsd") == 1.0
    assert _lr(80, "wsd") == pytest.approx(1 - 0.9 / 20)
    assert _lr(99, "wsd") == pytest.approx(0.1)
    assert _lr(99, "constant") == 1.0
    with pytest.raises(ValueError, match="schedule"):
        _lr(50, "linear")
