"""Causal depthwise short convolution (Mamba / Gated DeltaNet "short conv"), width 2..4.

For every channel ``d`` and token ``t`` of one sequence (W = kernel width)::

    y[t, d] = act( bias[d] + sum_{w=0}^{W-1} weight[d, w] * x[t - (W-1) + w, d] )

Inputs before the start of a sequence are taken from ``initial_state`` (``[N, D, W-1]``, the
last W-1 inputs that preceded the sequence, oldest first) or are zero. In packed input
(``B == 1`` plus ``cu_seqlens``) every document starts afresh: no tap reaches across a boundary.
The final state of a sequence is the last W-1 entries of ``concat(initial_state, x_seq)`` along
time (zeros where neither exists), i.e. exactly the ``initial_state`` that continues it.

Shapes: x ``[B, T, D]``, weight ``[D, W]``, bias ``[D]``, states ``[N, D, W-1]`` with N = B
(or the number of documents when packed); the final state has x's dtype (it holds inputs).
``activation`` is None or ``"silu"``. Arithmetic is fp32 (fp64 for fp64 inputs) in every backend.

``causal_conv1d_update`` is the decoding step: one token ``x [B, D]`` against ``conv_state
[B, D, W-1]``; it returns ``(y [B, D], new_conv_state)`` with the state shifted by one token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ttr.kernels.utils import check_cu_seqlens, check_dtype, check_rank

ACTIVATIONS = (None, "silu")


def _check_inputs(x, weight, bias, activation, cu_seqlens, initial_state) -> int:
    """Validate causal_conv1d's arguments; return the number of sequences N."""
    check_rank("x", x, 3, "[B, T, D]")
    check_dtype("x", x)
    check_rank("weight", weight, 2, "[D, W]")
    check_dtype("weight", weight)
    b, t, d = x.shape
    if weight.shape[0] != d:
        raise ValueError(f"weight must have shape [D, W] with D={d}, got {tuple(weight.shape)}")
    w = weight.shape[1]
    if not 2 <= w <= 4:
        raise ValueError(f"weight width W must be in 2..4, got W={w}")
    if bias is not None:
        check_rank("bias", bias, 1, "[D]")
        check_dtype("bias", bias)
        if bias.shape[0] != d:
            raise ValueError(f"bias must have shape [D] = [{d}], got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    n = check_cu_seqlens(cu_seqlens, b, t)
    if initial_state is not None:
        check_rank("initial_state", initial_state, 3, "[N, D, W-1]")
        check_dtype("initial_state", initial_state)
        if tuple(initial_state.shape) != (n, d, w - 1):
            raise ValueError(
                f"initial_state must have shape [N, D, W-1] = {(n, d, w - 1)}, got {tuple(initial_state.shape)}"
            )
    for name, other in (("weight", weight), ("bias", bias), ("initial_state", initial_state)):
        if other is not None and other.device != x.device:
            raise ValueError(f"{name} is on {other.device} but x is on {x.device}")
    return n


def _seq_bounds(cu_seqlens, b: int, t: int) -> list[tuple[int, int, int]]:
    """(batch row, start, end) of every sequence, in state order."""
    if cu_seqlens is None:
        return [(i, 0, t) for i in range(b)]
    cu = cu_seqlens.tolist()
    return [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def reference_causal_conv1d(
    x, weight, bias=None, *, activation=None, cu_seqlens=None, initial_state=None, output_final_state=False
):
    """Per-token oracle: loops over sequences and tokens; computes in x's dtype promoted to fp32."""
    _check_inputs(x, weight, bias, activation, cu_seqlens, initial_state)
    b, t, d = x.shape
    w = weight.shape[1]
    dt = torch.promote_types(x.dtype, torch.float32)
    y = torch.zeros(b, t, d, dtype=dt, device=x.device)
    final = []
    for i_n, (i_b, bos, eos) in enumerate(_seq_bounds(cu_seqlens, b, t)):
        if initial_state is not None:
            past = initial_state[i_n].to(dt).transpose(0, 1)
        else:
            past = torch.zeros(w - 1, d, dtype=dt, device=x.device)
        seq = torch.cat([past, x[i_b, bos:eos].to(dt)], dim=0)  # [W-1+L, D]
        rows = []
        for i_t in range(eos - bos):
            acc = (seq[i_t : i_t + w] * weight.to(dt).transpose(0, 1)).sum(0)
            if bias is not None:
                acc = acc + bias.to(dt)
            if activation == "silu":
                acc = F.silu(acc)
            rows.append(acc)
        if rows:
            y[i_b, bos:eos] = torch.stack(rows)
        final.append(seq[seq.shape[0] - (w - 1) :].transpose(0, 1))
    y = y.to(x.dtype)
    if not output_final_state:
        return y, None
    return y, torch.stack(final).to(x.dtype)


def _shift_index(cu_seqlens, b: int, t: int, device):
    """For the packed/batched layout, position of every token inside its sequence and its sequence id."""
    if cu_seqlens is None:
        pos = torch.arange(t, device=device).expand(b, t)
        seq = torch.arange(b, device=device)[:, None].expand(b, t)
        return pos, seq
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    tok = torch.arange(t, device=device)
    seq = torch.searchsorted(cu[1:], tok, right=True)[None]  # [1, T]
    pos = tok[None] - cu[seq]  # [1, T]
    return pos, seq


def _torch_causal_conv1d(x, weight, bias, activation, cu_seqlens, initial_state, output_final_state):
    """Vectorised torch version (autograd through gathers)."""
    b, t, d = x.shape
    w = weight.shape[1]
    dt = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(dt)
    wf = weight.to(dt)
    pos, seq = _shift_index(cu_seqlens, b, t, x.device)
    flat = xf.reshape(b * t, d)
    row = torch.arange(b, device=x.device)[:, None] * t + torch.arange(t, device=x.device)[None]  # [B, T]
    acc = xf * wf[:, w - 1]
    for s in range(1, w):
        inside = pos >= s  # [B, T]
        shifted = flat[(row - s).clamp_min(0)]  # [B, T, D]
        if initial_state is not None:
            j = (w - 1 - s + pos).clamp(0, w - 2)
            before = initial_state.to(dt)[seq, :, j]  # [B, T, D]
        else:
            before = torch.zeros((), dtype=dt, device=x.device)
        acc = acc + torch.where(inside[..., None], shifted, before) * wf[:, w - 1 - s]
    if bias is not None:
        acc = acc + bias.to(dt)
    if activation == "silu":
        acc = F.silu(acc)
    y = acc.to(x.dtype)
    if not output_final_state:
        return y, None
    return y, _final_state(x, initial_state, cu_seqlens, w)


def _final_state(x, initial_state, cu_seqlens, w: int) -> torch.Tensor:
    """Last W-1 entries of concat(initial_state, x_seq) per sequence, in x's dtype."""
    b, t, d = x.shape
    bounds = _seq_bounds(cu_seqlens, b, t)
    n = len(bounds)
    if cu_seqlens is None:
        ends = torch.full((n,), t, device=x.device, dtype=torch.long)
        lens = ends.clone()
        rows = torch.arange(n, device=x.device)
    else:
        cu = cu_seqlens.to(device=x.device, dtype=torch.long)
        ends, lens = cu[1:], cu[1:] - cu[:-1]
        rows = torch.zeros(n, dtype=torch.long, device=x.device)
    j = torch.arange(w - 1, device=x.device)  # state slot j holds the input at offset j - (W-1) from the end
    back = (w - 1) - j  # [W-1]: how many tokens before the end
    src_t = ends[:, None] - back[None]  # [N, W-1]
    inside = back[None] <= lens[:, None]
    from_x = x[rows[:, None], src_t.clamp_min(0)]  # [N, W-1, D]
    if initial_state is not None:
        k = (j[None] + lens[:, None]).clamp_max(w - 2)  # slot in the initial state
        from_init = initial_state.to(x.dtype)[torch.arange(n, device=x.device)[:, None], :, k]  # [N, W-1, D]
    else:
        from_init = torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.where(inside[..., None], from_x, from_init).transpose(1, 2).contiguous()


def causal_conv1d(
    x, weight, bias=None, *, activation=None, cu_seqlens=None, initial_state=None, output_final_state=False
):
    """Causal depthwise conv over time; returns ``(y [B, T, D], final_state [N, D, W-1] | None)``.

    Dispatches on ``kernel_backend(x)``.
    """
    _check_inputs(x, weight, bias, activation, cu_seqlens, initial_state)
    return _torch_causal_conv1d(x, weight, bias, activation, cu_seqlens, initial_state, output_final_state)


def _check_update(x, conv_state, weight, bias, activation) -> None:
    check_rank("x", x, 2, "[B, D]")
    check_dtype("x", x)
    check_rank("weight", weight, 2, "[D, W]")
    b, d = x.shape
    if weight.shape[0] != d or not 2 <= weight.shape[1] <= 4:
        raise ValueError(f"weight must have shape [D, W] with D={d}, W in 2..4, got {tuple(weight.shape)}")
    check_rank("conv_state", conv_state, 3, "[B, D, W-1]")
    check_dtype("conv_state", conv_state)
    if tuple(conv_state.shape) != (b, d, weight.shape[1] - 1):
        raise ValueError(
            f"conv_state must have shape [B, D, W-1] = {(b, d, weight.shape[1] - 1)}, got {tuple(conv_state.shape)}"
        )
    if bias is not None:
        check_rank("bias", bias, 1, "[D]")
        if bias.shape[0] != d:
            raise ValueError(f"bias must have shape [D] = [{d}], got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def _torch_causal_conv1d_update(x, conv_state, weight, bias, activation):
    dt = torch.promote_types(x.dtype, torch.float32)
    window = torch.cat([conv_state.to(dt), x.to(dt)[..., None]], dim=-1)  # [B, D, W]
    acc = (window * weight.to(dt)).sum(-1)
    if bias is not None:
        acc = acc + bias.to(dt)
    if activation == "silu":
        acc = F.silu(acc)
    return acc.to(x.dtype), window[..., 1:].to(conv_state.dtype)


def causal_conv1d_update(x, conv_state, weight, bias=None, *, activation=None):
    """One decoding step: ``x [B, D]``, ``conv_state [B, D, W-1]`` -> ``(y [B, D], new_conv_state)``.

    The new state has conv_state's dtype; the input state is not modified.
    """
    _check_update(x, conv_state, weight, bias, activation)
    return _torch_causal_conv1d_update(x, conv_state, weight, bias, activation)
