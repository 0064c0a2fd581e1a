"""``TTRConfig``: one configuration for every decoder ttr builds.

A model is a stack of ``num_hidden_layers`` pre-norm blocks. Block ``i`` runs the token mixer
named by ``layer_types[i]`` (see ``ttr.models.layers.LAYER_TYPES``) and, unless
``intermediate_size == 0``, a SwiGLU MLP. Per-mixer settings:

* linear mixers (``gla``, ``delta_net``, ``gated_deltanet``): ``num_heads`` heads with key head
  dim ``head_dim`` (default ``hidden_size // num_heads``) and value head dim
  ``head_dim * expand_v``; a causal short convolution of width ``conv_size`` over q, k, v when
  ``use_short_conv``; ``allow_neg_eigval`` lets the delta-rule beta range over (0, 2) instead of
  (0, 1), and Mamba2's transition over (-1, 1) instead of (0, 1) (Grazzi et al. 2024,
  arXiv:2411.12537); ``gla_gate_low_rank_dim`` and
  ``gla_gate_logit_normalizer`` shape GLA's forget gate.
* ``mamba2``: inner width ``mamba_expand * hidden_size`` split into heads of
  ``mamba_head_dim``, ``mamba_n_groups`` groups of B/C with state size ``mamba_state_size``,
  the short conv of width ``conv_size``; ``mamba_a_init_range`` sets its decay initialisation
  (Dao & Gu 2024, arXiv:2405.21060).
* ``dt_min``/``dt_max``/``dt_init_floor``: the log-uniform time-step initialisation of the
  ``dt_bias`` of Mamba2 and Gated DeltaNet (Gu & Dao 2023, arXiv:2312.00752).
* ``swa`` / ``attn``: ``attn_num_heads`` query heads and ``attn_num_kv_heads`` key/value heads
  (GQA) of ``attn_head_dim``, rotary embeddings with base ``rope_theta`` (``None``: no position
  encoding, "NoPE", Kazemnejad et al. 2023, arXiv:2305.19466: order then comes only from the
  causal mask and any short conv, which lets content lookups run past the trained lengths);
  ``swa`` attends to the last ``window_size`` tokens; ``attn_short_conv`` puts a causal short conv
  of width ``conv_size`` on their q, k and v (off by default, as in Transformer++; the MQAR
  models turn it on); ``attn_qkv_bias`` / ``attn_o_bias`` add biases to the q/k/v and output
  projections (Llama's ``attention_bias`` sets both, fla's ``qkv_bias`` the first).
* ``mlp_bias``: biases on the SwiGLU projections (Llama's ``mlp_bias``).
* Mamba2 source options: ``mamba_dt_limit`` (``[low, high]`` clamp of the time step after the
  softplus, ``None``: no clamp), ``mamba_proj_bias`` (biases on ``in_proj``/``out_proj``),
  ``mamba_conv_bias``; GLA: ``gla_gate_clamp_min`` (lower clamp of the log forget gate).
* ``initializer_scheme``: ``"reference"`` (default) initialises every layer as the reference
  implementation of its family does (see ``TTRPreTrainedModel._init_weights``);
  ``"depth_scaled"`` draws every matrix from N(0, ``initializer_range``) and scales the residual
  output projections by 1/sqrt(number of residual branches) (GPT-2, Radford et al. 2019).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from ttr.kernels.utils import MAX_HEAD_DIM

from .layers import LAYER_TYPES
from .layers.linear import LinearMixer

INITIALIZER_SCHEMES = ("reference", "depth_scaled")

# the mixers that read num_heads / head_dim / expand_v, and the softmax-attention ones
LINEAR_TYPES = tuple(name for name, cls in LAYER_TYPES.items() if issubclass(cls, LinearMixer))
ATTENTION_TYPES = tuple(name for name, cls in LAYER_TYPES.items() if cls.is_attention)


def default_intermediate_size(hidden_size: int) -> int:
    """SwiGLU width 8/3 * hidden rounded up to a multiple of 256 (Shazeer 2020, arXiv:2002.05202)."""
    return 256 * -(-(8 * hidden_size // 3) // 256)


class TTRConfig(PretrainedConfig):
    model_type = "ttr"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 2048,
        num_hidden_layers: int = 24,
        layer_types: list[str] | None = None,
        intermediate_size: int | None = None,
        num_heads: int = 16,
        head_dim: int | None = None,
        expand_v: float = 1.0,
        use_short_conv: bool = True,
        conv_size: int = 4,
        allow_neg_eigval: bool = False,
        gla_gate_low_rank_dim: int = 16,
        gla_gate_logit_normalizer: float = 16.0,
        mamba_expand: int = 2,
        mamba_head_dim: int = 64,
        mamba_state_size: int = 128,
        mamba_n_groups: int = 1,
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init_floor: float = 1e-4,
        mamba_a_init_range: tuple[float, float] | list[float] = (1.0, 16.0),
        attn_num_heads: int | None = None,
        attn_num_kv_heads: int | None = None,
        attn_head_dim: int | None = None,
        window_size: int = 2048,
        attn_short_conv: bool = False,
        attn_qkv_bias: bool = False,
        attn_o_bias: bool = False,
        mlp_bias: bool = False,
        mamba_dt_limit: tuple[float, float] | list[float] | None = None,
        mamba_proj_bias: bool = False,
        mamba_conv_bias: bool = True,
        gla_gate_clamp_min: float | None = None,
        rope_theta: float | None = 10000.0,
        max_position_embeddings: int = 2048,
        rms_norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        initializer_scheme: str = "reference",
        tie_word_embeddings: bool = False,
        fuse_cross_entropy: bool = True,
        use_cache: bool = True,
        bos_token_id: int | None = 1,
        eos_token_id: int | None = 2,
        pad_token_id: int | None = None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.intermediate_size = (
            default_intermediate_size(hidden_size) if intermediate_size is None else intermediate_size
        )
        self.num_heads = num_heads
        self.head_dim = head_dim if head_dim is not None else _div(hidden_size, num_heads, "num_heads")
        self.expand_v = expand_v
        self.use_short_conv = use_short_conv
        self.conv_size = conv_size
        self.allow_neg_eigval = allow_neg_eigval
        self.gla_gate_low_rank_dim = gla_gate_low_rank_dim
        self.gla_gate_logit_normalizer = gla_gate_logit_normalizer
        self.mamba_expand = mamba_expand
        self.mamba_head_dim = mamba_head_dim
        self.mamba_state_size = mamba_state_size
        self.mamba_n_groups = mamba_n_groups
        self.dt_min = dt_min
        self.dt_max = dt_max
        self.dt_init_floor = dt_init_floor
        self.mamba_a_init_range = list(mamba_a_init_range)
        self.attn_num_heads = attn_num_heads if attn_num_heads is not None else num_heads
        self.attn_num_kv_heads = attn_num_kv_heads if attn_num_kv_heads is not None else self.attn_num_heads
        self.attn_head_dim = (
            attn_head_dim
            if attn_head_dim is not None
            else _div(hidden_size, self.attn_num_heads, "attn_num_heads")
        )
        self.window_size = window_size
        self.attn_short_conv = attn_short_conv
        self.attn_qkv_bias = attn_qkv_bias
        self.attn_o_bias = attn_o_bias
        self.mlp_bias = mlp_bias
        self.mamba_dt_limit = list(mamba_dt_limit) if mamba_dt_limit is not None else None
        self.mamba_proj_bias = mamba_proj_bias
        self.mamba_conv_bias = mamba_conv_bias
        self.gla_gate_clamp_min = gla_gate_clamp_min
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.initializer_scheme = initializer_scheme
        self.fuse_cross_entropy = fuse_cross_entropy
        self.use_cache = use_cache
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        # Set after the base __init__: transformers' own validator restricts ``layer_types`` to its
        # attention names (see ``validate``).
        self.layer_types = (
            list(layer_types) if layer_types is not None else ["gated_deltanet"] * num_hidden_layers
        )
        self._validate()

    def validate(self) -> None:
        """Run transformers' config validators (as ``save_pretrained`` does), then ttr's own.

        transformers' ``validate_layer_type`` only knows its own attention names, so it runs with
        ``layer_types`` hidden; ttr checks ``layer_types`` against ``LAYER_TYPES`` instead.
        """
        base_validate = getattr(super(), "validate", None)
        if base_validate is not None:
            layer_types = self.__dict__.pop("layer_types")
            try:
                base_validate()
            finally:
                self.layer_types = layer_types
        self._validate()

    @property
    def value_head_dim(self) -> int:
        return int(self.head_dim * self.expand_v)

    @property
    def mamba_num_heads(self) -> int:
        return self.mamba_expand * self.hidden_size // self.mamba_head_dim

    def _validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "head_dim"):
            _positive(name, getattr(self, name))
        if not isinstance(self.layer_types, list) or len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types must list one mixer per layer: got {len(self.layer_types)} entries for "
                f"num_hidden_layers={self.num_hidden_layers}"
            )
        unknown = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if unknown:
            raise ValueError(
                f"layer_types has unknown layer type(s) {unknown}; expected one of {sorted(LAYER_TYPES)}"
            )
        if self.initializer_scheme not in INITIALIZER_SCHEMES:
            raise ValueError(
                f"initializer_scheme must be one of {list(INITIALIZER_SCHEMES)}, got {self.initializer_scheme!r}"
            )
        if self.intermediate_size < 0:
            raise ValueError(f"intermediate_size must be >= 0 (0 = no MLP), got {self.intermediate_size}")
        used = set(self.layer_types)
        if used & set(LINEAR_TYPES):
            _head_dim("head_dim", self.head_dim)
            if (
                self.expand_v <= 0
                or self.value_head_dim < 1
                or self.value_head_dim != self.head_dim * self.expand_v
            ):
                raise ValueError(
                    f"expand_v must make head_dim * expand_v a positive integer, got {self.expand_v}"
                )
            _head_dim("head_dim * expand_v", self.value_head_dim)
        convs = used & set(LINEAR_TYPES) or "mamba2" in used or (used & set(ATTENTION_TYPES) and self.attn_short_conv)
        if convs and not 2 <= self.conv_size <= 4:
            raise ValueError(f"conv_size must be in 2..4, got {self.conv_size}")
        if "gla" in used:
            _positive("gla_gate_low_rank_dim", self.gla_gate_low_rank_dim)
            if self.gla_gate_clamp_min is not None and not self.gla_gate_clamp_min < 0:
                raise ValueError(
                    f"gla_gate_clamp_min must be None or < 0 (a log gate), got {self.gla_gate_clamp_min}"
                )
            if self.gla_gate_logit_normalizer <= 0:
                raise ValueError(
                    f"gla_gate_logit_normalizer must be > 0, got {self.gla_gate_logit_normalizer}"
                )
        if "mamba2" in used:
            for name in ("mamba_expand", "mamba_head_dim", "mamba_state_size", "mamba_n_groups"):
                _positive(name, getattr(self, name))
            _div(self.mamba_expand * self.hidden_size, self.mamba_head_dim, "mamba_head_dim")
            _head_dim("mamba_head_dim", self.mamba_head_dim)
            _head_dim("mamba_state_size", self.mamba_state_size)
            if self.mamba_num_heads % self.mamba_n_groups:
                raise ValueError(
                    f"mamba_n_groups={self.mamba_n_groups} must divide the number of Mamba2 heads "
                    f"{self.mamba_num_heads} (mamba_expand * hidden_size / mamba_head_dim)"
                )
            lo, hi = self.mamba_a_init_range
            if not 0 < lo <= hi:
                raise ValueError(
                    f"mamba_a_init_range must satisfy 0 < low <= high, got {self.mamba_a_init_range}"
                )
            limit = self.mamba_dt_limit
            if limit is not None and (len(limit) != 2 or not 0 <= limit[0] < limit[1]):
                raise ValueError(f"mamba_dt_limit must be None or [low, high] with 0 <= low < high, got {limit}")
        if used & {"mamba2", "gated_deltanet"} and not 0 < self.dt_min <= self.dt_max:
            raise ValueError(f"need 0 < dt_min <= dt_max, got dt_min={self.dt_min}, dt_max={self.dt_max}")
        if used & set(ATTENTION_TYPES):
            _positive("attn_num_heads", self.attn_num_heads)
            _positive("attn_num_kv_heads", self.attn_num_kv_heads)
            _head_dim("attn_head_dim", self.attn_head_dim)
            if self.attn_num_heads % self.attn_num_kv_heads:
                raise ValueError(
                    f"attn_num_kv_heads={self.attn_num_kv_heads} must divide attn_num_heads={self.attn_num_heads}"
                )
            if self.rope_theta is not None and (
                isinstance(self.rope_theta, bool)
                or not isinstance(self.rope_theta, (int, float))
                or not self.rope_theta > 0
            ):
                raise ValueError(f"rope_theta must be > 0 or None (no rotary), got {self.rope_theta!r}")
            if self.rope_theta is not None and self.attn_head_dim % 2:
                raise ValueError(
                    f"attn_head_dim must be even for rotary embeddings, got {self.attn_head_dim}"
                )
        if "swa" in used and (not isinstance(self.window_size, int) or self.window_size < 1):
            raise ValueError(f"window_size must be an integer >= 1, got {self.window_size!r}")


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _div(width: int, heads: int, name: str) -> int:
    _positive(name, heads)
    if width % heads:
        raise ValueError(f"{name}={heads} does not divide the width {width}")
    return width // heads


def _head_dim(name: str, value: int) -> None:
    _positive(name, value)
    if value > MAX_HEAD_DIM:
        raise ValueError(f"{name}={value} exceeds the maximum head dim {MAX_HEAD_DIM}")
