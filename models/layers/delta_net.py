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

from ttr.kernels.delta import chunk_delta_rule, recurrent_delta_rule

from ..modules import RMSNorm, mask_tokens
from .linear import LinearMixer


class DeltaNet(LinearMixer):
    delta_rule = True
    qk_l2_norm = True
    input_projections = ("q_proj", "k_proj", "v_proj", "b_proj")

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.b_proj = nn.Linear(config.hidden_size, self.num_heads, bias=False)
        self.o_norm = RMSNorm(self.head_v, eps=config.rms_norm_eps)

    def forward(self, x, *, mask=None, full_mask=None, cu_seqlens=None, position_ids=None, cache=None):
        layer_cache = cache[self.layer_idx] if cache is not None else None
        decoding = layer_cache is not None and x.shape[1] == 1
        q, k, v, p = self.project_qkv(x, mask=mask, cu_seqlens=cu_seqlens, layer_cache=layer_cache, decoding=decoding)
        # fp32: in bf16 a beta near 1 rounds to 1 - 2^-8 or 1, and the sigmoid's backward, which
        # scales the gradient by beta (1 - beta), then gets 1 - beta off by up to 100 %
        beta = torch.sigmoid(p["b_proj"].float())
        if self.config.allow_neg_eigval:
            beta = 2 * beta
        k, v, beta = mask_tokens(mask, k, v, beta)
        o = self.run_kernel(chunk_delta_rule, recurrent_delta_rule, q, k, v, beta,
                            layer_cache=layer_cache, decoding=decoding, cu_seqlens=cu_seqlens)
        return self.output(o)
