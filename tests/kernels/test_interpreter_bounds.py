"""The interpreter's bounds check (``tests/interpreter_bounds.py``) is on wherever kernels are
interpreted, and catches a read one element before a tensor, masked-off pointers aside."""

import interpreter_bounds
import pytest
import torch
import triton
import triton.language as tl

from ttr.kernels.utils import interpreter_active


@triton.jit
def _shift_kernel(x, y, n, SHIFT: tl.constexpr, MASKED: tl.constexpr, B: tl.constexpr):
    o = tl.arange(0, B)
    src = o - SHIFT
    m = (o < n) & (src >= 0) if MASKED else o < n
    tl.store(y + o, tl.load(x + src, mask=m, other=0.0), mask=o < n)


@pytest.mark.parametrize("shift, masked, inside", [(0, False, True), (1, True, True), (1, False, False)])
def test_bounds_check(shift, masked, inside):
    assert interpreter_bounds.INSTALLED == interpreter_active()
    if not interpreter_bounds.INSTALLED:
        return  # compiled kernels: nothing to check here
    buf = torch.arange(20, dtype=torch.float32)
    x, y = buf[4:12], torch.zeros(8)  # x a view: buf[3], before it, is memory but not x's
    run = lambda: _shift_kernel[(1,)](x, y, 8, SHIFT=shift, MASKED=masked, B=8)  # noqa: E731
    if inside:
        run()
        assert torch.equal(y, torch.cat([torch.zeros(shift), x[: 8 - shift]]))
    else:
        with pytest.raises(Exception, match="_shift_kernel: load of 1 element"):
            run()
