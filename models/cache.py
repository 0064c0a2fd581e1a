"""``TTRCache``: the decoding state of a ``TTRForCausalLM``.

One dict per layer, written by the layer itself:

* linear mixers (GLA, DeltaNet, Gated DeltaNet, Mamba2): ``"recurrent"`` the state
  ``[B, H, K, V]`` (fp32) and ``"conv"`` the short-conv states ``[B, D, W-1]`` (a tuple, one per
  convolution). Their memory does not grow with the generated length.
* ``swa``: ``"k"``/``"v"`` ``[B, L, Hkv, D]`` with L <= window - 1, the keys a next query can
  still see (a rolling window; memory bounded by the window).
* ``attn``: ``"k"``/``"v"`` grow by one position per generated token.
* attention layers with ``attn_short_conv`` also keep ``"conv"`` (q, k, v conv states).

Key/value caches keep padded positions (left padding in batched generation) so that they stay
aligned with the 2-D ``attention_mask``; the attention layer masks them out. ``seen_tokens``
counts positions consumed so far (padding included), as transformers' ``get_seq_length``
expects.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache


class TTRCache(Cache):
    is_compileable = False
    is_croppable = False

    def __init__(self, num_layers: int):
        super().__init__(layers=[])
        self.states: list[dict[str, Any]] = [{} for _ in range(num_layers)]
        self.seen_tokens = 0

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, layer_idx: int) -> dict[str, Any]:
        return self.states[layer_idx]

    def __repr__(self) -> str:
        return f"TTRCache(num_layers={len(self.states)}, seen_tokens={self.seen_tokens})"

    def get_seq_length(self, layer_idx: int | None = 0, *args, **kwargs) -> int:
        return self.seen_tokens

    def get_max_length(self, *args, **kwargs) -> int:
        return -1

    def get_max_cache_shape(self, *args, **kwargs) -> int:
        return -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0, *args, **kwargs) -> tuple[int, int]:
        return self.seen_tokens + query_length, 0

    def _map(self, fn) -> None:
        def apply(value):
            if isinstance(value, torch.Tensor):
                return fn(value)
            if isinstance(value, tuple):
                return tuple(apply(v) for v in value)
            return value

        self.states = [{key: apply(value) for key, value in state.items()} for state in self.states]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, max_length: int) -> None:
        raise NotImplementedError(
            "TTRCache holds recurrent states, which cannot be cropped to an earlier length"
        )

    def reset(self) -> None:
        self.states = [{} for _ in self.states]
        self.seen_tokens = 0
