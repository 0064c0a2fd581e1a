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
* memory: what the backward keeps per token is the input projection's output (z, xBC and dt are
  read in place as its slices), the SSD output y and small fp32 per-head terms; the conv's output
  is recomputed in the backward (``chunk_conv_ssd``) and the gated norm is one kernel.
* ``mamba_dt_limit`` clamps ``dt`` after the softplus (mamba_ssm's ``dt_limit``); biases on the
  projections and the conv follow ``mamba_proj_bias`` / ``mamba_conv_bias``.
* ``allow_neg_eigval``: the transition ``a_t = 2 exp(dt_t A) - 1`` ranges over (-1, 1) instead of
  (0, 1), Grazzi et al. 2024 (arXiv:2411.12537, Sec. 4), which lets the layer track parity. The
  log-space kernels take ``log|a_t|``; the sign is carried by the transform in
  :func:`signed_decay_inputs` (no kernel change).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ttr.kernels.common.index import CHUNK_SIZE, Packing
from ttr.kernels.ssd import chunk_conv_ssd, chunk_simple_gla, chunk_ssd, recurrent_simple_gla, recurrent_ssd

from ..modules import ShortConv, init_time_step_bias, linear, mask_tokens, norm_linear, run_short_convs
from .base import Mixer


def sign_parity(negative: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """``P_t = prod_{s <= t} sign(a_s)`` (+-1, fp32) per sequence, restarting at every document."""
    count = negative.to(torch.int32).cumsum(1)  # [B, T, H]
    if cu_seqlens is not None:
        starts = cu_seqlens[:-1].long()
        before = torch.cat([count.new_zeros(1, 1, count.shape[2]), count[:, :-1]], dim=1)  # exclusive
        doc = torch.searchsorted(cu_seqlens[1:].long(), torch.arange(count.shape[1], device=count.device),
                                 right=True)
        count = count - before[:, starts][:, doc]
    return 1.0 - 2.0 * (count % 2).float()


def signed_decay_inputs(a_signed, dt, xs, cu_seqlens):
    """Run a transition with negative eigenvalues through the log-space simple-GLA kernels.

    With ``P_t`` the running product of the signs of ``a_t`` and ``S'_t = P_t S_t``:
    ``S'_t = |a_t| S'_{t-1} + B_t (P_t dt_t x_t)^T`` and ``y_t = P_t S'^T_t C_t``, so the kernel
    sees the gate ``log|a_t|`` and the value ``P_t dt_t x_t``, the output is multiplied by ``P_t``
    and the final state by ``P_T`` (``P_0 = 1``: the initial state is the true state).
    Returns ``(g, v, P)``.
    """
    parity = sign_parity(a_signed < 0, cu_seqlens)
    g = torch.log(a_signed.abs().clamp_min(1e-6))
    v = (xs * (dt * parity).unsqueeze(-1)).to(xs.dtype)
    return g, v, parity


def last_parity(parity: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """``P`` at the last token of every sequence, ``[N, H]`` (1 for an empty document)."""
    if cu_seqlens is None:
        return parity[:, -1]
    ends = cu_seqlens[1:].long() - 1
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.where((lengths > 0)[:, None], parity[0, ends.clamp_min(0)], torch.ones_like(parity[0, :1]))


class Mamba2(Mixer):
    @classmethod
    def state_size(cls, config, seq_len: int) -> int:
        return config.mamba_num_heads * config.mamba_state_size * config.mamba_head_dim

    @classmethod
    def flops_per_token(cls, config, seq_len: int) -> float:
        """The SSD chunkwise form: GLA's count with K = state size N and V = head dim P."""
        n, p = config.mamba_state_size, config.mamba_head_dim
        return config.mamba_num_heads * (2.0 * CHUNK_SIZE * (n + p) + 4.0 * n * p)

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        d = config.hidden_size
        self.d_inner = config.mamba_expand * d
        self.num_heads, self.head_dim = config.mamba_num_heads, config.mamba_head_dim
        self.n_groups, self.state_size = config.mamba_n_groups, config.mamba_state_size
        self.conv_dim = self.d_inner + 2 * self.n_groups * self.state_size
        self.in_proj = nn.Linear(d, self.d_inner + self.conv_dim + self.num_heads, bias=config.mamba_proj_bias)
        self.conv = ShortConv(self.conv_dim, config.conv_size, bias=config.mamba_conv_bias)
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))
        self.D = nn.Parameter(torch.empty(self.num_heads))
        for p in (self.A_log, self.dt_bias, self.D):
            p._no_weight_decay = True
        self.norm_weight = nn.Parameter(torch.ones(self.d_inner))
        self.eps = config.rms_norm_eps
        self.out_proj = nn.Linear(self.d_inner, d, bias=config.mamba_proj_bias)
        self.out_proj._residual_out = True

    def init_mixer_weights(self, init) -> None:
        cfg = self.config
        if cfg.initializer_scheme == "reference":
            # mamba_ssm's initialisation (the authors' release): projections and conv keep
            # PyTorch's defaults, kaiming-uniform with a = sqrt(5), i.e. U(+-1/sqrt(fan_in)) (conv
            # bias included); the output projection is then divided by sqrt(number of residual
            # branches) (its rescale_prenorm_residual); Linear biases start at zero.
            branches = cfg.num_hidden_layers * (2 if cfg.intermediate_size > 0 else 1)
            for proj, scale in ((self.in_proj, 1.0), (self.out_proj, 1.0 / math.sqrt(branches))):
                bound = scale / math.sqrt(proj.in_features)
                init.uniform_(proj.weight, -bound, bound)
                if proj.bias is not None:
                    init.zeros_(proj.bias)
            bound = 1.0 / math.sqrt(self.conv.weight.shape[1])
            init.uniform_(self.conv.weight, -bound, bound)
            if self.conv.bias is not None:
                init.uniform_(self.conv.bias, -bound, bound)
        lo, hi = cfg.mamba_a_init_range
        a = torch.empty(self.num_heads, dtype=torch.float32, device=self.A_log.device).uniform_(lo, hi)
        init.copy_(self.A_log, torch.log(a))
        init_time_step_bias(self.dt_bias, cfg.dt_min, cfg.dt_max, cfg.dt_init_floor, init)
        init.ones_(self.D)
        init.ones_(self.norm_weight)

    def _signed_ssd(self, xs, dt, a, bm, cm, initial_state, output_final_state, cu_seqlens, decoding):
        """The SSD step with ``a_t = 2 exp(dt_t A) - 1`` in (-1, 1) (``allow_neg_eigval``)."""
        # dt = 0 at padded positions gives a_t = 1: no decay, no input, no sign flip
        offsets = cu_seqlens.cu_seqlens if isinstance(cu_seqlens, Packing) else cu_seqlens
        g, v, parity = signed_decay_inputs(2.0 * torch.exp(dt * a) - 1.0, dt, xs, offsets)
        rep = self.num_heads // self.n_groups
        q, k = cm.repeat_interleave(rep, dim=2), bm.repeat_interleave(rep, dim=2)
        kernel = recurrent_simple_gla if decoding else chunk_simple_gla
        y, state = kernel(q, k, v, g, scale=1.0, initial_state=initial_state,
                          output_final_state=output_final_state, cu_seqlens=cu_seqlens)
        y = y * parity.unsqueeze(-1).to(y.dtype)
        if state is not None:
            state = state * last_parity(parity, offsets)[:, :, None, None]
        return y, state

    def _ssd_with_states(self, xbc, dt, a, *, mask, cu_seqlens, layer_cache, decoding):
        """The short conv and SSD as two ops, with their states in ``layer_cache`` (and the
        signed transition); ``y`` includes the D skip."""
        b, t, _ = xbc.shape
        (xbc,) = run_short_convs(
            [self.conv], [xbc], mask=mask, cu_seqlens=cu_seqlens, layer_cache=layer_cache, decoding=decoding
        )
        gn = self.n_groups * self.state_size
        xs, bm, cm = xbc.split([self.d_inner, gn, gn], dim=-1)
        xs = xs.reshape(b, t, self.num_heads, self.head_dim)
        bm = bm.reshape(b, t, self.n_groups, self.state_size)
        cm = cm.reshape(b, t, self.n_groups, self.state_size)
        initial_state = layer_cache.get("recurrent") if layer_cache is not None else None
        if self.config.allow_neg_eigval:
            y, state = self._signed_ssd(xs, dt, a, bm, cm, initial_state, layer_cache is not None, cu_seqlens,
                                        decoding)
            y = y + xs * self.D.to(xs.dtype)[:, None]
        else:
            kernel = recurrent_ssd if decoding else chunk_ssd
            y, state = kernel(xs, dt, a, bm, cm, D=self.D.float(), initial_state=initial_state,
                              output_final_state=layer_cache is not None, cu_seqlens=cu_seqlens)
        if layer_cache is not None:
            layer_cache["recurrent"] = state
        return y

    def forward(self, x, *, mask=None, full_mask=None, cu_seqlens=None, position_ids=None, cache=None):
        b, t, _ = x.shape
        layer_cache = cache[self.layer_idx] if cache is not None else None
        decoding = layer_cache is not None and t == 1
        # z, xbc and dt stay views of the one projection: the conv and the norm read their slices in
        # place, so the backward keeps this one tensor and no copies of its parts.
        z, xbc, dt = linear(x, self.in_proj).split([self.d_inner, self.conv_dim, self.num_heads], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        if self.config.mamba_dt_limit is not None:
            dt = dt.clamp(*self.config.mamba_dt_limit)
        # dt = 0 at padded positions: no decay (exp(0) = 1) and no input (B dt x = 0).
        (dt,) = mask_tokens(mask, dt)
        a = -self.A_log.float().exp()
        if layer_cache is None and not self.config.allow_neg_eigval:
            # Training: the conv runs inside the SSD op, whose backward runs it again rather than
            # keep its output (x, B, C) alive from the forward to the backward.
            (xbc,) = mask_tokens(mask, xbc)
            y, _ = chunk_conv_ssd(xbc, self.conv.weight, self.conv.bias, dt, a, groups=self.n_groups,
                                  state_size=self.state_size, D=self.D.float(), cu_seqlens=cu_seqlens)
        else:
            y = self._ssd_with_states(xbc, dt, a, mask=mask, cu_seqlens=cu_seqlens, layer_cache=layer_cache,
                                      decoding=decoding)
        # gate, then per-group RMSNorm, then out_proj: the norm keeps y, z (read in place) and the
        # stats, and its output is formed again in the backward for out_proj's weight gradient
        return norm_linear(y.reshape(b, t, self.d_inner), z, self.norm_weight, self.out_proj, eps=self.eps,
                           norm_before_gate=False, groups=self.n_groups)
