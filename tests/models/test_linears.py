"""``linears``: several projections of one input, whose input gradient the matmuls accumulate."""

import pytest
import torch
from torch import nn

from ttr.models.modules import linears


def _maps(bias):
    torch.manual_seed(0)
    return [nn.Linear(24, n, bias=bias) for n in (16, 3, 40)]


def _grads(mods, x, fn, used=(0, 1, 2)):
    x = x.clone().requires_grad_()
    outs = fn(x, mods)
    loss = sum((outs[i].float() * (i + 1)).sin().sum() for i in used)
    params = [p for m in mods for p in m.parameters()]
    for p in params:
        p.grad = None
    loss.backward()
    return [o.detach() for o in outs], [x.grad] + [p.grad for p in params]


def separate(x, mods):
    return [m(x) for m in mods]


def shared(x, mods):
    return list(linears(x, *mods))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("used", [(0, 1, 2), (0, 2), (1,)])
def test_linears_equal_separate_projections(bias, used):
    """Outputs and every gradient (input, weights, biases) as the modules called one by one, also
    when some outputs get no gradient."""
    mods = _maps(bias)
    x = torch.randn(2, 5, 24)
    outs_a, grads_a = _grads(mods, x, separate, used)
    outs_b, grads_b = _grads(mods, x, shared, used)
    for a, b in zip(outs_a, outs_b):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(grads_a, grads_b):
        if a is None:
            assert b is None
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_linears_under_autocast():
    """bf16 autocast: outputs in bf16 as ``F.linear`` gives them; the weights' and biases' fp32
    gradients exactly those of the separate calls (the same products); the input's within one bf16
    rounding step (the sum is rounded once per product here, once per addition there)."""
    mods = _maps(True)
    x = torch.randn(3, 7, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs_a, grads_a = _grads(mods, x, separate)
        outs_b, grads_b = _grads(mods, x, shared)
    for a, b in zip(outs_a, outs_b):
        assert b.dtype == torch.bfloat16
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    dx_a, dx_b = grads_a[0], grads_b[0]
    assert dx_a.dtype == dx_b.dtype
    assert (dx_a - dx_b).abs().max() <= 2**-7 * dx_a.abs().max()
    for a, b in zip(grads_a[1:], grads_b[1:]):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_linears_call_modules_that_are_not_plain():
    """A forward hook, or a module put in a linear's place (an adapter), is honoured: the modules
    are then called one by one."""
    mods = _maps(False)
    seen = []
    handle = mods[1].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    x = torch.randn(2, 24, requires_grad=True)
    linears(x, *mods)
    assert seen == [torch.Size([2, 3])]
    handle.remove()
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: seen.append(type(m).__name__))
    try:
        linears(x, *mods)
    finally:
        handle.remove()
    assert seen[1:] == ["Linear"] * 3  # a global hook sees every projection

    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    mods[2].__class__ = Scaled
    out = linears(x, *mods)
    torch.testing.assert_close(out[2], 2 * nn.functional.linear(x, mods[2].weight))
