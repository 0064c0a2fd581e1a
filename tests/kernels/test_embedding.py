"""The token embedding's lookup and its table gradient (``kernels.embedding``): both backends against
float64, frequent ids, the padding row, strided and low-precision gradients, the same bits on every
run, bad input; the GPU case in bf16 at a preset's shape."""

import pytest
import torch
import torch.nn.functional as F

from ttr.kernels.embedding import embedding, embedding_weight_grad

from .conftest import DEVICE, rel_rms


def ids_with_a_frequent_one(rows, n, generator=None):
    """``n`` ids in ``[0, rows)``, a third of them one id: a run longer than one step of the kernel."""
    ids = torch.randint(0, rows, (n,), generator=generator)
    ids[torch.randperm(n, generator=generator)[: n // 3]] = rows // 2
    return ids.to(DEVICE)


def check(weight, ids, dy, padding_idx=None, tol=1e-6):
    w = weight.detach().clone().requires_grad_()
    y = embedding(w, ids, padding_idx)
    (dw,) = torch.autograd.grad(y, w, dy.to(y.dtype))
    w64 = weight.detach().double().requires_grad_()
    pad = None if padding_idx is None else padding_idx % weight.shape[0]
    y64 = F.embedding(ids, w64, pad)
    (dw64,) = torch.autograd.grad(y64, w64, dy.double())
    assert y.dtype == weight.dtype and y.shape == (*ids.shape, weight.shape[1])
    assert torch.equal(y.double(), y64)
    assert dw.dtype == weight.dtype and dw.shape == weight.shape
    assert rel_rms(dw, dw64) < tol
    return dw


@pytest.mark.parametrize("rows,d,shape", [(50, 300, (3, 33)), (7, 64, (200,)), (1000, 513, (2, 5)), (3, 1, (4,))])
def test_embedding_against_float64(backend, rows, d, shape):
    torch.manual_seed(0)
    ids = ids_with_a_frequent_one(rows, int(torch.tensor(shape).prod())).view(shape)
    check(torch.randn(rows, d, device=DEVICE), ids, torch.randn(*shape, d, device=DEVICE))


@pytest.mark.parametrize("padding_idx", [0, 3, -1])
def test_embedding_padding_row_gets_no_gradient(backend, padding_idx):
    torch.manual_seed(1)
    ids = torch.tensor([[0, 3, 6, 3, 0, 6, 6, 2]], device=DEVICE)
    dw = check(torch.randn(7, 40, device=DEVICE), ids, torch.randn(1, 8, 40, device=DEVICE), padding_idx)
    assert not dw[padding_idx].any()
    assert dw[[i for i in range(7) if i not in (1, 4, 5, padding_idx % 7)]].abs().sum(-1).all()
    assert not dw[[1, 4, 5]].any()


def test_embedding_gradient_strided_and_low_precision(backend):
    """A gradient that is a transposed view, and one in bf16 for a bf16 table: fp32 sums, rounded once."""
    torch.manual_seed(2)
    ids = ids_with_a_frequent_one(90, 60).view(6, 10)
    check(torch.randn(90, 130, device=DEVICE), ids, torch.randn(10, 6, 130, device=DEVICE).transpose(0, 1))
    check(torch.randn(90, 130, device=DEVICE).bfloat16(), ids, torch.randn(6, 10, 130, device=DEVICE), tol=4e-3)


def test_embedding_gradient_is_the_same_bits_each_run(backend):
    torch.manual_seed(3)
    ids = ids_with_a_frequent_one(20, 400)
    dy = torch.randn(400, 96, device=DEVICE)
    first = embedding_weight_grad(ids, dy, 20, torch.float32)
    assert torch.equal(first, embedding_weight_grad(ids, dy, 20, torch.float32))
    assert rel_rms(first, torch.zeros(20, 96, dtype=torch.float64).index_add_(0, ids.cpu(), dy.double().cpu())) < 1e-6


def test_embedding_without_gradient_and_empty_ids(backend):
    w = torch.randn(9, 16, device=DEVICE)
    ids = torch.tensor([[1, 8, 1]], device=DEVICE)
    assert torch.equal(embedding(w, ids), F.embedding(ids, w))
    w.requires_grad_()
    empty = torch.empty(2, 0, dtype=torch.long, device=DEVICE)
    y = embedding(w, empty)
    assert y.shape == (2, 0, 16)
    y.sum().backward()
    assert w.grad is not None and not w.grad.any()


def test_embedding_bad_inputs():
    w = torch.randn(5, 4, requires_grad=True)
    with pytest.raises(TypeError, match="ids"):
        embedding(w, torch.ones(3))
    with pytest.raises(TypeError, match="ids"):
        embedding(w, torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="weight"):
        embedding(torch.randn(5, 4, 2), torch.ones(3, dtype=torch.long))
    with pytest.raises(TypeError, match="weight"):
        embedding(torch.ones(5, 4, dtype=torch.long), torch.ones(3, dtype=torch.long))
    with pytest.raises(ValueError, match="padding_idx"):
        embedding(w, torch.ones(3, dtype=torch.long), padding_idx=5)


@pytest.mark.gpu
def test_gpu_embedding_at_a_presets_shape(monkeypatch):
    """A 32,000-row table of 2048 values (fp32, as autocast leaves it) and B = 8, T = 4096 ids with a
    frequent one, the gradient from bf16-rounded values in fp32: against float64, and the same bits on
    a second run; a bf16 table too."""
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    torch.manual_seed(4)
    ids = ids_with_a_frequent_one(32000, 8 * 4096).view(8, 4096)
    dy = torch.randn(8, 4096, 2048, device="cuda").bfloat16().float()
    first = check(torch.randn(32000, 2048, device="cuda"), ids, dy)
    assert torch.equal(first, embedding_weight_grad(ids, dy, 32000, torch.float32))
    check(torch.randn(32000, 2048, device="cuda").bfloat16(), ids, dy, tol=4e-3)
