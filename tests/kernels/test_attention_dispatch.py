"""The attention dispatch (``kernels/attention/dispatch.py``): which path runs which input, with the
GPU and ``varlen_attn`` stood in for on a CPU, and every path's numerics against the float64
oracle, gradients included."""

import pytest
import torch

from ttr.kernels.attention import attention, dispatch, reference_attention

from .conftest import DEVICE
from .test_attention import make_inputs, rel_err, run


def fake_varlen(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                enable_gqa=False):
    """``varlen_attn`` as its documentation states it, in torch: per document of ``cu_seq_q``,
    query i sees key j where ``i - left <= j <= i + right`` (-1: unbounded)."""
    assert torch.equal(cu_seq_q, cu_seq_k) and cu_seq_q.dtype == torch.int32
    assert max_q == max_k == int((cu_seq_q[1:] - cu_seq_q[:-1]).max())
    hq, hkv = q.shape[1], k.shape[1]
    assert enable_gqa or hq == hkv
    left, right = window_size
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    pieces = []
    for bos, eos in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist()):
        b_q = q[bos:eos].transpose(0, 1)  # [Hq, L, D]
        b_k = k[bos:eos].transpose(0, 1).repeat_interleave(hq // hkv, 0)
        b_v = v[bos:eos].transpose(0, 1).repeat_interleave(hq // hkv, 0)
        o_t = torch.arange(eos - bos)
        diff = o_t[:, None] - o_t[None, :]  # i - j
        keep = torch.ones_like(diff, dtype=torch.bool)
        if left >= 0:
            keep &= diff <= left
        if right >= 0:
            keep &= -diff <= right
        s = (b_q @ b_k.transpose(1, 2) * scale).masked_fill(~keep, float("-inf"))
        pieces.append((torch.softmax(s, -1) @ b_v).transpose(0, 1))
    return torch.cat(pieces)


def fake_varlen_causal_only(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """The first ``varlen_attn``: ``is_causal`` only, no window, scale or grouped kv heads."""
    return fake_varlen(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, window_size=(-1, 0 if is_causal else -1))


NEW_API = dispatch.VarlenAPI(fake_varlen, window=True, gqa=True, scale=True)
OLD_API = dispatch.VarlenAPI(fake_varlen_causal_only, window=False, gqa=False, scale=False)
ALL_FUSED = {
    ("full", "plain"): ("sdpa", "triton"),
    ("full", "packed"): ("varlen", "triton"),
    ("window", "plain"): ("varlen", "triton"),
    ("window", "packed"): ("varlen", "triton"),
}


@pytest.fixture
def gpu_like(monkeypatch):
    """CPU tensors stand in for the GPU's fp16/bf16 ones; varlen_attn is the new-API fake."""
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    monkeypatch.delenv("TTR_ATTENTION", raising=False)
    monkeypatch.setattr(dispatch, "fused_ok", lambda q: True)
    monkeypatch.setattr(dispatch, "varlen_api", lambda: NEW_API)


def spy_paths(monkeypatch):
    """Record the path every dispatched call runs (the paths themselves still run)."""
    seen = []
    for name, fn in (("sdpa", dispatch.sdpa_causal), ("varlen", dispatch.varlen_causal),
                     ("triton", dispatch.triton_attention)):
        def spy(*args, _name=name, _fn=fn, **kwargs):
            seen.append(_name)
            return _fn(*args, **kwargs)

        monkeypatch.setattr(dispatch, {"sdpa": "sdpa_causal", "varlen": "varlen_causal"}.get(name, "triton_attention"),
                            spy)
    return seen


def choose(q, k, window=None, scale=None, packed=False, max_len=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return dispatch.choose_path(q, k, window=window, scale=scale, packed=packed,
                                max_len=q.shape[1] if max_len is None else max_len)


@pytest.mark.parametrize(
    "window,packed,max_len,routes,want",
    [
        (None, False, 64, None, "sdpa"),
        (64, False, 64, None, "sdpa"),  # a window as long as the sequence is full causal
        (100, False, 64, None, "sdpa"),
        (63, False, 64, None, "triton"),
        (None, True, 40, None, "triton"),
        (None, True, 40, ALL_FUSED, "varlen"),
        (16, True, 40, ALL_FUSED, "varlen"),
        (40, True, 40, {("full", "packed"): ("triton",)}, "triton"),  # routes as full, not as window
        (16, False, 64, ALL_FUSED, "varlen"),
        (None, False, 64, {("full", "plain"): ("varlen", "sdpa", "triton")}, "varlen"),
    ],
)
def test_choose_path_follows_routes(gpu_like, monkeypatch, window, packed, max_len, routes, want):
    if routes is not None:
        monkeypatch.setattr(dispatch, "ROUTES", {**dispatch.ROUTES, **routes})
    q, k, _ = make_inputs(1, 64, 4, 2, 32)
    assert choose(q, k, window=window, packed=packed, max_len=max_len) == want


def test_choose_path_falls_back_to_triton(gpu_like, monkeypatch):
    monkeypatch.setattr(dispatch, "ROUTES", ALL_FUSED)
    q, k, _ = make_inputs(1, 64, 4, 2, 32)
    # head dims the fused kernels do not take
    q12, k12, _ = make_inputs(1, 64, 4, 2, 12)
    assert choose(q12, k12) == "triton" and choose(q12, k12, packed=True) == "triton"
    # the first varlen_attn: no window, no grouped kv heads, no scale argument
    monkeypatch.setattr(dispatch, "varlen_api", lambda: OLD_API)
    q1, k1, _ = make_inputs(1, 64, 2, 2, 32)
    assert choose(q1, k1, packed=True) == "varlen"
    assert choose(q1, k1, window=16, packed=True) == "triton"
    assert choose(q, k, packed=True) == "triton"  # GQA
    assert choose(q1, k1, packed=True, scale=0.3) == "triton"
    # no varlen_attn in this torch
    monkeypatch.setattr(dispatch, "varlen_api", lambda: None)
    assert choose(q, k, packed=True) == "triton"
    assert choose(q, k) == "sdpa"
    # forced
    monkeypatch.setenv("TTR_ATTENTION", "triton")
    assert choose(q, k) == "triton"


def test_fused_paths_need_a_gpu_half_tensor(monkeypatch):
    monkeypatch.delenv("TTR_ATTENTION", raising=False)
    q, k, _ = make_inputs(1, 64, 2, 2, 32)
    assert not dispatch.fused_ok(q) and not dispatch.fused_ok(q.half().cpu())
    assert choose(q, k) == "triton"


def test_attention_mode_is_checked(monkeypatch):
    for mode, want in (("", "auto"), ("AUTO", "auto"), (" triton ", "triton")):
        monkeypatch.setenv("TTR_ATTENTION", mode)
        assert dispatch.attention_mode() == want
    monkeypatch.setenv("TTR_ATTENTION", "cudnn")
    with pytest.raises(ValueError, match="TTR_ATTENTION"):
        dispatch.attention_mode()
    with pytest.raises(ValueError, match="attention path"):
        dispatch.supports("flex", *make_inputs(1, 4, 2, 2, 16)[:2], full=True, packed=False, scale=0.25)


def test_installed_varlen_api_is_recognised():
    api = dispatch.varlen_api.__wrapped__()
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        assert api is None
        return
    assert api is not None and callable(api.fn)


def packed_case(lengths, hq, hkv, d):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    return (*make_inputs(1, sum(lengths), hq, hkv, d), cu)


CASES = {
    # name: (inputs, window, scale, path under ALL_FUSED)
    "full plain": (lambda: (*make_inputs(2, 65, 4, 4, 32), None), None, None, "sdpa"),
    "full plain gqa scale": (lambda: (*make_inputs(2, 65, 4, 1, 32), None), None, 0.3, "sdpa"),
    "window >= T plain": (lambda: (*make_inputs(1, 40, 4, 2, 16), None), 40, None, "sdpa"),
    "window plain gqa": (lambda: (*make_inputs(2, 65, 4, 2, 32), None), 16, None, "varlen"),
    "full packed gqa": (lambda: packed_case([1, 63, 64, 0, 30], 4, 2, 32), None, 0.2, "varlen"),
    "window packed": (lambda: packed_case([1, 63, 64, 0, 30], 2, 2, 32), 7, None, "varlen"),
    "window 1 packed gqa": (lambda: packed_case([5, 17, 1], 4, 1, 16), 1, None, "varlen"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_dispatched_paths_match_oracle(gpu_like, monkeypatch, name):
    """Every path a call can take, run through ``attention`` as dispatched (fp32 on the CPU: SDPA's
    CPU kernels, the varlen fake), against the float64 oracle with all gradients."""
    monkeypatch.setattr(dispatch, "ROUTES", ALL_FUSED)
    make, window, scale, path = CASES[name]
    q, k, v, cu = make()
    seen = spy_paths(monkeypatch)
    do = torch.randn_like(q)
    kw = dict(window=window, scale=scale, cu_seqlens=cu)
    got = run(attention, q, k, v, do, **kw)
    want = run(reference_attention, q.double(), k.double(), v.double(), do.double(), **kw)
    assert seen == [path]
    for label, x, ref in zip(("o", "dq", "dk", "dv"), got, want):
        assert x.shape == ref.shape and x.dtype == q.dtype, label
        assert rel_err(x, ref) < 1e-4, (label, rel_err(x, ref))


def test_old_varlen_api_matches_oracle(gpu_like, monkeypatch):
    monkeypatch.setattr(dispatch, "ROUTES", ALL_FUSED)
    monkeypatch.setattr(dispatch, "varlen_api", lambda: OLD_API)
    q, k, v, cu = packed_case([3, 64, 20], 2, 2, 32)
    seen = spy_paths(monkeypatch)
    do = torch.randn_like(q)
    got = run(attention, q, k, v, do, cu_seqlens=cu)
    want = run(reference_attention, q.double(), k.double(), v.double(), do.double(), cu_seqlens=cu)
    assert seen == ["varlen"]
    for x, ref in zip(got, want):
        assert rel_err(x, ref) < 1e-4


def test_forced_triton_runs_the_kernel(gpu_like, monkeypatch):
    monkeypatch.setenv("TTR_ATTENTION", "triton")
    q, k, v = make_inputs(1, 40, 2, 2, 16)
    seen = spy_paths(monkeypatch)
    o = attention(q, k, v)
    assert seen == ["triton"] and rel_err(o, reference_attention(q.double(), k.double(), v.double())) < 1e-4


def test_sdpa_path_output_layout():
    """SDPA on transposed views hands back an output whose transpose is ttr's contiguous layout, so
    the layer's reshape to ``[B, T, H * D]`` copies nothing."""
    q, k, v = make_inputs(2, 33, 4, 2, 16)
    o = dispatch.sdpa_causal(q, k, v, 0.25)
    assert o.shape == q.shape and o.is_contiguous()


# the interpreter runs ttr's kernel on the script's fp16 rows; their values are not checked here
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_bench_attention_runs_on_cpu(monkeypatch, capsys, tmp_path):
    """scripts/bench_attention.py end to end at tiny shapes on the CPU (stand-in timers): every row
    prints a time or ``n/a: <reason>`` (varlen, cuDNN and the efficient kernel need a GPU), the
    summary and the JSON come out."""
    import json

    from ttr.kernels.utils import interpreter_active
    from ttr.scripts import bench_attention

    if not interpreter_active():
        pytest.skip("needs TRITON_INTERPRET=1 on a CPU machine")
    monkeypatch.setattr(bench_attention, "DEVICE", "cpu")
    monkeypatch.setattr(bench_attention, "time_ms", lambda fn, reps, warmup: fn() or 1.0)
    monkeypatch.setattr(bench_attention, "peak_mib", lambda fn: fn() or 0.0)
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    out = tmp_path / "attention.json"
    argv = ["--seqlens", "32", "--tokens", "64", "--heads", "2", "--head-dim", "16", "--window", "16",
            "--doc-mean", "24", "--dtype", "float16", "--reps", "1", "--no-presets", "--json", str(out)]
    assert bench_attention.main(argv) == 0
    text = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * 2 * 6 + 3  # layouts x masks x rows, and SDPA on views for full plain batches
    timed = {r["row"] for r in rows if "fwd_bwd_ms" in r}
    assert all("gpu_fwd_bwd_ms" in r for r in rows if r["row"] in timed)
    assert {"ttr", "auto -> triton", "sdpa flash", "sdpa flash (views)"} <= timed
    views = next(r for r in rows if r["row"] == "sdpa flash (views)")
    assert (views["mask"], views["layout"]) == ("full", "plain") and views["out_contiguous"]
    assert all(r["row"] in timed or r["na"] for r in rows)
    assert "n/a: " in text and "ROUTES the wall times call for" in text and "ROUTES the GPU times call for" in text
    bounds = bench_attention.packed_bounds(1000, 64, 24)
    assert bounds[0] == 0 and bounds[-1] == 1000 and sorted(bounds) == bounds
    assert all(e - s <= 64 and (s // 64 == (e - 1) // 64) for s, e in zip(bounds[:-1], bounds[1:]))


def fake_cudnn(calls):
    """``aten._scaled_dot_product_cudnn_attention`` by its schema, in torch (math SDPA), recording
    the arguments it was called with."""

    def op(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
           scale=None):
        calls.append(dict(shape=tuple(q.shape), bias=attn_bias, lse=compute_log_sumexp, dropout=dropout_p,
                          causal=is_causal, debug=return_debug_mask, scale=scale))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
        return (o,) + (None,) * 8

    return op


@pytest.mark.parametrize("case", ["direct", "gqa", "deterministic", "flash_first", "cudnn_refuses", "no_grad"])
def test_sdpa_path_calls_cudnn_directly_where_sdpa_would(monkeypatch, case):
    """Where cuDNN leads SDPA_BACKENDS and accepts the call, ``sdpa_causal`` runs its op directly (no
    backend context per call) with SDPA's arguments; grouped kv heads, deterministic mode, another
    backend first or inputs cuDNN refuses take SDPA's own dispatch. Values and gradients match the
    oracle either way."""
    from torch.nn.attention import SDPBackend

    calls = []
    monkeypatch.setattr(dispatch, "_cudnn_op", lambda: fake_cudnn(calls))
    accepts = case != "cudnn_refuses"
    monkeypatch.setattr(torch.backends.cuda, "can_use_cudnn_attention", lambda params, debug=False: accepts)
    if case == "flash_first":
        monkeypatch.setattr(dispatch, "SDPA_BACKENDS", (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION))
    if case == "deterministic":
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    q, k, v = (x.requires_grad_() for x in make_inputs(2, 33, 4, 2 if case == "gqa" else 4, 16))
    with torch.set_grad_enabled(case != "no_grad"):
        o = dispatch.sdpa_causal(q, k, v, 0.25)
    want = reference_attention(q.double(), k.double(), v.double(), scale=0.25)
    assert o.shape == q.shape and o.is_contiguous() and rel_err(o, want) < 1e-5
    direct = case in ("direct", "no_grad")
    assert calls == ([dict(shape=(2, 4, 33, 16), bias=None, lse=case == "direct", dropout=0.0, causal=True,
                           debug=False, scale=0.25)] if direct else [])
    if case != "no_grad":
        do = torch.randn_like(o)
        got = torch.autograd.grad(o, (q, k, v), do)
        ref = torch.autograd.grad(want, (q, k, v), do.double())
        for x, r in zip(got, ref):
            assert rel_err(x, r) < 1e-5
