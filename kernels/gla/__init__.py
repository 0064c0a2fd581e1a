"""Gated linear attention (GLA) with a per-key-dimension log gate ``g [B, T, H, K]``.

``chunk_gla`` (training / prefill), ``recurrent_gla`` (decoding), ``reference_gla`` (the
float64-capable per-token oracle); identical signatures.
"""

from ttr.kernels.gla.chunk import chunk_gla
from ttr.kernels.gla.recurrent import recurrent_gla
from ttr.kernels.gla.reference import reference_gla

__all__ = ["chunk_gla", "recurrent_gla", "reference_gla"]
