"""Every mixer class states its traits, which the config, the FLOP count and the synthetic
benchmarks read through LAYER_TYPES instead of lists of names."""

import pytest
import torch

from ttr.kernels.common.index import CHUNK_SIZE
from ttr.models import TTRConfig, TTRForCausalLM, get_preset
from ttr.models.configuration import ATTENTION_TYPES, LINEAR_TYPES
from ttr.models.layers import LAYER_TYPES, Mixer


@pytest.mark.parametrize("name", list(LAYER_TYPES))
def test_every_mixer_states_its_traits(name):
    cls = LAYER_TYPES[name]
    cfg = TTRConfig(hidden_size=64, num_hidden_layers=1, layer_types=[name], num_heads=2, window_size=8)
    assert issubclass(cls, Mixer)
    assert cls.state_size(cfg, 32) > 0 and cls.flops_per_token(cfg, 32) > 0
    layer = cls(cfg, 0)
    assert layer(torch.randn(1, 5, 64), position_ids=torch.arange(5)[None]).shape == (1, 5, 64)


def test_config_groups_come_from_the_classes():
    assert set(ATTENTION_TYPES) == {"attn", "swa"}
    assert set(LINEAR_TYPES) == {"gla", "delta_net", "gated_deltanet"}


def test_window_bounds_attention_state_and_flops():
    cfg = TTRConfig(hidden_size=64, num_hidden_layers=1, layer_types=["swa"], num_heads=2, window_size=8)
    swa, attn = LAYER_TYPES["swa"], LAYER_TYPES["attn"]
    assert swa.state_size(cfg, 1000) == swa.state_size(cfg, 8) < attn.state_size(cfg, 1000)
    assert swa.flops_per_token(cfg, 4) == attn.flops_per_token(cfg, 4)  # the window covers the sequence
    assert swa.flops_per_token(cfg, 1000) < attn.flops_per_token(cfg, 1000)


def test_delta_rules_add_the_wy_terms():
    cfg = TTRConfig(hidden_size=64, num_hidden_layers=1, num_heads=2)
    c, k, v, h = CHUNK_SIZE, cfg.head_dim, cfg.value_head_dim, cfg.num_heads
    assert LAYER_TYPES["gla"].flops_per_token(cfg, 64) == h * (2 * c * (k + v) + 4 * k * v)
    assert LAYER_TYPES["gated_deltanet"].flops_per_token(cfg, 64) == h * (6 * c * k + 4 * c * v + 6 * k * v)


def test_a_mixer_without_its_traits_cannot_be_built():
    class Incomplete(Mixer):
        def forward(self, x, **_):
            return x

    with pytest.raises(TypeError, match="state_size"):
        Incomplete()


@pytest.mark.parametrize("name", ["delta_net", "gated_deltanet"])
def test_delta_rules_take_beta_in_fp32_under_autocast(name, monkeypatch):
    """beta reaches the kernel in fp32 under bf16 autocast: in bf16 a beta near 1 rounds to 1 (or
    1 - 2^-8), and the sigmoid's backward, which scales by beta (1 - beta), loses its gradient."""
    cfg = TTRConfig(hidden_size=64, num_hidden_layers=1, layer_types=[name], num_heads=2)
    layer = LAYER_TYPES[name](cfg, 0)
    torch.nn.init.normal_(layer.b_proj.weight, 0.08, 0.01)  # logits about 5 on the input below
    seen = {}

    def run_kernel(chunk_fn, recurrent_fn, *inputs, **kw):
        seen["beta"] = inputs[-1]
        return inputs[2]  # v as the output: [B, T, H, V]

    monkeypatch.setattr(layer, "run_kernel", run_kernel)
    x = torch.ones(1, 7, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x)
    beta = seen["beta"]
    assert beta.dtype == torch.float32
    assert ((beta > 0.99) & (beta < 1 - 2**-9)).all()  # saturated, yet below what bf16 rounds to 1
    # the gradient through the sigmoid, against float64 from the same bf16 logits: a bf16 beta has
    # 1 - beta on a grid of 2^-8 and misses it by tens of percent here
    (dw,) = torch.autograd.grad(beta.sum(), layer.b_proj.weight)
    logits = torch.nn.functional.linear(x.detach().bfloat16(), layer.b_proj.weight.detach().bfloat16()).double()
    want = (torch.sigmoid(logits) * torch.sigmoid(-logits)).sum((0, 1))[:, None].expand_as(dw)  # x is ones
    assert ((dw.double() - want).norm() / want.norm()) < 1e-2


def layer_with_watched_convs(name, monkeypatch, change=None):
    """A delta-rule layer of ``name`` (``change`` applied to it first), its weights drawn (a layer
    built alone has none initialised: the model initialises them), and the list into which each call
    of ``causal_conv1d_columns`` puts its ``passthrough``."""
    from ttr.models.layers import linear as linear_layer

    torch.manual_seed(0)
    cfg = TTRConfig(hidden_size=64, num_hidden_layers=1, layer_types=[name], num_heads=2)
    layer = LAYER_TYPES[name](cfg, 0)
    if change is not None:
        change(layer)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.1)
    calls = []
    real = linear_layer.causal_conv1d_columns
    monkeypatch.setattr(linear_layer, "causal_conv1d_columns",
                        lambda *a, **k: calls.append(k["passthrough"]) or real(*a, **k))
    return layer, calls


@pytest.mark.parametrize("name", ["delta_net", "gated_deltanet"])
@pytest.mark.parametrize("packed", [False, True])
def test_qkv_as_one_product_is_the_layer_of_three(name, packed, monkeypatch):
    """With short convs (training, no mask) q, k and v run as one projection whose gradient the
    convs give back as one tensor (``causal_conv1d_columns``), the narrow gate maps (beta, and
    Gated DeltaNet's decay) as columns of it that the convs pass through; the layer's output and
    every gradient are those of the separate projections and convs it replaces, and a mask or a
    cache takes the separate ones."""
    from ttr.kernels.common.index import TUNING

    layer, calls = layer_with_watched_convs(name, monkeypatch)
    x = torch.randn(1 if packed else 2, 40, 64)
    cu = torch.tensor([0, 17, 40], dtype=torch.int32) if packed else None
    results = []
    for tuning in ({"enabled": True}, {"enabled": True, "narrow": False}, {"enabled": False}):
        monkeypatch.setitem(TUNING, "qkv_columns", tuning)
        xx = x.clone().requires_grad_()
        for p in layer.parameters():
            p.grad = None
        out = layer(xx, cu_seqlens=cu)
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        results.append([out.detach(), xx.grad] + [p.grad for p in layer.parameters()])
    from ttr.models.modules import NARROW_MAP
    narrow = [getattr(layer, n).out_features for n in layer.input_projections[3:]]
    assert calls == [sum(w for w in narrow if w <= NARROW_MAP), 0] and calls[0] >= 2  # beta per head, at least
    for other in results[1:]:
        for a, b in zip(results[0], other):  # the same sums, in another order inside the products
            assert a.shape == b.shape and ((a - b).norm() / b.norm()) < 1e-5
    monkeypatch.setitem(TUNING, "qkv_columns", {"enabled": True})
    layer(x, mask=torch.ones(x.shape[:2], dtype=torch.bool) if not packed else None, cu_seqlens=cu)
    assert len(calls) == (2 if not packed else 3)


def test_narrow_map_that_cannot_share_the_product_stays_apart(monkeypatch):
    """A narrow map whose bias differs from q's (``joinable``) is not passed through the convs: q,
    k and v still run as one product, and the layer gives the separate projections' results."""
    from ttr.kernels.common.index import TUNING

    layer, calls = layer_with_watched_convs(
        "delta_net", monkeypatch, change=lambda m: setattr(m.b_proj, "bias", torch.nn.Parameter(torch.zeros(2))))
    x = torch.randn(2, 40, 64)
    outs = []
    for enabled in (True, False):
        monkeypatch.setitem(TUNING, "qkv_columns", {"enabled": enabled})
        outs.append(layer(x).detach())
    assert calls == [0]
    assert ((outs[0] - outs[1]).norm() / outs[1].norm()) < 1e-5


def gla_layer_results(layer, x, monkeypatch, key, choices):
    """Under each choice of ``TUNING[key]``: the layer's output on x packed as two sequences, x's
    gradient and every parameter's, for the loss ``sum(y^2)``."""
    from ttr.kernels.common.index import TUNING

    results = []
    for choice in choices:
        monkeypatch.setitem(TUNING, key, choice)
        xx = x.clone().requires_grad_()
        layer.zero_grad()
        y = layer(xx, cu_seqlens=torch.tensor([0, 30, x.shape[1]]))
        y.square().sum().backward()
        results.append([y.detach(), xx.grad] + [p.grad.clone() for p in layer.parameters()])
    return results


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gla_layer_gives_its_op_the_gate_logits(backend, monkeypatch):
    """GLA's layer hands the op its gate's logits (``chunk_gla(gate_logits=)``) unless
    ``TUNING["gla_gate"]`` says otherwise, or a mask must zero the gate: the same output and
    gradients as forming the gate first, packed, with a clamp."""
    from ttr.kernels.common.index import TUNING
    from ttr.models.layers import gla as gla_layer

    monkeypatch.setenv("TTR_KERNEL_BACKEND", backend)
    # the projections' gradients as one buffer sum their products in another order (the next test)
    monkeypatch.setitem(TUNING, "gla_columns", {"enabled": False})
    calls = []
    real = gla_layer.chunk_gla
    monkeypatch.setattr(gla_layer, "chunk_gla", lambda *a, **kw: calls.append(kw.get("gate_logits")) or real(*a, **kw))
    torch.manual_seed(0)
    model = TTRForCausalLM(get_preset("gla-debug", vocab_size=64, gla_gate_clamp_min=-0.04))
    cfg, layer = model.config, model.model.layers[0].mixer
    x = torch.randn(1, 70, cfg.hidden_size)
    results = gla_layer_results(layer, x, monkeypatch, "gla_gate", [{"fused": True}, {"fused": False}])
    assert calls == [(cfg.gla_gate_logit_normalizer, -0.04), None]
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    mask = torch.ones(1, 70, dtype=torch.bool)
    mask[0, :3] = False
    monkeypatch.setitem(TUNING, "gla_gate", {"fused": True})
    layer(x, mask=mask)
    assert calls[-1] is None


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gla_layer_writes_its_projections_gradients_into_one_buffer(backend, monkeypatch):
    """GLA's five input projections take their input gradients from one buffer (``GradColumns``)
    that the chunk op (dq, dk, dv) and the output norm (the gate's) write into on the Triton path,
    ``gk_down``'s block copied in: the output and every gradient as with a product per projection
    (``TUNING["gla_columns"]``), packed; the torch path writes nothing into it and takes the products
    one by one."""
    from ttr.models import modules

    monkeypatch.setenv("TTR_KERNEL_BACKEND", backend)
    written = []
    real_take = modules.GradColumns.take

    def take(self, grads):
        written.append([g is not None and g.data_ptr() == self.block(i).data_ptr() for i, g in enumerate(grads)])
        return real_take(self, grads)

    monkeypatch.setattr(modules.GradColumns, "take", take)
    torch.manual_seed(0)
    model = TTRForCausalLM(get_preset("gla-debug", vocab_size=64))
    layer = model.model.layers[0].mixer
    for p in layer.parameters():  # every gradient away from zero (the gate's up-projection starts at zero)
        torch.nn.init.normal_(p, 0.0, 0.1)
    x = torch.randn(1, 70, model.config.hidden_size)
    results = gla_layer_results(layer, x, monkeypatch, "gla_columns", [{"enabled": True}, {"enabled": False}])
    names = ["y", "x"] + [n for n, _ in layer.named_parameters()]
    for name, a, b in zip(names, *results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    order = list(layer.input_projections)
    assert order == ["q_proj", "k_proj", "v_proj", "gk_down", "g_proj"]
    assert written == ([[True, True, True, False, True]] if backend == "triton" else [])
