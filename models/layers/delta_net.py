"""DeltaNet mixer (Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule over
Sequence Length", arXiv:2406.06484; delta rule of Schlag et al. 2021, arXiv:2102.11174).

Per head: ``S_t = (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T``, ``o_t = S_t^T q_t / sqrt(K)``.

* q, k, v: linear projections, each through a causal short conv with SiLU, q and k
  L2-normalised (paper Sec. 3.3 / 4: the architecture ablations pick SiLU + L2 norm).
* beta ``b_t = sigmoid(W_b x_t)`` in (0, 1), or ``2 * sigmoid`` in (0, 2) with
  ``allow_neg_eigval`` (Grazzi et al. 2024, arXiv:2411.12537).
* output: per-head RMSNorm, then the output projection.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..modules import RMSNorm, ShortConv, l2_normalize, mask_tokens, run_short_convs


class DeltaNet(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        d, h = config.hidden_size, config.num_heads
        self.num_heads, self.head_k, self.head_v = h, config.head_dim, config.value_head_dim
        self.q_proj = nn.Linear(d, h * self.head_k, bias=False)
        self.k_proj = nn.Linear(d, h * self.head_k, bias=False)
        self.v_proj = nn.Linear(d, h * self.head_v, bias=False)
        self.b_proj = nn.Linear(d, h, bias=False)
        self.convs = (
            nn.ModuleList(
                ShortConv(n, config.conv_size) for n in (h * self.head_k, h * self.head_k, h * self.head_v)
            )
            if config.use_short_conv
            else None
        )
        self.o_norm = RMSNorm(self.head_v, eps=config.rms_norm_eps)
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
        q = l2_normalize(q.view(b, t, self.num_heads, self.head_k))
        k = l2_normalize(k.view(b, t, self.num_heads, self.head_k))
        v = v.view(b, t, self.num_heads, self.head_v)
        beta = torch.sigmoid(self.b_proj(x))
        if self.config.allow_neg_eigval:
            beta = 2 * beta
        k, v, beta = mask_tokens(mask, k, v, beta)
        kernel = ops.recurrent_delta_rule if decoding else ops.chunk_delta_rule
        o, state = kernel(
            q,
            k,
            v,
            beta,
            initial_state=layer_cache.get("recurrent") if layer_cache is not None else None,
            output_final_state=layer_cache is not None,
            cu_seqlens=cu_seqlens,
        )
        if layer_cache is not None:
            layer_cache["recurrent"] = state
        o = self.o_norm(o).reshape(b, t, self.num_heads * self.head_v)
        return self.o_proj(o)
