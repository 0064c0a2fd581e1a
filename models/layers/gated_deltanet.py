"""Gated DeltaNet mixer (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks", arXiv:2412.06464).

Per head: ``S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T``, ``o_t = S_t^T q_t / sqrt(K)``.

* q, k, v: linear projections, each through a causal short conv with SiLU (paper Sec. 3.3),
  q and k L2-normalised (needed for the delta rule's stability, Yang et al. 2024, arXiv:2406.06484).
* beta ``b_t = sigmoid(W_b x_t)``, optionally ``2 * sigmoid`` so the transition may have negative
  eigenvalues (Grazzi et al. 2024, arXiv:2411.12537).
* decay ``log a_t = -exp(A_log) * softplus(W_a x_t + dt_bias)``: Mamba2's parameterisation
  (paper Sec. 3.3), ``A ~ U(0, 16)`` and ``dt_bias`` from a log-uniform time step, as in the
  authors' release.
* output: per-head gated RMSNorm with ``silu(W_g x_t)``, then the output projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..modules import GatedRMSNorm, ShortConv, init_time_step_bias, l2_normalize, mask_tokens, run_short_convs


class GatedDeltaNet(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        d, h = config.hidden_size, config.num_heads
        self.num_heads, self.head_k, self.head_v = h, config.head_dim, config.value_head_dim
        self.q_proj = nn.Linear(d, h * self.head_k, bias=False)
        self.k_proj = nn.Linear(d, h * self.head_k, bias=False)
        self.v_proj = nn.Linear(d, h * self.head_v, bias=False)
        self.a_proj = nn.Linear(d, h, bias=False)
        self.b_proj = nn.Linear(d, h, bias=False)
        self.A_log = nn.Parameter(torch.empty(h))
        self.dt_bias = nn.Parameter(torch.empty(h))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
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

    def init_mixer_weights(self, init) -> None:
        # A ~ U(0, 16); the floor only keeps log(A) finite.
        a = torch.empty(self.A_log.shape, dtype=torch.float32, device=self.A_log.device).uniform_(0, 16)
        init.copy_(self.A_log, torch.log(a.clamp_(min=1e-4)))
        cfg = self.config
        init_time_step_bias(self.dt_bias, cfg.dt_min, cfg.dt_max, cfg.dt_init_floor, init)

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
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias.float())
        k, v, beta, g = mask_tokens(mask, k, v, beta, g)
        kernel = ops.recurrent_gated_delta_rule if decoding else ops.chunk_gated_delta_rule
        o, state = kernel(
            q,
            k,
            v,
            g,
            beta,
            initial_state=layer_cache.get("recurrent") if layer_cache is not None else None,
            output_final_state=layer_cache is not None,
            cu_seqlens=cu_seqlens,
        )
        if layer_cache is not None:
            layer_cache["recurrent"] = state
        gate = self.g_proj(x).view(b, t, self.num_heads, self.head_v)
        o = self.o_norm(o, gate).reshape(b, t, self.num_heads * self.head_v)
        return self.o_proj(o)
