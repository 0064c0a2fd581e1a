"""``linears``: several projections of one input, whose input gradient the matmuls accumulate."""

import pytest
import torch
from torch import nn

from ttr.models.modules import NARROW_MAP, GradColumns, SwiGLU, linear, linears


def _maps(bias):
    """Two narrow maps (one product of their stacked weights) and a wide one (a product of its own)."""
    torch.manual_seed(0)
    return [nn.Linear(24, n, bias=bias) for n in (16, 3, NARROW_MAP + 16)]


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
    """Outputs and every gradient (input, weights, biases) as the modules called one by one, to
    fp32 rounding (the narrow maps' product sums in its own order), also when some outputs get
    no gradient."""
    mods = _maps(bias)
    x = torch.randn(2, 5, 24)
    outs_a, grads_a = _grads(mods, x, separate, used)
    outs_b, grads_b = _grads(mods, x, shared, used)
    for a, b in zip(outs_a, outs_b):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads_a, grads_b):
        if a is None:
            assert b is None
        else:  # dx sums its products in another order
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_linears_under_autocast():
    """bf16 autocast: outputs in bf16 as ``F.linear`` gives them; the input's gradient within one
    bf16 rounding step of the separate calls' (the sum is rounded once per product here, once per
    addition there); the weights' and biases' gradients in fp32, the product of the bf16 operands
    without the bf16 rounding of ``F.linear``'s backward (to fp32 accuracy of the float64 product,
    and closer to it than the separate calls')."""
    mods = _maps(True)
    x = torch.randn(3, 7, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs_a, grads_a = _grads(mods, x, separate)
        outs_b, grads_b = _grads(mods, x, shared)
    for a, b in zip(outs_a[2:], outs_b[2:]):  # the wide map: F.linear itself
        assert b.dtype == torch.bfloat16
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    stacked = torch.cat([m.weight for m in mods[:2]]).to(torch.bfloat16)
    narrow = nn.functional.linear(x.to(torch.bfloat16), stacked, torch.cat([m.bias for m in mods[:2]]).to(torch.bfloat16))
    torch.testing.assert_close(torch.cat(outs_b[:2], -1), narrow, rtol=0, atol=0)
    dx_a, dx_b = grads_a[0], grads_b[0]
    assert dx_a.dtype == dx_b.dtype
    assert (dx_a - dx_b).abs().max() <= 2**-7 * dx_a.abs().max()
    # the operands the products see: x and each output's gradient, in bf16
    x2 = x.to(torch.bfloat16).reshape(-1, 24).double()
    expected = []
    for i, out in enumerate(outs_b):
        g = ((i + 1) * torch.cos((i + 1) * out.float())).to(torch.bfloat16).reshape(-1, out.shape[-1]).double()
        expected += [g.t() @ x2, g.sum(0)]
    for a, b, ref in zip(grads_a[1:], grads_b[1:], expected):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(b.double(), ref, rtol=1e-5, atol=1e-5)
        assert (b.double() - ref).abs().max() <= (a.double() - ref).abs().max()


def test_linear_one_map_is_the_module():
    """``linear`` (one map: the output projections) gives the module's output and gradients."""
    mods = _maps(True)[:1]
    x = torch.randn(2, 5, 24)
    outs_a, grads_a = _grads(mods, x, separate, used=(0,))
    outs_b, grads_b = _grads(mods, x, lambda x, m: [linear(x, m[0])], used=(0,))
    torch.testing.assert_close(outs_a[0], outs_b[0], rtol=0, atol=0)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


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


@pytest.mark.gpu
@pytest.mark.parametrize("n,d", [(1, 256), (3, 256), (3, 16)])
def test_linears_fp32_weight_grads_on_cuda(n, d):
    """On CUDA under bf16 autocast the weights' fp32 gradients come from the product itself
    (``torch.mm(..., out_dtype=float32)``): the float64 product of the bf16 operands to fp32
    accuracy, also through transposed operands and a bias, and from 16 inputs the bias's gradient
    as a column of its weight's product (``weight_bias_grad``)."""
    torch.manual_seed(0)
    mods = [nn.Linear(d, (16, 128, 8)[i], bias=i == 1).cuda() for i in range(n)]
    x = torch.randn(4, 96, d, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        outs, grads = _grads(mods, x, shared, used=tuple(range(n)))
    x2 = x.to(torch.bfloat16).reshape(-1, d).double()
    params = [p for m in mods for p in m.parameters()]
    expected = []
    for i, (out, m) in enumerate(zip(outs, mods)):
        g = ((i + 1) * torch.cos((i + 1) * out.float())).to(torch.bfloat16).reshape(-1, out.shape[-1]).double()
        expected += [g.t() @ x2] + ([g.sum(0)] if m.bias is not None else [])
    assert len(expected) == len(params)
    for got, ref in zip(grads[1:], expected):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), ref, rtol=2e-5, atol=2e-4)


@pytest.mark.parametrize("folded", [True, False])
def test_narrow_input_bias_grad_as_a_weight_product_column(folded, monkeypatch):
    """A map from few inputs to many outputs (GLA's rank-16 gate map up to its keys) takes its bias's
    gradient as one more column of its weight's product (x padded with ones): the gradients of the
    module called alone, and no column sums of their own; ``TUNING["bias_column"]`` off sums them."""
    import ttr.kernels.utils as utils
    from ttr.kernels.common.index import TUNING

    monkeypatch.setitem(TUNING, "bias_column", {"enabled": folded})
    sums = []
    monkeypatch.setattr(utils, "bias_grad", lambda g, dtype: sums.append(g) or g.sum(0, dtype=torch.float32).to(dtype))
    torch.manual_seed(0)
    mods = [nn.Linear(16, 96, bias=True)]
    x = torch.randn(3, 7, 16)
    outs_a, grads_a = _grads(mods, x, separate, used=(0,))
    outs_b, grads_b = _grads(mods, x, shared, used=(0,))
    torch.testing.assert_close(outs_a[0], outs_b[0], rtol=1e-6, atol=1e-6)
    for a, b in zip(grads_a, grads_b):
        assert a.shape == b.shape and b.is_contiguous()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert len(sums) == (0 if folded else 1)


def test_narrow_maps_share_one_product():
    """The narrow maps' outputs are columns of one product; in the backward their input gradient
    is the first product (written, not added), the wide maps' add into it, and each of the
    products forms the weights' gradients of its maps once."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Products(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm_, torch.ops.aten.addmm):
                self.seen.append((func.overloadpacket.__name__, tuple(args[-1].shape)))
            return func(*args, **(kwargs or {}))

    mods = _maps(False)
    x = torch.randn(2, 5, 24, requires_grad=True)
    outs = linears(x, *mods)
    assert outs[0].untyped_storage().data_ptr() == outs[1].untyped_storage().data_ptr()
    assert outs[2].untyped_storage().data_ptr() != outs[0].untyped_storage().data_ptr()
    loss = sum((o * (i + 1)).sin().sum() for i, o in enumerate(outs))
    with Products() as mode:
        loss.backward()
    wide = NARROW_MAP + 16
    assert mode.seen[0] == ("mm", (19, 24))  # dx = g_narrow W_narrow
    assert ("addmm_", (wide, 24)) in mode.seen  # dx += g_wide W_wide
    assert sorted(s for _, s in mode.seen if s[0] == 10) == [(10, 24), (10, 24)]  # one dW per product


@pytest.mark.parametrize("columns", [True, False])
@pytest.mark.parametrize("autocast", [False, True])
def test_swiglu_mlp_as_its_modules(autocast, columns, monkeypatch):
    """The MLP (whose down projection runs with the product in ``swiglu_linear``, gate and up as
    the halves of one product unless ``TUNING["mlp_columns"]`` says otherwise) gives the output and
    gradients of its modules called one by one."""
    from ttr.kernels.common.index import TUNING
    from ttr.models import modules

    monkeypatch.setitem(TUNING, "mlp_columns", {"enabled": columns})
    halves = []
    real = modules.swiglu_linear
    monkeypatch.setattr(modules, "swiglu_linear", lambda g, u, *a: halves.append(u is None) or real(g, u, *a))
    torch.manual_seed(0)
    mlp = SwiGLU(24, 40, bias=True)
    x = torch.randn(2, 9, 24)
    mods = [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    results = []
    for fn in (lambda x: mlp(x), lambda x: mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))):
        xx = x.clone().requires_grad_()
        for p in mlp.parameters():
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = fn(xx)
            (y.float() ** 2).sum().backward()
        results.append([y.detach(), xx.grad] + [p.grad for m in mods for p in m.parameters()])
    tol = 2e-2 if autocast else 1e-5
    for a, b in zip(*results):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * a.abs().max().item())
    assert halves == [columns]


@pytest.mark.parametrize("bias", [False, True])
def test_joined_linears_equal_separate_projections(bias):
    """``joined_linears``: the joined maps' outputs as one tensor (their columns in order) and the
    others as ``linears`` gives them; every gradient as with separate projections; the joined
    gradient is used whole (no cat of its blocks) in one product that adds into dx."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ttr.models.modules import joined_linears

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.seen.append((func.overloadpacket.__name__, tuple(out.shape) if isinstance(out, torch.Tensor) else ()))
            return out

    torch.manual_seed(0)
    joined = [nn.Linear(24, n, bias=bias) for n in (8, 8, 16)]
    others = [nn.Linear(24, n, bias=bias) for n in (3, 4, NARROW_MAP + 16)]
    mods = joined + others
    x = torch.randn(2, 5, 24)
    ref_out, ref_grads = _grads(mods, x, separate, used=range(6))

    def fn(x, mods):
        whole, *rest = joined_linears(x, mods[:3], *mods[3:])
        assert whole.shape == (2, 5, 32)
        return [*whole.split([8, 8, 16], -1), *rest]

    with Ops() as mode:
        out, grads = _grads(mods, x, fn, used=range(6))
    for a, b in zip(out + grads, ref_out + ref_grads):  # the same sums, in another order in the products
        assert a.shape == b.shape and ((a - b).norm() / b.norm()) < 1e-6
    assert ("mm", (32, 24)) in mode.seen  # one weight gradient for the joined maps, split after
    assert ("cat", (10, 32)) not in mode.seen  # their gradient is used whole: no cat of its blocks


def test_joined_linears_decline_what_linears_calls():
    """None (the caller takes its own path) for one map, maps of mixed dtypes or biases, or a
    module that is not a plain ``nn.Linear``."""
    from ttr.models.modules import joined_linears

    x = torch.randn(2, 3, 8)
    a, b = nn.Linear(8, 4, bias=False), nn.Linear(8, 4, bias=False)
    assert joined_linears(x, [a]) is None
    assert joined_linears(x, [a, nn.Linear(8, 4)]) is None
    assert joined_linears(x, [a, nn.Linear(8, 4, bias=False).double()]) is None
    hooked = nn.Linear(8, 4, bias=False)
    hooked.register_forward_hook(lambda *args: None)
    assert joined_linears(x, [a, hooked]) is None
    assert joined_linears(x, [a, b])[0].shape == (2, 3, 8)


class _WritesInto(torch.autograd.Function):
    """A consumer of a map's output whose backward writes its gradient (``2 * dy``) into a block
    the caller gives, as the chunk op and the output norm do for GLA's projections."""

    @staticmethod
    def forward(ctx, y, block):
        ctx.block = block
        return 2 * y

    @staticmethod
    def backward(ctx, dy):
        out = ctx.block()
        out.copy_(2 * dy)
        return out, None


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("case", ["all_written", "one_unused", "one_copied"])
def test_grad_columns_give_the_separate_projections_gradients(bias, case):
    """``linears(..., into=GradColumns())``: the maps' input gradients as column blocks of one
    buffer, written by the consumers' backward or copied (zeroed where an output got none) into
    it, one product each way: outputs and every gradient as the modules called one by one; the
    buffer let go after the backward."""
    torch.manual_seed(1)
    mods = [nn.Linear(24, n, bias=bias) for n in (16, 8, NARROW_MAP + 16, 3)]
    x = torch.randn(2, 5, 24)

    def consume(outs, grads):
        ys = []
        for i, y in enumerate(outs):
            if case == "one_unused" and i == 1:
                continue
            written = grads is not None and not (case == "one_copied" and i == 2)
            ys.append(_WritesInto.apply(y, lambda i=i: grads.block(i)) if written else 2 * y)
        return sum((y * (j + 1)).sin().sum() for j, y in enumerate(ys))

    results = []
    for into in (None, GradColumns()):
        xx = x.clone().requires_grad_()
        for m in mods:
            m.zero_grad(set_to_none=True)
        outs = linears(xx, *mods, into=into)
        assert into is None or into.ready
        consume(outs, into).backward()
        results.append([xx.grad] + [p.grad for m in mods for p in m.parameters()])
        assert into is None or into.buffer is None
    for a, b in zip(*results):
        if a is None:
            assert b is None
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_grad_columns_not_taken_where_linears_calls_the_modules():
    mods = [nn.Linear(8, 4), nn.Linear(8, 4, bias=False)]  # a bias on one map only: not one product
    into = GradColumns()
    linears(torch.randn(3, 8), *mods, into=into)
    assert not into.ready
    with pytest.raises(RuntimeError, match="linears"):
        into.block(0)
