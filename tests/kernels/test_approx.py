"""``kernels.common.approx``: the GPU's approximate exp and sigmoid against torch's, and the
interpreter's fallback to ``tl.exp`` / ``tl.sigmoid``."""

import pytest
import torch
import triton
import triton.language as tl

from ttr.kernels.common import approx
from ttr.kernels.common.approx import fast_exp, fast_sigmoid
from ttr.kernels.utils import interpreter_active

from .conftest import DEVICE


@triton.jit
def _both_kernel(x, e, s, N: tl.constexpr):
    o = tl.arange(0, N)
    b_x = tl.load(x + o)
    tl.store(e + o, fast_exp(b_x))
    tl.store(s + o, fast_sigmoid(b_x))


def both(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    e, s = torch.empty_like(x), torch.empty_like(x)
    _both_kernel[(1,)](x, e, s, N=x.numel())
    return e, s


def inputs() -> torch.Tensor:
    # the gates' and activations' range, the edges of fp32's exponent, and the infinities
    x = torch.cat([torch.linspace(-100.0, 88.0, 4090), torch.tensor([-87.4, -87.3, 0.0, -0.0])])
    return torch.cat([x, torch.tensor([float("-inf"), float("inf")])]).to(DEVICE)


def check_interpreter(x, e, s):
    """The interpreter's branch: ``tl.exp`` and ``tl.sigmoid``, torch's results."""
    assert torch.allclose(e, torch.exp(x), rtol=1e-6, atol=0)
    assert torch.allclose(s, torch.sigmoid(x), rtol=1e-6, atol=1e-7)


def check_gpu(x, e, s):
    """The GPU's branch: ``ex2.approx.ftz`` and ``div.approx``."""
    ref_e, ref_s = torch.exp(x.double()), torch.sigmoid(x.double())
    normal = (ref_e >= 2.0**-126) & torch.isfinite(x)
    # exp: where the result is a normal number, the error of rounding x log2(e) to fp32 (up to 2.6e-6
    # of the result at |x| = 88) and a few ulp of ex2's; zero below it
    assert ((e.double() - ref_e).abs() <= 1e-5 * ref_e)[normal].all()
    assert (e[ref_e < 2.0**-126] == 0).all()
    assert e[-1] == float("inf")
    # sigmoid: within a few ulp of 1, exactly 0 and 1 at the infinities, never NaN
    assert (s.double() - ref_s).abs().max() < 1e-6
    assert s[-2] == 0 and s[-1] == 1 and torch.isfinite(s).all()


# the CPU suite runs the interpreter's branch, the GPU suite (-m gpu) the compiled one; each run
# checks the branch its build takes
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # numpy's sigmoid at -inf
@pytest.mark.parametrize("suite", ["any", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_fast_exp_and_sigmoid_match_their_branch(suite):
    assert approx.APPROX == (not interpreter_active())
    x = inputs()
    e, s = both(x)
    (check_gpu if approx.APPROX else check_interpreter)(x, e, s)
