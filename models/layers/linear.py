"""The frame shared by the q/k/v linear mixers (DeltaNet, Gated DeltaNet, GLA).

Each of them projects q, k and v, optionally runs each through a causal short conv (with its
conv state in the cache while decoding), splits heads, calls a chunk kernel (training and
prefill) or a recurrent kernel (one-token decoding) on the layer's recurrent state, and ends in
an output projection scaled with depth. Subclasses add their gates and output norm.
"""

from __future__ import annotations

from torch import nn

from ttr.kernels.common.index import CHUNK_SIZE, tuned
from ttr.kernels.conv import causal_conv1d_columns

from ..modules import (
    NARROW_MAP,
    ShortConv,
    joinable,
    joined_linears,
    l2_normalize,
    linears,
    output_projection,
    plain_modules,
    run_short_convs,
)
from .base import Mixer


class LinearMixer(Mixer):
    #: the delta rule's WY terms run on top of the gated linear attention ones
    delta_rule: bool = False
    # q and k L2-normalised per head (the delta rules): inside the short convs when there are some
    qk_l2_norm: bool = False
    #: the linear maps of the layer's input, run by one ``linears`` call (one input gradient
    #: accumulated by the matmuls): q, k, v, then a subclass's gate projections
    input_projections: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")

    @classmethod
    def state_size(cls, config, seq_len: int) -> int:
        return config.num_heads * config.head_dim * config.value_head_dim

    @classmethod
    def flops_per_token(cls, config, seq_len: int) -> float:
        """Chunkwise form, per head with key dim K and value dim V and C the chunk size:
        ``2C(K + V)`` intra-chunk (QK^T, AV) ``+ 4KV`` (output from the state, state update); the
        delta rule adds ``KK^T`` (2CK), ``W = TK`` (2CK), ``U = TV`` (2CV) and ``U - WS`` (2KV), the
        triangular inverse (about C^2/3) left out. No term grows with ``seq_len``."""
        c, k, v = CHUNK_SIZE, config.head_dim, config.value_head_dim
        per_head = 2.0 * c * (k + v) + 4.0 * k * v
        if cls.delta_rule:
            per_head += 4.0 * c * k + 2.0 * c * v + 2.0 * k * v
        return config.num_heads * per_head

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        d, h = config.hidden_size, config.num_heads
        self.num_heads, self.head_k, self.head_v = h, config.head_dim, config.value_head_dim
        self.q_proj = nn.Linear(d, h * self.head_k, bias=False)
        self.k_proj = nn.Linear(d, h * self.head_k, bias=False)
        self.v_proj = nn.Linear(d, h * self.head_v, bias=False)
        l2 = self.head_k if self.qk_l2_norm else None
        self.convs = (
            nn.ModuleList(
                ShortConv(n, config.conv_size, l2_group=g)
                for n, g in ((h * self.head_k, l2), (h * self.head_k, l2), (h * self.head_v, None))
            )
            if config.use_short_conv
            else None
        )
        self.o_proj = nn.Linear(h * self.head_v, d, bias=False)
        self.o_proj._residual_out = True

    def project_qkv(self, x, *, mask, cu_seqlens, layer_cache, decoding, into=None):
        """q, k ``[B, T, H, K]`` and v ``[B, T, H, V]``, after the short convs when enabled (q and k
        L2-normalised per head with ``qk_l2_norm``), and the other ``input_projections`` of x by
        name. ``into``: a ``GradColumns`` for the projections' input gradients, in the order of
        ``input_projections`` (without short convs; ``into.ready`` tells whether it was taken)."""
        b, t, _ = x.shape
        names = self.input_projections
        maps = [getattr(self, n) for n in names]
        joined = None
        if self.convs is not None and mask is None and layer_cache is None and not decoding and self._columns():
            narrow = self._passed_through(maps)
            others = [i for i in range(3, len(maps)) if i not in narrow]
            joined = joined_linears(x, maps[:3] + [maps[i] for i in narrow], *[maps[i] for i in others])
        if joined is not None:
            # q, k and v as one product, its gradient one tensor that the convs' backward writes
            # (``kernels.conv.causal_conv1d_columns``): one input-gradient product instead of three
            # that add into dx, and one product each forward and for the weights; the narrow gate
            # maps join it as columns the convs pass through, where a product of their own would
            # read x once more each way for a few outputs
            out = dict(zip([names[i] for i in others], joined[1:]))
            widths = [maps[i].out_features for i in narrow]
            q, k, v, *passed = causal_conv1d_columns(
                joined[0], [c.weight for c in self.convs], [c.bias for c in self.convs], activation="silu",
                cu_seqlens=cu_seqlens, l2_groups=[c.l2_group for c in self.convs], passthrough=sum(widths),
            )
            if narrow:
                out.update(zip([names[i] for i in narrow], passed[0].split(widths, -1)))
        else:
            out = dict(zip(names, linears(x, *maps, into=into if self.convs is None else None)))
            q, k, v = out.pop("q_proj"), out.pop("k_proj"), out.pop("v_proj")
        if self.convs is not None and joined is None:
            q, k, v = run_short_convs(
                list(self.convs), [q, k, v], mask=mask, cu_seqlens=cu_seqlens, layer_cache=layer_cache,
                decoding=decoding,
            )
        h = self.num_heads
        q, k = q.view(b, t, h, self.head_k), k.view(b, t, h, self.head_k)
        if self.qk_l2_norm and self.convs is None:
            q, k = l2_normalize(q), l2_normalize(k)
        return q, k, v.view(b, t, h, self.head_v), out

    def _columns(self) -> bool:
        """Whether the short convs may take q, k and v as column blocks of one product: ttr's own
        ``ShortConv`` without hooks (as ``linears`` asks of its maps), unless
        ``TUNING["qkv_columns"] = {"enabled": False}`` (for measurement)."""
        return plain_modules(self.convs, (ShortConv,)) and tuned("qkv_columns", enabled=True)["enabled"]

    @staticmethod
    def _passed_through(maps) -> list[int]:
        """The indices of the narrow maps after q, k and v (``NARROW_MAP`` outputs or fewer) that
        join q, k and v's product, passed through by the convs: those that can share q's product
        (``joinable``); none under ``TUNING["qkv_columns"] = {"narrow": False}`` (for measurement)."""
        if not tuned("qkv_columns", narrow=True)["narrow"]:
            return []
        return [i for i in range(3, len(maps)) if isinstance(maps[i], nn.Linear) and maps[i].out_features <= NARROW_MAP
                and joinable([maps[0], maps[i]])]

    def run_kernel(self, chunk_fn, recurrent_fn, *inputs, layer_cache, decoding, cu_seqlens):
        """Run the mixer's op from (and into) the cached recurrent state; returns o ``[B, T, H, V]``."""
        kernel = recurrent_fn if decoding else chunk_fn
        o, state = kernel(
            *inputs,
            initial_state=layer_cache.get("recurrent") if layer_cache is not None else None,
            output_final_state=layer_cache is not None,
            cu_seqlens=cu_seqlens,
        )
        if layer_cache is not None:
            layer_cache["recurrent"] = state
        return o

    def output(self, o, gate=None, dz_into=None):
        """``o_proj(o_norm(o[, gate]))`` over the merged heads of o ``[B, T, H, V]``; ``dz_into`` as
        in ``norm_linear``."""
        return output_projection(self.o_norm, o, gate, self.o_proj, dz_into=dz_into)
