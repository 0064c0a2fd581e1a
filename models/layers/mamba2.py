"""Mamba2 mixer (Dao & Gu 2024, "Transformers are SSMs", arXiv:2405.21060), SSD form.

Per head: ``S_t = exp(dt_t A) S_{t-1} + B_t (dt_t x_t)^T``, ``y_t = S_t^T C_t + D x_t``.

* one input projection into ``z`` (gate), ``xBC`` and ``dt`` (paper Sec. 7.1: the parallel
  projections of the Mamba-2 block); a causal depthwise conv with SiLU over ``xBC``.
* ``B``/``C`` shared by the heads of a group (``mamba_n_groups``; paper Sec. 7.2, grouped-value
  attention analogue).
* ``dt = softplus(dt_raw + dt_bias)`` with ``dt_bias`` from a log-uniform time step,
  ``A = -exp(A_log)`` with ``A ~ U(mamba_a_init_range)`` (default 1..16), ``D = 1``: the
  initialisation of the authors' release.
* output: ``RMSNorm(y * silu(z))`` per group (gate before the norm, paper Sec. 7.3), then the
  output projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..modules import ShortConv, init_time_step_bias, mask_tokens, run_short_convs


class Mamba2(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        d = config.hidden_size
        self.d_inner = config.mamba_expand * d
        self.num_heads, self.head_dim = config.mamba_num_heads, config.mamba_head_dim
        self.n_groups, self.state_size = config.mamba_n_groups, config.mamba_state_size
        self.conv_dim = self.d_inner + 2 * self.n_groups * self.state_size
        self.in_proj = nn.Linear(d, self.d_inner + self.conv_dim + self.num_heads, bias=False)
        self.conv = ShortConv(self.conv_dim, config.conv_size, bias=True)
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))
        self.D = nn.Parameter(torch.empty(self.num_heads))
        for p in (self.A_log, self.dt_bias, self.D):
            p._no_weight_decay = True
        self.norm_weight = nn.Parameter(torch.ones(self.d_inner))
        self.eps = config.rms_norm_eps
        self.out_proj = nn.Linear(self.d_inner, d, bias=False)
        self.out_proj._residual_out = True

    def init_mixer_weights(self, init) -> None:
        cfg = self.config
        lo, hi = cfg.mamba_a_init_range
        a = torch.empty(self.num_heads, dtype=torch.float32, device=self.A_log.device).uniform_(lo, hi)
        init.copy_(self.A_log, torch.log(a))
        init_time_step_bias(self.dt_bias, cfg.dt_min, cfg.dt_max, cfg.dt_init_floor, init)
        init.ones_(self.D)
        init.ones_(self.norm_weight)

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        u = y * F.silu(z)
        if self.n_groups == 1:
            return ops.rms_norm(u, self.norm_weight, eps=self.eps)
        shape = u.shape
        grouped = u.reshape(*shape[:-1], self.n_groups, self.d_inner // self.n_groups)
        ones = torch.ones(grouped.shape[-1], dtype=self.norm_weight.dtype, device=u.device)
        return ops.rms_norm(grouped, ones, eps=self.eps).reshape(shape) * self.norm_weight

    def forward(self, x, *, mask=None, full_mask=None, cu_seqlens=None, position_ids=None, cache=None):
        b, t, _ = x.shape
        layer_cache = cache[self.layer_idx] if cache is not None else None
        decoding = layer_cache is not None and t == 1
        z, xbc, dt = self.in_proj(x).split([self.d_inner, self.conv_dim, self.num_heads], dim=-1)
        (xbc,) = run_short_convs(
            [self.conv], [xbc], mask=mask, cu_seqlens=cu_seqlens, layer_cache=layer_cache, decoding=decoding
        )
        gn = self.n_groups * self.state_size
        xs, bm, cm = xbc.split([self.d_inner, gn, gn], dim=-1)
        xs = xs.reshape(b, t, self.num_heads, self.head_dim)
        bm = bm.reshape(b, t, self.n_groups, self.state_size)
        cm = cm.reshape(b, t, self.n_groups, self.state_size)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        # dt = 0 at padded positions: no decay (exp(0) = 1) and no input (B dt x = 0).
        (dt,) = mask_tokens(mask, dt)
        a = -self.A_log.float().exp()
        kernel = ops.recurrent_ssd if decoding else ops.chunk_ssd
        y, state = kernel(
            xs,
            dt,
            a,
            bm,
            cm,
            initial_state=layer_cache.get("recurrent") if layer_cache is not None else None,
            output_final_state=layer_cache is not None,
            cu_seqlens=cu_seqlens,
        )
        if layer_cache is not None:
            layer_cache["recurrent"] = state
        y = y + xs * self.D.to(xs.dtype)[:, None]
        y = self._gated_norm(y.reshape(b, t, self.d_inner), z)
        return self.out_proj(y)
