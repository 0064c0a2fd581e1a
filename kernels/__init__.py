"""Triton kernels and torch references for ttr's mixers.

Each op has ``chunk_<op>`` (training / prefill), ``recurrent_<op>`` (decoding) and
``reference_<op>`` (float64-capable per-token oracle, same signature). The public functions
dispatch on ``ttr.kernels.utils.kernel_backend`` and launch on their first input's GPU. Every op
that takes ``cu_seqlens`` also takes a ``Packing`` (``prepare_packing``), which resolves packed
documents once for all the ops of a forward.
"""

# The checkout's root is the package, so with that root on sys.path (python started there) this
# file is also found as a top-level `kernels`, a name transformers imports to probe for the hub
# package of that name while its own modules are half loaded. Only as ttr.kernels does it import
# the ops; imported as `kernels` from inside transformers they would import ttr and, through it,
# those half-loaded transformers modules.
if __name__ == "ttr.kernels":
    from ttr.kernels.attention import attention, reference_attention
    from ttr.kernels.common.index import Packing, prepare_packing
    from ttr.kernels.conv import causal_conv1d, causal_conv1d_update, reference_causal_conv1d
    from ttr.kernels.delta import chunk_delta_rule, recurrent_delta_rule, reference_delta_rule
    from ttr.kernels.gated_delta import (
        chunk_gated_delta_rule,
        recurrent_gated_delta_rule,
        reference_gated_delta_rule,
    )
    from ttr.kernels.gla import chunk_gla, recurrent_gla, reference_gla
    from ttr.kernels.loss import linear_cross_entropy, reference_linear_cross_entropy
    from ttr.kernels.norm import (
        gated_rms_norm,
        l2_norm,
        reference_gated_rms_norm,
        reference_l2_norm,
        reference_rms_norm,
        rms_norm,
    )
    from ttr.kernels.rotary import reference_rotary, rope_tables, rotary
    from ttr.kernels.ssd import (
        chunk_conv_ssd,
        chunk_simple_gla,
        chunk_ssd,
        recurrent_simple_gla,
        recurrent_ssd,
        reference_conv_ssd,
        reference_simple_gla,
        reference_ssd,
    )
    from ttr.kernels.swiglu import reference_swiglu, swiglu

__all__ = [
    "Packing",
    "attention",
    "causal_conv1d",
    "causal_conv1d_update",
    "chunk_conv_ssd",
    "chunk_delta_rule",
    "chunk_gated_delta_rule",
    "chunk_gla",
    "chunk_simple_gla",
    "chunk_ssd",
    "gated_rms_norm",
    "l2_norm",
    "linear_cross_entropy",
    "prepare_packing",
    "recurrent_delta_rule",
    "recurrent_gated_delta_rule",
    "recurrent_gla",
    "recurrent_simple_gla",
    "recurrent_ssd",
    "reference_attention",
    "reference_causal_conv1d",
    "reference_conv_ssd",
    "reference_delta_rule",
    "reference_gated_delta_rule",
    "reference_gla",
    "reference_gated_rms_norm",
    "reference_l2_norm",
    "reference_linear_cross_entropy",
    "reference_rms_norm",
    "reference_rotary",
    "reference_simple_gla",
    "reference_ssd",
    "reference_swiglu",
    "rms_norm",
    "rope_tables",
    "rotary",
    "swiglu",
]
