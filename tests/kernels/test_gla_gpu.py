"""GPU checks of GLA and simple GLA (``pytest -m gpu``): bf16 / fp16 / fp32 at real sizes.

The oracle is the chunked torch form in float64 (exact; itself checked against the per-token
recurrence on CPU in test_gla.py / test_ssd.py), fed the same (rounded) inputs. Memory is
poisoned with NaN before every Triton run so that a kernel relying on zero-filled buffers fails.
Tolerances by relative RMS error: fp32 5e-3 (tf32 matmuls), bf16 / fp16 1e-2 (dg 2e-2: a reverse
cumulative sum of products of rounded operands).
"""

import pytest
import torch
import torch.nn.functional as F

from ttr.kernels.common.torch_chunk import chunk_torch
from ttr.kernels.gla import chunk_gla, recurrent_gla
from ttr.kernels.ssd import chunk_simple_gla, recurrent_simple_gla

from .conftest import rel_rms

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [  # (B, T, H, K, V, cu_seqlens)
    (2, 2048, 4, 128, 128, None),
    (2, 2048, 4, 64, 128, None),  # gla-1.3b's head shape (its own launch defaults)
    (1, 8192, 2, 128, 128, None),
    (1, 1024, 2, 256, 256, None),
    (1, 1024, 2, 192, 160, None),  # above 128, not a power of two
    (1, 4097, 4, 128, 128, [0, 1, 700, 2048, 4097]),
    (2, 1024, 4, 32, 64, None),  # heads narrower than the launches' key and value tiles
    (2, 1024, 4, 16, 32, None),
    (2, 1024, 4, 8, 16, None),
    (2, 1024, 4, 48, 64, None),  # a masked key tile
    (1, 1500, 4, 64, 64, [0, 1, 700, 1500]),
    (2, 1024, 4, 96, 96, None),  # not a power of two: masked tiles
    (1, 6400, 4, 32, 64, list(range(0, 6401, 100))),  # 64 documents: the launches a full grid picks
]


def poison():
    junk = torch.full((1 << 28,), float("nan"), device="cuda")
    del junk


def tolerances(dtype):
    return (5e-3, 5e-3) if dtype == torch.float32 else (1e-2, 2e-2)


def inputs(b, t, h, dk, dv, dtype, *, vector, n):
    q = torch.randn(b, t, h, dk, device="cuda").to(dtype)
    k = (torch.randn(b, t, h, dk, device="cuda") * dk**-0.5).to(dtype)
    v = torch.randn(b, t, h, dv, device="cuda").to(dtype)
    shape = (b, t, h, dk) if vector else (b, t, h)
    g = F.logsigmoid(torch.randn(shape, device="cuda") + 2.0) / 4  # decays from ~1 to ~exp(-1) per token
    h0 = torch.randn(n, h, dk, dv, device="cuda")
    return q, k, v, g, h0


def forward_backward(fn, q, k, v, g, h0, cu, do, dht):
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g, h0)]
    o, ht = fn(*leaves[:4], initial_state=leaves[4], output_final_state=True, cu_seqlens=cu)
    ((o.double() * do).sum() + (ht.double() * dht).sum()).backward()
    return o, ht, [x.grad for x in leaves]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(str(d) for d in s[:5]) + ("-packed" if s[5] else ""))
@pytest.mark.parametrize("op", ["gla", "simple_gla"])
def test_chunk_vs_float64(op, shape, dtype):
    check_vs_float64(op, shape, dtype)


# the shapes whose backward walks the chunks at K <= 128 (not the two-level pass of long sequences)
WALKED = [s for s in SHAPES if s[3] <= 128 and s[1] / (1 if s[5] is None else len(s[5]) - 1) < 96 * 64]
# gla-1.3b's heads at 8 x 2048: a full grid, where the walk forms dv and dA by default
FULL_GRID = (8, 2048, 16, 64, 128, None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", WALKED + [FULL_GRID],
                         ids=lambda s: "x".join(str(d) for d in s[:5]) + ("-packed" if s[5] else ""))
def test_walk_forming_dv_and_dA_vs_float64(monkeypatch, shape, dtype):
    """GLA's backward walk forming the intra-chunk dv and dA over whole value rows
    (``state.walk_forms_dv_dA``), forced on at the smaller shapes and by default at ``FULL_GRID``,
    against the float64 oracle."""
    from ttr.kernels.common import index, state
    from ttr.kernels.gla import chunk as gla_chunk

    if shape != FULL_GRID:
        monkeypatch.setitem(index.TUNING, "state_bwd", {"intra_dv": True})
    walked = []
    monkeypatch.setattr(gla_chunk, "state_bwd",
                        lambda *a, **kw: walked.append("values" in kw) or state.state_bwd(*a, **kw))
    check_vs_float64("gla", shape, dtype)
    assert walked == [True]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gla_mixed_gates_vs_float64(dtype):
    """Half the key dims decay by ~e^-5 per token (a 16-token sub-chunk spans > 60: the diagonal
    blocks take the token-by-token fallback), the others mildly (the tensor-core product)."""
    def strong_half(g):
        g = g.clone()
        g[..., : g.shape[-1] // 2] = -5.0 - torch.rand_like(g[..., : g.shape[-1] // 2])
        return g
    check_vs_float64("gla", (1, 4097, 4, 128, 128, [0, 1, 700, 2048, 4097]), dtype, gate=strong_half)


def check_vs_float64(op, shape, dtype, gate=None):
    b, t, h, dk, dv, cu = shape
    n = b if cu is None else len(cu) - 1
    cu = None if cu is None else torch.tensor(cu, device="cuda", dtype=torch.int32)
    fn = chunk_gla if op == "gla" else chunk_simple_gla
    q, k, v, g, h0 = inputs(b, t, h, dk, dv, dtype, vector=op == "gla", n=n)
    if gate is not None:
        g = gate(g)
    do = torch.randn(b, t, h, dv, device="cuda", dtype=torch.float64)
    dht = torch.randn(n, h, dk, dv, device="cuda", dtype=torch.float64)
    scale = dk**-0.5

    def oracle(q, k, v, g, *, initial_state, output_final_state, cu_seqlens):
        return chunk_torch(q, k, v, g, None, scale, initial_state, output_final_state, cu_seqlens)

    ref = forward_backward(oracle, *(x.double() for x in (q, k, v, g, h0)), cu, do, dht)
    poison()
    got = forward_backward(fn, q, k, v, g, h0, cu, do, dht)
    tol, tol_dg = tolerances(dtype)
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    assert rel_rms(got[0], ref[0]) < tol, f"o {rel_rms(got[0], ref[0])}"
    assert rel_rms(got[1], ref[1]) < tol, f"final state {rel_rms(got[1], ref[1])}"
    for name, a, r in zip(["dq", "dk", "dv", "dg", "dh0"], got[2], ref[2]):
        assert torch.isfinite(a).all(), name
        limit = tol_dg if name == "dg" else tol
        assert rel_rms(a, r) < limit, f"{name} {rel_rms(a, r)}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("op", ["gla", "simple_gla"])
def test_strong_decay_finite(op, dtype):
    b, t, h, dk, dv = 1, 2048, 2, 128, 128
    q, k, v, g, h0 = inputs(b, t, h, dk, dv, dtype, vector=op == "gla", n=b)
    g = g * 0 - 5.0 - torch.rand_like(g)  # exp(-g) over a 64-token chunk would be exp(350)
    fn = chunk_gla if op == "gla" else chunk_simple_gla
    poison()
    o, ht, grads = forward_backward(fn, q, k, v, g, h0, None, torch.randn(b, t, h, dv, device="cuda"),
                                    torch.randn(b, h, dk, dv, device="cuda"))
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert all(torch.isfinite(x).all() for x in grads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("op", ["gla", "simple_gla"])
def test_chunk_equals_decoding(op, dtype):
    b, t, h, dk, dv = 2, 300, 4, 128, 128
    q, k, v, g, h0 = inputs(b, t, h, dk, dv, dtype, vector=op == "gla", n=b)
    chunk_fn, step_fn = (chunk_gla, recurrent_gla) if op == "gla" else (chunk_simple_gla, recurrent_simple_gla)
    o, ht = chunk_fn(q, k, v, g, initial_state=h0, output_final_state=True)
    poison()
    state, outs = h0, []
    for i in range(t):
        sl = slice(i, i + 1)
        o_i, state = step_fn(q[:, sl], k[:, sl], v[:, sl], g[:, sl], initial_state=state, output_final_state=True)
        outs.append(o_i)
    tol = tolerances(dtype)[0]
    assert rel_rms(torch.cat(outs, 1), o) < tol
    assert rel_rms(state, ht) < tol


@pytest.mark.parametrize("clamp_min", [None, -0.05])
def test_gate_logits_bf16(clamp_min):
    """gla-1.3b's layer at B = 2, T = 2048 in bf16, the gate's bf16 logits given to the op
    (``gate_logits``): against float64 (the gate formed in float64 from the same logits), and
    against the op on ``gla_gate``'s fp32 gate."""
    from ttr.kernels.gla.gate import gla_gate, reference_gla_gate

    torch.manual_seed(0)
    q, k, v, _, h0 = inputs(2, 2048, 16, 64, 128, torch.bfloat16, vector=True, n=2)
    z = (torch.randn(2, 2048, 16, 64, device="cuda") * 3 + 2).bfloat16()
    do = torch.randn(2, 2048, 16, 128, device="cuda", dtype=torch.float64)
    dht = torch.randn(2, 16, 64, 128, device="cuda", dtype=torch.float64)
    gate = (16.0, clamp_min)

    def oracle(q, k, v, z, *, initial_state, output_final_state, cu_seqlens):
        g = reference_gla_gate(z, *gate)
        return chunk_torch(q, k, v, g, None, 64**-0.5, initial_state, output_final_state, cu_seqlens)

    ref = forward_backward(oracle, *(x.double() for x in (q, k, v, z, h0)), None, do, dht)
    poison()
    got = forward_backward(lambda *a, **kw: chunk_gla(*a, gate_logits=gate, **kw), q, k, v, z, h0, None, do, dht)
    sep = forward_backward(lambda q, k, v, z, **kw: chunk_gla(q, k, v, gla_gate(z, *gate), **kw), q, k, v, z, h0,
                           None, do, dht)
    assert got[2][3].dtype == torch.bfloat16
    for name, a, r, s in zip(["o", "final state"], got[:2], ref[:2], sep[:2]):
        assert rel_rms(a, r) < 1e-2 and rel_rms(a, s) < 1e-5, name
    for name, a, r, s in zip(["dq", "dk", "dv", "dz", "dh0"], got[2], ref[2], sep[2]):
        assert torch.isfinite(a).all(), name
        assert rel_rms(a, r) < (2e-2 if name == "dz" else 1e-2), f"{name} {rel_rms(a, r)}"
        assert rel_rms(a, s) < 1e-3, f"{name} against the separate gate {rel_rms(a, s)}"


@pytest.mark.parametrize("b,t", [(2, 2048), (1, 16384)])
def test_grads_into_bf16(b, t):
    """gla-1.3b's heads in bf16, the gate's logits given: dq, dk and dv written into column blocks
    of one wider buffer (``grads_into``, as GLA's layer gives its projections' gradient buffer) are
    the bits of new tensors, the buffer's other columns untouched; at 1 x 16384 the state backward
    takes the two-level pass."""
    torch.manual_seed(0)
    q, k, v, _, _ = inputs(b, t, 16, 64, 128, torch.bfloat16, vector=True, n=b)
    z = (torch.randn(b, t, 16, 64, device="cuda") * 3 + 2).bfloat16()
    do = torch.randn(b, t, 16, 128, device="cuda", dtype=torch.bfloat16)
    buf = torch.full((b, t, 8 + 1024 + 1024 + 2048 + 2064), 3.0, device="cuda", dtype=torch.bfloat16)
    blocks = tuple(x.view(b, t, 16, -1) for x in buf[..., 8:8 + 4096].split([1024, 1024, 2048], -1))
    results = []
    for into in (None, lambda: blocks):
        poison()
        leaves = [x.clone().requires_grad_() for x in (q, k, v, z)]
        o, _ = chunk_gla(*leaves, gate_logits=(16.0, None), grads_into=into)
        results.append(torch.autograd.grad(o, leaves, do))
    for name, a, r in zip("q k v z".split(), *results):
        assert torch.equal(a, r), name
    assert all(a.data_ptr() == blk.data_ptr() for a, blk in zip(results[1], blocks))
    assert (buf[..., :8] == 3).all() and (buf[..., 8 + 4096:] == 3).all()
