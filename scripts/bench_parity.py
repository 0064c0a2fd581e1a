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
gradients are right at these shapes).

``--impls ttr_refinit`` trains ttr's model from the reference's initial weights (converted), and
``--impls reference_ttrinit`` the reference from ttr's, so a pair of runs differs in the
implementation only; ``--init-seed N`` draws a model's weights again (the data order stays
``--seed``'s). One run is not a measurement at this scale: repeats of one reference from the same
weights differ by several percent at step 800 (its kernels are not deterministic), and draws of
the weights as much, so the table compares means over draws (a draw's repeats averaged first)
with their standard error, and same-start runs as per-draw ratios.

Each run writes ``<out>/<family>.<impl>[.initN].json`` (loss per step, validation loss every ``--val-every``
steps, gradient norm at step 0, tokens/s, peak memory); a repeat of a run is kept as
``<family>.<label>.repeatN.json``. ``--report`` merges such files into the markdown table of
``docs/benchmarks.md`` and a plot of the curves.
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
            module.l2_normalize = lambda x: x
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


def ttr_from_reference(config, seed: int, device: str = "cuda", attn_mode: str | None = None):
    """ttr's model holding the weights of the reference initialised with ``seed`` (through ``ttr
    convert``), in fp32 on ``device``, and the reference itself."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from ttr.models.convert import convert_checkpoint

    ref = build("reference", config, seed, device, attn_mode)
    with tempfile.TemporaryDirectory() as tmp:
        ref.save_pretrained(f"{tmp}/ref")
        convert_checkpoint(f"{tmp}/ref", f"{tmp}/ttr")
        mine = AutoModelForCausalLM.from_pretrained(f"{tmp}/ttr", dtype=torch.float32).to(device)
    return mine, ref


@torch.no_grad()
def reference_from_ttr(config, seed: int, device: str = "cuda", attn_mode: str | None = None):
    """The reference model holding ttr's initial weights drawn with ``seed``: ``ttr convert``'s map
    read backwards (a renaming, plus the depthwise convs' ``[C, 1, W]`` view)."""
    from transformers import AutoModelForCausalLM

    from ttr.models.convert import convert_state_dict
    from ttr.scripts.reference_models import build_reference

    torch.manual_seed(seed)
    mine = AutoModelForCausalLM.from_config(config).state_dict()
    ref = build_reference(config, attn_mode)
    for key, value in ref.state_dict().items():
        if not key.endswith("rotary.inv_freq"):
            (name,) = convert_state_dict(ref.config.model_type, {key: value})
            value.copy_(mine[name].view_as(value))
    return ref.to(device)


def build(impl: str, config, seed: int, device: str = "cuda", attn_mode: str | None = None):
    """``impl``'s model of ``config`` (``IMPLS``), its weights drawn with ``seed``; ``attn_mode``
    picks an fla reference's kernels (``reference_models.reference_config``)."""
    from transformers import AutoModelForCausalLM

    from ttr.scripts.reference_models import build_reference, check_same_shape

    if impl == "ttr_refinit":
        return ttr_from_reference(config, seed, device, attn_mode)[0]
    if impl == "reference_ttrinit":
        return reference_from_ttr(config, seed, device, attn_mode)
    torch.manual_seed(seed)
    if impl in ("ttr", "swap", "swap_l2"):
        if impl != "ttr":
            swap_in_reference_kernels(config, l2_in_kernel=impl == "swap_l2")
        model = AutoModelForCausalLM.from_config(config)
    else:
        model = build_reference(config, attn_mode)
        check_same_shape(config, model)
    return model.to(device)


def grad_check(config, batch: torch.Tensor, attn_mode: str | None = None, device: str = "cuda") -> dict:
    """Loss and gradients of the reference and of ttr on the reference's initial weights, under
    the training run's bf16 autocast (so the kernels checked are the ones that train), and each
    model once more in fp32: ttr's fp32 gradients are the baseline that says whether a bf16
    difference between the two is an error of one of them or the bf16 rounding of both, amplified
    by the model at its initial weights (then ttr's own bf16 gradients are as far from fp32)."""
    from ttr.models.convert import convert_state_dict

    mine, ref = ttr_from_reference(config, seed=1234, device=device, attn_mode=attn_mode)
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
              "seq_len": args.seq_len, "reference": REFERENCE_NAMES[family]
              + (f" ({args.reference_mode} kernels)" if args.reference_mode else "")}
    if impl == "reference" and not args.skip_grad_check:
        check = grad_check(config, torch.from_numpy(train_tokens[0][:2]).long(), args.reference_mode)
        result["grad_check"] = check
        print(f"{family}: bf16 gradient check vs reference: loss {check['loss_reference']:.5f} / "
              f"{check['loss_ttr']:.5f}, gradient rel. error {check['grad_rel_err_all']:.2e} (worst tensor "
              f"{check['grad_rel_err_max']:.2e}, {check['grad_worst']}); against ttr's fp32 gradients: reference "
              f"bf16 {check['reference_bf16_vs_ttr_fp32']:.2e}, ttr bf16 {check['ttr_bf16_vs_ttr_fp32']:.2e}, "
              f"reference fp32 {check['reference_fp32_vs_ttr_fp32']:.2e}", flush=True)
    model = build(impl, config, init_seed(args), attn_mode=args.reference_mode if "reference" in impl else None)
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


# -- report --------------------------------------------------------------------------------------


def op_error_table(records: list[dict]) -> list[str]:
    """``--op-errors`` results as markdown: per family and captured layer, ttr's and the
    reference's relative RMS error against float64 for the output and each input gradient."""
    lines = []
    for rec in sorted((r for r in records if r.get("rows")), key=lambda r: r["family"]):
        names = rec["outputs"]
        lines += ["", f"{rec['family']}: the chunkwise op on the inputs of ttr's model trained {rec['steps_trained']} "
                  "steps, relative RMS error against float64, ttr / reference", "",
                  "| layer call | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        lines += [f"| {row['call']} | " + " | ".join(
            f"{row['ttr'][n]['rel_err']:.1e} / {row['reference'][n]['rel_err']:.1e}" for n in names) + " |"
            for row in rec["rows"]]
    return lines


def report(paths: list[str], plot: str | None) -> str:
    files = []
    for p in map(Path, paths):
        files += sorted(p.glob("*.json")) if p.is_dir() else [p]
    results: dict[str, dict] = {}
    op_errors = []
    for f in files:
        if f.name.endswith(".operrors.json"):
            op_errors.append(json.loads(f.read_text()))
            continue
        run = json.loads(f.read_text())
        if "final_val" not in run:
            # cut short: keep its curve so far (written at every validation)
            run.update(run["partial"], final_val=None)
        entry = results.setdefault(run["family"], {"family": run["family"], "size": run["size"],
                                                    "reference": run["reference"], "runs": {}})
        if run["impl"] == "reference":  # it names the reference's kernels where they were chosen
            entry["reference"] = run["reference"]
        # the file's name: a repeat of a run is saved as <family>.<label>.repeatN.json
        prefix = f"{run['family']}."
        label = f.stem[len(prefix):] if f.stem.startswith(prefix) else run.get("label", run["impl"])
        previous = entry["runs"].get(label)
        if previous is None or len(run["val"]) > len(previous["val"]):
            entry["runs"][label] = run
        if "grad_check" in run:
            entry["grad_check"] = run["grad_check"]
    results = sorted(results.values(), key=lambda r: FAMILIES.index(r["family"]) if r["family"] in FAMILIES else 99)
    lines = ["| family | reference | ttr, own initialisation | reference | ratio | same initial weights: ttr / "
             "reference, per draw | mean ratio |", "|---|---|---|---|---|---|---|"]

    def by_draw(runs: dict, impl: str) -> dict:
        """The runs of ``impl`` grouped by their draw of the weights (``init_seed``): repeats of one
        draw are one sample of the draw's quality, not several."""
        draws: dict = {}
        for run in runs.values():
            if run["impl"] == impl:  # files older than the field drew with the default seed, 0
                draws.setdefault(run.get("init_seed", 0), []).append(dict(map(tuple, run["val"])))
        return draws

    def curves(runs: dict, impl: str) -> list[list[dict]]:
        return list(by_draw(runs, impl).values())

    def last_step(every: list[dict]) -> int | None:
        """The last validation step that every one of the curves reached."""
        common = set.intersection(*(set(v) for v in every)) if every else set()
        return max(common) if common else None

    def at(draws: list[list[dict]], step: int) -> list[tuple[float, int]]:
        """(mean over the draw's runs, number of runs) per draw, at ``step``."""
        return [(float(np.mean([v[step] for v in runs])), len(runs)) for runs in draws]

    def verdict(value: float, se: float | None, step: int, extra: str = "") -> str:
        shown_se = "" if se is None else f" ± {se:.4f}"
        word = "meets" if value <= TARGET else "**misses**"
        return f"{value:.4f}{shown_se} at step {step} ({word} <= {TARGET}{extra})"

    def paired(runs: dict) -> tuple[str, str]:
        """Both sides from the same initial weights: ttr from the reference's draws (``ttr_refinit``
        against ``reference``) and the reference from ttr's (``reference_ttrinit`` against ``ttr``).
        The mean of the per-draw ratios ttr / reference, with its standard error, at the last step
        every run of those draws reached."""
        pairs = []
        for mine_impl, ref_impl in (("ttr_refinit", "reference"), ("ttr", "reference_ttrinit")):
            mine, ref = by_draw(runs, mine_impl), by_draw(runs, ref_impl)
            pairs += [(mine[k], ref[k]) for k in sorted(set(mine) & set(ref), key=str)]
        step = last_step([v for a, b in pairs for v in a + b])
        if step is None:
            return "", ""
        ratios = [x / y for (x, _), (y, _) in zip(at([a for a, _ in pairs], step), at([b for _, b in pairs], step))]
        se = float(np.std(ratios, ddof=1) / np.sqrt(len(ratios))) if len(ratios) > 1 else None
        extra = f"; {len(ratios)} pair{'s' * (len(ratios) > 1)}"
        return ", ".join(f"{r:.4f}" for r in ratios), verdict(float(np.mean(ratios)), se, step, extra)

    def compare(mine: list[list[dict]], ref: list[list[dict]]) -> tuple[str, str, str]:
        """(ttr's value, the reference's, the ratio of the means over draws with its standard error)
        at the last step every run reached."""
        step = last_step([v for runs in mine + ref for v in runs]) if mine and ref else None
        if step is None:
            return "", "", "not measured"
        a, b = at(mine, step), at(ref, step)
        ma, mb = np.mean([v for v, _ in a]), np.mean([v for v, _ in b])
        value = float(ma / mb)
        rel_se = [float(np.std([v for v, _ in x], ddof=1) / np.sqrt(len(x)) / m) for x, m in ((a, ma), (b, mb))
                  if len(x) > 1]
        se = value * float(np.sqrt(np.sum(np.square(rel_se)))) if rel_se else None
        return shown(a), shown(b), verdict(value, se, step)

    def shown(draws: list[tuple[float, int]]) -> str:
        mean = float(np.mean([v for v, _ in draws]))
        if len(draws) == 1 and draws[0][1] == 1:
            return f"{mean:.4f}"
        each = ", ".join(f"{v:.4f}" + (f" ({n} runs)" if n > 1 else "") for v, n in draws)
        return f"{mean:.4f} (mean of {len(draws)} draw{'s' if len(draws) > 1 else ''}: {each})"

    for r in results:
        runs = r["runs"]
        ref = curves(runs, "reference")
        mine, ref_shown, ratio = compare(curves(runs, "ttr"), ref)
        same, same_ratio = paired(runs)
        if not ref:
            ref_shown = "not measured"
        lines.append(f"| {r['family']} | {r['reference']} | {mine} | {ref_shown} | {ratio} | {same} | "
                     f"{same_ratio if same else ''} |")
    others = [(r, label) for r in results for label in r["runs"] if len(r["runs"]) > 2 or label not in ("ttr", "reference")]
    if others:
        lines += ["", "Every run, at the last step it shares with the reference's runs:", "",
                  "| family | run | val loss | at step | ratio to the reference |", "|---|---|---|---|---|"]
        for r, label in others:
            run = dict(map(tuple, r["runs"][label]["val"]))
            refs = curves(r["runs"], "reference")
            shared = last_step([run] + [v for runs in refs for v in runs]) if refs else None
            step = max(run) if shared is None else shared
            ratio = (f"{run[step] / np.mean([v for v, _ in at(refs, step)]):.4f}" if shared is not None
                     else "no reference run")
            lines.append(f"| {r['family']} | {label} | {run[step]:.4f} | {step} | {ratio} |")
    checks = [(r["family"], r["grad_check"]) for r in results if "grad_check" in r]
    if checks:
        lines += ["", "| family | loss, reference / ttr (same weights, bf16 autocast) | gradient rel. error, "
                  "all / worst tensor | against ttr's fp32 gradients: reference bf16 / ttr bf16 / reference fp32 |",
                  "|---|---|---|---|"]
        def cell(c: dict, key: str) -> str:  # checks of earlier runs lack the later columns
            return f"{c[key]:.1e}" if key in c else "-"

        lines += [f"| {f} | {c['loss_reference']:.5f} / {c['loss_ttr']:.5f} | {cell(c, 'grad_rel_err_all')} / "
                  f"{cell(c, 'grad_rel_err_max')} (`{c['grad_worst']}`) | "
                  + " / ".join(cell(c, k + "_vs_ttr_fp32") for k in ("reference_bf16", "ttr_bf16", "reference_fp32"))
                  + " |" for f, c in checks]
    lines += op_error_table(op_errors)
    if plot and results:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        n = len(results)
        fig, axes = plt.subplots(1, n, figsize=(4 * n, 3.4), squeeze=False)
        # colour: whose code trained the run; line: whose draw of the weights it started from
        # (solid its own, dotted the other side's; dash-dot ttr with the reference's kernel)
        kinds = {"ttr": ("C0", "-", "ttr"), "reference": ("C1", "-", "{ref}"),
                 "ttr_refinit": ("C0", ":", "ttr from {ref}'s weights"),
                 "reference_ttrinit": ("C1", ":", "{ref} from ttr's weights"),
                 "swap": ("C2", "-.", "ttr, reference kernel"),
                 "swap_l2": ("C3", "-.", "ttr, reference kernel, l2 in it")}
        for ax, r in zip(axes[0], results):
            ref_name = r["reference"].split()[0]  # "fla" or "HF"; the title names the model
            shown_kinds = set()
            for _, run in sorted(r["runs"].items()):
                steps, values = zip(*run["val"])
                colour, style, name = kinds.get(run["impl"], ("C7", "--", run["impl"]))
                ax.plot(steps, values, style, color=colour, linewidth=1.2, alpha=0.8,
                        label=None if run["impl"] in shown_kinds else name.format(ref=ref_name))
                shown_kinds.add(run["impl"])
            ax.set_title(f"{r['family']}-{r['size']}")
            ax.set_xlabel("step")
            ax.set_ylabel("validation loss")
            ax.legend(fontsize=6)
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(plot, dpi=110)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
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
    parser.add_argument("--reference-mode", choices=("chunk", "fused_recurrent"),
                        help="the kernels of fla's reference layers (its attn_mode; default: fla's, chunk); "
                             "fused_recurrent trains the reference on its recurrent kernels, a second opinion on "
                             "the chunk ones")
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
    fla_families = set(FLA_OPS)
    if args.reference_mode and not set(families) <= fla_families:
        parser.error(f"--reference-mode picks fla's kernels: the fla families {sorted(fla_families)}; got --families "
                     f"{args.families}")
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
