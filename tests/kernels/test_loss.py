"""Fused linear cross-entropy: every backend against F.cross_entropy on full float64 logits.

Loss and the grads of hidden, weight and bias; ignore_index rows, reductions mean/sum, chunk
sizes that do not divide the token count, vocab sizes that are not powers of two, all-ignored
batches, autocast. The "triton" backend runs the CE kernel (interpreter on CPU, fp32).
"""

import pytest
import torch
import torch.nn.functional as F

from ttr.kernels.loss import linear_cross_entropy, reference_linear_cross_entropy

from .conftest import DEVICE, rel_rms

TOL = 1e-5
def unfused(hidden, weight, labels, *, bias=None, ignore_index=-100, reduction="mean"):
    return F.cross_entropy(
        F.linear(hidden, weight, bias), labels, ignore_index=ignore_index, reduction=reduction
    )


def run(fn, tensors, labels, upcast, grad_scale=1.7, **kw):
    leaves = [None if t is None else (t.detach().double() if upcast else t.detach().clone()) for t in tensors]
    for t in leaves:
        if t is not None:
            t.requires_grad_()
    loss = fn(leaves[0], leaves[1], labels, bias=leaves[2], **kw)
    (loss * grad_scale).backward()
    return loss, [None if t is None else t.grad for t in leaves]


def make(n, d, v, bias=True, ignore_every=3, dtype=torch.float32):
    hidden = torch.randn(n, d, device=DEVICE, dtype=dtype)
    weight = torch.randn(v, d, device=DEVICE, dtype=dtype) / d**0.5
    b = torch.randn(v, device=DEVICE, dtype=dtype) if bias else None
    labels = torch.randint(0, v, (n,), device=DEVICE)
    if ignore_every:
        labels[::ignore_every] = -100
    return (hidden, weight, b), labels


def check(tensors, labels, tol=TOL, **kw):
    loss, grads = run(linear_cross_entropy, tensors, labels, upcast=False, **kw)
    kw.pop("chunk_size", None)
    want, grads_want = run(unfused, tensors, labels, upcast=True, **kw)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert abs(loss.item() - want.item()) <= tol * max(1.0, abs(want.item())), (loss.item(), want.item())
    for name, g, r, t in zip(("dhidden", "dweight", "dbias"), grads, grads_want, tensors):
        if t is None:
            continue
        assert g.dtype == t.dtype and g.shape == t.shape, name
        assert rel_rms(g, r) < tol, f"{name}: {rel_rms(g, r)}"


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_size", [None, 7, 16, 1000])
def test_against_cross_entropy(backend, reduction, chunk_size):
    tensors, labels = make(45, 24, 101)
    check(tensors, labels, reduction=reduction, chunk_size=chunk_size)


@pytest.mark.parametrize("v", [1, 50, 4099])
def test_vocab_sizes(backend, v):
    """4099 > the kernel's vocab block (4096): two passes over several blocks."""
    tensors, labels = make(9, 16, v, bias=False, ignore_every=4)
    check(tensors, labels, chunk_size=4)


def test_custom_ignore_index(backend):
    tensors, labels = make(20, 8, 33, ignore_every=0)
    labels[::2] = 5
    check(tensors, labels, ignore_index=5)


def test_reference_matches_cross_entropy():
    tensors, labels = make(30, 8, 17)
    h, w, b = (t.double() for t in tensors)
    for reduction in ("mean", "sum"):
        got = reference_linear_cross_entropy(h, w, labels, bias=b, reduction=reduction)
        assert torch.allclose(got, unfused(h, w, labels, bias=b, reduction=reduction))


def test_all_ignored_gives_zero_not_nan(backend):
    tensors, labels = make(6, 8, 11, ignore_every=1)
    loss, grads = run(linear_cross_entropy, tensors, labels, upcast=False)
    assert loss.item() == 0.0
    for g in grads:
        assert torch.equal(g, torch.zeros_like(g))
    ref = reference_linear_cross_entropy(*tensors[:2], labels, bias=tensors[2])
    assert ref.item() == 0.0


def test_no_grad_needed(backend):
    tensors, labels = make(12, 8, 19)
    with torch.no_grad():
        loss = linear_cross_entropy(tensors[0], tensors[1], labels, bias=tensors[2], chunk_size=5)
    want = reference_linear_cross_entropy(
        *(t.double() for t in tensors[:2]), labels, bias=tensors[2].double()
    )
    assert abs(loss.item() - want.item()) < TOL * want.item()


def test_only_weight_requires_grad(backend):
    (h, w, _), labels = make(10, 8, 13, bias=False)
    w = w.clone().requires_grad_()
    linear_cross_entropy(h, w, labels, chunk_size=3).backward()
    w64 = w.detach().double().requires_grad_()
    unfused(h.double(), w64, labels).backward()
    assert rel_rms(w.grad, w64.grad) < TOL


def test_autocast_casts_like_linear(backend):
    """Under autocast (bf16 on CPU) hidden/weight are cast first; grads reach the fp32 leaves."""
    tensors, labels = make(16, 32, 40, bias=False)
    h, w = (t.clone().requires_grad_() for t in tensors[:2])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, w, labels, chunk_size=5)
    loss.backward()
    assert loss.dtype == torch.float32 and h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    h64, w64 = (t.detach().to(torch.bfloat16).double().requires_grad_() for t in tensors[:2])
    want = unfused(h64, w64, labels)
    want.backward()
    assert abs(loss.item() - want.item()) < 2e-2 * want.item()
    assert rel_rms(h.grad, h64.grad) < 2e-2
    assert rel_rms(w.grad, w64.grad) < 2e-2


def test_autocast_weight_grad_from_fp32_accumulator(backend):
    """Under autocast the fp32 weight's gradient comes from the fp32 accumulator the chunks' products
    add into, not rounded to bf16 per chunk or at the end: on the torch backend it equals, to fp32
    rounding, the float64 sum over tokens of the op's own bf16 ``softmax - onehot`` times h."""
    torch.manual_seed(0)
    (h, w, _), labels = make(64, 32, 40, bias=False)
    h, w = h.requires_grad_(), w.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        linear_cross_entropy(h, w, labels, chunk_size=5).backward()
    assert w.grad.dtype == torch.float32
    assert not torch.equal(w.grad.bfloat16().float(), w.grad)  # not rounded to bf16 on the way
    if backend != "torch":
        return  # the interpreter truncates the CE kernel's bf16 stores rather than rounding them
    hb = h.detach().bfloat16()
    valid = labels != -100
    dz = torch.softmax((hb @ w.detach().bfloat16().t()).float(), -1)
    dz[torch.arange(len(labels))[valid], labels[valid]] -= 1
    dz[~valid] = 0
    want = dz.bfloat16().double().t() @ hb.double() / valid.sum()
    assert rel_rms(w.grad.double(), want) < 1e-6


def test_fp16_grads_survive_loss_scale(backend):
    """softmax / n_valid (~6e-7 here) is subnormal in fp16; the 1/n_valid is applied together with
    grad_output (a loss scale of 2**16), so the fp16 grads keep their precision."""
    tensors, labels = make(200, 16, 8200, bias=False, ignore_every=0, dtype=torch.float16)
    loss, grads = run(linear_cross_entropy, tensors, labels, upcast=False, grad_scale=2.0**16, chunk_size=128)
    want, grads_want = run(unfused, tensors, labels, upcast=True, grad_scale=2.0**16)
    assert abs(loss.item() - want.item()) < 1e-3 * want.item()
    for name, g, r in zip(("dhidden", "dweight"), grads, grads_want):
        assert g.dtype == torch.float16
        assert rel_rms(g, r) < 5e-3, f"{name}: {rel_rms(g, r)}"


def test_bad_inputs():
    (h, w, b), labels = make(4, 8, 10)
    with pytest.raises(ValueError, match="labels"):
        linear_cross_entropy(h, w, labels.clamp_min(0) + 10)
    with pytest.raises(ValueError, match="labels"):
        linear_cross_entropy(h, w, labels[:3])
    with pytest.raises(TypeError, match="labels"):
        linear_cross_entropy(h, w, labels.float())
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(h, w[:, :7], labels)
    with pytest.raises(ValueError, match="hidden"):
        linear_cross_entropy(h[None], w, labels)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(h, w, labels, reduction="none")
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(h, w, labels, chunk_size=0)
    with pytest.raises(ValueError, match="bias"):
        linear_cross_entropy(h, w, labels, bias=b[:5])
    with pytest.raises(TypeError, match="dtype"):
        linear_cross_entropy(h.double(), w, labels)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_loss_gpu(monkeypatch, dtype):
    """Real sizes: 8192 tokens, hidden 2048, vocab 32000, chunks that do not divide the tokens."""
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    tol = 5e-3 if dtype == torch.float32 else 1e-2
    tensors, labels = make(8192, 2048, 32000, bias=False, ignore_every=7, dtype=dtype)
    loss, grads = run(linear_cross_entropy, tensors, labels, upcast=False, chunk_size=3000)
    want, grads_want = run(
        unfused, [t.float() if t is not None else None for t in tensors], labels, upcast=True
    )
    assert abs(loss.item() - want.item()) < tol * want.item()
    for name, g, r in zip(("dhidden", "dweight"), grads, grads_want):
        assert g.dtype == dtype
        assert rel_rms(g, r) < tol, f"{name}: {rel_rms(g, r)}"


def _peak_bytes(fn, *args):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(*args).backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.gpu
def test_loss_gpu_peak_memory_quarter_of_unfused(monkeypatch):
    """At the 1.3B presets' size (32768 tokens, hidden 2048, vocab 32000, bf16) the fused loss peaks
    at a quarter of the unfused path's memory or less: the point of fusing it."""
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    (h, w, _), labels = make(32768, 2048, 32000, bias=False, ignore_every=0, dtype=torch.bfloat16)
    h.requires_grad_()
    w.requires_grad_()
    unfused_peak = _peak_bytes(unfused, h, w, labels)
    h.grad = w.grad = None
    fused_peak = _peak_bytes(linear_cross_entropy, h, w, labels)
    assert fused_peak <= unfused_peak / 4, (fused_peak / 2**30, unfused_peak / 2**30)


@pytest.mark.gpu
def test_loss_gpu_autocast(monkeypatch):
    """bf16 autocast with fp32 leaves: grads come back in fp32 and match the bf16-cast oracle."""
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    n, d, v = 4096, 1024, 32000
    h = torch.randn(n, d, device=DEVICE, requires_grad=True)
    w = (torch.randn(v, d, device=DEVICE) / d**0.5).requires_grad_()
    labels = torch.randint(0, v, (n,), device=DEVICE)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, w, labels)
    loss.backward()
    assert loss.dtype == torch.float32 and h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    h64, w64 = (
        h.detach().bfloat16().double().requires_grad_(),
        w.detach().bfloat16().double().requires_grad_(),
    )
    want = unfused(h64, w64, labels)
    want.backward()
    assert abs(loss.item() - want.item()) < 1e-2 * want.item()
    assert rel_rms(h.grad, h64.grad) < 1e-2 and rel_rms(w.grad, w64.grad) < 1e-2
