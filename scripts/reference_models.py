"""The reference implementation of each ttr family, built at the shape of a ttr config.

``reference_config(config)`` returns the reference model's config (fla 0.6.0 for Gated
DeltaNet, DeltaNet, GLA and the Gated DeltaNet + SWA hybrid; Hugging Face ``LlamaForCausalLM``
for the transformer; Hugging Face ``Mamba2ForCausalLM`` for Mamba2) with the same architecture:
``ttr.models.convert`` maps it back onto ``config`` (checked by :func:`check_same_shape`), so a
converted reference computes the ttr model's function. fla and transformers are imported lazily.

fla's softmax attention layer calls ``flash_attn``; where that package is missing,
:func:`install_flash_attn_shim` provides the two functions it uses on top of
``torch.nn.functional.scaled_dot_product_attention`` (causal, optional window, GQA), so fla's
hybrids run with a plain PyTorch attention.
"""

from __future__ import annotations

import math
import sys
import types

import torch
import torch.nn.functional as F

FLA_FAMILIES = {"gated_deltanet", "delta_net", "gla"}


def family_of(config) -> str:
    """The family a ttr config belongs to, from its ``layer_types``."""
    kinds = set(config.layer_types)
    if kinds == {"attn"}:
        return "transformer"
    if kinds == {"gated_deltanet", "swa"}:
        return "gated_deltanet_h1"
    if len(kinds) == 1 and kinds <= FLA_FAMILIES | {"mamba2"}:
        return kinds.pop()
    raise ValueError(f"no reference implementation for layer_types {sorted(kinds)}")


def _attention_spec(config) -> dict | None:
    layers = [i for i, t in enumerate(config.layer_types) if t in ("swa", "attn")]
    if not layers:
        return None
    windows = {t for t in config.layer_types if t in ("swa", "attn")}
    return dict(
        layers=layers,
        num_heads=config.attn_num_heads,
        num_kv_heads=config.attn_num_kv_heads,
        qkv_bias=config.attn_qkv_bias,
        window_size=config.window_size if windows == {"swa"} else None,
        rope_theta=config.rope_theta,
    )


def reference_config(config):
    """The reference model's config at ``config``'s shape."""
    family = family_of(config)
    common = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers, tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
        max_position_embeddings=config.max_position_embeddings, initializer_range=config.initializer_range,
        use_cache=False,
    )
    if family == "transformer":
        from transformers import LlamaConfig

        return LlamaConfig(
            **common, intermediate_size=config.intermediate_size, num_attention_heads=config.attn_num_heads,
            num_key_value_heads=config.attn_num_kv_heads, head_dim=config.attn_head_dim,
            rms_norm_eps=config.rms_norm_eps, attention_bias=config.attn_qkv_bias, mlp_bias=config.mlp_bias,
            rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        )
    if family == "mamba2":
        from transformers import Mamba2Config

        # HF's defaults differ from the authors' release (initializer_range 0.1, no residual
        # rescale); the reference is built as mamba_ssm initialises it.
        return Mamba2Config(
            **common, num_heads=config.mamba_num_heads, head_dim=config.mamba_head_dim, expand=config.mamba_expand,
            state_size=config.mamba_state_size, n_groups=config.mamba_n_groups, conv_kernel=config.conv_size,
            layer_norm_epsilon=config.rms_norm_eps, use_bias=config.mamba_proj_bias,
            use_conv_bias=config.mamba_conv_bias, time_step_min=config.dt_min, time_step_max=config.dt_max,
            time_step_floor=config.dt_init_floor, rescale_prenorm_residual=True,
            time_step_limit=tuple(config.mamba_dt_limit) if config.mamba_dt_limit else (0.0, float("inf")),
        )
    import fla  # noqa: F401  (registers fla's model types)
    from fla.models import DeltaNetConfig, GatedDeltaNetConfig, GLAConfig

    fla_common = dict(
        common, intermediate_size=config.intermediate_size, norm_eps=config.rms_norm_eps,
        attn=_attention_spec(config), fuse_cross_entropy=False,
    )
    key_dim = config.num_heads * config.head_dim
    if family in ("gated_deltanet", "gated_deltanet_h1"):
        return GatedDeltaNetConfig(
            **fla_common, num_heads=config.num_heads, head_dim=config.head_dim, expand_v=config.expand_v,
            conv_size=config.conv_size, use_short_conv=config.use_short_conv,
            allow_neg_eigval=config.allow_neg_eigval,
        )
    if family == "delta_net":
        return DeltaNetConfig(
            **fla_common, num_heads=config.num_heads, expand_k=key_dim / config.hidden_size,
            expand_v=key_dim * config.expand_v / config.hidden_size, conv_size=config.conv_size,
            use_short_conv=config.use_short_conv, allow_neg_eigval=config.allow_neg_eigval,
        )
    return GLAConfig(
        **fla_common, num_heads=config.num_heads, expand_k=key_dim / config.hidden_size,
        expand_v=key_dim * config.expand_v / config.hidden_size, use_short_conv=config.use_short_conv,
        conv_size=config.conv_size, clamp_min=config.gla_gate_clamp_min,
    )


def build_reference(config):
    """The reference ``*ForCausalLM`` at ``config``'s shape, with its own default initialisation."""
    from transformers import AutoModelForCausalLM

    family = family_of(config)
    if family == "gated_deltanet_h1":
        install_flash_attn_shim()
    scan = use_mamba_ssm_scan() if family == "mamba2" else None
    ref_config = reference_config(config)
    if family == "transformer":
        ref_config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(ref_config)
    if family == "mamba2":
        init_mamba2_as_released(model, config)
        # which SSD the reference trains through, for the benchmark tables
        model.reference_path = "mamba_ssm's SSD kernel" if scan else "PyTorch path"
    return model


@torch.no_grad()
def init_mamba2_as_released(model, config) -> None:
    """Re-initialise HF Mamba2's mixers where HF's ``_init_weights`` departs from the authors'
    release (mamba_ssm), which is what the paper trained and ttr's default follows: ``A`` drawn
    from ``U(mamba_a_init_range)`` (HF: ``A = 1..H``, the same for every layer), ``in_proj`` left
    at PyTorch's kaiming-uniform ``U(+-1/sqrt(fan_in))`` (HF: N(0, initializer_range)) and the
    conv bias at PyTorch's default ``U(+-1/sqrt(kernel))`` (HF: zeros). The time-step bias, D,
    the conv weight and the (rescaled) output projection already match."""
    lo, hi = config.mamba_a_init_range
    for layer in model.backbone.layers:
        mixer = layer.mixer
        mixer.A_log.copy_(torch.empty_like(mixer.A_log).uniform_(lo, hi).log())
        bound = 1.0 / math.sqrt(mixer.in_proj.in_features)
        mixer.in_proj.weight.uniform_(-bound, bound)
        if mixer.conv1d.bias is not None:
            bound = 1.0 / math.sqrt(mixer.conv1d.weight.shape[-1])
            mixer.conv1d.bias.uniform_(-bound, bound)


def use_mamba_ssm_scan() -> bool:
    """Let HF Mamba2 train through the authors' Triton SSD kernel when only that part of mamba_ssm
    is importable. HF's training forward first tries mamba_ssm's fused conv + scan, which calls the
    causal_conv1d CUDA extension; without that package the fused entry is turned off, so HF takes
    its split path: a torch depthwise conv, then ``mamba_chunk_scan_combined``. Without mamba_ssm
    HF's pure torch path runs (its memory grows with the batch: it does not fit at 8 x 2048 on one
    GPU at 340M). Returns whether mamba_ssm's scan is used."""
    try:
        import mamba_ssm.ops.triton.ssd_combined  # noqa: F401
    except ImportError:
        return False
    try:
        import causal_conv1d  # noqa: F401
        return True
    except ImportError:
        from transformers.models.mamba2 import modeling_mamba2

        modeling_mamba2.mamba2_split_conv1d_scan_combined = lambda *args, **kwargs: None
        return True


def check_same_shape(config, reference) -> None:
    """Raise unless ``ttr.models.convert`` maps the reference back onto ``config``'s architecture."""
    from ttr.models.convert import convert_config

    back = convert_config(reference.config.to_dict(), reference.state_dict())
    keys = ("layer_types", "hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")
    family = family_of(config)
    if family in FLA_FAMILIES | {"gated_deltanet_h1"}:
        keys += ("num_heads", "head_dim", "value_head_dim")
    if family == "mamba2":
        keys += ("mamba_num_heads", "mamba_head_dim", "mamba_state_size", "mamba_n_groups")
    if any(t in ("swa", "attn") for t in config.layer_types):
        keys += ("attn_num_heads", "attn_num_kv_heads", "attn_head_dim")
    diff = {k: (getattr(config, k), getattr(back, k)) for k in keys if getattr(config, k) != getattr(back, k)}
    if diff:
        raise ValueError(f"the reference model differs from the ttr config: {diff}")


def _window_mask(t_q: int, t_k: int, window: int, device) -> torch.Tensor:
    q_pos = torch.arange(t_k - t_q, t_k, device=device)[:, None]
    k_pos = torch.arange(t_k, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window >= 0:
        allowed &= q_pos - k_pos <= window
    return allowed


def _sdpa(q, k, v, causal: bool, window_size) -> torch.Tensor:
    """q ``[B, T, Hq, D]``, k/v ``[B, S, Hkv, D]`` in flash_attn's layout; returns ``[B, T, Hq, D]``."""
    if not causal:
        raise ValueError("the flash_attn shim implements causal attention only")
    left = window_size[0] if window_size is not None else -1
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    if left < 0 and q.shape[2] == k.shape[2]:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    else:
        mask = _window_mask(q.shape[2], k.shape[2], left, q.device)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return o.transpose(1, 2)


def _flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), **kwargs):
    if dropout_p or softmax_scale is not None:
        raise ValueError("the flash_attn shim supports neither dropout nor a custom softmax_scale")
    return _sdpa(q, k, v, causal, window_size)


def _flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                            dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), **kwargs):
    if dropout_p or softmax_scale is not None:
        raise ValueError("the flash_attn shim supports neither dropout nor a custom softmax_scale")
    outs = []
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(bounds_q) - 1):
        sq, eq, sk, ek = bounds_q[i], bounds_q[i + 1], bounds_k[i], bounds_k[i + 1]
        outs.append(_sdpa(q[None, sq:eq], k[None, sk:ek], v[None, sk:ek], causal, window_size)[0])
    return torch.cat(outs, dim=0)


def install_flash_attn_shim() -> bool:
    """Provide ``flash_attn.flash_attn_func`` / ``flash_attn_varlen_func`` through SDPA when the
    package is missing, and point an already imported ``fla.layers.attn`` at them. Returns True
    when the shim is in use."""
    try:
        import flash_attn  # noqa: F401

        return False
    except ImportError:
        pass
    shim = types.ModuleType("flash_attn")
    shim.flash_attn_func = _flash_attn_func
    shim.flash_attn_varlen_func = _flash_attn_varlen_func
    sys.modules["flash_attn"] = shim
    attn = sys.modules.get("fla.layers.attn")
    if attn is not None:
        attn.flash_attn_func, attn.flash_attn_varlen_func = _flash_attn_func, _flash_attn_varlen_func
    return True
