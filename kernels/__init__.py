"""Triton kernels and torch references for ttr's mixers.

Each op has ``chunk_<op>`` (training / prefill), ``recurrent_<op>`` (decoding) and
``reference_<op>`` (float64-capable per-token oracle, same signature). The public functions
dispatch on ``ttr.kernels.utils.kernel_backend``.
"""
