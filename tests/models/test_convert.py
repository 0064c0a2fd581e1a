"""``ttr convert``: HF Llama and HF Mamba2 folders give the source's logits (fp32, CPU); fla
folders map onto ttr's parameters one to one (their kernels need a GPU: test_convert_gpu.py);
unsupported options are one-line errors naming the option."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Mamba2Config, Mamba2ForCausalLM

from ttr.__main__ import main as ttr_main
from ttr.models import get_preset
from ttr.models.convert import ConversionError, convert_checkpoint

VOCAB = 128


def perturb_vectors(model: torch.nn.Module) -> None:
    """Move norm weights, biases, D and dt_bias off their initial constants, so a swapped or
    dropped vector changes the logits."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))


def roundtrip(model, tmp_path, **kwargs):
    model.save_pretrained(tmp_path / "src")
    (tmp_path / "src" / "tokenizer_config.json").write_text("{}")
    convert_checkpoint(tmp_path / "src", tmp_path / "dst", **kwargs)
    return AutoModelForCausalLM.from_pretrained(tmp_path / "dst").eval()


def max_logit_diff(src, dst, ids) -> float:
    with torch.no_grad():
        return (src(ids).logits - dst(ids).logits).abs().max().item()


LLAMA_CASES = {
    "gqa-untied": dict(num_key_value_heads=2),
    "tied-headdim-biases": dict(num_key_value_heads=1, head_dim=24, tie_word_embeddings=True,
                                attention_bias=True, mlp_bias=True,
                                rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                                rms_norm_eps=1e-5),
}


@pytest.mark.parametrize("case", sorted(LLAMA_CASES))
def test_llama_logits(case, tmp_path):
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, **LLAMA_CASES[case])
    src = LlamaForCausalLM(cfg).eval()
    perturb_vectors(src)
    dst = roundtrip(src, tmp_path)
    assert dst.config.layer_types == ["attn", "attn"]
    assert (tmp_path / "dst" / "tokenizer_config.json").is_file()
    assert (tmp_path / "dst" / "model.safetensors").is_file()
    ids = torch.randint(0, VOCAB, (2, 45))
    assert max_logit_diff(src, dst, ids) <= 1e-4


@pytest.mark.parametrize("groups,limit", [(1, (0.0, float("inf"))), (2, (0.0, 0.05))])
def test_mamba2_logits(groups, limit, tmp_path):
    cfg = Mamba2Config(vocab_size=VOCAB, hidden_size=64, num_heads=8, head_dim=16, state_size=16,
                       n_groups=groups, num_hidden_layers=2, time_step_limit=limit, chunk_size=16)
    src = Mamba2ForCausalLM(cfg).eval()
    perturb_vectors(src)
    dst = roundtrip(src, tmp_path)
    assert dst.config.mamba_n_groups == groups
    assert dst.config.mamba_dt_limit == (None if limit[1] == float("inf") else list(limit))
    ids = torch.randint(0, VOCAB, (2, 40))
    assert max_logit_diff(src, dst, ids) <= 1e-4


def test_bf16_output_dtype(tmp_path):
    src = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=1, num_attention_heads=2))
    dst = roundtrip(src, tmp_path, dtype=torch.bfloat16)
    assert dst.model.embeddings.weight.dtype == torch.bfloat16


def _folder(tmp_path, config: dict, weights: dict | None = None):
    from safetensors.torch import save_file

    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(weights or {"x": torch.zeros(1)}, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize(
    "config,option",
    [
        (dict(model_type="bert"), "model_type"),
        (dict(model_type="llama", hidden_size=8, vocab_size=8, num_hidden_layers=1, num_attention_heads=2,
              intermediate_size=8, rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope_type"),
        (dict(model_type="llama", hidden_size=8, vocab_size=8, num_hidden_layers=1, num_attention_heads=2,
              intermediate_size=8, hidden_act="gelu"), "hidden_act"),
        (dict(model_type="mamba2", hidden_size=8, vocab_size=8, num_hidden_layers=1, hidden_act="relu"),
         "hidden_act"),
        (dict(model_type="delta_net", hidden_size=8, vocab_size=8, num_hidden_layers=1, num_heads=2,
              use_gate=True), "use_gate"),
        (dict(model_type="gla", hidden_size=8, vocab_size=8, num_hidden_layers=1, num_heads=2,
              feature_map="relu"), "feature_map"),
    ],
)
def test_unsupported_option_names_it(tmp_path, capsys, config, option):
    folder = _folder(tmp_path, config, {"model.layers.0.mlp.gate_proj.weight": torch.zeros(8, 8)})
    with pytest.raises(ConversionError, match=option):
        convert_checkpoint(folder, tmp_path / "dst")
    assert ttr_main(["convert", str(folder), str(tmp_path / "dst2")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and option in err


def test_refuses_to_overwrite(tmp_path):
    src = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=1, num_attention_heads=2))
    src.save_pretrained(tmp_path / "src")
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "notes.txt").write_text("mine")
    with pytest.raises(ConversionError, match="not empty"):
        convert_checkpoint(tmp_path / "src", tmp_path / "dst")
    assert (tmp_path / "dst" / "notes.txt").read_text() == "mine"
    with pytest.raises(ConversionError, match="config.json"):
        convert_checkpoint(tmp_path / "nowhere", tmp_path / "dst3")


FLA_FAMILIES = ["gated_deltanet", "delta_net", "gla", "gated_deltanet_h1"]


@pytest.mark.parametrize("family", FLA_FAMILIES)
def test_fla_folders_map_one_to_one(family, tmp_path):
    """Every fla weight lands on the ttr parameter of the same shape, and the converted config
    has the ttr preset's architecture (``reference_models`` builds fla at that shape)."""
    pytest.importorskip("fla")
    from ttr.scripts.reference_models import build_reference, check_same_shape

    config = get_preset(f"{family}-debug", vocab_size=VOCAB, allow_neg_eigval=family == "delta_net")
    ref = build_reference(config)
    check_same_shape(config, ref)
    perturb_vectors(ref)
    ref.save_pretrained(tmp_path / "src")
    convert_checkpoint(tmp_path / "src", tmp_path / "dst")
    dst = AutoModelForCausalLM.from_pretrained(tmp_path / "dst")
    assert dst.config.layer_types == config.layer_types
    assert dst.config.allow_neg_eigval == config.allow_neg_eigval
    n_ref = sum(p.numel() for p in ref.parameters())
    assert n_ref == sum(p.numel() for p in dst.parameters())
    # the values moved too: every ttr parameter is some fla parameter, reshaped
    ref_values = {tuple(p.flatten()[:4].tolist()) for p in ref.state_dict().values()}
    for name, p in dst.state_dict().items():
        assert tuple(p.flatten()[:4].tolist()) in ref_values, name


def test_mamba2_reference_initialised_as_released():
    """The parity reference (HF Mamba2) starts as the authors' release and ttr's default do:
    A from U(mamba_a_init_range) per layer, in_proj U(+-1/sqrt(fan_in)), conv bias U(+-1/sqrt(kernel))."""
    from ttr.scripts.reference_models import build_reference

    config = get_preset("mamba2-debug", vocab_size=VOCAB)
    torch.manual_seed(0)
    ref = build_reference(config)
    lo, hi = config.mamba_a_init_range
    mixers = [layer.mixer for layer in ref.backbone.layers]
    for mixer in mixers:
        a = mixer.A_log.exp()
        assert torch.all((a >= lo * 0.999) & (a <= hi * 1.001))
        bound = mixer.in_proj.in_features ** -0.5
        assert mixer.in_proj.weight.abs().max() <= bound
        assert abs(mixer.in_proj.weight.std().item() - bound / 3**0.5) < 0.1 * bound
        conv_bound = mixer.conv1d.weight.shape[-1] ** -0.5
        assert 0 < mixer.conv1d.bias.abs().max() <= conv_bound
    # drawn per layer, not HF's fixed 1..H
    assert not torch.equal(mixers[0].A_log, torch.arange(1, len(mixers[0].A_log) + 1).float().log())
    if len(mixers) > 1:
        assert not torch.equal(mixers[0].A_log, mixers[1].A_log)
    # the benchmark tables name the SSD the reference trains through
    from ttr.scripts.bench_model import model_name

    assert model_name(ref) == f"HF Mamba2ForCausalLM ({ref.reference_path})"
    assert ref.reference_path in ("mamba_ssm's SSD kernel", "PyTorch path")
    if importlib.util.find_spec("mamba_ssm") is None:
        assert ref.reference_path == "PyTorch path"
