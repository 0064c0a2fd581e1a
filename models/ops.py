"""Lazy entry points into ``ttr.kernels``.

``import ttr`` imports ``ttr.models``; importing the kernel modules pulls in Triton and the
Triton-decorated kernels, which is slow and may fail while a kernel file is being edited. Every
function here imports its kernel module on first call, so the model classes stay importable on
their own and the kernel backend (Triton or torch) is chosen per call by ``ttr.kernels``.
"""

from __future__ import annotations

import importlib


def _kernel(module: str, name: str):
    return getattr(importlib.import_module(f"ttr.kernels.{module}"), name)


def chunk_delta_rule(*args, **kwargs):
    return _kernel("delta", "chunk_delta_rule")(*args, **kwargs)


def recurrent_delta_rule(*args, **kwargs):
    return _kernel("delta", "recurrent_delta_rule")(*args, **kwargs)


def chunk_gated_delta_rule(*args, **kwargs):
    return _kernel("gated_delta", "chunk_gated_delta_rule")(*args, **kwargs)


def recurrent_gated_delta_rule(*args, **kwargs):
    return _kernel("gated_delta", "recurrent_gated_delta_rule")(*args, **kwargs)


def chunk_gla(*args, **kwargs):
    return _kernel("gla", "chunk_gla")(*args, **kwargs)


def recurrent_gla(*args, **kwargs):
    return _kernel("gla", "recurrent_gla")(*args, **kwargs)


def chunk_ssd(*args, **kwargs):
    return _kernel("ssd", "chunk_ssd")(*args, **kwargs)


def recurrent_ssd(*args, **kwargs):
    return _kernel("ssd", "recurrent_ssd")(*args, **kwargs)


def chunk_simple_gla(*args, **kwargs):
    return _kernel("ssd", "chunk_simple_gla")(*args, **kwargs)


def recurrent_simple_gla(*args, **kwargs):
    return _kernel("ssd", "recurrent_simple_gla")(*args, **kwargs)


def attention(*args, **kwargs):
    return _kernel("attention", "attention")(*args, **kwargs)


def causal_conv1d(*args, **kwargs):
    return _kernel("conv", "causal_conv1d")(*args, **kwargs)


def causal_conv1d_update(*args, **kwargs):
    return _kernel("conv", "causal_conv1d_update")(*args, **kwargs)


def l2_norm(*args, **kwargs):
    return _kernel("norm", "l2_norm")(*args, **kwargs)


def swiglu(*args, **kwargs):
    return _kernel("swiglu", "swiglu")(*args, **kwargs)


def rms_norm(*args, **kwargs):
    return _kernel("norm", "rms_norm")(*args, **kwargs)


def gated_rms_norm(*args, **kwargs):
    return _kernel("norm", "gated_rms_norm")(*args, **kwargs)


def linear_cross_entropy(*args, **kwargs):
    return _kernel("loss", "linear_cross_entropy")(*args, **kwargs)
