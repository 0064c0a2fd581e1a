"""Model-level equalities for every family and both hybrids (CPU, fp32, torch kernel backend).

full forward == prefill + token-by-token decoding with the cache; packed (cu_seqlens or
position_ids resets) == separate forwards; save/load and AutoModelForCausalLM round trips; greedy
generation on a left-padded batch == unpadded single generation; a short training run lowers the
loss. The same equalities on the Triton path run under the interpreter (short cases) and, in
bf16, on a GPU (``-m gpu``).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

import ttr  # noqa: F401  (registers the Auto classes)
from ttr.kernels.utils import interpreter_active
from ttr.models import TTRCache, TTRConfig, TTRForCausalLM, TTRModel, get_preset

FAMILIES = [
    "gated_deltanet",
    "delta_net",
    "gla",
    "mamba2",
    "gated_deltanet_h1",
    "gated_deltanet_h2",
    "transformer",
]
VOCAB = 128
WINDOW = 5


def make_model(family: str, **overrides) -> TTRForCausalLM:
    torch.manual_seed(0)
    cfg = get_preset(f"{family}-debug", vocab_size=VOCAB, window_size=WINDOW, **overrides)
    return TTRForCausalLM(cfg).eval()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def decode_stepwise(model, ids, prefill: int, attention_mask=None) -> torch.Tensor:
    """Logits of a prefill of ``prefill`` tokens followed by one-token decoding steps."""
    mask = None if attention_mask is None else attention_mask[:, :prefill]
    out = model(ids[:, :prefill], attention_mask=mask, use_cache=True)
    cache, logits = out.past_key_values, [out.logits]
    for t in range(prefill, ids.shape[1]):
        mask = None if attention_mask is None else attention_mask[:, : t + 1]
        out = model(ids[:, t : t + 1], attention_mask=mask, past_key_values=cache, use_cache=True)
        logits.append(out.logits)
    return torch.cat(logits, 1)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_decoding_matches_full_forward(family):
    # gla-debug has no short conv and mamba2 no MLP; the layer-only MQAR shape (conv + mixer, no
    # MLP) is covered by test_mixer_only_blocks.
    model = make_model(family)
    ids = torch.randint(0, VOCAB, (2, 10))
    full = model(ids, use_cache=False).logits
    for prefill in (1, 6):
        assert rel_err(decode_stepwise(model, ids, prefill), full) < 1e-5


@pytest.mark.parametrize("mixer", ["gla", "delta_net", "gated_deltanet"])
@torch.no_grad()
def test_mixer_only_blocks(mixer):
    """Blocks of short conv + mixer without MLP (``intermediate_size=0``), as MQAR models use."""
    torch.manual_seed(0)
    cfg = TTRConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, layer_types=[mixer] * 2, num_heads=1,
        intermediate_size=0, use_short_conv=True,
    )  # fmt: skip
    model = TTRForCausalLM(cfg).eval()
    assert model.model.layers[0].mlp is None and model.model.layers[0].mixer.convs is not None
    ids = torch.randint(0, VOCAB, (2, 9))
    assert rel_err(decode_stepwise(model, ids, 4), model(ids, use_cache=False).logits) < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_packed_matches_separate(family):
    model = make_model(family)
    lengths = [5, 1, 9, 7]
    docs = [torch.randint(0, VOCAB, (1, n)) for n in lengths]
    separate = torch.cat([model(d, use_cache=False).logits for d in docs], 1)
    packed = torch.cat(docs, 1)
    cu = torch.tensor([0, 5, 6, 15, 22], dtype=torch.int32)
    assert rel_err(model(packed, cu_seqlens=cu).logits, separate) < 1e-5
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    assert rel_err(model(packed, position_ids=position_ids).logits, separate) < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_save_load_round_trip(family, tmp_path):
    model = make_model(family)
    ids = torch.randint(0, VOCAB, (2, 9))
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is TTRForCausalLM
    assert loaded.config.layer_types == model.config.layer_types
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_left_padded_generate_matches_single(family):
    model = make_model(family, pad_token_id=0, eos_token_id=None)
    prompts = [torch.randint(3, VOCAB, (n,)) for n in (6, 3)]
    width = max(p.numel() for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - p.numel() :] = p
        mask[i, width - p.numel() :] = 1
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    batched = model.generate(input_ids=ids, attention_mask=mask, **kwargs)[:, width:]
    for i, p in enumerate(prompts):
        single = model.generate(
            input_ids=p[None], attention_mask=torch.ones(1, p.numel(), dtype=torch.long), **kwargs
        )
        assert torch.equal(batched[i], single[0, p.numel() :]), f"row {i}"


@pytest.mark.parametrize("family", ["gated_deltanet_h1", "mamba2", "gla", "delta_net"])
@torch.no_grad()
def test_left_padded_logits_match_unpadded(family):
    model = make_model(family)
    p = torch.randint(0, VOCAB, (1, 6))
    ids = torch.cat([torch.zeros(1, 4, dtype=torch.long), p], 1)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)], 1)
    ref = model(p, use_cache=False).logits
    assert rel_err(model(ids, attention_mask=mask, use_cache=False).logits[:, 4:], ref) < 1e-5
    assert rel_err(decode_stepwise(model, ids, 5, mask)[:, 4:], ref) < 1e-5
    # padding never touches a recurrent or conv state
    padded = model(ids, attention_mask=mask, use_cache=True).past_key_values
    unpadded = model(p, use_cache=True).past_key_values
    for a, b in zip(padded.states, unpadded.states):
        if "recurrent" in a:
            torch.testing.assert_close(a["recurrent"], b["recurrent"], rtol=1e-5, atol=1e-6)
            for ca, cb in zip(a.get("conv", ()), b.get("conv", ())):
                torch.testing.assert_close(ca, cb, rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_cache_memory_is_bounded():
    model = make_model("gated_deltanet_h2")
    ids = torch.randint(0, VOCAB, (2, 20))
    out = model(ids[:, :3], use_cache=True)
    cache = out.past_key_values
    sizes = None
    for t in range(3, 20):
        out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
        now = [sum(v.numel() for v in s.values() if torch.is_tensor(v)) for s in cache.states]
        sizes = sizes or now
        assert now == sizes
    assert isinstance(cache, TTRCache) and cache.get_seq_length() == 20
    swa = cache[model.config.layer_types.index("swa")]
    assert swa["k"].shape[1] == WINDOW - 1


def test_loss_fused_unfused_and_num_items():
    model = make_model("gated_deltanet_h1")
    ids = torch.randint(0, VOCAB, (2, 12))
    labels = ids.clone()
    labels[0, :3] = -100
    out = model(ids, labels=labels, return_logits=False)
    fused = out.loss
    assert out.logits is None
    model.config.fuse_cross_entropy = False
    out = model(ids, labels=labels)
    torch.testing.assert_close(fused, out.loss, rtol=1e-5, atol=1e-6)
    logits = out.logits
    manual = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    torch.testing.assert_close(out.loss, manual)
    n_items = int((labels[:, 1:] != -100).sum())
    summed = model(ids, labels=labels, num_items_in_batch=torch.tensor(4 * n_items)).loss
    torch.testing.assert_close(summed * 4, manual)


def test_fused_loss_runs_through_the_head_module():
    """The fused loss is computed in ``lm_head``'s forward (FSDP2 gathers the head's weight and
    reduces its gradient only around that forward); its grad reaches the head's weight."""
    model = make_model("gated_deltanet").train()
    calls = []
    model.lm_head.register_forward_hook(lambda module, args, kwargs, out: calls.append(kwargs.get("targets")),
                                        with_kwargs=True)
    ids = torch.randint(0, VOCAB, (1, 9))
    model(ids, labels=ids).loss.backward()
    assert len(calls) == 1 and calls[0] is not None
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0


def test_packed_loss_ignores_document_boundaries():
    model = make_model("gated_deltanet")
    docs = [torch.randint(0, VOCAB, (1, n)) for n in (6, 5)]
    separate = [model(d, labels=d).loss for d in docs]
    packed = torch.cat(docs, 1)
    loss = model(packed, labels=packed, cu_seqlens=torch.tensor([0, 6, 11], dtype=torch.int32)).loss
    expected = (separate[0] * 5 + separate[1] * 4) / 9
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "family, overrides",
    [("gated_deltanet", {"num_hidden_layers": 1})]
    + [pytest.param(f, {}, marks=pytest.mark.slow) for f in FAMILIES],
)
def test_training_lowers_loss(family, overrides):
    model = make_model(family, **overrides).train()
    ids = torch.randint(0, 16, (2, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(50):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses[::10]


@pytest.mark.filterwarnings("ignore:.*gradient_checkpointing_enable.*:FutureWarning")
def test_gradient_checkpointing_gives_same_gradients():
    model = make_model("gated_deltanet_h1").train()
    ids = torch.randint(0, VOCAB, (2, 10))
    model(ids, labels=ids).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.gradient_checkpointing_enable()
    assert model.model.layers[0].gradient_checkpointing
    model(ids, labels=ids).loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], msg=n)


@torch.no_grad()
def test_hidden_states_are_the_blocks_outputs():
    """Blocks hand on ``(residual, branch)`` and leave the last add to the next norm; the reported
    hidden states are still the embeddings, every block's ``residual + branch``, then the final norm."""
    model = make_model("gated_deltanet_h1")
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    out = model(ids, output_hidden_states=True)
    states = out.hidden_states
    assert len(states) == model.config.num_hidden_layers + 1
    hidden, branch = model.get_input_embeddings()(ids), None
    torch.testing.assert_close(states[0], hidden)
    for i, layer in enumerate(model.model.layers[:-1]):
        hidden, branch = layer(hidden, branch)
        torch.testing.assert_close(states[i + 1], hidden + branch)
    torch.testing.assert_close(states[-1], model.model(ids).last_hidden_state)


@torch.no_grad()
def test_tied_embeddings_and_dtype(tmp_path):
    model = make_model("gated_deltanet", tie_word_embeddings=True)
    assert model.lm_head.weight.data_ptr() == model.model.embeddings.weight.data_ptr()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embeddings.weight.data_ptr()
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    ids = torch.randint(0, VOCAB, (1, 8))
    assert rel_err(loaded.eval()(ids).logits, model(ids).logits) < 3e-2
    base = AutoModel.from_pretrained(tmp_path)
    assert type(base) is TTRModel
    assert type(AutoConfig.from_pretrained(tmp_path)) is TTRConfig


def test_weight_init():
    """The reference scheme: fla / HF Llama matrices and short convs N(0, std), Mamba2 as
    mamba_ssm (out_proj U(+-1/sqrt(fan_in)) / sqrt(branches)); depth_scaled divides the residual
    output projections by sqrt(branches)."""
    model = make_model("gated_deltanet_h2")
    cfg = model.config
    mixer = model.model.layers[0].mixer  # mamba2
    assert torch.all(-mixer.A_log.exp() < 0)
    dt = torch.nn.functional.softplus(mixer.dt_bias)
    assert torch.all(dt >= cfg.dt_init_floor * 0.99) and torch.all(dt <= cfg.dt_max * 1.01)
    branches = 2 * cfg.num_hidden_layers
    bound = 1 / (mixer.out_proj.in_features * branches) ** 0.5
    assert mixer.out_proj.weight.abs().max() <= bound
    assert mixer.out_proj.weight.std() > 0.5 * bound / 3**0.5
    gdn = model.model.layers[1].mixer
    for weight in (gdn.o_proj.weight, gdn.convs[0].weight, model.model.layers[1].mlp.down_proj.weight):
        assert abs(weight.std().item() - cfg.initializer_range) < 0.2 * cfg.initializer_range
    scaled = make_model("gated_deltanet_h2", initializer_scheme="depth_scaled")
    std = scaled.model.layers[1].mixer.o_proj.weight.std().item()
    expected = cfg.initializer_range / branches**0.5
    assert abs(std - expected) < 0.2 * expected
    with pytest.raises(ValueError, match="initializer_scheme"):
        make_model("gated_deltanet", initializer_scheme="gpt2")


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(layer_types=["gated_deltanet", "lstm"]), "layer_types"),
        (dict(num_hidden_layers=3, layer_types=["gla", "gla"]), "layer_types"),
        (dict(num_heads=3), "num_heads"),
        (dict(layer_types=["swa", "swa"], attn_num_heads=3), "attn_num_heads"),
        (dict(layer_types=["swa", "swa"], attn_num_kv_heads=3, attn_num_heads=4), "attn_num_kv_heads"),
        (dict(layer_types=["swa", "attn"], window_size=0), "window_size"),
        (dict(num_heads=1, hidden_size=512), "head_dim"),
        (dict(layer_types=["mamba2", "mamba2"], mamba_head_dim=48), "mamba_head_dim"),
        (dict(intermediate_size=-1), "intermediate_size"),
        (dict(conv_size=5), "conv_size"),
        (dict(layer_types=["attn", "attn"], rope_theta=0.0), "rope_theta"),
        (dict(layer_types=["attn", "attn"], rope_theta="1e4"), "rope_theta"),
    ],
)
def test_config_errors_name_the_field(overrides, field):
    settings = dict(hidden_size=64, num_hidden_layers=2, num_heads=2, vocab_size=VOCAB)
    settings.update(overrides)
    with pytest.raises(ValueError, match=field):
        TTRConfig(**settings)


@torch.no_grad()
def test_attention_without_rotary():
    """``rope_theta=None`` (NoPE, any head dim, odd too): decoding still matches the full forward,
    and the same weights give other logits with rotary embeddings on (the flag takes effect)."""
    torch.manual_seed(0)
    cfg = TTRConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, layer_types=["attn", "swa"], num_heads=2,
        intermediate_size=0, window_size=WINDOW, rope_theta=None, attn_head_dim=15,
    )  # fmt: skip
    model = TTRForCausalLM(cfg).eval()
    ids = torch.randint(0, VOCAB, (2, 9))
    full = model(ids, use_cache=False).logits
    assert rel_err(decode_stepwise(model, ids, 4), full) < 1e-5
    rope = TTRForCausalLM(TTRConfig(**{**cfg.to_dict(), "rope_theta": 1e4, "attn_head_dim": 16})).eval()
    nope = TTRForCausalLM(TTRConfig(**{**cfg.to_dict(), "attn_head_dim": 16})).eval()
    nope.load_state_dict(rope.state_dict())
    assert rel_err(nope(ids, use_cache=False).logits, rope(ids, use_cache=False).logits) > 1e-3


@pytest.mark.parametrize("rope_theta", [None, 1e4])
@torch.no_grad()
def test_attention_short_conv(rope_theta):
    """``attn_short_conv``: q/k/v convs in attention layers (the MQAR models' conv + attention).
    Decoding from the cache (conv states included), packed documents and left padding all give
    the logits of the plain forward; and the convs take effect."""
    torch.manual_seed(0)
    cfg = TTRConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, layer_types=["attn", "swa"], num_heads=2,
        attn_num_kv_heads=1, intermediate_size=0, window_size=WINDOW, rope_theta=rope_theta,
        attn_short_conv=True, conv_size=3,
    )  # fmt: skip
    model = TTRForCausalLM(cfg).eval()
    mixer = model.model.layers[0].mixer
    assert [c.weight.shape for c in mixer.convs] == [(32, 3), (16, 3), (16, 3)]
    ids = torch.randint(0, VOCAB, (2, 9))
    full = model(ids, use_cache=False).logits
    for prefill in (1, 4):
        assert rel_err(decode_stepwise(model, ids, prefill), full) < 1e-5
    docs = [ids[:1, :4], ids[1:, :5]]
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    separate = torch.cat([model(d, use_cache=False).logits for d in docs], 1)
    assert rel_err(model(torch.cat(docs, 1), cu_seqlens=cu).logits, separate) < 1e-5
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids[:1]], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 9, dtype=torch.long)], 1)
    assert rel_err(model(padded, attention_mask=mask, use_cache=False).logits[:, 3:], full[:1]) < 1e-5
    assert rel_err(decode_stepwise(model, padded, 5, mask)[:, 3:], full[:1]) < 1e-5
    plain = TTRForCausalLM(TTRConfig(**{**cfg.to_dict(), "attn_short_conv": False})).eval()
    plain.load_state_dict(model.state_dict(), strict=False)
    assert rel_err(plain(ids, use_cache=False).logits, full) > 1e-3


def test_unknown_preset_and_bad_inputs():
    with pytest.raises(ValueError, match="preset"):
        get_preset("gated_deltanet-7b")
    model = make_model("gated_deltanet")
    ids = torch.randint(0, VOCAB, (2, 6))
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids, attention_mask=torch.ones(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(ids, cu_seqlens=torch.tensor([0, 6], dtype=torch.int32))


def require_interpreter() -> None:
    """The model is on the CPU: its Triton path runs under the interpreter, which
    ``tests/conftest.py`` switches on before triton is imported. On a CUDA machine the same
    comparison is ``test_models_gpu.py::test_triton_gradients_match_torch_backend``."""
    if torch.cuda.is_available():
        pytest.skip("the GPU variant in test_models_gpu.py covers this on CUDA machines")
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    assert interpreter_active() and isinstance(tl.standard.sum, InterpretedFunction), (
        "Triton is not interpreted: TRITON_INTERPRET=1 must be set before triton is imported"
    )


@pytest.mark.parametrize(
    "family",
    ["gated_deltanet_h1", "mamba2"] + [pytest.param(f, marks=pytest.mark.slow) for f in ("gla", "delta_net")],
)
@torch.no_grad()
def test_triton_backend_matches_torch_backend(family, monkeypatch):
    require_interpreter()
    model = make_model(family)
    ids = torch.randint(0, VOCAB, (1, 10))
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "torch")
    ref = model(ids, use_cache=False).logits
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    assert rel_err(model(ids, use_cache=False).logits, ref) < 1e-4
    assert rel_err(decode_stepwise(model, ids, 7), ref) < 1e-4
