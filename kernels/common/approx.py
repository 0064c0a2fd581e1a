"""fp32 exp and sigmoid by the GPU's approximate instructions, without Triton's range checks.

``tl.exp`` lowers to ``ex2.approx.f32`` behind a check that rescales an input whose result would be
denormal (below 2^-126), and ``tl.sigmoid``'s division to ``div.full.f32`` behind one that rescales a
divisor above 2^126: a compare, a select or predicated multiply and a multiply more around every exp
and division, on the dependent path of each. ``ex2.approx.ftz`` gives ``tl.exp``'s results except
there, where it returns zero, and ``div.approx`` is as accurate as ``div.full`` (2 ulp) for divisors
up to 2^126 and returns zero above: a decay below 2^-126 or a sigmoid of an input below -87, which
the kernels never tell apart from zero. Compiled for a GPU (``APPROX``) these helpers take
them; the Triton interpreter has no libdevice and takes ``tl.exp`` and ``tl.sigmoid``, so the GPU
tests are what check this arithmetic.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice

from ttr.kernels.utils import interpreter_active

APPROX = tl.constexpr(not interpreter_active())


@triton.jit
def fast_exp(x):
    """exp(x) of fp32 x, 0 where the result would be denormal."""
    if APPROX:
        return libdevice.fast_expf(x)
    else:
        return tl.exp(x)


@triton.jit
def fast_sigmoid(x):
    """1 / (1 + exp(-x)) of fp32 x."""
    if APPROX:
        return libdevice.fast_dividef(1.0, 1.0 + libdevice.fast_expf(-x))
    else:
        return tl.sigmoid(x)
