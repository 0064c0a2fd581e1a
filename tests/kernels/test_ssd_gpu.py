"""GPU checks of Mamba2's SSD form (``pytest -m gpu``): bf16 / fp16 / fp32, groups, packing.

Oracle: the same map onto simple GLA, evaluated by the chunked torch form in float64.
Tolerances by relative RMS error: fp32 5e-3, bf16 / fp16 1e-2 (ddt, dA 2e-2).
"""

import pytest
import torch
import torch.nn.functional as F

from ttr.kernels.common.torch_chunk import chunk_torch
from ttr.kernels.ssd import chunk_conv_ssd, chunk_ssd, recurrent_ssd
from ttr.kernels.ssd.reference import ssd_as_simple_gla

from .conftest import rel_rms

pytestmark = pytest.mark.gpu


def oracle(x, dt, A, B, C, *, initial_state, output_final_state, cu_seqlens):
    q, k, v, g = ssd_as_simple_gla(x, dt, A, B, C)
    return chunk_torch(q, k, v, g, None, 1.0, initial_state, output_final_state, cu_seqlens)


def inputs(b, t, h, groups, n_state, p, dtype, n):
    x = torch.randn(b, t, h, p, device="cuda").to(dtype)
    dt = F.softplus(torch.randn(b, t, h, device="cuda") - 3.0)
    A = -torch.rand(h, device="cuda").mul(15).add(1)
    B = (torch.randn(b, t, groups, n_state, device="cuda") * n_state**-0.5).to(dtype)
    C = torch.randn(b, t, groups, n_state, device="cuda").to(dtype)
    return x, dt, A, B, C, torch.randn(n, h, n_state, p, device="cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "shape",
    [(2, 2048, 8, 1, 128, 64, None), (1, 8192, 8, 2, 128, 64, None), (1, 1024, 4, 4, 256, 128, None),
     (1, 1024, 4, 2, 192, 96, None),  # above 128, not a power of two
     (1, 3000, 8, 1, 128, 64, [0, 1, 64, 1000, 3000]),
     # Mamba2's N = 64 in 8 groups, and a state narrower than the launches' tiles
     (2, 2048, 16, 8, 64, 64, None), (1, 1000, 4, 1, 32, 32, [0, 1, 500, 1000]), (2, 1024, 4, 1, 16, 32, None),
     (2, 1024, 4, 1, 8, 16, None), (2, 1024, 4, 1, 48, 64, None),
     (2, 1024, 8, 2, 96, 96, None),  # not a power of two: masked tiles
     (1, 6400, 8, 1, 32, 32, list(range(0, 6401, 100))),  # 64 documents: the launches a full grid picks
     (8, 512, 64, 8, 64, 64, None)],  # 512 walks: the backward's walk of the states on 2 stages
    ids=lambda s: "x".join(str(d) for d in s[:6]) + ("-packed" if s[6] else ""),
)
def test_ssd_vs_float64(shape, dtype):
    check_vs_float64(shape, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "shape",
    [(2, 2048, 16, 8, 64, 64, None), (1, 1000, 4, 1, 32, 32, [0, 1, 500, 1000]), (2, 1024, 8, 2, 96, 96, None),
     (2, 1024, 4, 1, 128, 64, None), (1, 3000, 8, 1, 16, 130, [0, 1, 64, 1000, 3000]),
     (4, 1024, 64, 8, 64, 64, None)],  # 256 walks: the value blocks of 64 a full grid takes
    ids=lambda s: "x".join(str(d) for d in s[:6]) + ("-packed" if s[6] else ""),
)
def test_ssd_walk_forms_y_vs_float64(monkeypatch, shape, dtype):
    """y formed by the state walk (``chunk.walk_forms_ssd_output``, on by default only where the
    walks fill the GPU) at every shape it can take: states up to 128 rows, packed, P over three value
    blocks, and the launch of a full grid (value blocks of 64; the smaller grids take narrower ones)."""
    from ttr.kernels.common import index

    monkeypatch.setitem(index.TUNING, "ssd_output", {"walk": True})
    check_vs_float64(shape, dtype)


def check_vs_float64(shape, dtype):
    b, t, h, groups, n_state, p, cu = shape
    n = b if cu is None else len(cu) - 1
    cu = None if cu is None else torch.tensor(cu, device="cuda", dtype=torch.int64)
    data = inputs(b, t, h, groups, n_state, p, dtype, n)
    dy = torch.randn(b, t, h, p, device="cuda", dtype=torch.float64)
    dht = torch.randn(n, h, n_state, p, device="cuda", dtype=torch.float64)

    def run(fn, tensors):
        leaves = [x.detach().clone().requires_grad_(True) for x in tensors]
        y, ht = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu)
        ((y.double() * dy).sum() + (ht.double() * dht).sum()).backward()
        return y, ht, [x.grad for x in leaves]

    ref = run(oracle, [x.double() for x in data])
    torch.full((1 << 28,), float("nan"), device="cuda")  # poison the allocator's free blocks
    got = run(chunk_ssd, data)
    tol = 5e-3 if dtype == torch.float32 else 1e-2
    assert rel_rms(got[0], ref[0]) < tol, f"y {rel_rms(got[0], ref[0])}"
    assert rel_rms(got[1], ref[1]) < tol, f"final state {rel_rms(got[1], ref[1])}"
    for name, a, r in zip(["dx", "ddt", "dA", "dB", "dC", "dh0"], got[2], ref[2]):
        assert torch.isfinite(a).all(), name
        limit = 2 * tol if name in ("ddt", "dA") else tol
        assert rel_rms(a, r) < limit, f"{name} {rel_rms(a, r)}"


def test_ssd_chunk_equals_decoding():
    x, dt, A, B, C, h0 = inputs(2, 200, 8, 2, 128, 64, torch.bfloat16, 2)
    y, ht = chunk_ssd(x, dt, A, B, C, initial_state=h0, output_final_state=True)
    state, outs = h0, []
    for i in range(200):
        sl = slice(i, i + 1)
        y_i, state = recurrent_ssd(x[:, sl], dt[:, sl], A, B[:, sl], C[:, sl], initial_state=state,
                                   output_final_state=True)
        outs.append(y_i)
    assert rel_rms(torch.cat(outs, 1), y) < 1e-2
    assert rel_rms(state, ht) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("groups,packed", [(1, False), (2, True)])
def test_conv_ssd_vs_float64(dtype, groups, packed):
    """The fused short conv + SSD with the D skip (Mamba2's training path), xBC a column slice of
    a wider projection as in the layer, against its torch form in float64."""
    t, h, p, n_state, w = 4096, 16, 64, 128, 4
    cu = torch.tensor([0, 1, 64, 1000, t], device="cuda", dtype=torch.int32) if packed else None
    n = 4 if packed else 1
    width = h * p + 2 * groups * n_state
    proj = (torch.randn(1, t, 64 + width + h, device="cuda") * 0.5).to(dtype)
    weight = torch.randn(width, w, device="cuda") / w**0.5  # fp32, as the layer's parameters under autocast
    bias = 0.1 * torch.randn(width, device="cuda")
    dt = F.softplus(torch.randn(1, t, h, device="cuda") - 3.0)
    A = -torch.rand(h, device="cuda").mul(15).add(1)
    D = torch.randn(h, device="cuda")
    h0 = torch.randn(n, h, n_state, p, device="cuda")
    dy = torch.randn(1, t, h, p, device="cuda", dtype=torch.float64)
    dht = torch.randn(n, h, n_state, p, device="cuda", dtype=torch.float64)

    def run(tensors):
        leaves = [x.detach().clone().requires_grad_(True) for x in tensors]
        proj_, weight_, bias_, dt_, A_, D_, h0_ = leaves
        y, ht = chunk_conv_ssd(proj_[..., 64:64 + width], weight_, bias_, dt_, A_, groups=groups, state_size=n_state,
                               D=D_, initial_state=h0_, output_final_state=True, cu_seqlens=cu)
        ((y.double() * dy).sum() + (ht.double() * dht).sum()).backward()
        return y, ht, [x.grad for x in leaves]

    data = [proj, weight, bias, dt, A, D, h0]
    ref = run([x.double() for x in data])
    torch.full((1 << 28,), float("nan"), device="cuda")  # poison the allocator's free blocks
    got = run(data)
    tol = 5e-3 if dtype == torch.float32 else 1e-2
    assert rel_rms(got[0], ref[0]) < tol, f"y {rel_rms(got[0], ref[0])}"
    assert rel_rms(got[1], ref[1]) < tol, f"final state {rel_rms(got[1], ref[1])}"
    for name, a, r in zip(["dproj", "dweight", "dbias", "ddt", "dA", "dD", "dh0"], got[2], ref[2]):
        assert torch.isfinite(a).all(), name
        limit = 2 * tol if name in ("ddt", "dA") else tol
        assert rel_rms(a, r) < limit, f"{name} {rel_rms(a, r)}"
