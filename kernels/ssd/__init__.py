"""Scalar-decay linear attention: simple GLA and Mamba2's SSD form (x, dt, A, B, C with groups).

``chunk_simple_gla`` / ``recurrent_simple_gla`` / ``reference_simple_gla`` and ``chunk_ssd`` /
``recurrent_ssd`` / ``reference_ssd``; each triple shares one signature. ``chunk_conv_ssd`` /
``reference_conv_ssd``: Mamba2's short conv over xBC followed by SSD, fused for training.
"""

from ttr.kernels.ssd.chunk import chunk_conv_ssd, chunk_simple_gla, chunk_ssd
from ttr.kernels.ssd.recurrent import recurrent_simple_gla, recurrent_ssd
from ttr.kernels.ssd.reference import reference_conv_ssd, reference_simple_gla, reference_ssd

__all__ = [
    "chunk_conv_ssd",
    "chunk_simple_gla",
    "chunk_ssd",
    "recurrent_simple_gla",
    "recurrent_ssd",
    "reference_conv_ssd",
    "reference_simple_gla",
    "reference_ssd",
]
