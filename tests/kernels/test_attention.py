"""Causal / sliding-window attention: Triton (interpreter on CPU, fp32) and the torch backend
against the float64 oracle and against SDPA with an explicit mask; outputs and q, k, v grads."""

import pytest
import torch
import torch.nn.functional as F

from ttr.kernels.attention import attention, reference_attention
from ttr.kernels.attention.reference import torch_attention
from ttr.kernels.utils import interpreter_active

from .conftest import DEVICE

# exact fp32 products under the interpreter; tf32 dots on a GPU
TOL = 1e-4 if DEVICE == "cpu" else 5e-3

@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")


def rel_err(x, ref):
    """Relative RMS error; an all-zero reference (window 1 gives dq = dk = 0) is judged absolutely."""
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    return ((x - ref).norm() / ref.norm().clamp_min(1.0)).item()


def make_inputs(b, t, hq, hkv, d, dtype=torch.float32):
    q = torch.randn(b, t, hq, d, device=DEVICE, dtype=dtype)
    k = torch.randn(b, t, hkv, d, device=DEVICE, dtype=dtype)
    v = torch.randn(b, t, hkv, d, device=DEVICE, dtype=dtype)
    return q, k, v


def run(fn, q, k, v, do, **kw):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o = fn(*leaves, **kw)
    grads = torch.autograd.grad(o, leaves, do)
    return (o, *grads)


def check_against_oracles(q, k, v, tol=TOL, **kw):
    """Triton vs the float64 reference and vs SDPA (explicit mask) in the input dtype."""
    do = torch.randn_like(q)
    got = run(attention, q, k, v, do, **kw)
    want = run(reference_attention, q.double(), k.double(), v.double(), do.double(), **kw)
    sdpa = run(torch_attention, q, k, v, do, **kw)
    for name, x, ref, alt in zip(("o", "dq", "dk", "dv"), got, want, sdpa):
        assert x.shape == ref.shape and x.dtype == q.dtype, name
        assert torch.isfinite(x).all(), name
        assert rel_err(x, ref) < tol, (name, rel_err(x, ref))
        assert rel_err(x, alt) < 2 * tol, (name, "sdpa", rel_err(x, alt))


@pytest.mark.parametrize("window", [1, 16, 64, None])
@pytest.mark.parametrize("t", [1, 15, 63, 64, 65, 200])
def test_triton_matches_oracles_gqa(triton_backend, t, window):
    check_against_oracles(*make_inputs(2 if t <= 65 else 1, t, 4, 1, 32), window=window)


@pytest.mark.parametrize(
    "d,hq,hkv,window",
    [(32, 2, 2, None), (48, 2, 2, 16), (48, 4, 1, None), (64, 2, 2, 64), (64, 4, 2, None), (32, 3, 1, 16)],
)
def test_triton_head_dims_and_groups(triton_backend, d, hq, hkv, window):
    check_against_oracles(*make_inputs(1, 65, hq, hkv, d), window=window)


@pytest.mark.parametrize("window", [None, 16])
def test_triton_rows_beyond_one_program_group(triton_backend, window):
    """More (sequence, head) rows than ``flash.GROUP_HEADS`` with a partial last group (36 query
    rows, 18 key/value rows): every program still maps to one (row, block)."""
    from ttr.kernels.attention import flash

    rows_q, rows_kv = 3 * 12, 3 * 6
    assert rows_kv > flash.GROUP_HEADS and rows_q % flash.GROUP_HEADS and rows_kv % flash.GROUP_HEADS
    check_against_oracles(*make_inputs(3, 65, 12, 6, 16), window=window)


@pytest.mark.parametrize(
    "lengths,window",
    [([1, 63, 64, 130], None), ([130, 0, 1, 64, 63], 16), ([64, 1, 130, 63], 64), ([63, 1, 64], 1)],
)
@pytest.mark.parametrize("compact", [True, False])
def test_triton_packed_documents(triton_backend, monkeypatch, lengths, window, compact):
    """Packed grids both ways: compact (one program per existing block) and padded
    (``flash.COMPACT_MAX_SEQS = 0``: cdiv(max L, B) blocks per sequence, the extra ones exit)."""
    from ttr.kernels.attention import flash

    if not compact:
        monkeypatch.setattr(flash, "COMPACT_MAX_SEQS", 0)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q, k, v = make_inputs(1, sum(lengths), 4, 2, 32)
    check_against_oracles(q, k, v, window=window, cu_seqlens=cu)


@pytest.mark.parametrize("window", [None, 16])
def test_triton_many_packed_documents(triton_backend, window):
    """More sequences than the program map's smallest vector (16), empty ones among them: the
    compact grid still gives every block of every sequence and head exactly one program."""
    lengths = torch.randint(0, 20, (19,)).tolist()
    lengths[3] = lengths[12] = 0
    lengths[15] = 70
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q, k, v = make_inputs(1, sum(lengths), 2, 1, 16)
    check_against_oracles(q, k, v, window=window, cu_seqlens=cu)


def test_triton_packed_equals_separate_sequences(triton_backend):
    lengths = [17, 64, 40]
    q, k, v = make_inputs(1, sum(lengths), 2, 1, 32)
    cu = torch.tensor([0, 17, 81, 121], device=DEVICE)
    packed = attention(q, k, v, window=20, cu_seqlens=cu)
    for bos, eos in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = attention(q[:, bos:eos], k[:, bos:eos], v[:, bos:eos], window=20)
        assert rel_err(packed[:, bos:eos], alone) < TOL


def test_triton_custom_scale_and_strided_inputs(triton_backend):
    # q, k, v as views of one fused projection (non-contiguous), with an explicit scale
    qkv = torch.randn(2, 40, 3 * 4 * 32, device=DEVICE)
    q, k, v = (x.unflatten(-1, (4, 32)) for x in qkv.split(4 * 32, dim=-1))
    check_against_oracles(q, k, v, window=9, scale=0.3)


def test_triton_fp16_close_to_reference(triton_backend):
    q, k, v = make_inputs(1, 65, 2, 1, 32, dtype=torch.float16)
    o = attention(q, k, v, window=16)
    ref = reference_attention(q.double(), k.double(), v.double(), window=16)
    assert o.dtype == torch.float16 and rel_err(o, ref) < 5e-3


def test_triton_rejects_float64(triton_backend):
    q, k, v = make_inputs(1, 8, 2, 1, 16, dtype=torch.float64)
    with pytest.raises(TypeError, match="float64"):
        attention(q, k, v)


@pytest.mark.parametrize(
    "t,hq,hkv,window,lengths",
    [(1, 2, 2, None, None), (65, 4, 1, 16, None), (200, 2, 1, 64, None), (258, 4, 2, 1, [1, 63, 64, 130]),
     (258, 2, 2, None, [130, 64, 0, 63, 1])],
)
def test_torch_backend_matches_reference_float64(t, hq, hkv, window, lengths):
    b = 2 if lengths is None else 1
    q, k, v = (x.double() for x in make_inputs(b, t, hq, hkv, 48))
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE)
    do = torch.randn_like(q)
    got = run(torch_attention, q, k, v, do, window=window, cu_seqlens=cu)
    want = run(reference_attention, q, k, v, do, window=window, cu_seqlens=cu)
    for x, ref in zip(got, want):
        assert rel_err(x, ref) < 1e-12


def test_reference_matches_sdpa_causal_and_window_semantics():
    q, k, v = (x.double() for x in make_inputs(1, 30, 2, 2, 16))
    full = reference_attention(q, k, v)
    sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    assert rel_err(full, sdpa.transpose(1, 2)) < 1e-12
    # window >= T is full causal; window 1 returns v itself
    assert rel_err(reference_attention(q, k, v, window=30), full) < 1e-12
    assert rel_err(reference_attention(q, k, v, window=1), v) < 1e-12
    # query 10 with window 3 sees exactly keys 8, 9, 10
    w = torch.softmax(torch.einsum("hd,shd->hs", q[0, 10], k[0, 8:11]) / 4.0, dim=-1)  # [H, 3]
    manual = torch.einsum("hs,shd->hd", w, v[0, 8:11])
    assert rel_err(reference_attention(q, k, v, window=3)[0, 10], manual) < 1e-12


def test_default_backend_on_cpu_is_torch(monkeypatch):
    monkeypatch.delenv("TTR_KERNEL_BACKEND", raising=False)
    q, k, v = (x.cpu() for x in make_inputs(1, 20, 2, 1, 16))
    assert torch.equal(attention(q, k, v, window=5), torch_attention(q, k, v, window=5))


def test_empty_sequence(backend):
    q, k, v = make_inputs(1, 0, 2, 1, 16)
    o = attention(q, k, v, window=4)
    assert o.shape == q.shape


def test_bad_input(backend):
    q, k, v = make_inputs(1, 10, 4, 2, 16)
    for window in (0, -3):
        with pytest.raises(ValueError, match="window"):
            attention(q, k, v, window=window)
    with pytest.raises(TypeError, match="window"):
        attention(q, k, v, window=2.5)
    with pytest.raises(ValueError, match="multiple"):
        attention(q, *make_inputs(1, 10, 3, 3, 16)[1:])
    with pytest.raises(ValueError, match="k must have shape"):
        attention(q, *make_inputs(1, 11, 4, 2, 16)[1:])
    with pytest.raises(ValueError, match="q must have shape"):
        attention(q[0], k, v)
    with pytest.raises(TypeError, match="dtype"):
        attention(q, k.half(), v)
    with pytest.raises(ValueError, match="head dim"):
        attention(*make_inputs(1, 4, 1, 1, 272))
    with pytest.raises(TypeError, match="scale"):
        attention(q, k, v, scale="big")
    bad_cu = [
        (torch.tensor([0, 4, 9]), "end at"),
        (torch.tensor([1, 4, 10]), "start at 0"),
        (torch.tensor([0, 6, 4, 10]), "non-decreasing"),
        (torch.tensor([0.0, 10.0]), "int32 or int64"),
    ]
    for cu, msg in bad_cu:
        with pytest.raises((ValueError, TypeError), match=msg):
            attention(q, k, v, cu_seqlens=cu.to(DEVICE))
    q2, k2, v2 = make_inputs(2, 10, 4, 2, 16)
    with pytest.raises(ValueError, match="batch size 1"):
        attention(q2, k2, v2, cu_seqlens=torch.tensor([0, 10], device=DEVICE))


@pytest.mark.slow
@pytest.mark.parametrize("d", [128, 256])
def test_configs_fit_hopper_shared_memory(d):
    """Every autotune config compiles for sm_90 (no GPU needed) within the 227 KiB an H100/H200
    block may use, so head dim 256 runs rather than failing with OutOfResources; and, where Triton
    ships ptxas, none has its wgmma serialised (ptxas note C7515), which runs the four products of
    a dK/dV step one after another (the loop runs without loop-invariant code motion for this)."""
    import itertools
    import os
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ttr.kernels.attention import flash

    if interpreter_active():
        pytest.skip("kernels built for the interpreter; run with TRITON_INTERPRET=0 (no GPU needed)")
    p = "*bf16"
    sig = {"q": p, "k": p, "v": p, "o": p, "do": p, "dq": p, "dk": p, "dv": p, "lse": "*fp32", "delta": "*fp32",
           "cu_seqlens": "*i32", "T_total": "i32", "max_len": "i32", "W": "i32", "qk_scale": "fp32", "scale": "fp32",
           "N": "i32"}
    try:  # the ptxas Triton itself uses for sm_90
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(90).path
    except (ImportError, AttributeError, RuntimeError):
        ptxas = ""
    wide = d > 128
    kernels = [
        (flash.attn_fwd_kernel, flash.FWD_CONFIGS_WIDE if wide else flash.FWD_CONFIGS),
        (flash.attn_bwd_kernel, flash.BWD_CONFIGS_WIDE if wide else flash.BWD_CONFIGS),
    ]
    # G = 1 and G = 2 compile differently (the dK/dV programs loop over a GQA group): ptxas
    # serialised the G = 1 dK/dV loop with loop-invariant code motion on, not the G = 2 one; plain
    # batches (VARLEN off, the benchmarked path) and packed documents are separate builds too
    for (kernel, configs), g, varlen in itertools.product(kernels, (1, 2), (False, True)):
        fn = kernel.fn
        for config in configs:
            consts = {"HQ": 8, "G": g, "D": d, "BD": d, "GH": flash.GROUP_HEADS, "NP": 32, "VARLEN": varlen,
                  "COMPACT": varlen, **config.kwargs}
            signature = {n: "constexpr" if n in consts else sig[n] for n in fn.arg_names}
            src = ASTSource(fn=fn, signature=signature,
                            constexprs={(fn.arg_names.index(n),): val for n, val in consts.items()},
                            attrs={(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                                   if signature[n].startswith("*")})
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": config.num_warps, "num_stages": config.num_stages})
            assert compiled.metadata.shared <= 232448, (fn.__name__, config, compiled.metadata.shared)
            if os.path.exists(ptxas):
                with tempfile.TemporaryDirectory() as tmp:
                    ptx = os.path.join(tmp, "k.ptx")
                    with open(ptx, "w") as f:
                        f.write(compiled.asm["ptx"])
                    out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", ptx, "-o", ptx + ".cubin"],
                                         capture_output=True, text=True, timeout=300)
                assert out.returncode == 0, out.stderr[-2000:]
                assert "C7515" not in out.stderr, (fn.__name__, config, "wgmma serialised")
