"""Named model configurations: ``<family>-<size>``.

Sizes follow the 1.3B / 340M settings of the Gated DeltaNet paper (Yang et al. 2024,
arXiv:2412.06464, Sec. 4): ``1.3b`` hidden 2048, 24 blocks, 16 heads of 128; ``340m`` hidden
1024, 24 blocks, 8 heads of 128; ``debug`` a CPU-sized model for tests. Families:

* ``gated_deltanet``, ``delta_net``: every block a delta-rule mixer plus SwiGLU MLP.
* ``gla``: heads with key dim hidden/2 and value dim hidden (GLA paper, arXiv:2312.06635, Sec. 4:
  expand_k 0.5, expand_v 1), no short conv.
* ``mamba2``: twice the blocks without MLP, as Mamba-2 stacks mixer-only blocks (arXiv:2405.21060).
* ``gated_deltanet_h1``: Gated DeltaNet and SWA alternating; ``gated_deltanet_h2``: Mamba2, Gated
  DeltaNet and SWA repeating (Gated DeltaNet paper, Sec. 3.4), window 2048.
* ``transformer``: Transformer++ with full attention (RoPE, SwiGLU, RMSNorm).
"""

from __future__ import annotations

from .configuration import TTRConfig

SIZES = {
    "debug": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_heads=2,
        vocab_size=8192,
        window_size=16,
        mamba_head_dim=16,
        mamba_state_size=16,
        max_position_embeddings=512,
    ),
    "340m": dict(hidden_size=1024, num_hidden_layers=24, num_heads=8, vocab_size=32000),
    "1.3b": dict(hidden_size=2048, num_hidden_layers=24, num_heads=16, vocab_size=32000),
}

# family -> (repeating layer pattern, blocks multiplier, extra settings; callables get the size dict)
FAMILIES = {
    "gated_deltanet": (["gated_deltanet"], 1, {}),
    "delta_net": (["delta_net"], 1, {}),
    "gla": (
        ["gla"],
        1,
        {
            "use_short_conv": False,
            "expand_v": 2.0,
            "head_dim": lambda s: s["hidden_size"] // (2 * s["num_heads"]),
        },
    ),
    "mamba2": (["mamba2"], 2, {"intermediate_size": 0}),
    "gated_deltanet_h1": (["gated_deltanet", "swa"], 1, {}),
    "gated_deltanet_h2": (["mamba2", "gated_deltanet", "swa"], 1, {}),
    "transformer": (["attn"], 1, {}),
}


def list_presets() -> list[str]:
    return [f"{family}-{size}" for family in FAMILIES for size in SIZES]


def get_preset(name: str, **overrides) -> TTRConfig:
    """Return the ``TTRConfig`` of preset ``name`` with ``overrides`` applied.

    Overriding ``num_hidden_layers`` without ``layer_types`` repeats the family's pattern.
    """
    family, _, size = name.rpartition("-")
    if family not in FAMILIES or size not in SIZES:
        raise ValueError(f"unknown preset name {name!r}; expected one of {list_presets()}")
    pattern, multiplier, extra = FAMILIES[family]
    settings = dict(SIZES[size])
    settings["num_hidden_layers"] = max(settings["num_hidden_layers"] * multiplier, len(pattern))
    settings.update({k: (v(settings) if callable(v) else v) for k, v in extra.items()})
    settings.update(overrides)
    if "layer_types" not in overrides:
        n = settings["num_hidden_layers"]
        settings["layer_types"] = [pattern[i % len(pattern)] for i in range(n)]
    return TTRConfig(**settings)
