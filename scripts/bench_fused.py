"""Benchmark the fused layer kernels on one GPU: linear cross-entropy, short conv, RMSNorms.

Tables (median ms over ``--reps`` CUDA-event timings; peak MiB of one forward+backward above
the inputs):
  loss   ttr fused linear_cross_entropy (Triton CE kernel, cuBLAS matmuls) vs the unfused
         ``F.cross_entropy(F.linear(h, W), y)``; 32768 tokens, hidden 2048, vocab 32000, bf16.
         Targets: fused peak <= 1/4 of unfused, fused time <= 1.2x unfused (the fusion is worth
         its code only if it saves most of the memory at little cost in time).
  conv   ttr causal_conv1d (Triton) vs its torch backend and depthwise ``F.conv1d``; W = 4, SiLU,
         B = 4, T = tokens / 4, D = 2 * hidden; then its two kernels alone at the 1.3B presets'
         conv shapes (Gated DeltaNet's q and k with their per-head L2 norm, its v, Mamba2's xBC
         read in place from its projection), B = 8, T = tokens / 8, and each packed (B = 1,
         random documents of 64 - 4096 tokens); ``--sweep`` also times the
         forward and the backward alone at the launch parameters of ``CONV_SWEEP``
         (``index.TUNING``'s ``conv_fwd`` and ``conv_bwd``), fastest first.
  norm   ttr rms_norm / gated_rms_norm (Triton) vs their torch backend; the residual add + norm
         of a pre-norm block (fp32 stream, bf16 branch) as an add then rms_norm, and fused;
         ``--sweep`` times the norm kernels at NORM_SWEEP's launches (``norm_fwd``, ``norm_bwd``).
  rope   rotary embedding of an attention layer's q and k at the 1.3B presets' shape (B = 8,
         T = tokens / 8, the transformer's heads), the angle tables included: ttr ``rotary``
         (Triton) vs its torch backend (the formula in torch ops) and fla's ``rotary_embedding``.
  proj   the projections whose input the backward forms again, at the 1.3B presets' shapes (read
         off the models): each mixer's output norm and o_proj (``norm_linear``) and the MLP's
         SwiGLU product and down_proj (``swiglu_linear``), against the op and then the module,
         as a model ran them before; bf16 autocast over fp32 weights, and the MiB each keeps for
         the backward.

    python -m ttr.scripts.bench_fused
    python -m ttr.scripts.bench_fused --only loss --chunk-size 2048 --reps 10
    python -m ttr.scripts.bench_fused --only conv --sweep
    python -m ttr.scripts.bench_fused --only norm --sweep
    python -m ttr.scripts.bench_fused --only proj
    python -m ttr.scripts.bench_fused --only rope
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F

from ttr.kernels.common.index import prepare_packing
from ttr.kernels.conv import causal_conv1d, conv_bwd, conv_fwd
from ttr.kernels.loss import linear_cross_entropy
from ttr.kernels.norm import gated_rms_norm, norm_linear, residual_rms_norm, rms_norm
from ttr.kernels.rotary import rope_tables, rotary
from ttr.kernels.swiglu import swiglu, swiglu_linear
from ttr.kernels.utils import backend_override
from ttr.models.presets import get_preset
from ttr.scripts.bench_utils import gpu_ms, peak_mib, time_ms, time_stages

SECTIONS = ("loss", "conv", "norm", "rope", "proj")
CONV_SWEEP = {
    "conv_fwd": [dict(BT=bt, BD=bd, num_warps=nw) for bt, bd in ((16, 256), (32, 128), (32, 256), (64, 64),
                 (64, 128), (128, 64), (128, 128)) for nw in (2, 4, 8)],
    "conv_bwd": [dict(SEG=seg, BD=bd, num_warps=nw, **cap) for seg in (128, 256, 512)
                 for bd, nw in ((128, 1), (128, 2), (256, 2), (256, 4))
                 for cap in ({}, {"maxnreg": 120}, {"maxnreg": 128})],
}
NORM_SWEEP = {
    "norm_fwd": [dict(ELEMS=e, num_warps=nw) for e in (2048, 4096, 8192) for nw in (4, 8, 16)],
    "norm_bwd": [dict(ELEMS=e, num_warps=nw, SM_PROGS=p) for e in (2048, 4096, 8192) for nw in (4, 8, 16)
                 for p in (2, 4, 8)],
}
DEVICE = "cuda"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=SECTIONS, nargs="+", default=list(SECTIONS))
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--chunk-size", type=int, default=None, help="fused loss chunk (default: the op's own)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--sweep", action="store_true",
                   help="conv, norm: also time the kernels at CONV_SWEEP's / NORM_SWEEP's launches")
    return p.parse_args(argv)


def with_backend(backend, fn):
    """Run ``fn`` with TTR_KERNEL_BACKEND set to ``backend`` (restored afterwards)."""

    def run():
        with backend_override(backend):
            return fn()

    return run


def measure(forward, inputs, reps, warmup, with_peak=False):
    """(fwd ms, fwd+bwd ms, peak MiB | None) of ``forward()`` whose result is a tensor or a tuple;
    the backward gets a random gradient for every output tensor that has one."""

    def outputs(out):
        out = out if isinstance(out, tuple) else (out,)
        return [o for o in out if isinstance(o, torch.Tensor) and o.requires_grad]

    grad_outs = [torch.randn_like(o) for o in outputs(forward())]

    def fwd():
        with torch.no_grad():
            forward()

    def fwd_bwd():
        torch.autograd.grad(outputs(forward()), inputs, grad_outs)

    fwd_bwd()  # compile before timing
    peak = peak_mib(fwd_bwd) if with_peak else None
    return time_ms(fwd, reps, warmup), time_ms(fwd_bwd, reps, warmup), peak


def row(name, fwd, fwd_bwd, peak=None):
    peak_s = f"{peak:10.0f}" if peak is not None else f"{'':>10}"
    print(f"| {name:<44} | {fwd:8.3f} | {fwd_bwd:8.3f} | {peak_s} |", flush=True)


def header(title):
    print(f"\n{title}\n| {'op':<44} | {'fwd ms':>8} | {'f+b ms':>8} | {'peak MiB':>10} |")
    print(f"|{'-' * 46}|{'-' * 10}|{'-' * 10}|{'-' * 12}|", flush=True)


def bench_loss(args, dtype):
    n, d, v = args.tokens, args.hidden, args.vocab
    h = torch.randn(n, d, device=DEVICE, dtype=dtype, requires_grad=True)
    w = (torch.randn(v, d, device=DEVICE, dtype=dtype) / d**0.5).requires_grad_()
    labels = torch.randint(0, v, (n,), device=DEVICE)
    labels[::17] = -100
    header(f"loss: {n} tokens, hidden {d}, vocab {v}, {dtype}")
    results = {}
    fused = with_backend("triton", lambda: linear_cross_entropy(h, w, labels, chunk_size=args.chunk_size))
    unfused = lambda: F.cross_entropy(F.linear(h, w), labels)
    for name, fn in (("unfused F.linear + F.cross_entropy", unfused), ("ttr linear_cross_entropy", fused)):
        try:
            results[name] = measure(fn, (h, w), args.reps, args.warmup, with_peak=True)
        except torch.OutOfMemoryError as e:
            print(f"| {name:<44} | OOM: {str(e).splitlines()[0][:60]}")
            continue
        row(name, *results[name])
    if len(results) == 2:
        (_, tu, pu), (_, tf, pf) = results.values()
        print(
            f"fused/unfused: time {tf / tu:.2f}x (target <= 1.2x: {'met' if tf <= 1.2 * tu else 'MISSED'}), "
            f"peak memory {pf / pu:.3f}x (target <= 0.25x: {'met' if pf <= 0.25 * pu else 'MISSED'})"
        )


def bench_conv(args, dtype):
    b, t, d, width = 4, args.tokens // 4, 2 * args.hidden, 4
    x = torch.randn(b, t, d, device=DEVICE, dtype=dtype, requires_grad=True)
    weight = (torch.randn(d, width, device=DEVICE, dtype=dtype) / 2).requires_grad_()
    bias = torch.randn(d, device=DEVICE, dtype=dtype, requires_grad=True)
    header(f"conv: B={b}, T={t}, D={d}, W={width}, SiLU, {dtype}")
    inputs = (x, weight, bias)
    for backend in ("triton", "torch"):
        fn = with_backend(backend, lambda: causal_conv1d(x, weight, bias, activation="silu")[0])
        row(f"ttr causal_conv1d [{backend}]", *measure(fn, inputs, args.reps, args.warmup, with_peak=True))
    try:
        from fla.modules.causal_conv1d import causal_conv1d as fla_conv

        fn = lambda: fla_conv(x, weight, bias, activation="silu")[0]  # noqa: E731
        row("fla causal_conv1d", *measure(fn, inputs, args.reps, args.warmup, with_peak=True))
    except Exception as err:  # fla is optional; say why the row is missing
        print(f"(fla causal_conv1d row skipped: {type(err).__name__}: {err})")

    def depthwise():
        y = F.conv1d(x.transpose(1, 2), weight[:, None, :], bias, padding=width - 1, groups=d)
        return F.silu(y[..., :t]).transpose(1, 2)

    row("F.conv1d depthwise + silu", *measure(depthwise, inputs, args.reps, args.warmup, with_peak=True))
    if args.sweep:
        dy = torch.randn_like(x)
        calls = {"conv_fwd": lambda: conv_fwd(x, weight, bias, None, "silu", None)[0],
                 "conv_bwd": lambda: conv_bwd(x, weight, bias, None, dy, None, "silu", None)}
        time_stages(calls, f"conv B={b} T={t} D={d}", CONV_SWEEP)
    conv_kernels_at_presets(dtype, args.tokens)


def first_block(preset: str):
    """The first block of ``preset``'s model, built on the meta device (shapes, no memory)."""
    from ttr.models.modeling import TTRForCausalLM

    with torch.device("meta"):
        return TTRForCausalLM(get_preset(preset)).model.layers[0]


def preset_convs(presets=("gated_deltanet-1.3b", "mamba2-1.3b")) -> list[tuple[str, int, int, bool, int]]:
    """The short convs of the first block of each preset, read off the model built on the meta
    device: (name, channels D, per-head L2 group or 0, bias, width of the projection x is a column
    slice of); convs of one shape are one row."""
    from ttr.models.modules import ShortConv

    found: dict[tuple, list[str]] = {}
    for preset in presets:
        mixer = first_block(preset).mixer
        # a mixer with one input projection (Mamba2's in_proj) hands its conv a column slice of it,
        # and the delta rules' layers read q, k and v as column blocks of one product in training
        proj = getattr(mixer, "in_proj", None)
        convs = [m for m in mixer.modules() if isinstance(m, ShortConv)]
        width = proj.out_features if proj else sum(c.weight.shape[0] for c in convs)
        for name, conv in mixer.named_modules():
            if isinstance(conv, ShortConv):
                key = (preset, conv.weight.shape[0], conv.l2_group or 0, conv.bias is not None, width)
                found.setdefault(key, []).append(name)
    return [(f"{key[0]} {', '.join(names)}", *key[1:]) for key, names in found.items()]


def _conv_kernel_ms(x, weight, bias, dy, l2, packing=None):
    """Median ms of ``conv_fwd`` and of ``conv_bwd`` on these inputs."""
    from triton.testing import do_bench

    fwd = do_bench(lambda: conv_fwd(x, weight, bias, None, "silu", packing, l2), warmup=10, rep=100,
                   return_mode="median")
    rstd = conv_fwd(x, weight, bias, None, "silu", packing, l2)[1]
    bwd = do_bench(lambda: conv_bwd(x, weight, bias, None, dy, None, "silu", packing, l2, rstd), warmup=10, rep=100,
                   return_mode="median")
    return fwd, bwd


def random_documents(tokens: int, seed: int = 0, shortest: int = 64, longest: int = 4096) -> torch.Tensor:
    """cu_seqlens (int32, on the GPU) of documents of uniformly random lengths filling ``tokens``."""
    gen = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < tokens:
        lens.append(int(torch.randint(shortest, longest, (1,), generator=gen)))
    lens[-1] -= sum(lens) - tokens
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEVICE, dtype=torch.int32)


def conv_kernels_at_presets(dtype, tokens: int, batch: int = 8):
    """The conv's two kernels alone (``conv_fwd``, ``conv_bwd``) at the presets' conv shapes, and the
    bandwidth they reach (the forward reads x and writes y, the backward reads x and dy and writes
    dx); each also packed, all tokens in one row of random-length documents."""
    t = tokens // batch
    cu = random_documents(tokens)
    packing = prepare_packing(cu, tokens, device=DEVICE)
    print(f"\nconv kernels at the 1.3B presets' shapes, B={batch}, T={t} (packed: B=1, T={tokens} in "
          f"{len(cu) - 1} documents), width 4, SiLU, {dtype}")
    print(f"| {'conv':<44} | {'D':>5} | {'fwd ms':>8} | {'bwd ms':>8} | {'bwd TB/s':>8} |")
    print(f"|{'-' * 46}|{'-' * 7}|{'-' * 10}|{'-' * 10}|{'-' * 10}|", flush=True)
    for name, d, l2, has_bias, width in preset_convs():
        for packed in (False, True):
            b, n = (1, tokens) if packed else (batch, t)
            x = torch.randn(b, n, width, device=DEVICE, dtype=dtype)[..., :d]  # read in place, as the layers do
            weight = torch.randn(d, 4, device=DEVICE, dtype=dtype) / 2
            bias = torch.randn(d, device=DEVICE, dtype=dtype) if has_bias else None
            dy = torch.randn(b, n, d, device=DEVICE, dtype=dtype)
            fwd, bwd = _conv_kernel_ms(x, weight, bias, dy, l2, packing if packed else None)
            label = (name + (f" (L2 norm per {l2})" if l2 else "") + (" (bias)" if has_bias else "")
                     + (" packed" if packed else ""))
            tbs = 3 * x.numel() * x.element_size() / bwd / 1e9
            print(f"| {label:<44} | {d:>5} | {fwd:8.3f} | {bwd:8.3f} | {tbs:8.2f} |", flush=True)


def bench_norm_shape(args, dtype, shape):
    x = torch.randn(*shape, device=DEVICE, dtype=dtype, requires_grad=True)
    z = torch.randn(*shape, device=DEVICE, dtype=dtype, requires_grad=True)
    w = torch.ones(shape[-1], device=DEVICE, dtype=dtype, requires_grad=True)
    header(f"norm: x {list(shape)}, {dtype}")
    for backend in ("triton", "torch"):
        fn = with_backend(backend, lambda: rms_norm(x, w))
        row(f"ttr rms_norm [{backend}]", *measure(fn, (x, w), args.reps, args.warmup, with_peak=True))
        fn = with_backend(backend, lambda: gated_rms_norm(x, z, w))
        row(
            f"ttr gated_rms_norm [{backend}]", *measure(fn, (x, z, w), args.reps, args.warmup, with_peak=True)
        )


def bench_residual_norm(args, dtype):
    """A pre-norm block's residual add and norm as a model runs them under autocast: the fp32
    stream plus a branch in ``dtype``, the normalised output in ``dtype``, a gradient on both."""
    h = torch.randn(args.tokens, args.hidden, device=DEVICE, requires_grad=True)
    branch = torch.randn(args.tokens, args.hidden, device=DEVICE, dtype=dtype, requires_grad=True)
    w = torch.ones(args.hidden, device=DEVICE, requires_grad=True)
    header(f"residual add + norm: fp32 stream [{args.tokens}, {args.hidden}], branch and output {dtype}")

    def unfused():
        s = h + branch
        return s, rms_norm(s, w, out_dtype=dtype)

    for name, fn in (("h + branch, then ttr rms_norm", unfused),
                     ("ttr residual_rms_norm", lambda: residual_rms_norm(h, branch, w, out_dtype=dtype))):
        row(name, *measure(fn, (h, branch, w), args.reps, args.warmup, with_peak=True))
    if args.sweep:
        sweep_norm(h.detach(), branch.detach(), w.detach(), dtype)


def sweep_norm(h, branch, w, dtype):
    """The norm kernels alone at NORM_SWEEP's launches: the residual norm (fp32 stream, ``dtype``
    branch and output, the stream's gradient added) and the per-head L2 norm of q and k
    (``[tokens * 16, 128]`` in ``dtype``)."""
    from ttr.kernels.norm import _triton_bwd, _triton_fwd

    _, rstd, s = _triton_fwd(h, None, w, 1e-6, dtype, r2=branch)
    dy, ds = torch.randn_like(h, dtype=dtype), torch.randn_like(h)
    calls = {"norm_fwd": lambda: _triton_fwd(h, None, w, 1e-6, dtype, r2=branch),
             "norm_bwd": lambda: _triton_bwd(s, None, w, dy, rstd, ds2=ds, dr_dtype=dtype)}
    time_stages(calls, f"residual norm {list(h.shape)}", NORM_SWEEP)
    q = torch.randn(h.shape[0] * 16, 128, device=DEVICE, dtype=dtype)
    wq = torch.full((128,), 128**-0.5, device=DEVICE)
    _, rstd_q, _ = _triton_fwd(q, None, wq, 1e-6)
    dq = torch.randn_like(q)
    calls = {"norm_fwd": lambda: _triton_fwd(q, None, wq, 1e-6),
             "norm_bwd": lambda: _triton_bwd(q, None, wq, dq, rstd_q)}
    time_stages(calls, f"per-head norm {list(q.shape)}", NORM_SWEEP)


def bench_norm(args, dtype):
    """Model-width rows and the per-head output norm of Gated DeltaNet / Mamba2 (16 heads of 128),
    then the residual add + norm."""
    for shape in ((args.tokens, args.hidden), (args.tokens, 16, 128)):
        bench_norm_shape(args, dtype, shape)
    bench_residual_norm(args, dtype)


def bench_rope(args, dtype, preset="transformer-1.3b"):
    """The wall-clock columns of an op this short are mostly its host's time (the angle tables are
    six small torch ops); the GPU column times the kernels alone (``gpu_ms``)."""
    cfg = get_preset(preset)
    b, t, h, d = 8, args.tokens // 8, cfg.attn_num_heads, cfg.attn_head_dim
    theta = cfg.rope_theta
    q = torch.randn(b, t, h, d, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(b, t, cfg.attn_num_kv_heads, d, device=DEVICE, dtype=dtype, requires_grad=True)
    pos = torch.arange(t, device=DEVICE)[None]
    print(f"\nrope: q and k of {preset}'s attention, B={b}, T={t}, H={h}, D={d}, {dtype}, tables included")
    print(f"| {'op':<28} | {'fwd ms':>8} | {'f+b ms':>8} | {'f+b GPU ms':>10} | {'peak MiB':>10} |")
    print(f"|{'-' * 30}|{'-' * 10}|{'-' * 10}|{'-' * 12}|{'-' * 12}|", flush=True)

    def ttr_rope():
        cos, sin = rope_tables(pos, d, theta)
        return rotary(q, cos, sin), rotary(k, cos, sin)

    def fla_rope():
        from fla.modules.rotary import rotary_embedding

        # fla takes [T, D/2] tables in x's dtype
        cos, sin = (tab[0].to(dtype) for tab in rope_tables(pos, d, theta))
        return rotary_embedding(q, cos, sin), rotary_embedding(k, cos, sin)

    for name, fn in (("ttr rotary [triton]", with_backend("triton", ttr_rope)),
                     ("ttr rotary [torch]", with_backend("torch", ttr_rope)), ("fla rotary_embedding", fla_rope)):
        try:
            fwd, fwd_bwd, peak = measure(fn, (q, k), args.reps, args.warmup, with_peak=True)
        except Exception as err:  # fla is optional; say why its row is missing
            print(f"({name} row skipped: {type(err).__name__}: {err})")
            continue
        grads = [torch.randn_like(o) for o in fn()]
        gpu = gpu_ms(lambda: torch.autograd.grad(fn(), (q, k), grads))  # noqa: B023
        print(f"| {name:<28} | {fwd:8.3f} | {fwd_bwd:8.3f} | {gpu:10.3f} | {peak:10.0f} |", flush=True)


def preset_projections(presets=("gated_deltanet-1.3b", "mamba2-1.3b")) -> list[dict]:
    """The first block's projections whose input the backward forms again, read off each model
    built on the meta device: the mixer's output norm before o_proj / out_proj (per-head width D,
    heads H, gated, gate first, groups, the projection's shape) and the MLP's down projection
    (its input width I and output width)."""
    from ttr.models.modules import GatedRMSNorm

    found = []
    for preset in presets:
        block = first_block(preset)
        mixer = block.mixer
        if hasattr(mixer, "o_norm"):
            norm, proj = mixer.o_norm, mixer.o_proj
            found.append(dict(name=f"{preset} o_norm + o_proj", kind="norm", d=norm.weight.shape[0],
                              heads=proj.in_features // norm.weight.shape[0], gated=isinstance(norm, GatedRMSNorm),
                              gate_first=False, groups=1, out=proj.out_features))
        elif hasattr(mixer, "out_proj") and hasattr(mixer, "norm_weight"):
            found.append(dict(name=f"{preset} gated norm + out_proj", kind="norm", d=mixer.norm_weight.shape[0],
                              heads=1, gated=True, gate_first=True, groups=mixer.n_groups,
                              out=mixer.out_proj.out_features))
        mlp = getattr(block, "mlp", None)
        if mlp is not None:
            found.append(dict(name=f"{preset} SwiGLU + down_proj", kind="mlp", d=mlp.down_proj.in_features,
                              out=mlp.down_proj.out_features))
    return found


def kept_mib(forward, inputs) -> float:
    """MiB that one call of ``forward()`` keeps for its backward, the ``inputs``' storages aside."""
    from ttr.scripts.activation_memory import Ledger

    with Ledger({t.untyped_storage().data_ptr() for t in inputs}) as ledger:
        forward()
    return sum(ledger.by_site().values()) / 2**20


def projection_calls(spec: dict, tokens: int, dtype, device=DEVICE):
    """(inputs, {name: forward}) of one ``preset_projections`` entry: the fused op and the op before
    it then the projection as a module, both under autocast to ``dtype`` with fp32 weights."""
    lin = torch.nn.Linear(spec["d"] * spec.get("heads", 1), spec["out"], bias=False, device=device)

    def autocast(fn):
        def run():
            with torch.autocast(torch.device(device).type, dtype=dtype):
                return fn()

        return run

    if spec["kind"] == "mlp":
        gate, up = (torch.randn(tokens, spec["d"], device=device, dtype=dtype, requires_grad=True) for _ in range(2))
        inputs = (gate, up, lin.weight)
        return inputs, {
            "fused (swiglu_linear)": autocast(lambda: swiglu_linear(gate, up, lin.weight)),
            "swiglu, then the module": autocast(lambda: lin(swiglu(gate, up))),
        }
    shape = (tokens, spec["heads"], spec["d"]) if spec["heads"] > 1 else (tokens, spec["d"])
    x = torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)
    z = torch.randn(*shape, device=device, dtype=dtype, requires_grad=True) if spec["gated"] else None
    w = torch.ones(spec["d"], device=device, requires_grad=True)
    kw = dict(norm_before_gate=not spec["gate_first"], groups=spec["groups"])
    inputs = tuple(t for t in (x, z, w, lin.weight) if t is not None)

    def unfused():
        y = gated_rms_norm(x, z, w, **kw) if z is not None else rms_norm(x, w)
        return lin(y.flatten(-2) if spec["heads"] > 1 else y)

    return inputs, {
        "fused (norm_linear)": autocast(lambda: norm_linear(x, z, w, lin.weight, heads=spec["heads"] > 1, **kw)),
        "the norm, then the module": autocast(unfused),
    }


def bench_proj(args, dtype):
    print(f"\nprojections whose input the backward forms again: {args.tokens} tokens, {dtype} autocast, fp32 "
          f"weights\n| {'op':<56} | {'fwd ms':>8} | {'f+b ms':>8} | {'peak MiB':>10} | {'kept MiB':>10} |")
    print(f"|{'-' * 58}|{'-' * 10}|{'-' * 10}|{'-' * 12}|{'-' * 12}|", flush=True)
    for spec in preset_projections():
        inputs, calls = projection_calls(spec, args.tokens, dtype)
        for name, fn in calls.items():
            fn = with_backend("triton", fn)
            fwd, fwd_bwd, peak = measure(fn, inputs, args.reps, args.warmup, with_peak=True)
            label = f"{spec['name']}: {name}"
            print(f"| {label:<56} | {fwd:8.3f} | {fwd_bwd:8.3f} | {peak:10.0f} | {kept_mib(fn, inputs):10.0f} |",
                  flush=True)


def describe():
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except OSError:
        commit = "unknown"
    import triton

    print(
        f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
        f"commit {commit or 'unknown'}"
    )


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_fused needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    describe()
    sections = {"loss": bench_loss, "conv": bench_conv, "norm": bench_norm, "rope": bench_rope, "proj": bench_proj}
    for name in args.only:
        sections[name](args, dtype)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
