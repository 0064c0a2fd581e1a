"""Softmax attention mixers: sliding-window (``swa``) and full causal (``attn``).

Multi-head attention (Vaswani et al. 2017, arXiv:1706.03762) with grouped key/value heads
(GQA, Ainslie et al. 2023, arXiv:2305.13245) and rotary positions (Su et al. 2021,
arXiv:2104.09864), as in Transformer++ baselines (Touvron et al. 2023, arXiv:2302.13971). The
sliding window (query t sees keys t-W+1 .. t) is the SWA of the Gated DeltaNet hybrids
(Yang et al. 2024, arXiv:2412.06464, Sec. 3.4).

Prefill and training run ``ttr.kernels.attention`` (padded rows are packed into ``cu_seqlens``
so padding is never attended); once a cache holds keys, the few new queries attend to the cached
keys in torch. The SWA cache keeps only the last W-1 keys (memory bounded by the window).

With ``attn_short_conv`` q, k and v each pass a causal depthwise short conv (width
``conv_size``, SiLU) after their projections, before rotary: the depthwise convolutions of
Primer's multi-dconv-head attention (So et al. 2021, arXiv:2109.08668) and the conv that
Zoology's MQAR models put before attention (Arora et al. 2023, arXiv:2312.04927). A key then
carries its predecessor token, so content lookups such as associative recall need no position
encoding; the conv states live in the cache next to the keys.
"""

from __future__ import annotations

import torch
from torch import nn

from ttr.kernels.attention import attention
from ttr.kernels.rotary import rope_tables, rotary

from ..modules import ShortConv, linear, linears, run_short_convs
from .base import Mixer


def attend_with_cache(q, k, v, key_valid, window: int | None, scale: float) -> torch.Tensor:
    """Causal (optionally windowed) attention of the last T positions over all L positions.

    q ``[B, T, Hq, D]``, k/v ``[B, L, Hkv, D]`` (L >= T, the queries are the last T positions),
    key_valid ``[B, L]`` bool or None. Masked scores use the dtype's minimum, not -inf, so a
    fully masked (padded) query row stays finite.
    """
    b, t, hq, _ = q.shape
    length, hkv = k.shape[1], k.shape[2]
    k = k.repeat_interleave(hq // hkv, dim=2)
    v = v.repeat_interleave(hq // hkv, dim=2)
    scores = torch.einsum("bthd,blhd->bhtl", q.float(), k.float()) * scale
    q_pos = torch.arange(length - t, length, device=q.device)[:, None]
    k_pos = torch.arange(length, device=q.device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed = allowed & (q_pos - k_pos < window)
    allowed = allowed[None, None]
    if key_valid is not None:
        allowed = allowed & key_valid[:, None, None, :].bool()
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhtl,blhd->bthd", probs, v.float()).to(q.dtype)


class Attention(Mixer):
    is_attention = True
    window: int | None = None
    #: keys are limited to the last ``config.window_size`` positions
    windowed: bool = False

    @classmethod
    def _keys_per_query(cls, config, seq_len: int) -> float:
        """Keys a query attends to, averaged over the positions t < seq_len: ``min(t + 1, W)``."""
        w = config.window_size
        if not cls.windowed or w >= seq_len:
            return (seq_len + 1) / 2
        return (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len

    @classmethod
    def state_size(cls, config, seq_len: int) -> int:
        span = min(seq_len, config.window_size) if cls.windowed else seq_len
        return 2 * span * config.attn_num_kv_heads * config.attn_head_dim

    @classmethod
    def flops_per_token(cls, config, seq_len: int) -> float:
        """QK^T and PV over the keys a causal query sees: the only term quadratic in ``seq_len``."""
        return 4.0 * config.attn_num_heads * config.attn_head_dim * cls._keys_per_query(config, seq_len)

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        d = config.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.attn_num_heads,
            config.attn_num_kv_heads,
            config.attn_head_dim,
        )
        self.scale = self.head_dim**-0.5
        qkv_bias = config.attn_qkv_bias
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=config.attn_o_bias)
        self.o_proj._residual_out = True
        widths = (self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim)
        self.convs = (
            nn.ModuleList(ShortConv(n, config.conv_size) for n in widths) if config.attn_short_conv else None
        )

    def _kernel(self, q, k, v, mask, cu_seqlens):
        if mask is None or bool(mask.all()):
            return attention(q, k, v, window=self.window, scale=self.scale, cu_seqlens=cu_seqlens)
        # Pack the valid tokens of each row into one varlen batch so padding is never attended.
        b, t = mask.shape
        idx = mask.reshape(-1).nonzero().squeeze(-1)
        lengths = mask.sum(1)
        cu = torch.zeros(b + 1, dtype=torch.int32, device=q.device)
        cu[1:] = lengths.cumsum(0)
        packed = [x.reshape(b * t, *x.shape[2:])[idx][None] for x in (q, k, v)]
        o = attention(*packed, window=self.window, scale=self.scale, cu_seqlens=cu)
        out = q.new_zeros(b * t, *o.shape[2:])
        out[idx] = o[0]
        return out.view(b, t, *o.shape[2:])

    def forward(self, x, *, mask=None, full_mask=None, cu_seqlens=None, position_ids=None, cache=None):
        b, t, _ = x.shape
        layer_cache = cache[self.layer_idx] if cache is not None else None
        q, k, v = linears(x, self.q_proj, self.k_proj, self.v_proj)
        if self.convs is not None:
            q, k, v = run_short_convs(
                list(self.convs), [q, k, v], mask=mask, cu_seqlens=cu_seqlens, layer_cache=layer_cache,
                decoding=layer_cache is not None and t == 1,
            )
        q = q.view(b, t, self.num_heads, self.head_dim)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        v = v.view(b, t, self.num_kv_heads, self.head_dim)
        if self.config.rope_theta is not None:
            # one table of angles for q and k, in fp32 (float64 for a float64 model)
            dtype = torch.promote_types(q.dtype, torch.float32)
            cos, sin = rope_tables(position_ids, self.head_dim, self.config.rope_theta, dtype)
            q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        if layer_cache is not None and "k" in layer_cache:
            k = torch.cat([layer_cache["k"], k], dim=1)
            v = torch.cat([layer_cache["v"], v], dim=1)
            key_valid = None if full_mask is None else full_mask[:, -k.shape[1] :]
            o = attend_with_cache(q, k, v, key_valid, self.window, self.scale)
        else:
            o = self._kernel(q, k, v, mask, cu_seqlens)
        if layer_cache is not None:
            keep = k.shape[1] if self.window is None else min(k.shape[1], self.window - 1)
            layer_cache["k"] = k[:, k.shape[1] - keep :]
            layer_cache["v"] = v[:, v.shape[1] - keep :]
        return linear(o.reshape(b, t, self.num_heads * self.head_dim), self.o_proj)


class SlidingWindowAttention(Attention):
    windowed = True

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.window = config.window_size
