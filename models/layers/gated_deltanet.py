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
from torch import nn

from ttr.kernels.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule
from ttr.kernels.gated_delta.gate import gated_delta_gate

from ..modules import GatedRMSNorm, init_time_step_bias, mask_tokens
from .linear import LinearMixer


class GatedDeltaNet(LinearMixer):
    delta_rule = True
    qk_l2_norm = True
    input_projections = ("q_proj", "k_proj", "v_proj", "b_proj", "a_proj", "g_proj")

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        d, h = config.hidden_size, self.num_heads
        self.a_proj = nn.Linear(d, h, bias=False)
        self.b_proj = nn.Linear(d, h, bias=False)
        self.A_log = nn.Parameter(torch.empty(h))
        self.dt_bias = nn.Parameter(torch.empty(h))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        self.g_proj = nn.Linear(d, h * self.head_v, bias=False)
        self.o_norm = GatedRMSNorm(self.head_v, eps=config.rms_norm_eps)

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
        q, k, v, p = self.project_qkv(x, mask=mask, cu_seqlens=cu_seqlens, layer_cache=layer_cache, decoding=decoding)
        # fp32 gates: in bf16 a beta near 1 rounds to 1 - 2^-8 or 1, and the sigmoid's backward,
        # which scales the gradient by beta (1 - beta), then gets 1 - beta off by up to 100 %
        g, beta = gated_delta_gate(p["a_proj"], p["b_proj"], self.A_log, self.dt_bias,
                                   2.0 if self.config.allow_neg_eigval else 1.0)
        k, v, beta, g = mask_tokens(mask, k, v, beta, g)
        o = self.run_kernel(chunk_gated_delta_rule, recurrent_gated_delta_rule, q, k, v, g, beta,
                            layer_cache=layer_cache, decoding=decoding, cu_seqlens=cu_seqlens)
        gate = p["g_proj"].view(b, t, self.num_heads, self.head_v)
        return self.output(o, gate)
