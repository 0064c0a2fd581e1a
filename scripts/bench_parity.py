"""Quality parity: every ttr family trained next to its reference implementation.

    python -m ttr.scripts.bench_parity [--families gated_deltanet,delta_net,gla,mamba2,transformer,
        gated_deltanet_h1] [--size 340m] [--steps 1000] [--batch 8] [--seq-len 2048] [--out DIR]
    python -m ttr.scripts.bench_parity --report DIR [DIR ...] [--plot parity.png]
    python -m ttr.scripts.bench_parity --op-errors 100 --families delta_net   # kernel error, see op_errors

For each family, the ttr preset ``<family>-<size>`` and the reference model of the same shape
(``ttr.scripts.reference_models``: fla 0.6.0, HF Llama, HF Mamba2) are trained in one process,
one after the other, from their own default initialisations, on the same batches in the same
order with the same recipe: AdamW (0.9, 0.95), peak lr 1e-3 after 30 linear warm-up steps, cosine
to 1e-4, weight decay 0.1 on matrices (parameters with two or more dims), gradient clipping at
1.0, bf16 autocast over fp32 weights, loss = mean next-token cross-entropy (the models' own).

Data, offline: the Python source files of the running interpreter (standard library and
site-packages), in a seeded file order; files whose path hashes to 0 mod 50 are held out for
validation. The tokenizer is ttr's embedded BPE (8192 pieces, trained on the standard library).
Documents are joined with EOS and cut into plain ``[batch, seq_len]`` rows (no packing
metadata), so every model sees exactly the same tokens.

Before training, fla's and HF's gradients are compared with ttr's on the reference's own
initial weights (converted by ``ttr.models.convert``), under the same bf16 autocast: this checks
the conversion and the reference kernels on the GPU at hand (fla 0.6.0 refuses its gated backward on Hopper with
Triton < 3.7.1, its issue #640; the guard is lifted here and this check says whether its
gradients are right at these shapes). Each side is also compared with ttr's fp32 gradients: a
model ill-conditioned at its initial weights (GLA) rounds far from fp32 in bf16 in either
implementation, and then only ``--op-errors`` says whether a kernel is right.

``--impls ttr_refinit`` trains ttr's model from the reference's initial weights (converted), and
``--impls reference_ttrinit`` the reference from ttr's, so a pair of runs differs in the
implementation only; ``--init-seed N`` draws a model's weights again (the data order stays
``--seed``'s). One run is not a measurement at this scale: repeats of one reference from the same
weights differ by several percent at step 800 (its kernels are not deterministic), and draws of
the weights as much, so the table compares means over draws (a draw's repeats averaged first)
with their standard error, and same-start runs as per-draw ratios.

Each run writes ``<out>/<family>.<impl>[.initN].json`` (loss per step, validation loss every ``--val-every``
steps, gradient norm at step 0, tokens/s, peak memory); a repeat of a run is kept as
``<family>.<label>.repeatN.json``. ``--report`` (``ttr.scripts.parity_report``) merges such files
into the markdown tables of ``docs/benchmarks.md`` and a plot of the curves.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import sys
import sysconfig
import time
import zlib
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

FAMILIES = ["gated_deltanet", "delta_net", "gla", "mamba2", "transformer", "gated_deltanet_h1"]
REFERENCE_NAMES = {
    "gated_deltanet": "fla 0.6.0 GatedDeltaNetForCausalLM",
    "delta_net": "fla 0.6.0 DeltaNetForCausalLM",
    "gla": "fla 0.6.0 GLAForCausalLM",
    "gated_deltanet_h1": "fla 0.6.0 GatedDeltaNetForCausalLM + SWA layers",
    "mamba2": "HF Mamba2ForCausalLM",
    "transformer": "HF LlamaForCausalLM (SDPA)",
}
TARGET = 1.01


# -- data ----------------------------------------------------------------------------------------


MAX_FILE_BYTES = 200_000


def source_files() -> list[str]:
    """Every ``.py`` file of the interpreter's library folders, except files over
    ``MAX_FILE_BYTES``: those are generated tables (unicode data, lexers, vendored bundles) whose
    tens of thousands of look-alike lines would fill many consecutive batches."""
    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")}
    files = set()
    for root in roots:
        for p in Path(root).rglob("*.py"):
            if "__pycache__" not in p.parts and p.is_file() and p.stat().st_size <= MAX_FILE_BYTES:
                files.add(str(p))
    return sorted(files)


def _encode_file(path: str) -> np.ndarray:
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    return np.asarray(_TOKENIZER.encode(text) + [_TOKENIZER.eos_id], dtype=np.int32)


_TOKENIZER = None


def _init_worker(tokenizer) -> None:
    global _TOKENIZER
    _TOKENIZER = tokenizer


def build_tokenizer():
    from ttr.train.sources import EmbeddedSource
    from ttr.train.tokenizer import load_tokenizer

    src = EmbeddedSource()
    return load_tokenizer("", texts=lambda: (src.get(i) for i in range(int(src.sizes.sum()))),
                          fingerprint=src.fingerprint(), vocab_size=8192)


def token_stream(files: list[str], tokenizer, need: int, workers: int) -> np.ndarray:
    """Encode ``files`` in order until ``need`` tokens; returns them joined (EOS between files)."""
    out, total = [], 0
    with ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        for start in range(0, len(files), 256):
            for ids in pool.map(_encode_file, files[start:start + 256], chunksize=8):
                out.append(ids)
                total += len(ids)
            if total >= need:
                break
    if total < need:
        raise ValueError(f"the corpus has {total:,} tokens, fewer than the {need:,} the run needs")
    return np.concatenate(out)[:need]


def build_data(args, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Training ``[steps, batch, seq_len]`` and validation ``[val_batches, batch, seq_len]`` tokens,
    read from ``--data-cache`` when it holds this run's shape (several processes then share one
    encoding pass)."""
    cache = Path(args.data_cache) if args.data_cache else None
    key = f"{args.seed}|{args.steps}|{args.batch}|{args.seq_len}|{args.val_batches}|{tokenizer.vocab_size}"
    if cache is not None and cache.is_file():
        data = np.load(cache)
        if str(data["key"]) == key:
            return data["train"], data["val"]
    train, val = _encode_data(args, tokenizer)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f"{cache.stem}.tmp{os.getpid()}.npz")
        np.savez(tmp, train=train, val=val, key=key)
        os.replace(tmp, cache)
    return train, val


def _encode_data(args, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    files = source_files()
    random.Random(args.seed).shuffle(files)
    val = [f for f in files if zlib.crc32(f.encode()) % 50 == 0]
    train = [f for f in files if zlib.crc32(f.encode()) % 50 != 0]
    rows = args.batch * args.seq_len
    workers = max(1, min(16, os.cpu_count() or 1))
    train_tokens = token_stream(train, tokenizer, args.steps * rows, workers)
    val_tokens = token_stream(val, tokenizer, args.val_batches * rows, workers)
    return (train_tokens.reshape(args.steps, args.batch, args.seq_len),
            val_tokens.reshape(args.val_batches, args.batch, args.seq_len))


# -- models --------------------------------------------------------------------------------------


def ttr_config(family: str, size: str, vocab_size: int):
    from ttr.models.presets import get_preset

    return get_preset(f"{family}-{size}", vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, use_cache=False)


# The chunkwise op each fla family's layer calls: (ttr layer module, the name it calls, fla's op,
# the keyword arguments fla's layer adds: GLA's keeps its state transposed, [V, K]).
FLA_OPS = {
    "gated_deltanet": ("gated_deltanet", "chunk_gated_delta_rule", "fla.ops.gated_delta_rule", {}),
    "gated_deltanet_h1": ("gated_deltanet", "chunk_gated_delta_rule", "fla.ops.gated_delta_rule", {}),
    "delta_net": ("delta_net", "chunk_delta_rule", "fla.ops.delta_rule", {}),
    "gla": ("gla", "chunk_gla", "fla.ops.gla", {"state_v_first": True}),
}


def layer_op(family: str):
    """``(layer module, name, ttr's op, fla's op)`` of an fla family's chunkwise mixer op, fla's
    called as its layer calls it."""
    import functools
    import importlib

    module_name, name, fla_module, fla_kwargs = FLA_OPS[family]
    module = importlib.import_module(f"ttr.models.layers.{module_name}")
    fla_op = getattr(importlib.import_module(fla_module), name)
    return module, name, getattr(module, name), functools.partial(fla_op, **fla_kwargs) if fla_kwargs else fla_op


def mixer_class(module):
    """The mixer class of a layer module that sets ``qk_l2_norm`` (its q and k L2-normalised)."""
    return next(c for c in vars(module).values() if isinstance(c, type) and "qk_l2_norm" in vars(c))


# Families whose fla layer L2-normalises q and k inside the chunkwise op (use_qk_l2norm_in_kernel).
L2_IN_KERNEL = ("delta_net", "gated_deltanet", "gated_deltanet_h1")


def swap_in_reference_kernels(config, l2_in_kernel: bool = False) -> None:
    """Route ttr's chunkwise mixer ops to the reference's kernels (fla's, and mamba_ssm's SSD for
    Mamba2), leaving the rest of ttr's model as it is. A diagnostic: when a family trains behind its
    reference, this run says whether the kernels are the cause (it then follows the reference's
    curve) or the layers around them (it stays with ttr's). With ``l2_in_kernel`` (the delta rules)
    the q/k L2 norm moves into fla's op too, as fla's layers call it, instead of ttr's own norm."""
    from ttr.models.layers import mamba2
    from ttr.scripts.reference_models import family_of

    family = family_of(config)
    if l2_in_kernel and family not in L2_IN_KERNEL:
        raise ValueError(f"{family}: its fla layer has no q/k L2 norm inside the op")
    if family in FLA_OPS:
        module, name, _, fla_op = layer_op(family)
        if l2_in_kernel:
            mixer_class(module).qk_l2_norm = False
            fla_op = functools.partial(fla_op, use_qk_l2norm_in_kernel=True)
        setattr(module, name, fla_op)
    elif family == "mamba2":
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

        from ttr.kernels.conv import causal_conv1d
        from ttr.kernels.ssd.reference import xbc_views

        def chunk_conv_ssd(xbc, conv_weight, conv_bias, dt, A, *, groups, state_size, D=None, initial_state=None,
                           output_final_state=False, cu_seqlens=None):
            if initial_state is not None or output_final_state or cu_seqlens is not None:
                raise ValueError("the swapped SSD trains plain batches only")
            y, _ = causal_conv1d(xbc, conv_weight, conv_bias, activation="silu")
            x, B, C = xbc_views(y, dt.shape[2], groups, state_size)
            return mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size=64, D=D), None

        mamba2.chunk_conv_ssd = chunk_conv_ssd
    else:
        raise ValueError(f"no reference kernel to swap in for {family}")


IMPLS = {
    "ttr": "ttr's model from its own initialisation",
    "reference": "the reference model from its own initialisation",
    "ttr_refinit": "ttr's model from the reference's initial weights (converted): the same start, so what "
                   "differs from the reference's run is the implementation alone, not the draw of the weights",
    "reference_ttrinit": "the reference model from ttr's initial weights: with ttr_refinit, tells a draw that "
                         "trains worse from an implementation that does",
    "swap": "ttr's model with the reference's chunkwise kernel in place of ttr's",
    "swap_l2": "as swap, the delta rules with the q/k L2 norm inside fla's kernel, as fla's layer calls it",
}


def ttr_from_reference(config, seed: int, device: str = "cuda"):
    """ttr's model holding the weights of the reference initialised with ``seed`` (through ``ttr
    convert``), in fp32 on ``device``, and the reference itself."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from ttr.models.convert import convert_checkpoint

    ref = build("reference", config, seed, device)
    with tempfile.TemporaryDirectory() as tmp:
        ref.save_pretrained(f"{tmp}/ref")
        convert_checkpoint(f"{tmp}/ref", f"{tmp}/ttr")
        mine = AutoModelForCausalLM.from_pretrained(f"{tmp}/ttr", dtype=torch.float32).to(device)
    return mine, ref


@torch.no_grad()
def reference_from_ttr(config, seed: int, device: str = "cuda"):
    """The reference model holding ttr's initial weights drawn with ``seed``: ``ttr convert``'s map
    read backwards (a renaming, plus the depthwise convs' ``[C, 1, W]`` view)."""
    from transformers import AutoModelForCausalLM

    from ttr.models.convert import convert_state_dict
    from ttr.scripts.reference_models import build_reference

    torch.manual_seed(seed)
    mine = AutoModelForCausalLM.from_config(config).state_dict()
    ref = build_reference(config)
    for key, value in ref.state_dict().items():
        if not key.endswith("rotary.inv_freq"):
            (name,) = convert_state_dict(ref.config.model_type, {key: value})
            value.copy_(mine[name].view_as(value))
    return ref.to(device)


def build(impl: str, config, seed: int, device: str = "cuda"):
    """``impl``'s model of ``config`` (``IMPLS``), its weights drawn with ``seed``."""
    from transformers import AutoModelForCausalLM

    from ttr.scripts.reference_models import build_reference, check_same_shape

    if impl == "ttr_refinit":
        return ttr_from_reference(config, seed, device)[0]
    if impl == "reference_ttrinit":
        return reference_from_ttr(config, seed, device)
    torch.manual_seed(seed)
    if impl in ("ttr", "swap", "swap_l2"):
        if impl != "ttr":
            swap_in_reference_kernels(config, l2_in_kernel=impl == "swap_l2")
        model = AutoModelForCausalLM.from_config(config)
    else:
        model = build_reference(config)
        check_same_shape(config, model)
    return model.to(device)


def grad_check(config, batch: torch.Tensor, device: str = "cuda") -> dict:
    """Loss and gradients of the reference and of ttr on the reference's initial weights, under
    the training run's bf16 autocast (so the kernels checked are the ones that train), and each
    model once more in fp32: ttr's fp32 gradients are the baseline that says whether a bf16
    difference between the two is an error of one of them or the bf16 rounding of both, amplified
    by the model at its initial weights (then ttr's own bf16 gradients are as far from fp32)."""
    from ttr.models.convert import convert_state_dict

    mine, ref = ttr_from_reference(config, seed=1234, device=device)
    x = batch.to(device)

    def loss_and_grads(model, autocast: bool, model_type: str | None = None):
        """Its loss and gradients, by ttr's names (the reference's renamed from ``model_type``'s)."""
        model.train()
        model.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        return loss.item(), convert_state_dict(model_type, grads) if model_type else grads

    ref_type = ref.config.model_type
    (loss_ref, ref_bf16), (loss_ttr, ttr_bf16) = loss_and_grads(ref, True, ref_type), loss_and_grads(mine, True)
    (_, ref_fp32), (_, ttr_fp32) = loss_and_grads(ref, False, ref_type), loss_and_grads(mine, False)
    names = [n for n in ttr_bf16 if n in ref_bf16]

    def rel(a: dict, b: dict) -> tuple[float, float, str]:
        """(error over all tensors, worst tensor's error, its name) of ``a`` against ``b``."""
        errors = {n: ((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-30)).item() for n in names}
        diff = torch.sqrt(sum((a[n] - b[n]).square().sum() for n in names))
        total = torch.sqrt(sum(b[n].square().sum() for n in names))
        worst = max(errors, key=errors.get)
        return (diff / total).item(), errors[worst], worst

    result = {"loss_reference": loss_ref, "loss_ttr": loss_ttr}
    result["grad_rel_err_all"], result["grad_rel_err_max"], result["grad_worst"] = rel(ref_bf16, ttr_bf16)
    for key, grads in (("reference_bf16", ref_bf16), ("ttr_bf16", ttr_bf16), ("reference_fp32", ref_fp32)):
        result[f"{key}_vs_ttr_fp32"] = rel(grads, ttr_fp32)[0]
    del ref, mine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


# -- training ------------------------------------------------------------------------------------


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


@torch.no_grad()
def evaluate(model, val: np.ndarray) -> float:
    model.eval()
    total = 0.0
    for rows in val:
        x = torch.from_numpy(rows).long().cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            total += model(input_ids=x, labels=x, use_cache=False).loss.float().item()
    model.train()
    return total / len(val)


def make_optimizer(model, args):
    """AdamW with decay on every parameter of two or more dims: a rule that needs no parameter
    names, so ttr and each reference get the same grouping (``ttr.optim`` groups by ttr's names)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    other = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": other, "weight_decay": 0.0}],
                             lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def train_step(model, opt, rows: np.ndarray, step: int, args):
    """One step of the recipe on ``rows`` ``[batch, seq_len]``; returns (loss, clipped-from norm)."""
    for group in opt.param_groups:
        group["lr"] = lr_at(step, args)
    x = torch.from_numpy(rows).long().cuda(non_blocking=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=x, labels=x, use_cache=False).loss
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss, norm


def train(model, train_tokens: np.ndarray, val: np.ndarray, args, checkpoint=None) -> dict:
    """Train ``model`` on ``train_tokens`` (one batch per step); ``checkpoint(partial)`` is called
    with the results so far after every validation, so a run cut short still leaves its curve."""
    opt = make_optimizer(model, args)
    losses, grad_norms, vals = [], [], []
    model.train()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    start = time.perf_counter()
    timed_from = min(10, args.steps - 1)
    for step in range(args.steps):
        if step == timed_from:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        loss, norm = train_step(model, opt, train_tokens[step], step, args)
        losses.append(loss.detach())
        grad_norms.append(norm.detach())
        if (step + 1) % args.val_every == 0 or step + 1 == args.steps:
            vals.append((step + 1, evaluate(model, val)))
            print(f"  step {step + 1}: train {losses[-1].item():.4f} val {vals[-1][1]:.4f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
            if checkpoint is not None:
                checkpoint({"losses": [v.item() for v in losses], "val": vals, "steps_done": step + 1})
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    losses = [v.item() for v in losses]
    grad_norms = [v.item() for v in grad_norms]
    tokens = (args.steps - timed_from) * args.batch * args.seq_len
    return {
        "losses": losses, "grad_norms": grad_norms, "val": vals, "final_val": vals[-1][1],
        "train_last50": float(np.mean(losses[-50:])), "grad_norm_step0": grad_norms[0],
        "tokens_per_s": tokens / elapsed, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "nonfinite_steps": int(sum(not math.isfinite(v) for v in losses)), "steps_done": args.steps,
    }


def init_seed(args) -> int:
    """The seed of a model's initial weights: ``--init-seed``, else ``--seed`` (which also orders the data)."""
    return args.seed if args.init_seed is None else args.init_seed


def run_label(impl: str, args) -> str:
    """A run's name in file names and tables: the impl, with ``.initSEED`` when its weights are drawn
    with ``--init-seed``. The table's ratio compares the mean over every draw of each side."""
    return impl if args.init_seed is None else f"{impl}.init{args.init_seed}"


def run_one(family: str, impl: str, args, train_tokens, val, vocab_size: int, path: Path) -> dict:
    config = ttr_config(family, args.size, vocab_size)
    result = {"family": family, "impl": impl, "label": run_label(impl, args), "init_seed": init_seed(args),
              "size": args.size, "steps": args.steps, "batch": args.batch,
              "seq_len": args.seq_len, "reference": REFERENCE_NAMES[family]}
    if impl == "reference" and not args.skip_grad_check:
        check = grad_check(config, torch.from_numpy(train_tokens[0][:2]).long())
        result["grad_check"] = check
        print(f"{family}: bf16 gradient check vs reference: loss {check['loss_reference']:.5f} / "
              f"{check['loss_ttr']:.5f}, gradient rel. error {check['grad_rel_err_all']:.2e} (worst tensor "
              f"{check['grad_rel_err_max']:.2e}, {check['grad_worst']}); against ttr's fp32 gradients: reference "
              f"bf16 {check['reference_bf16_vs_ttr_fp32']:.2e}, ttr bf16 {check['ttr_bf16_vs_ttr_fp32']:.2e}, "
              f"reference fp32 {check['reference_fp32_vs_ttr_fp32']:.2e}", flush=True)
    model = build(impl, config, init_seed(args))
    params = sum(p.numel() for p in model.parameters())
    print(f"{family} / {impl}: {params:,} parameters", flush=True)
    result["params"] = params

    def checkpoint(partial):
        path.write_text(json.dumps(dict(result, partial=partial)))

    result.update(train(model, train_tokens, val, args, checkpoint))
    print(f"{family} / {impl}: val {result['final_val']:.4f}, train(last 50) {result['train_last50']:.4f}, "
          f"grad norm at step 0 {result['grad_norm_step0']:.2f}, {result['tokens_per_s']:,.0f} tokens/s, "
          f"{result['peak_mem_gib']:.1f} GiB", flush=True)
    del model
    torch.cuda.empty_cache()
    return result


# -- kernel error on the training's own inputs ---------------------------------------------------


def op_errors(family: str, args, train_tokens: np.ndarray, vocab_size: int, n_layers: int = 5) -> dict:
    """Train ttr's model ``args.op_errors`` steps of the recipe, then capture the chunkwise op's
    inputs and the gradient arriving at its output at ``n_layers`` layers (one bf16 forward and
    backward of the next batch), and run ttr's and fla's op on exactly those: the relative RMS
    error of the output and of every input gradient against float64 (ttr's torch form), and the
    projection of each on the exact one (1 = no bias). What the parity runs cannot say, that a
    kernel is less exact than the reference on the inputs training gives it, this does."""
    from transformers import AutoModelForCausalLM

    from ttr.kernels.utils import backend_override

    module, name, ttr_op, fla_op = layer_op(family)
    config = ttr_config(family, args.size, vocab_size)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config).cuda()
    opt = make_optimizer(model, args)
    for step in range(args.op_errors):
        train_step(model, opt, train_tokens[step], step, args)
    del opt
    captured = []

    def capture(*inputs, **kwargs):
        o, state = ttr_op(*inputs, **kwargs)
        record = {"inputs": [t.detach().clone() for t in inputs]}
        o.register_hook(lambda grad: record.__setitem__("do", grad.detach().clone()))
        captured.append(record)
        return o, state

    setattr(module, name, capture)
    try:
        x = torch.from_numpy(train_tokens[args.op_errors]).long().cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(input_ids=x, labels=x, use_cache=False).loss.backward()
    finally:
        setattr(module, name, ttr_op)
    del model

    def run(op, inputs, do, dtype=None):
        xs = [(t if dtype is None else t.to(dtype)).detach().clone().requires_grad_(True) for t in inputs]
        o, _ = op(*xs)
        grads = torch.autograd.grad(o, xs, do.to(o.dtype))
        return [o.detach().double()] + [g.double() for g in grads]

    names = ["o"] + [f"d{n}" for n in {"gla": ["q", "k", "v", "g"], "delta_net": ["q", "k", "v", "beta"]}.get(
        family, ["q", "k", "v", "g", "beta"])]
    picks = sorted({round(i * (len(captured) - 1) / max(1, n_layers - 1)) for i in range(n_layers)})
    rows = []
    for index in picks:
        record = captured[index]
        with backend_override("torch"):  # float64 runs on ttr's torch form
            exact = run(ttr_op, record["inputs"], record["do"], torch.float64)
        row = {"call": index}
        for impl, op in (("ttr", ttr_op), ("reference", fla_op)):
            got = run(op, record["inputs"], record["do"])
            row[impl] = {n: {"rel_err": ((a - b).norm() / b.norm()).item(),
                             "projection": ((a * b).sum() / (b * b).sum()).item()}
                         for n, a, b in zip(names, got, exact)}
        rows.append(row)
        print(f"  {family} layer call {index}: " + "; ".join(
            f"{n} {row['ttr'][n]['rel_err']:.2e} / {row['reference'][n]['rel_err']:.2e}" for n in names)
            + "  (ttr / fla, relative RMS error against float64)", flush=True)
    return {"family": family, "steps_trained": args.op_errors, "outputs": names, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    from ttr.scripts.parity_report import report

    parser = argparse.ArgumentParser(prog="bench_parity", description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--impls", default="ttr,reference",
                        help="which models to train, some of: " + "; ".join(f"{k}: {v}" for k, v in IMPLS.items()))
    parser.add_argument("--size", default="340m")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--min-lr", type=float, default=1e-4)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--val-every", type=int, default=100)
    parser.add_argument("--val-batches", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0, help="orders the data and, without --init-seed, draws the weights")
    parser.add_argument("--init-seed", type=int, help="draw the initial weights with this seed (the data order stays "
                        "--seed's): repeat runs that measure how much the draw of the weights moves the loss")
    parser.add_argument("--skip-grad-check", action="store_true")
    parser.add_argument("--data-cache", help="an .npz to read the encoded batches from (written when missing)")
    parser.add_argument("--prepare-only", action="store_true", help="only encode the data (into --data-cache)")
    parser.add_argument("--op-errors", type=int, metavar="STEPS",
                        help="only measure the chunkwise op's bf16 error against float64, ttr's and fla's, on the "
                             "inputs of ttr's model after STEPS training steps (fla families)")
    parser.add_argument("--out", default="runs/parity", help="folder for <family>.json")
    parser.add_argument("--report", nargs="+", metavar="PATH", help="merge result files/folders into a table")
    parser.add_argument("--plot", help="with --report: write the validation curves here (PNG)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.report:
        print(report(args.report, args.plot))
        return 0
    families = [f for f in args.families.split(",") if f]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        parser.error(f"--families: unknown {unknown}; expected some of {FAMILIES}")
    impls = [i for i in args.impls.split(",") if i]
    if not set(impls) <= set(IMPLS):
        parser.error(f"--impls takes some of {', '.join(IMPLS)}; got {args.impls!r}")
    if "swap_l2" in impls and not set(families) <= set(L2_IN_KERNEL):
        parser.error(f"--impls swap_l2 runs the delta rules {list(L2_IN_KERNEL)}; got --families {args.families}")
    if args.op_errors is not None:
        if not 0 <= args.op_errors < args.steps:
            parser.error(f"--op-errors must be in [0, --steps), got {args.op_errors}")
        if not set(families) <= set(FLA_OPS):
            parser.error(f"--op-errors measures the fla families {sorted(FLA_OPS)}; got --families {args.families}")
    if not torch.cuda.is_available() and not args.prepare_only:
        parser.error("needs a CUDA GPU")
    for name in ("steps", "batch", "seq_len", "val_every", "val_batches", "warmup"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    from ttr.scripts.bench_utils import lift_fla_guard

    lifted = lift_fla_guard() is not None
    tokenizer = build_tokenizer()
    t0 = time.perf_counter()
    train_tokens, val = build_data(args, tokenizer)
    print(f"data: {train_tokens.size:,} training and {val.size:,} validation tokens "
          f"({time.perf_counter() - t0:.0f} s); fla #640 guard lifted: {lifted}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    if args.prepare_only:
        return 0
    if args.op_errors is not None:
        for family in families:
            result = op_errors(family, args, train_tokens, tokenizer.vocab_size)
            (out / f"{family}.operrors.json").write_text(json.dumps(dict(result, env=env)))
        return 0
    for family in families:
        for impl in impls:
            path = out / f"{family}.{run_label(impl, args)}.json"
            result = run_one(family, impl, args, train_tokens, val, tokenizer.vocab_size, path)
            result["env"] = env
            path.write_text(json.dumps(result))
    print(report([str(out / f"{f}.{run_label(i, args)}.json") for f in families for i in impls], None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
