"""Attention on a CUDA GPU (``pytest -m gpu``): bf16/fp16/fp32 at real sizes against an fp32
oracle (the float64 one at T = 8192 would need tens of GB), packed documents, head dim 256,
memory that grows linearly in T for a fixed window, and every path of the dispatch (SDPA,
``varlen_attn``, ttr's kernel) forced in turn."""

import pytest
import torch

from ttr.kernels.attention import attention, dispatch, reference_attention

pytestmark = pytest.mark.gpu

# relative RMS error bounds (docs/design.md, "Testing"): bf16/fp16 1e-2, fp32 with tf32 dots 5e-3
TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 5e-3}


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    torch.backends.cuda.matmul.allow_tf32 = False


@pytest.fixture(params=["auto", "triton"])
def mode(request, monkeypatch):
    """The dispatched op, and ttr's kernel forced (``TTR_ATTENTION``)."""
    monkeypatch.setenv("TTR_ATTENTION", request.param)
    return request.param


def rel_err(x, ref):
    """Relative RMS error; a near-zero reference (window 1 gives dq = dk = 0) is judged against an
    RMS floor of 1e-3 instead."""
    x, ref = x.float(), ref.float()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-3 * ref.numel() ** 0.5)).item()


def poison_allocator(nbytes=1 << 30):
    """Fill freed cache blocks with NaN so outputs a kernel forgets to write show up."""
    junk = torch.full((nbytes // 4,), float("nan"), device="cuda")
    del junk


def check(b, t, hq, hkv, d, window, dtype, cu_seqlens=None):
    q = torch.randn(b, t, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, t, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(b, t, hkv, d, device="cuda", dtype=dtype)
    do = torch.randn_like(q)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    poison_allocator()
    o = attention(*leaves, window=window, cu_seqlens=cu_seqlens)
    poison_allocator()
    got = (o, *torch.autograd.grad(o, leaves, do))
    ref_leaves = [x.float().requires_grad_() for x in (q, k, v)]
    ref_o = reference_attention(*ref_leaves, window=window, cu_seqlens=cu_seqlens)
    want = (ref_o, *torch.autograd.grad(ref_o, ref_leaves, do.float()))
    for name, x, ref in zip(("o", "dq", "dk", "dv"), got, want):
        assert x.dtype == dtype and torch.isfinite(x).all(), name
        err = rel_err(x, ref)
        assert err < TOL[dtype], (name, err)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])  # 96: a head dim that is not a power of two
@pytest.mark.parametrize("t,window", [(1000, None), (4096, 512), (8192, 2048), (777, 1)])
def test_gpu_matches_reference(mode, dtype, d, t, window):
    check(1, t, 4, 2, d, window, dtype)


@pytest.mark.parametrize("d", [64, 128])
def test_gpu_fp32_batched(d):
    check(2, 1500, 4, 4, d, 300, torch.float32)


@pytest.mark.parametrize("window", [None, 512])
def test_gpu_packed_documents(mode, window):
    lengths = [1, 63, 64, 130, 3000, 0, 4096, 777]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    check(1, sum(lengths), 8, 2, 128, window, torch.bfloat16, cu_seqlens=cu)


def test_gpu_head_dim_not_power_of_two():
    check(1, 2000, 4, 1, 96, 256, torch.bfloat16)


def test_gpu_memory_linear_in_t():
    def peak(t):
        q = torch.randn(1, t, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, t, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, t, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        attention(q, k, v, window=1024)  # autotune outside the measurement
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        attention(q, k, v, window=1024).sum().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    small, large = peak(4096), peak(16384)
    assert large < 4.5 * small, (small, large)


PATH_CASES = {
    # name: (B, T, Hq, Hkv, D, window, packed document lengths or None)
    "full plain": (2, 2048, 8, 8, 128, None, None),
    "full plain gqa": (2, 2048, 8, 2, 128, None, None),
    "full plain d64": (1, 3000, 4, 4, 64, None, None),
    "window >= T plain": (2, 2048, 8, 2, 128, 2048, None),
    "window plain gqa": (2, 4096, 8, 2, 128, 1024, None),
    "full packed gqa": (1, None, 8, 2, 128, None, [1, 63, 64, 130, 3000, 0, 4096, 777]),
    "window packed": (1, None, 8, 8, 128, 512, [1, 63, 64, 130, 3000, 0, 4096, 777]),
    "window 1 packed gqa": (1, None, 8, 4, 64, 1, [5, 700, 1, 2048]),
}


@pytest.mark.parametrize("path", dispatch.PATHS)
@pytest.mark.parametrize("name", list(PATH_CASES))
def test_gpu_each_path_matches_reference(monkeypatch, path, name):
    """Each path forced through ``ROUTES`` (skipped where it cannot compute the case), bf16 against
    the fp32 oracle, output and all gradients; the spy proves the path ran."""
    monkeypatch.delenv("TTR_ATTENTION", raising=False)
    b, t, hq, hkv, d, window, lengths = PATH_CASES[name]
    cu = None
    if lengths is not None:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
        t = sum(lengths)
    max_len = t if lengths is None else max(lengths)
    full = window is None or window >= max_len
    case = ("full" if full else "window", "plain" if lengths is None else "packed")
    monkeypatch.setattr(dispatch, "ROUTES", {**dispatch.ROUTES, case: (path, "triton")})
    q = torch.empty(1, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.empty(1, 1, hkv, d, device="cuda", dtype=torch.bfloat16)
    if not dispatch.supports(path, q, k, full=full, packed=lengths is not None, scale=d**-0.5):
        pytest.skip(f"{path} does not compute {name} here")
    seen = []
    impl = {"sdpa": "sdpa_causal", "varlen": "varlen_causal", "triton": "triton_attention"}[path]
    original = getattr(dispatch, impl)
    monkeypatch.setattr(dispatch, impl, lambda *a, **kw: seen.append(path) or original(*a, **kw))
    check(b, t, hq, hkv, d, window, torch.bfloat16, cu_seqlens=cu)
    assert seen == [path]


def test_gpu_default_routes_of_the_presets():
    """The layer shapes of the presets take the path ``ROUTES`` names first where it can."""
    q = torch.empty(1, 1, 16, 128, device="cuda", dtype=torch.bfloat16)
    for (mask, layout), paths in dispatch.ROUTES.items():
        want = next(p for p in paths if dispatch.supports(p, q, q, full=mask == "full", packed=layout == "packed",
                                                          scale=128**-0.5))
        window, max_len = (None, 4096) if mask == "full" else (2048, 4096)
        got = dispatch.choose_path(q, q, window=window, scale=128**-0.5, packed=layout == "packed", max_len=max_len)
        assert got == want, (mask, layout)


@pytest.mark.parametrize("backend", ["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"])
def test_gpu_sdpa_backend_matches_reference(monkeypatch, backend):
    """Each SDPA backend alone on the SDPA path (GQA, bf16), against the oracle; a backend this
    torch or GPU does not offer for the input is skipped, so SDPA_BACKENDS may name it first."""
    from torch.nn.attention import SDPBackend

    monkeypatch.setattr(dispatch, "SDPA_BACKENDS", (getattr(SDPBackend, backend),))
    monkeypatch.setattr(dispatch, "ROUTES", {**dispatch.ROUTES, ("full", "plain"): ("sdpa", "triton")})
    try:
        check(2, 1024, 8, 2, 128, None, torch.bfloat16)
    except RuntimeError as err:
        if "No available kernel" in str(err):
            pytest.skip(f"{backend}: {err}".splitlines()[0])
        raise
