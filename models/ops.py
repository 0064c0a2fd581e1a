"""Lazy entry points into ``ttr.kernels``.

``import ttr`` imports ``ttr.models``; importing the kernel modules pulls in Triton and the
Triton-decorated kernels, which is slow and may fail while a kernel file is being edited. Every
function here imports its kernel module on first call, so the model classes stay importable on
their own and the kernel backend (Triton or torch) is chosen per call by ``ttr.kernels``.
"""

from __future__ import annotations

import importlib

import torch


def _kernel(module: str, name: str):
    return getattr(importlib.import_module(f"ttr.kernels.{module}"), name)


def _call(module: str, name: str, args, kwargs):
    """Run the kernel with its first tensor's GPU as the current device: Triton launches on the
    current device, so a model on ``cuda:1`` called while ``cuda:0`` is current would otherwise
    run its forward kernels on the wrong GPU (autograd already runs the backward on the tensors'
    device)."""
    fn = _kernel(module, name)
    t = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if t is not None and t.is_cuda and t.device.index != torch.cuda.current_device():
        with torch.cuda.device(t.device):
            return fn(*args, **kwargs)
    return fn(*args, **kwargs)


def chunk_delta_rule(*args, **kwargs):
    return _call("delta", "chunk_delta_rule", args, kwargs)


def recurrent_delta_rule(*args, **kwargs):
    return _call("delta", "recurrent_delta_rule", args, kwargs)


def chunk_gated_delta_rule(*args, **kwargs):
    return _call("gated_delta", "chunk_gated_delta_rule", args, kwargs)


def recurrent_gated_delta_rule(*args, **kwargs):
    return _call("gated_delta", "recurrent_gated_delta_rule", args, kwargs)


def chunk_gla(*args, **kwargs):
    return _call("gla", "chunk_gla", args, kwargs)


def recurrent_gla(*args, **kwargs):
    return _call("gla", "recurrent_gla", args, kwargs)


def chunk_ssd(*args, **kwargs):
    return _call("ssd", "chunk_ssd", args, kwargs)


def chunk_conv_ssd(*args, **kwargs):
    return _call("ssd", "chunk_conv_ssd", args, kwargs)


def recurrent_ssd(*args, **kwargs):
    return _call("ssd", "recurrent_ssd", args, kwargs)


def chunk_simple_gla(*args, **kwargs):
    return _call("ssd", "chunk_simple_gla", args, kwargs)


def recurrent_simple_gla(*args, **kwargs):
    return _call("ssd", "recurrent_simple_gla", args, kwargs)


def attention(*args, **kwargs):
    return _call("attention", "attention", args, kwargs)


def causal_conv1d(*args, **kwargs):
    return _call("conv", "causal_conv1d", args, kwargs)


def causal_conv1d_update(*args, **kwargs):
    return _call("conv", "causal_conv1d_update", args, kwargs)


def l2_norm(*args, **kwargs):
    return _call("norm", "l2_norm", args, kwargs)


def swiglu(*args, **kwargs):
    return _call("swiglu", "swiglu", args, kwargs)


def rms_norm(*args, **kwargs):
    return _call("norm", "rms_norm", args, kwargs)


def gated_rms_norm(*args, **kwargs):
    return _call("norm", "gated_rms_norm", args, kwargs)


def linear_cross_entropy(*args, **kwargs):
    return _call("loss", "linear_cross_entropy", args, kwargs)
