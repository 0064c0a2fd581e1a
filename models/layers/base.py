"""What every token mixer class states about itself, besides its forward.

The decoder builds block ``i`` from ``LAYER_TYPES[config.layer_types[i]]``. Code that needs a fact
about a kind of mixer (the config's checks, the trainer's FLOP count, the synthetic benchmarks'
models and state sizes) asks the class through that registry, so a new mixer states its facts in
its own file and nowhere else.
"""

from __future__ import annotations

import abc

from torch import nn


class Mixer(nn.Module, metaclass=abc.ABCMeta):
    #: softmax attention over cached keys and values, rather than a fixed-size recurrent state
    is_attention: bool = False

    @classmethod
    @abc.abstractmethod
    def state_size(cls, config, seq_len: int) -> int:
        """Elements one layer keeps per sequence to decode after ``seq_len`` tokens: the recurrent
        state, or for attention the cached keys and values."""

    @classmethod
    @abc.abstractmethod
    def flops_per_token(cls, config, seq_len: int) -> float:
        """Forward FLOPs per token of the sequence mixing itself, for sequences of ``seq_len`` tokens.

        Linear layers (projections, gates) are counted by the caller from the model's ``nn.Linear``
        modules; short convolutions, norms and element-wise gates are left out (< 0.5 %)."""
