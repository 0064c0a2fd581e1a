"""Gated Linear Attention mixer (Yang et al. 2023, "Gated Linear Attention Transformers with
Hardware-Efficient Training", arXiv:2312.06635).

Per head: ``S_t = Diag(a_t) S_{t-1} + k_t v_t^T``, ``o_t = S_t^T q_t / sqrt(K)``.

* forget gate from a low-rank projection ``W_a2 W_a1 x_t`` (rank 16), ``log a_t =
  logsigmoid(.) / 16``: the normaliser tau = 16 keeps the gates close to 1 (paper Sec. 4.4).
* output: per-head RMSNorm gated by ``silu(W_r x_t)`` (paper Eq. 6 uses Swish(r_t) with a
  LayerNorm over heads; the released models use RMSNorm), then the output projection.
* optional short conv on q, k, v (not in the paper; shared with the delta-rule mixers).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from .. import ops
from ..modules import GatedRMSNorm, ShortConv, mask_tokens, run_short_convs


class GatedLinearAttention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        d, h = config.hidden_size, config.num_heads
        self.num_heads, self.head_k, self.head_v = h, config.head_dim, config.value_head_dim
        self.q_proj = nn.Linear(d, h * self.head_k, bias=False)
        self.k_proj = nn.Linear(d, h * self.head_k, bias=False)
        self.v_proj = nn.Linear(d, h * self.head_v, bias=False)
        self.gk_down = nn.Linear(d, config.gla_gate_low_rank_dim, bias=False)
        self.gk_up = nn.Linear(config.gla_gate_low_rank_dim, h * self.head_k, bias=True)
        self.convs = (
            nn.ModuleList(
                ShortConv(n, config.conv_size) for n in (h * self.head_k, h * self.head_k, h * self.head_v)
            )
            if config.use_short_conv
            else None
        )
        self.g_proj = nn.Linear(d, h * self.head_v, bias=False)
        self.o_norm = GatedRMSNorm(self.head_v, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(h * self.head_v, d, bias=False)
        self.o_proj._residual_out = True

    def forward(self, x, *, mask=None, full_mask=None, cu_seqlens=None, position_ids=None, cache=None):
        b, t, _ = x.shape
        layer_cache = cache[self.layer_idx] if cache is not None else None
        decoding = layer_cache is not None and t == 1
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.convs is not None:
            q, k, v = run_short_convs(
                list(self.convs),
                [q, k, v],
                mask=mask,
                cu_seqlens=cu_seqlens,
                layer_cache=layer_cache,
                decoding=decoding,
            )
        q = q.view(b, t, self.num_heads, self.head_k)
        k = k.view(b, t, self.num_heads, self.head_k)
        v = v.view(b, t, self.num_heads, self.head_v)
        gk = F.logsigmoid(self.gk_up(self.gk_down(x)).float()) / self.config.gla_gate_logit_normalizer
        k, v, gk = mask_tokens(mask, k, v, gk.view(b, t, self.num_heads, self.head_k))
        kernel = ops.recurrent_gla if decoding else ops.chunk_gla
        o, state = kernel(
            q,
            k,
            v,
            gk,
            initial_state=layer_cache.get("recurrent") if layer_cache is not None else None,
            output_final_state=layer_cache is not None,
            cu_seqlens=cu_seqlens,
        )
        if layer_cache is not None:
            layer_cache["recurrent"] = state
        gate = self.g_proj(x).view(b, t, self.num_heads, self.head_v)
        o = self.o_norm(o, gate).reshape(b, t, self.num_heads * self.head_v)
        return self.o_proj(o)
