"""Gated DeltaNet's gates from their projections (``gated_delta_gate``): both backends against the
float64 torch expression (values and the gradients of all four inputs), heads that are not a
power of two, projections read in place from a wider product, beta scaled by 2, low-precision
projections, bad input; the GPU case in bf16."""

import pytest
import torch

from ttr.kernels.gated_delta.gate import gated_delta_gate, reference_gated_delta_gate

from .conftest import DEVICE, rel_rms


def inputs(shape, dtype=torch.float32, wide=False):
    torch.manual_seed(0)
    h = shape[-1]
    # both branches of the softplus; A in [1, 16] and dt_bias from steps in [1e-3, 0.1], as initialised
    ab = 3 * torch.randn(*shape[:-1], 3 * h if wide else 2 * h, device=DEVICE)
    a, b = (ab[..., :h], ab[..., 2 * h:]) if wide else ab.split(h, -1)
    A_log = torch.empty(h, device=DEVICE).uniform_(1, 16).log()
    dt = torch.exp(torch.empty(h, device=DEVICE).uniform_(-6.9, -2.3))
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    return a.to(dtype), b.to(dtype), A_log, dt_bias


def check(a, b, A_log, dt_bias, beta_scale, tol):
    xs = [x.detach().clone().requires_grad_() for x in (a, b, A_log, dt_bias)]
    g, beta = gated_delta_gate(*xs, beta_scale)
    dg, dbeta = torch.randn_like(g, dtype=torch.float64), torch.randn_like(beta, dtype=torch.float64)
    grads = torch.autograd.grad((g, beta), xs, (dg.float(), dbeta.float()))
    refs = [x.detach().double().requires_grad_() for x in (a, b, A_log, dt_bias)]
    g_ref, beta_ref = reference_gated_delta_gate(*refs, beta_scale)
    grads_ref = torch.autograd.grad((g_ref, beta_ref), refs, (dg, dbeta))
    assert g.dtype == beta.dtype == torch.float32 and g.shape == beta.shape == a.shape
    assert rel_rms(g, g_ref) < tol and rel_rms(beta, beta_ref) < tol
    for x, d, d_ref in zip(xs, grads, grads_ref):
        assert d.dtype == x.dtype and d.shape == x.shape
        assert rel_rms(d, d_ref) < tol


@pytest.mark.parametrize("beta_scale", [1.0, 2.0])
@pytest.mark.parametrize("shape", [(1,), (3, 700, 16), (2, 5, 7)])
def test_gated_delta_gate(backend, shape, beta_scale):
    check(*inputs(shape), beta_scale, 1e-6)


def test_gated_delta_gate_views_of_a_wider_product(backend):
    """a and b as column views of one product (the layer's merged narrow projections)."""
    a, b, A_log, dt_bias = inputs((2, 300, 16), wide=True)
    assert not a.is_contiguous() and not b.is_contiguous()
    check(a, b, A_log, dt_bias, 1.0, 1e-6)


def test_gated_delta_gate_half_projections(backend):
    check(*inputs((4, 333, 16), torch.bfloat16), 1.0, 1e-2)


def test_gated_delta_gate_empty(backend):
    a, b, A_log, dt_bias = inputs((0, 16))
    g, beta = gated_delta_gate(a, b, A_log, dt_bias)
    assert g.shape == beta.shape == (0, 16)


def test_gated_delta_gate_bad_inputs():
    a, b, A_log, dt_bias = inputs((3, 8))
    with pytest.raises(ValueError, match="b must have a's shape"):
        gated_delta_gate(a, b[:, :4], A_log, dt_bias)
    with pytest.raises(ValueError, match="A_log must be"):
        gated_delta_gate(a, b, A_log[:4], dt_bias)
    with pytest.raises(ValueError, match="dt_bias must be"):
        gated_delta_gate(a, b, A_log, dt_bias[None])
    with pytest.raises(TypeError, match="a has unsupported dtype"):
        gated_delta_gate(a.long(), b, A_log, dt_bias)
    with pytest.raises(ValueError, match="scalar"):
        gated_delta_gate(a[0, 0], b[0, 0], A_log, dt_bias)


@pytest.mark.gpu
def test_gpu_gated_delta_gate(monkeypatch):
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    a, b, A_log, dt_bias = inputs((8, 4096, 16), torch.bfloat16, wide=True)
    check(a, b, A_log, dt_bias, 1.0, 1e-2)
    check(a, b, A_log, dt_bias, 2.0, 1e-2)
