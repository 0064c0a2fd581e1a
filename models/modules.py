"""Building blocks shared by the layers: norms, SwiGLU MLP, rotary embedding, short conv."""

from __future__ import annotations

import math

import torch
from torch import nn

from ttr.kernels.conv import causal_conv1d, causal_conv1d_update
from ttr.kernels.norm import gated_rms_norm, l2_norm, rms_norm
from ttr.kernels.swiglu import swiglu


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype of x's device type when autocast is on there, else None."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467) through ``ttr.kernels.norm``."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under autocast the output is in the autocast dtype: every consumer of a pre-norm is a
        # projection that would cast it anyway, once per projection (six in Gated DeltaNet).
        return rms_norm(x, self.weight, eps=self.eps, out_dtype=autocast_dtype(x))


class GatedRMSNorm(nn.Module):
    """``rms_norm(x) * weight * silu(z)``: the output gate of GLA / Gated DeltaNet heads."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, z, self.weight, eps=self.eps)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` (Shazeer 2020, arXiv:2002.05202)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.down_proj._residual_out = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """L2-normalise the last dim (DeltaNet's q/k normalisation, Yang et al. 2024, arXiv:2406.06484)."""
    return l2_norm(x, eps=eps)


def apply_rotary(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021, arXiv:2104.09864), rotate-half layout.

    x ``[B, T, H, D]``, position_ids ``[B, T]`` (or ``[1, T]``); computed in fp32.
    """
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    angles = position_ids.to(torch.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, :, None]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, :, None]
    xf = x.float()
    rotated = torch.cat([-xf[..., d // 2 :], xf[..., : d // 2]], -1)
    return (xf * cos + rotated * sin).to(x.dtype)


class ShortConv(nn.Module):
    """Depthwise causal convolution of width ``W`` with SiLU, through ``ttr.kernels.conv``.

    The short convolution of Mamba (Gu & Dao 2023, arXiv:2312.00752) that DeltaNet and Gated
    DeltaNet put on q, k and v. ``mask`` ``[B, T]`` zeroes padded inputs so they never enter a
    conv state; ``cu_seqlens`` keeps documents apart.
    """

    def __init__(self, dim: int, width: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, width))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def init_conv_weights(self, init) -> None:
        # nn.Conv1d's default for a depthwise kernel: fan_in = width.
        bound = 1.0 / math.sqrt(self.weight.shape[1])
        init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            init.zeros_(self.bias)

    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
        decoding: bool = False,
        output_final_state: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if mask is not None:
            x = x * mask[..., None].to(x.dtype)
        if decoding:
            if state is None:
                state = x.new_zeros(x.shape[0], x.shape[2], self.weight.shape[1] - 1)
            y, new_state = causal_conv1d_update(x[:, 0], state, self.weight, self.bias, activation="silu")
            return y[:, None], new_state
        return causal_conv1d(
            x,
            self.weight,
            self.bias,
            activation="silu",
            cu_seqlens=cu_seqlens,
            initial_state=state,
            output_final_state=output_final_state,
        )


def mask_tokens(mask: torch.Tensor | None, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Zero every tensor ``[B, T, ...]`` at padded positions (``mask[b, t] == 0``)."""
    if mask is None:
        return tensors
    out = []
    for t in tensors:
        m = mask.view(*mask.shape, *([1] * (t.dim() - 2))).to(t.dtype)
        out.append(t * m)
    return tuple(out)


def run_short_convs(
    convs: list[ShortConv],
    xs: list[torch.Tensor],
    *,
    mask: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    layer_cache: dict | None,
    decoding: bool,
) -> list[torch.Tensor]:
    """Apply ``convs[i]`` to ``xs[i]``, reading and writing the conv states in ``layer_cache``."""
    states = layer_cache.get("conv") if layer_cache is not None else None
    ys, new_states = [], []
    for i, (conv, x) in enumerate(zip(convs, xs)):
        y, state = conv(
            x,
            mask=mask,
            cu_seqlens=cu_seqlens,
            state=None if states is None else states[i],
            decoding=decoding,
            output_final_state=layer_cache is not None,
        )
        ys.append(y)
        new_states.append(state)
    if layer_cache is not None:
        layer_cache["conv"] = tuple(new_states)
    return ys


def init_time_step_bias(dt_bias: torch.Tensor, dt_min: float, dt_max: float, floor: float, init) -> None:
    """``dt_bias = softplus^-1(dt)`` with ``dt`` log-uniform in [dt_min, dt_max] (Gu & Dao 2023,
    arXiv:2312.00752, Sec. 3.6; reused by Mamba2 and Gated DeltaNet)."""
    u = torch.rand(dt_bias.shape, dtype=torch.float32, device=dt_bias.device)
    dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=floor)
    init.copy_(dt_bias, dt + torch.log(-torch.expm1(-dt)))
