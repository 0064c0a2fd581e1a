"""Token mixers, one file each. A new mixer is one file plus one line in ``LAYER_TYPES``.

Every mixer is a :class:`~.base.Mixer`: ``cls(config, layer_idx)`` with ``forward(x, *, mask,
full_mask, cu_seqlens, position_ids, cache) -> [B, T, hidden]``, and ``init_mixer_weights(init)``
where it has parameters beyond Linear layers and short convs (which the model initialises); it
reads and writes its own entry ``cache[layer_idx]`` of a ``TTRCache``. Its class states its traits
(``is_attention``, ``state_size``, ``flops_per_token``), which the config, the trainer's MFU and
the synthetic benchmarks read through ``LAYER_TYPES``.
"""

from .attention import Attention, SlidingWindowAttention
from .base import Mixer
from .delta_net import DeltaNet
from .gated_deltanet import GatedDeltaNet
from .gla import GatedLinearAttention
from .mamba2 import Mamba2

LAYER_TYPES = {
    "gla": GatedLinearAttention,
    "mamba2": Mamba2,
    "delta_net": DeltaNet,
    "gated_deltanet": GatedDeltaNet,
    "swa": SlidingWindowAttention,
    "attn": Attention,
}

__all__ = ["LAYER_TYPES", "Mixer"]
