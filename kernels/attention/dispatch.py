"""Which implementation runs a GPU attention call: ttr's flash kernel or a fused kernel of torch.

Three paths compute the same function (``reference.py`` states it):

* ``"sdpa"``: ``F.scaled_dot_product_attention(is_causal=True)`` with its backends tried in the
  order of ``SDPA_BACKENDS``; plain batches without a window only, since SDPA has no band mask
  other than a dense one.
* ``"varlen"``: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2's variable-length
  kernel), for packed documents and plain batches (one document per row); windows only where the
  installed torch has its ``window_size`` argument (``varlen_api``).
* ``"triton"``: ttr's kernel (``flash.py``), which takes every input.

``ROUTES`` maps the case of a call, (``"full"`` or ``"window"``, ``"plain"`` or ``"packed"``), to
the paths to try in order; the first that supports the input runs. A window at least as long as
the longest sequence is full causal attention and routes as such. The fused paths need a CUDA
tensor in fp16 or bf16 and a head dim that is a multiple of 8 up to 256 (what FlashAttention,
cuDNN and the efficient kernel accept); anything else runs ``"triton"``.

``TTR_ATTENTION=auto|triton`` (read at every call): ``auto`` (default) follows ``ROUTES``,
``triton`` forces ttr's kernel everywhere, for measurement. ``scripts/bench_attention.py`` times
every path per case and prints the table its measurements call for.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ttr.kernels.attention.flash import sequence_plan, triton_attention

PATHS = ("sdpa", "varlen", "triton")
MODES = ("auto", "triton")

# Each case lists its paths fastest first on Hopper, as scripts/bench_attention.py measures them
# (bf16, H = 16, D = 128, 16384 tokens per batch, and the presets' shapes; it prints the table
# its measurements call for). Full causal plain batches go to SDPA, measured ahead of ttr's
# kernel there. A path stays out of a case until it beats the next one at every measured shape,
# since a dispatch that is slower somewhere is worse than none: varlen_attn is the candidate for
# the packed and windowed cases. "triton" ends every list, so each case has a path.
ROUTES: dict[tuple[str, str], tuple[str, ...]] = {
    ("full", "plain"): ("sdpa", "triton"),
    ("full", "packed"): ("triton",),
    ("window", "plain"): ("triton",),
    ("window", "packed"): ("triton",),
}

# SDPA's backends in the order SDPA should try them (``sdpa_kernel(..., set_priority=True)``),
# fastest first on Hopper as the benchmark's SDPA rows rank them: cuDNN leads because its kernels
# use Hopper's asynchronous copies and warpgroup products, which FlashAttention-2 does not.
# FlashAttention and the efficient kernel follow so an input the first one rejects (grouped kv
# heads, some head dims, an older cuDNN) still runs fused, never in the math backend, which
# would materialise the T x T scores.
SDPA_BACKENDS: tuple[SDPBackend, ...] = (
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
)

_FUSED_DTYPES = (torch.float16, torch.bfloat16)


class VarlenAPI(NamedTuple):
    """What the installed ``varlen_attn`` accepts: its first versions have ``is_causal`` and no
    window, scale or grouped kv heads; later ones take ``window_size=(left, right)`` instead."""

    fn: Callable
    window: bool
    gqa: bool
    scale: bool


@functools.cache
def varlen_api() -> VarlenAPI | None:
    """The installed ``varlen_attn`` and its capabilities; None where torch has none, or one whose
    arguments this adapter does not know."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" not in params and "is_causal" not in params:
        return None
    return VarlenAPI(varlen_attn, "window_size" in params, "enable_gqa" in params, "scale" in params)


def attention_mode() -> str:
    mode = os.environ.get("TTR_ATTENTION", "").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"TTR_ATTENTION must be one of {MODES}, got {mode!r}")
    return mode


def fused_ok(q: torch.Tensor) -> bool:
    """Device and dtype the fused kernels of torch take (the tests stand this in for a GPU)."""
    return q.is_cuda and q.dtype in _FUSED_DTYPES


def supports(path: str, q, k, *, full: bool, packed: bool, scale: float) -> bool:
    """Whether ``path`` computes this call exactly (``full``: no window within the sequences)."""
    if path not in PATHS:
        raise ValueError(f"unknown attention path {path!r} in ROUTES; expected one of {PATHS}")
    if path == "triton":
        return True
    d = q.shape[-1]
    if not fused_ok(q) or d % 8 or d > 256:
        return False
    if path == "sdpa":
        return full and not packed
    api = varlen_api()  # path == "varlen"
    if api is None:
        return False
    gqa = q.shape[2] != k.shape[2]
    return (full or api.window) and (not gqa or api.gqa) and (api.scale or scale == d**-0.5)


def choose_path(q, k, *, window, scale, packed: bool, max_len: int) -> str:
    """The first path of this call's ``ROUTES`` entry that supports it (``"triton"`` when forced)."""
    if attention_mode() == "triton":
        return "triton"
    full = window is None or window >= max_len
    for path in ROUTES[("full" if full else "window", "packed" if packed else "plain")]:
        if supports(path, q, k, full=full, packed=packed, scale=scale):
            return path
    return "triton"


def sdpa_causal(q, k, v, scale):
    """Plain batch, full causal: SDPA on ``[B, H, T, D]`` views of ttr's ``[B, T, H, D]``. The
    views cost nothing: FlashAttention and the efficient kernel run on that layout themselves and
    return an output whose transpose back is contiguous.

    Where cuDNN leads ``SDPA_BACKENDS`` and takes the call (SDPA's own test of it), its op is called
    directly, as SDPA would call it: entering and leaving ``sdpa_kernel`` costs about as much host
    time as the rest of the call, and a call with a small input waits on its host."""
    tr = lambda x: x.transpose(1, 2)
    qt, kt, vt = tr(q), tr(k), tr(v)
    if _cudnn_takes(qt, kt, vt):
        lse = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        return tr(_cudnn_op()(qt, kt, vt, None, lse, 0.0, True, False, scale=scale)[0])
    with _sdpa_backends():
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return tr(o)


def _cudnn_op():
    return torch.ops.aten._scaled_dot_product_cudnn_attention


def _cudnn_takes(q, k, v) -> bool:
    """Whether SDPA would run ``[B, H, T, D]`` q, k, v on cuDNN first: cuDNN leads ``SDPA_BACKENDS``
    and accepts them (no grouped kv heads, which it leaves to the others, and not under
    ``torch.use_deterministic_algorithms``, whose backward it does not guarantee)."""
    if SDPA_BACKENDS[0] != SDPBackend.CUDNN_ATTENTION or q.shape[1] != k.shape[1]:
        return False
    if torch.are_deterministic_algorithms_enabled():
        return False
    return torch.backends.cuda.can_use_cudnn_attention(torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, False))


def _sdpa_backends():
    if _has_set_priority():
        return sdpa_kernel(list(SDPA_BACKENDS), set_priority=True)
    return sdpa_kernel(list(SDPA_BACKENDS))


@functools.cache
def _has_set_priority() -> bool:
    return "set_priority" in inspect.signature(sdpa_kernel).parameters


def varlen_causal(q, k, v, cu, max_len, window, scale):
    """Packed documents (``cu`` int32 bounds) or a plain batch (``cu`` None: rows of T tokens)
    through ``varlen_attn``, whose ``window_size = (left, 0)`` lets query t see keys t-left .. t,
    so ttr's window W is ``left = W - 1``."""
    api = varlen_api()
    b, t, hq, d = q.shape
    if cu is None:
        cu = torch.arange(0, (b + 1) * t, t, device=q.device, dtype=torch.int32)
    kw = {}
    if api.window:
        kw["window_size"] = (-1, 0) if window is None or window >= max_len else (window - 1, 0)
    else:
        kw["is_causal"] = True
    if api.scale:
        kw["scale"] = scale
    if hq != k.shape[2]:
        kw["enable_gqa"] = True
    flat = lambda x: x.reshape(b * t, x.shape[2], d)
    o = api.fn(flat(q), flat(k), flat(v), cu, cu, max_len, max_len, **kw)
    return o.view(b, t, hq, d)


def dispatch_attention(q, k, v, *, window, scale, cu_seqlens):
    """Validated GPU-backend inputs (``ttr.kernels.attention.attention``) -> o, by ``choose_path``."""
    b, t = q.shape[:2]
    if b == 0 or t == 0:
        return torch.zeros_like(q)
    plan = sequence_plan(q, cu_seqlens)
    if plan.max_len == 0:
        return torch.zeros_like(q)
    path = choose_path(q, k, window=window, scale=scale, packed=cu_seqlens is not None, max_len=plan.max_len)
    if path == "sdpa":
        return sdpa_causal(q, k, v, scale)
    if path == "varlen":
        return varlen_causal(q, k, v, plan.cu, plan.max_len, window, scale)
    return triton_attention(q, k, v, window=window, scale=scale, cu_seqlens=cu_seqlens, plan=plan)
