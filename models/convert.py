"""Convert ``save_pretrained`` folders of the reference implementations into ttr folders.

Sources, by ``config.json`` ``model_type``:

* ``llama``: Hugging Face ``LlamaForCausalLM`` (GQA, ``head_dim``, tied or untied embeddings,
  ``rope_theta``, biases) -> ``attn`` layers;
* ``mamba2``: Hugging Face ``Mamba2ForCausalLM`` (groups, head dim, D skip, gated norm per group,
  time-step limit, biases) -> ``mamba2`` layers without MLP;
* ``gated_deltanet``, ``delta_net``, ``gla``: fla 0.6.0's models, their hybrid ``attn`` settings
  (layers, heads, window, ``rope_theta``, ``qkv_bias``) becoming ``swa`` / ``attn`` entries of
  ``layer_types``.

Every source option is mapped to the ttr config field that computes the same function, or
refused with a :class:`ConversionError` that names it; nothing is approximated. The logits of the
converted model equal the source's (tests/models/test_convert.py).
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch

from ttr.errors import DEBUG_HELP, TTRError

from .configuration import TTRConfig

# files copied unchanged next to the converted weights
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja",
)


class ConversionError(TTRError, ValueError):
    """A source folder or option that ttr cannot represent exactly (one line from ``ttr convert``)."""


def _option(src: dict, key: str, allowed, default, source: str):
    value = src.get(key, default)
    if value not in allowed:
        raise ConversionError(f"{source} option {key}={value!r} is not supported (supported: {list(allowed)})")
    return value


def _common(src: dict, source: str) -> dict:
    """Settings every source spells alike."""
    out = {k: src[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers") if k in src}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings", "initializer_range"):
        if key in src:
            out[key] = src[key]
    out["tie_word_embeddings"] = bool(src.get("tie_word_embeddings", False))
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers") if k not in out]
    if missing:
        raise ConversionError(f"{source} config.json lacks {missing}")
    return out


def _float(value) -> float:
    """A float from config.json, where transformers writes infinity as ``{"__float__": "Infinity"}``."""
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    return float(value)


def _mlp_size(sd: dict, prefix: str) -> int:
    return sd[f"{prefix}.gate_proj.weight"].shape[0]


def _rope_theta(src: dict, source: str) -> float:
    params = src.get("rope_parameters") or {}
    scaling = src.get("rope_scaling")
    rope_type = params.get("rope_type", (scaling or {}).get("rope_type", (scaling or {}).get("type", "default")))
    if rope_type != "default":
        raise ConversionError(f"{source} option rope_type={rope_type!r} is not supported (supported: ['default'])")
    return float(params.get("rope_theta", src.get("rope_theta", 10000.0)))


# -- config mappings: source config.json (dict) + weights -> TTRConfig keyword arguments --------


def _llama_config(src: dict, sd: dict) -> dict:
    s = "llama"
    _option(src, "hidden_act", ("silu",), "silu", s)
    for key in ("attention_dropout", "mlp_dropout"):
        if float(src.get(key, 0.0) or 0.0) != 0.0:
            raise ConversionError(f"{s} option {key}={src[key]!r} is not supported (supported: [0.0])")
    heads = src["num_attention_heads"]
    bias = bool(src.get("attention_bias", False))
    return dict(
        _common(src, s),
        layer_types=["attn"] * src["num_hidden_layers"],
        intermediate_size=src["intermediate_size"],
        attn_num_heads=heads,
        attn_num_kv_heads=src.get("num_key_value_heads") or heads,
        attn_head_dim=src.get("head_dim") or src["hidden_size"] // heads,
        attn_qkv_bias=bias,
        attn_o_bias=bias,
        mlp_bias=bool(src.get("mlp_bias", False)),
        rope_theta=_rope_theta(src, s),
        rms_norm_eps=src.get("rms_norm_eps", 1e-6),
    )


def _mamba2_config(src: dict, sd: dict) -> dict:
    s = "mamba2"
    _option(src, "hidden_act", ("silu",), "silu", s)
    expand, hidden, head_dim = src.get("expand", 2), src["hidden_size"], src.get("head_dim", 64)
    if src.get("num_heads") is not None and src["num_heads"] * head_dim != expand * hidden:
        raise ConversionError(
            f"{s} option num_heads={src['num_heads']} must equal expand * hidden_size / head_dim = "
            f"{expand * hidden // head_dim}"
        )
    low, high = (_float(v) for v in src.get("time_step_limit", (0.0, math.inf)))
    return dict(
        _common(src, s),
        layer_types=["mamba2"] * src["num_hidden_layers"],
        intermediate_size=0,
        mamba_expand=expand,
        mamba_head_dim=head_dim,
        mamba_state_size=src.get("state_size", 128),
        mamba_n_groups=src.get("n_groups", 1),
        conv_size=src.get("conv_kernel", 4),
        mamba_dt_limit=None if (low, high) == (0.0, math.inf) else [low, high],
        mamba_proj_bias=bool(src.get("use_bias", False)),
        mamba_conv_bias=bool(src.get("use_conv_bias", True)),
        dt_min=src.get("time_step_min", 0.001),
        dt_max=src.get("time_step_max", 0.1),
        dt_init_floor=src.get("time_step_floor", 1e-4),
        rms_norm_eps=src.get("layer_norm_epsilon", 1e-5),
    )


def _fla_common(src: dict, sd: dict, source: str, mixer: str) -> dict:
    _option(src, "attnres_block_size", (None,), None, source)
    _option(src, "hidden_act", ("swish", "silu"), "swish", source)
    n = src["num_hidden_layers"]
    layer_types = [mixer] * n
    out = dict(_common(src, source), intermediate_size=_mlp_size(sd, "model.layers.0.mlp"),
               rms_norm_eps=src.get("norm_eps", 1e-6))
    specs = src.get("attn")
    if specs:
        specs = [specs] if isinstance(specs, dict) else specs
        if len({(a["num_heads"], a.get("num_kv_heads") or a["num_heads"], bool(a.get("qkv_bias", False)),
                 float(a.get("rope_theta", 10000.0))) for a in specs}) > 1:
            raise ConversionError(f"{source} option attn: attention specs with different heads/bias/rope_theta")
        windows = {a.get("window_size") for a in specs}
        if len(windows) > 1:
            raise ConversionError(f"{source} option attn: attention specs with different window_size {windows}")
        a = specs[0]
        window = a.get("window_size")
        for spec in specs:
            for i in spec["layers"]:
                layer_types[i] = "attn" if window is None else "swa"
        out.update(
            attn_num_heads=a["num_heads"],
            attn_num_kv_heads=a.get("num_kv_heads") or a["num_heads"],
            attn_head_dim=src["hidden_size"] // a["num_heads"],
            attn_qkv_bias=bool(a.get("qkv_bias", False)),
            rope_theta=float(a.get("rope_theta", 10000.0)),
        )
        if window is not None:
            out["window_size"] = window
    out["layer_types"] = layer_types
    return out


def _delta_heads(src: dict, default_k: float) -> dict:
    hidden, heads = src["hidden_size"], src["num_heads"]
    key_dim = round(hidden * src.get("expand_k", default_k))
    value_dim = round(hidden * src.get("expand_v", 1.0))
    return dict(num_heads=heads, head_dim=key_dim // heads, expand_v=value_dim / key_dim)


def _gated_deltanet_config(src: dict, sd: dict) -> dict:
    s = "gated_deltanet"
    _option(src, "use_gate", (True,), True, s)
    _option(src, "use_short_conv", (True,), True, s)
    _option(src, "output_gate_activation", ("swish", "silu"), "swish", s)
    heads = src.get("num_heads", 6)
    if src.get("num_v_heads") not in (None, heads):
        raise ConversionError(f"{s} option num_v_heads={src['num_v_heads']} is not supported (supported: [None, {heads}])")
    return dict(
        _fla_common(src, sd, s, "gated_deltanet"),
        num_heads=heads, head_dim=src.get("head_dim", 256), expand_v=src.get("expand_v", 2.0),
        conv_size=src.get("conv_size", 4), allow_neg_eigval=bool(src.get("allow_neg_eigval", False)),
    )


def _delta_net_config(src: dict, sd: dict) -> dict:
    s = "delta_net"
    _option(src, "use_gate", (False,), False, s)
    _option(src, "use_beta", (True,), True, s)
    _option(src, "use_short_conv", (True,), True, s)
    _option(src, "qk_activation", ("silu",), "silu", s)
    _option(src, "qk_norm", ("l2",), "l2", s)
    return dict(
        _fla_common(src, sd, s, "delta_net"), **_delta_heads(src, 1.0),
        conv_size=src.get("conv_size", 4), allow_neg_eigval=bool(src.get("allow_neg_eigval", False)),
    )


def _gla_config(src: dict, sd: dict) -> dict:
    s = "gla"
    _option(src, "use_output_gate", (True,), True, s)
    _option(src, "feature_map", (None,), None, s)
    _option(src, "elementwise_affine", (True, None), True, s)
    heads = src.get("num_heads", 4)
    if src.get("num_kv_heads") not in (None, heads):
        raise ConversionError(f"{s} option num_kv_heads={src['num_kv_heads']} is not supported (supported: [None, {heads}])")
    return dict(
        _fla_common(src, sd, s, "gla"), **_delta_heads(src, 0.5),
        use_short_conv=bool(src.get("use_short_conv", False)), conv_size=src.get("conv_size", 4),
        gla_gate_low_rank_dim=sd["model.layers.0.attn.gk_proj.0.weight"].shape[0]
        if "model.layers.0.attn.gk_proj.0.weight" in sd else 16,
        gla_gate_logit_normalizer=16.0,
        gla_gate_clamp_min=src.get("clamp_min"),
    )


# -- weight mappings: (source key pattern, ttr key) in order; the first match wins ---------------

_LLAMA_KEYS = [
    (r"model\.embed_tokens\.", "model.embeddings."),
    (r"model\.layers\.(\d+)\.input_layernorm\.", r"model.layers.\1.mixer_norm."),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.", r"model.layers.\1.mlp_norm."),
    (r"model\.layers\.(\d+)\.self_attn\.", r"model.layers.\1.mixer."),
    (r"model\.layers\.(\d+)\.mlp\.", r"model.layers.\1.mlp."),
    (r"model\.norm\.", "model.norm."),
    (r"lm_head\.", "lm_head."),
]

_MAMBA2_KEYS = [
    (r"backbone\.embeddings\.", "model.embeddings."),
    (r"backbone\.layers\.(\d+)\.norm\.", r"model.layers.\1.mixer_norm."),
    (r"backbone\.layers\.(\d+)\.mixer\.conv1d\.", r"model.layers.\1.mixer.conv."),
    (r"backbone\.layers\.(\d+)\.mixer\.norm\.weight", r"model.layers.\1.mixer.norm_weight"),
    (r"backbone\.layers\.(\d+)\.mixer\.", r"model.layers.\1.mixer."),
    (r"backbone\.norm_f\.", "model.norm."),
    (r"lm_head\.", "lm_head."),
]

_FLA_KEYS = [
    (r"model\.layers\.(\d+)\.attn_norm\.", r"model.layers.\1.mixer_norm."),
    (r"model\.layers\.(\d+)\.attn\.q_conv1d\.", r"model.layers.\1.mixer.convs.0."),
    (r"model\.layers\.(\d+)\.attn\.k_conv1d\.", r"model.layers.\1.mixer.convs.1."),
    (r"model\.layers\.(\d+)\.attn\.v_conv1d\.", r"model.layers.\1.mixer.convs.2."),
    (r"model\.layers\.(\d+)\.attn\.gk_proj\.0\.", r"model.layers.\1.mixer.gk_down."),
    (r"model\.layers\.(\d+)\.attn\.gk_proj\.1\.", r"model.layers.\1.mixer.gk_up."),
    (r"model\.layers\.(\d+)\.attn\.(g_norm_swish_gate|g_norm)\.", r"model.layers.\1.mixer.o_norm."),
    (r"model\.layers\.(\d+)\.attn\.", r"model.layers.\1.mixer."),
    (r"model\.(embeddings|norm|layers\.\d+\.mlp_norm|layers\.\d+\.mlp)\.", r"model.\1."),
    (r"lm_head\.", "lm_head."),
]

SOURCES = {
    "llama": (_llama_config, _LLAMA_KEYS),
    "mamba2": (_mamba2_config, _MAMBA2_KEYS),
    "gated_deltanet": (_gated_deltanet_config, _FLA_KEYS),
    "delta_net": (_delta_net_config, _FLA_KEYS),
    "gla": (_gla_config, _FLA_KEYS),
}


def convert_state_dict(model_type: str, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename (and reshape) a source state dict into ttr's parameter names."""
    table = [(re.compile(p), r) for p, r in SOURCES[model_type][1]]
    out = {}
    for key, value in sd.items():
        if key.endswith("rotary.inv_freq"):
            continue  # a buffer recomputed from rope_theta
        for pattern, repl in table:
            if pattern.match(key):
                new = pattern.sub(repl, key, count=1)
                break
        else:
            raise ConversionError(f"{model_type} weight {key!r} has no counterpart in ttr")
        if value.dim() == 3 and value.shape[1] == 1 and re.search(r"\.convs?\.(\d+\.)?weight$", new):
            value = value[:, 0]  # nn.Conv1d depthwise [C, 1, W] -> ttr's [C, W]
        out[new] = value
    return out


def load_state_dict(folder: str | Path) -> dict[str, torch.Tensor]:
    """All weights of a ``save_pretrained`` folder (safetensors, sharded or not, or ``.bin``)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    for index_name, loader in (("model.safetensors.index.json", load_file),
                               ("pytorch_model.bin.index.json", _load_bin)):
        index = folder / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            sd = {}
            for shard in shards:
                sd.update(loader(str(folder / shard)))
            return sd
    if (folder / "model.safetensors").is_file():
        return load_file(str(folder / "model.safetensors"))
    if (folder / "pytorch_model.bin").is_file():
        return _load_bin(str(folder / "pytorch_model.bin"))
    raise ConversionError(f"{folder}: no model.safetensors or pytorch_model.bin (sharded or not)")


def _load_bin(path: str) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def convert_config(src: dict, sd: dict[str, torch.Tensor]) -> TTRConfig:
    """The ``TTRConfig`` computing the same function as the source config ``src`` (a dict)."""
    model_type = src.get("model_type")
    if model_type not in SOURCES:
        raise ConversionError(
            f"config.json model_type {model_type!r} is not supported (supported: {sorted(SOURCES)})"
        )
    kwargs = SOURCES[model_type][0](src, sd)
    return TTRConfig(**kwargs)


def convert_checkpoint(src: str | Path, dst: str | Path, *, dtype: torch.dtype | None = None,
                       overwrite: bool = False) -> Path:
    """Convert the ``save_pretrained`` folder ``src`` into a ttr folder ``dst``.

    Writes safetensors weights (in the source dtype, or ``dtype``), ``config.json``, the
    generation config and the tokenizer files found in ``src``. ``dst`` must not exist unless
    ``overwrite``. Returns ``dst``.
    """
    from .modeling import TTRForCausalLM

    src, dst = Path(src), Path(dst)
    config_path = src / "config.json"
    if not config_path.is_file():
        raise ConversionError(f"{src}: no config.json (expected a save_pretrained folder)")
    if dst.exists() and not overwrite and any(dst.iterdir()):
        raise ConversionError(f"{dst} exists and is not empty (pass overwrite to replace it)")
    try:
        source_config = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise ConversionError(f"{config_path}: not valid JSON ({err})") from None
    sd = load_state_dict(src)
    config = convert_config(source_config, sd)
    weights = convert_state_dict(source_config["model_type"], sd)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = TTRForCausalLM(config)
    expected = set(model.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unexpected:
        raise ConversionError(f"{src}: weights do not match the converted config (missing {missing[:4]}, "
                              f"unexpected {unexpected[:4]})")
    model.load_state_dict(weights, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    if dtype is not None:
        model.to(dtype)
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    return dst


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv: list[str] | None = None) -> int:
    """``ttr convert SRC DST``: the command line of :func:`convert_checkpoint`."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="ttr convert",
        description="Convert a save_pretrained folder (HF llama / mamba2, fla 0.6.0 gated_deltanet / "
        "delta_net / gla) into a ttr folder that loads with AutoModelForCausalLM.",
        epilog=DEBUG_HELP,
    )
    parser.add_argument("src", help="source save_pretrained folder (config.json + weights)")
    parser.add_argument("dst", help="output folder (must not exist or be empty, unless --overwrite)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast the weights (default: keep the source dtype)")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty DST")
    args = parser.parse_args(argv)
    # a ConversionError or OSError reaches ttr's one error handler: one line, exit status 2
    out = convert_checkpoint(args.src, args.dst, dtype=DTYPES.get(args.dtype), overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0
