"""Gated Linear Attention mixer (Yang et al. 2023, "Gated Linear Attention Transformers with
Hardware-Efficient Training", arXiv:2312.06635).

Per head: ``S_t = Diag(a_t) S_{t-1} + k_t v_t^T``, ``o_t = S_t^T q_t / sqrt(K)``.

* forget gate from a low-rank projection ``W_a2 W_a1 x_t`` (rank 16), ``log a_t =
  logsigmoid(.) / 16``: the normaliser tau = 16 keeps the gates close to 1 (paper Sec. 4.4).
* output: per-head RMSNorm gated by ``silu(W_r x_t)`` (paper Eq. 6 uses Swish(r_t) with a
  LayerNorm over heads; the released models use RMSNorm), then the output projection.
* ``gla_gate_clamp_min``: an optional floor on the log gate (fla's ``clamp_min``).
* optional short conv on q, k, v (not in the paper; shared with the delta-rule mixers).
"""

from __future__ import annotations

import functools

from torch import nn

from ttr.kernels.common.index import tuned
from ttr.kernels.gla import chunk_gla, recurrent_gla
from ttr.kernels.gla.gate import gla_gate

from ..modules import GatedRMSNorm, GradColumns, linear, mask_tokens
from .linear import LinearMixer


class GatedLinearAttention(LinearMixer):
    input_projections = ("q_proj", "k_proj", "v_proj", "gk_down", "g_proj")

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        d, h = config.hidden_size, self.num_heads
        self.gk_down = nn.Linear(d, config.gla_gate_low_rank_dim, bias=False)
        self.gk_up = nn.Linear(config.gla_gate_low_rank_dim, h * self.head_k, bias=True)
        self.g_proj = nn.Linear(d, h * self.head_v, bias=False)
        self.o_norm = GatedRMSNorm(self.head_v, eps=config.rms_norm_eps)

    def forward(self, x, *, mask=None, full_mask=None, cu_seqlens=None, position_ids=None, cache=None):
        b, t, _ = x.shape
        layer_cache = cache[self.layer_idx] if cache is not None else None
        decoding = layer_cache is not None and t == 1
        fused = mask is None and not decoding and tuned("gla_gate", fused=True)["fused"]
        # the five projections' input gradients as the column blocks of one buffer, which the chunk op
        # (dq, dk, dv) and the output norm (the gate's) write into: one input-gradient product and one
        # weight-gradient product for all five (``GradColumns``). Where the chunk op reads q, k and v
        # as given (the gate formed inside it, no mask, not decoding); ``TUNING["gla_columns"] =
        # {"enabled": False}`` takes a product each (for measurement).
        grads = GradColumns() if fused and tuned("gla_columns", enabled=True)["enabled"] else None
        q, k, v, p = self.project_qkv(x, mask=mask, cu_seqlens=cu_seqlens, layer_cache=layer_cache, decoding=decoding,
                                      into=grads)
        grads = grads if grads is not None and grads.ready else None
        cfg = self.config
        gate_map = (cfg.gla_gate_logit_normalizer, cfg.gla_gate_clamp_min)
        logits = linear(p["gk_down"], self.gk_up).view(b, t, self.num_heads, self.head_k)
        gate = p["g_proj"].view(b, t, self.num_heads, self.head_v)
        if fused:
            # the gate formed from its logits inside the chunk op's kernels: no fp32 gate written and
            # read each way (``chunk_gla(gate_logits=)``). A mask zeroes the gate itself (no decay at
            # padding), so masked inputs form it first.
            # shapes, not tensors: the op's node keeps the callable until the graph goes
            shapes = q.shape, k.shape, v.shape
            into = None if grads is None else lambda: tuple(grads.block(i, s) for i, s in enumerate(shapes))
            o = self.run_kernel(functools.partial(chunk_gla, gate_logits=gate_map, grads_into=into), recurrent_gla,
                                q, k, v, logits, layer_cache=layer_cache, decoding=decoding, cu_seqlens=cu_seqlens)
        else:
            k, v, gk = mask_tokens(mask, k, v, gla_gate(logits, *gate_map))
            o = self.run_kernel(chunk_gla, recurrent_gla, q, k, v, gk,
                                layer_cache=layer_cache, decoding=decoding, cu_seqlens=cu_seqlens)
        gate_block, gate_shape = self.input_projections.index("g_proj"), gate.shape
        dz_into = None if grads is None else lambda: grads.block(gate_block, gate_shape)
        return self.output(o, gate, dz_into=dz_into)
