"""End-to-end training throughput of every 1.3B preset next to its reference, and decoding (GPU).

Training: for each preset (``--presets``, default every 1.3B preset) the plain user loop:
``AutoModelForCausalLM.from_config(get_preset(name))``, fused AdamW, bf16 autocast over fp32
weights, no activation checkpointing, random tokens of ``--batch`` x ``--seq-len`` (8 x 4096),
``--warmup`` steps and then ``--steps`` timed steps (CUDA events, median step): tokens/s, MFU
(FLOPs per token as ``ttr.train.metrics`` counts them, each mixer's ``flops_per_token`` included,
against the GPU's dense bf16 peak; the reference has the same architecture and is credited the
same FLOPs) and peak memory (``torch.cuda.max_memory_allocated``: weights, optimizer state and
activations). Next to it, in the same process, the reference model of the same shape that
``ttr.scripts.reference_models`` builds: fla 0.6.0 for Gated DeltaNet, DeltaNet, GLA and the Gated
DeltaNet + SWA hybrid (with fla's own default loss), Hugging Face ``LlamaForCausalLM`` (SDPA) for the
transformer and ``Mamba2ForCausalLM`` for Mamba2 (through mamba_ssm's Triton SSD kernel with a torch
depthwise conv where mamba_ssm's Triton sources are importable, else its PyTorch path, which may not
fit: that is reported, and the row names the path). ``gated_deltanet_h2`` has no reference. Out of memory and other
failures are rows, not crashes; each model starts from a freed GPU, or with ``--isolate`` in its
own process, so that a crash (an illegal address poisons the CUDA context) costs only its row.
``--time-budget`` lists the models not started in time as skipped; the table and JSON are
rewritten after every model, so a run killed from outside keeps what it measured.

``--profile`` (plain loop) also runs one more step under ``torch.profiler`` and splits its GPU time
by kind of work: matrix products, each library's mixer op, norms, short convs, loss, attention,
PyTorch's elementwise kernels, the optimizer, and the time no kernel ran; the JSON keeps the
longest kernels too. A second profiled step records the host's ops with their input shapes and
gives the matrix products by op and shape with their TFLOP/s: a narrow map (few outputs per
token) shows there as a product far below the GPU's rate, bound by reading its input.

``--rounds N`` (plain loop) builds each preset's two models side by side and trains them in turn N
times, each round a fresh optimizer with its warm-up and timed steps; tokens/s is each model's
median round, so a drift of the GPU's clocks during the pair falls on both. Both models' weights
stay on the GPU meanwhile (each peak is counted above what the other holds); a pair that does not
fit side by side is measured one after the other, and its rows say so.

``--loop trainer`` drives the models with ttr's trainer instead (``configs/PRESET.toml``'s
optimizer, packed documents of the embedded corpus with ``cu_seqlens``, accelerate; tokens/s the
median of the timed steps); its references are fla's models, the ones that take ``cu_seqlens``.

On Hopper with Triton < 3.7.1 fla 0.6.0 refuses its gated backward (fla issue #640);
``--lift-fla-guard`` lets it run for timing only, and the output then says so.

Decoding (``--decode``): bf16 weights, a ``--prompt-len`` (1024) token prompt prefilled with the
chunk kernels, then ``--gen-len`` tokens decoded one at a time with the recurrent kernels at batch
1 and 64: tokens/s and allocated memory after 1/4, 1/2 and all of the generated tokens (constant
for recurrent layers: the state does not grow with the generated length).

``--chunk-states recompute,auto`` adds the memory-against-time table of the chunk ops' choice
(``TTR_CHUNK_STATES``): ttr's model of each preset, built once, trained by the plain loop under each
choice in turn, the choices alternated ``--alternate-rounds`` times (2) so that a drift of the GPU
falls on all of them; each row gives every round's tokens/s and the choice's peak memory.
``--tuning '[{}, {"output_bwd_dqk_walk": {"num_warps": 8}}]'`` does the same for launch overrides
(``index.TUNING``, ``{}`` the built-in defaults), and names any overridden stage that no launch read.

Usage: ``python -m ttr.scripts.bench_model [--presets a,b] [--no-references] [--steps 5]
[--isolate] [--json OUT.json] [--out OUT.md]``; ``--device cpu`` runs the code paths on a CPU
(debug presets; no measurement).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ttr.scripts.bench_utils import (
    LIFT_FLA_GUARD_HELP,
    Deadline,
    chunk_state_choices,
    describe_environment,
    environment,
    error_text,
    fla_guard_note,
    kernel_times,
    launch_overrides,
    lift_fla_guard,
    product_shapes,
    step_breakdown,
    time_ms,
    triton_kernel_kinds,
    tuning_override,
)

GIB = 2**30
SIZE = "1.3b"
IMPLS = ("ttr", "reference")
LOOPS = ("plain", "trainer")


def default_presets() -> list[str]:
    from ttr.models.presets import list_presets

    return [p for p in list_presets() if p.endswith(f"-{SIZE}")]


def has_reference(preset: str, loop: str = "plain") -> bool:
    """Whether ``reference_models`` builds a reference for ``preset`` (in the trainer loop: an fla
    one, as only fla's models take the packed batches' ``cu_seqlens``)."""
    from ttr.models import get_preset
    from ttr.scripts.reference_models import FLA_FAMILIES, family_of

    try:
        family = family_of(get_preset(preset))
    except ValueError:
        return False
    return loop == "plain" or family in FLA_FAMILIES | {"gated_deltanet_h1"}


def model_facts(preset: str, seq_len: int) -> dict:
    """Parameters and trained FLOPs per token of ``preset``, from a model on the meta device."""
    from transformers import AutoModelForCausalLM

    from ttr.models import get_preset
    from ttr.train.metrics import train_flops_per_token

    config = get_preset(preset)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {"params": sum(p.numel() for p in model.parameters()),
            "flops_per_token": train_flops_per_token(model, config, seq_len)}


def build(preset: str, impl: str, device):
    """ttr's model of ``preset`` or its reference, initialised on ``device``; fla's models keep
    their own default loss (the parity runs switch fla's fused loss off, a throughput run does not)."""
    from transformers import AutoModelForCausalLM

    import ttr  # noqa: F401  (registers ttr's model with the Auto classes)
    from ttr.models import get_preset
    from ttr.scripts.reference_models import build_reference

    config = get_preset(preset)
    torch.manual_seed(0)
    with torch.device(device):  # initialised in place: a 1.3B model's CPU init costs seconds per model
        model = AutoModelForCausalLM.from_config(config) if impl == "ttr" else build_reference(config)
    if impl != "ttr" and hasattr(model.config, "fuse_cross_entropy"):
        model.config.fuse_cross_entropy = type(model.config)().fuse_cross_entropy
    return model.to(device)


ORIGINS = {"fla": "fla", "transformers": "HF", "ttr": "ttr"}


def model_name(model) -> str:
    origin = type(model).__module__.split(".")[0]
    path = getattr(model, "reference_path", None)
    return f"{ORIGINS.get(origin, origin)} {type(model).__name__}" + (f" ({path})" if path else "")


def plain_loop(model, vocab: int, batch: int, seq_len: int, steps: int, warmup: int, device,
               profile: bool = False) -> dict:
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=device.type == "cuda")
    ids = torch.randint(0, vocab, (batch, seq_len), device=device)
    losses = []

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    ms = time_ms(step, reps=steps, warmup=warmup, device=device)
    result = {"step_ms": ms, "tokens_per_s": batch * seq_len / ms * 1e3,
              "loss_first": losses[0].item(), "loss_last": losses[-1].item()}
    if profile:
        result.update(profile_step(step, device))
    return result


def profile_step(step, device) -> dict:
    """One more ``step`` under ``torch.profiler``: its GPU time by kind of work (``step_breakdown``)
    and its 25 longest kernels; then one more with the host's ops and their input shapes recorded,
    for the matrix products by shape (``product_shapes``). The first step records the GPU alone,
    so the host's recording does not widen its gaps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    on_gpu = device.type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    sync()
    with torch_profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        step()
        sync()
        wall = (time.perf_counter() - start) * 1e3
    kernels = kernel_times(prof)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with torch_profile(activities=activities, record_shapes=True) as shaped:
        step()
        sync()
    return {"profile": {"step_ms": wall, "kinds": step_breakdown(kernels, wall, triton_kernel_kinds()),
                        "kernels": kernels[:25], "products": product_shapes(shaped, on_gpu)}}


def breakdown_table(results: list[dict]) -> str:
    """Each profiled row's step by kind of work, as markdown: ms per step and share."""
    blocks = []
    for r in results:
        prof = r.get("profile")
        if not prof:
            continue
        blocks += [f"{r['preset']}, {r.get('model', r['impl'])}: one profiled step, {prof['step_ms']:.1f} ms", "",
                   "| kind of work | ms per step | share |", "|---|---|---|"]
        blocks += [f"| {kind} | {ms:.1f} | {100 * share:.1f} % |" for kind, ms, share in prof["kinds"]] + [""]
        products = prof.get("products") or []
        if products:
            blocks += ["Its matrix products by shape (the next step, its host ops recorded; the 12 longest):", "",
                       "| op | M x K x N | calls | ms | TFLOP/s |", "|---|---|---|---|---|"]
            blocks += [f"| {r['op']} | {r['m']} x {r['k']} x {r['n']} | {r['calls']} | {r['ms']:.2f} | {r['tflops']:.0f} |"
                       for r in products[:12]] + [""]
    return "\n".join(blocks)


def trainer_loop(preset: str, impl: str, args) -> dict:
    """The timed steps of ttr's trainer on ``configs/PRESET.toml``, the reference swapped in as
    the model where asked."""
    from ttr.scripts.reference_models import build_reference
    from ttr.train.cli import CONFIG_DIR
    from ttr.train.config import load_config
    from ttr.train.metrics import train_flops_per_token
    from ttr.train.trainer import Trainer, build_model

    recipe = CONFIG_DIR / f"{preset}.toml"
    if not recipe.is_file():
        raise ValueError(f"--loop trainer: no recipe {recipe} for preset {preset}")
    total = args.warmup + args.steps
    cfg = load_config(recipe, [
        f"--run_dir={args.run_root}/{preset}.{impl}", "--data.source=embedded", f"--tokenizer.path={args.tokenizer}",
        "--model.overrides.vocab_size=32000", f"--train.micro_batch_size={args.batch}",
        f"--train.seq_len={args.seq_len}", "--train.batch_tokens=0", f"--train.max_steps={total}",
        "--optim.warmup_steps=2", "--train.export_at_end=false", "--train.precision=bf16", "--log.every=1",
        "--log.val_every=0", "--log.wandb=off", "--log.progress=false", "--data.val_docs=0",
    ])

    class Packed(torch.nn.Module):
        """fla's model called as the trainer calls ttr's: packed ``[1, B*T]`` input with
        ``cu_seqlens``, loss = summed token loss / ``num_items_in_batch`` (fla's convention too)."""

        def __init__(self, model):
            super().__init__()
            self.model, self.config = model, None  # no config: the trainer leaves FLOPs to the caller

        def forward(self, input_ids, labels, cu_seqlens, num_items_in_batch, use_cache=False, return_logits=None):
            return self.model(input_ids=input_ids, labels=labels, cu_seqlens=cu_seqlens, use_cache=False,
                              num_items_in_batch=num_items_in_batch)

    facts = {}

    def factory(cfg_, tokenizer):
        if impl == "ttr":
            return build_model(cfg_, tokenizer)
        with torch.device("meta"):  # only the config (the trainer's vocabulary and positions) and FLOPs
            mine = build_model(cfg_, tokenizer)
        config = mine.config
        facts["flops_per_token"] = train_flops_per_token(mine, config, cfg_.train.seq_len)
        torch.manual_seed(0)
        model = build_reference(config)
        model.config.fuse_cross_entropy = type(model.config)().fuse_cross_entropy
        return Packed(model)

    class NoCheckpoints(Trainer):
        def save(self):
            return None

    trainer = NoCheckpoints(cfg, overwrite=True, model_factory=factory)
    record = trainer.run()
    timed = sorted(r["tokens_per_s"] for r in trainer.history[args.warmup:])
    inner = trainer.inner.model if impl != "ttr" else trainer.inner
    tps = timed[len(timed) // 2]
    result = {"model": model_name(inner), "params": sum(p.numel() for p in inner.parameters()), "tokens_per_s": tps,
              "step_ms": trainer.batch_tokens / tps * 1e3, "loss_first": trainer.history[0]["loss"],
              "loss_last": record["loss"], "flops_per_token": facts.get("flops_per_token", trainer.flops_per_token)}
    del trainer, inner
    return result


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def failed(row: dict, e: BaseException) -> None:
    """A model's failure as its row's status: ``oom`` with the allocator's first line, or ``error``."""
    if isinstance(e, torch.cuda.OutOfMemoryError):
        row.update(status="oom", error=(str(e).splitlines() or [""])[0][:300])
    else:
        row.update(status="error", error=error_text(e))


def measure(preset: str, impl: str, args) -> dict:
    """One model's row; out of memory and other failures become its status."""
    from ttr.train.metrics import peak_flops

    device = torch.device(args.device)
    row = {"preset": preset, "impl": impl, **model_facts(preset, args.seq_len)}
    model = None
    _free()
    try:
        if args.loop == "trainer":
            row.update(trainer_loop(preset, impl, args))
        else:
            model = build(preset, impl, device)
            row["model"] = model_name(model)
            row["params"] = sum(p.numel() for p in model.parameters())
            row.update(plain_loop(model, model.config.vocab_size, args.batch, args.seq_len, args.steps, args.warmup,
                                  device, profile=args.profile))
        row["status"] = "ok"
        if device.type == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        peak = peak_flops(device)
        row["mfu"] = row["flops_per_token"] * row["tokens_per_s"] / peak if peak else None
    except Exception as e:  # a failed model (out of memory included) is reported, the others still run
        failed(row, e)
    # the exception (and the tensors of its frames) is gone here, so the memory can be returned
    model = None
    _free()
    return row


def _own_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def measure_rounds(preset: str, impls: list[str], args) -> list[dict]:
    """``--rounds``: the models of ``preset`` (``impls``: ttr's, and its reference) built side by side
    and trained by the plain loop in turn, ``args.rounds`` times, each round a fresh optimizer and
    ``--warmup`` + ``--steps`` steps. A row's tokens/s and step time are the medians of its rounds
    (``tokens_per_s_rounds``), so a drift of the GPU's clocks during the pair reaches both models;
    its peak is the most it allocated above what the other model held. Models that do not fit side by
    side are measured one after the other instead (``measure``), and their rows say so."""
    import statistics

    from ttr.train.metrics import peak_flops

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    facts = model_facts(preset, args.seq_len)
    rows = {impl: {"preset": preset, "impl": impl, **facts, "status": "ok", "tokens_per_s_rounds": [],
                   "step_ms_rounds": []} for impl in impls}
    models, fits = {}, True
    _free()
    for impl in impls:
        try:
            models[impl] = build(preset, impl, device)
        except torch.cuda.OutOfMemoryError:
            fits = False
            break
        except Exception as e:  # this model is reported, the other still runs
            failed(rows[impl], e)
    if not fits:  # outside the handler, whose frames would keep the failed build's memory
        models.clear()
        _free()
        return [{**measure(preset, impl, args), "rounds": "one after the other: the models did not fit side by side"}
                for impl in impls]
    for impl, model in models.items():
        rows[impl].update(model=model_name(model), params=sum(p.numel() for p in model.parameters()))
    for _ in range(args.rounds):
        for impl, model in models.items():
            row = rows[impl]
            if row["status"] != "ok":
                continue
            _free()
            held = torch.cuda.memory_allocated(device) - _own_bytes(model) if cuda else 0
            try:
                r = plain_loop(model, model.config.vocab_size, args.batch, args.seq_len, args.steps, args.warmup,
                               device)
            except Exception as e:
                failed(row, e)
                continue
            row["tokens_per_s_rounds"].append(r["tokens_per_s"])
            row["step_ms_rounds"].append(r["step_ms"])
            row.setdefault("loss_first", r["loss_first"])
            row["loss_last"] = r["loss_last"]
            if cuda:
                row["peak_gib"] = max(row.get("peak_gib") or 0.0, (torch.cuda.max_memory_allocated(device) - held) / GIB)
    models.clear()
    _free()
    peak = peak_flops(device)
    for row in rows.values():
        if row["status"] == "ok":
            row["tokens_per_s"] = statistics.median(row["tokens_per_s_rounds"])
            row["step_ms"] = statistics.median(row["step_ms_rounds"])
            row["mfu"] = row["flops_per_token"] * row["tokens_per_s"] / peak if peak else None
    return list(rows.values())


def _child_argv(args, preset: str, impl: str, result: str) -> list[str]:
    argv = ["--one", f"{preset}:{impl}", "--result", result, "--batch", str(args.batch), "--seq-len",
            str(args.seq_len), "--steps", str(args.steps), "--warmup", str(args.warmup), "--loop", args.loop,
            "--device", args.device, "--run-root", args.run_root, "--tokenizer", args.tokenizer]
    return argv + (["--lift-fla-guard"] if args.lift_fla_guard else []) + (["--profile"] if args.profile else [])


def measure_isolated(preset: str, impl: str, args, timeout: float | None) -> dict:
    """``measure`` in a fresh process (the same Python and ``PYTHONPATH``)."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "row.json")
        code = "import sys; from ttr.scripts.bench_model import main; sys.exit(main(sys.argv[1:]))"
        try:
            proc = subprocess.run([sys.executable, "-c", code, *_child_argv(args, preset, impl, result)],
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"preset": preset, "impl": impl, "status": "error", "error": f"timed out after {timeout:.0f} s"}
        sys.stderr.write(proc.stderr[-4000:])
        if os.path.exists(result):
            return json.loads(Path(result).read_text())
        last = (proc.stderr.strip().splitlines() or [""])[-1]
        return {"preset": preset, "impl": impl, "status": "error", "error": f"exit {proc.returncode}: {last}"[:300]}


def _cell(r: dict | None) -> list[str]:
    """model, tokens/s, MFU, peak GiB of one row."""
    if r is None:
        return ["none", "", "", ""]
    if r["status"] != "ok":
        what = {"oom": "out of memory", "skipped": "not run: time budget spent"}.get(r["status"], r.get("error", ""))
        return [r.get("model", ""), what.replace("|", "/")[:120], "", ""]
    mfu = f"{100 * r['mfu']:.1f} %" if r.get("mfu") is not None else ""
    mem = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else ""
    return [r["model"], f"{r['tokens_per_s']:,.0f}", mfu, mem]


def format_table(results: list[dict], header: list[str]) -> str:
    lines = header + [
        "| preset | ttr tokens/s | ttr MFU | ttr peak GiB | reference | ref tokens/s | ref MFU | ref peak GiB | "
        "ttr / ref |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by_preset: dict[str, dict] = {}
    for r in results:
        by_preset.setdefault(r["preset"], {})[r["impl"]] = r
    for preset, pair in by_preset.items():
        mine, ref = pair.get("ttr"), pair.get("reference")
        ratio = ""
        if mine and ref and mine["status"] == ref["status"] == "ok":
            ratio = f"{mine['tokens_per_s'] / ref['tokens_per_s']:.2f}"
        ttr_cells = _cell(mine)[1:] if mine else ["", "", ""]
        lines.append(f"| {preset} | " + " | ".join(ttr_cells + _cell(ref)) + f" | {ratio} |")
    return "\n".join(lines)


@torch.no_grad()
def decode_throughput(model, vocab: int, batch: int, prompt_len: int, gen_len: int, device) -> dict:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    prompt = torch.randint(0, vocab, (batch, prompt_len), device=device)
    out = model(prompt, use_cache=True, logits_to_keep=1)
    from ttr.models.modeling import CACHE_FIELD

    cache, token = getattr(out, CACHE_FIELD), out.logits[:, -1].argmax(-1, keepdim=True)
    marks = {gen_len // 4, gen_len // 2, gen_len}
    memory = {}
    sync()
    start = time.perf_counter()
    for i in range(1, gen_len + 1):
        out = model(token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        if i in marks:
            memory[i] = torch.cuda.memory_allocated() / GIB if device.type == "cuda" else None
    sync()
    return {"tokens_per_s": batch * gen_len / (time.perf_counter() - start), "memory_gib": memory}


def decode_table(presets: list[str], args, rows: list[dict]) -> str:
    """The decoding table of ttr's models of ``presets``; each measurement is appended to ``rows``."""
    device = torch.device(args.device)
    q = sorted({args.gen_len // 4, args.gen_len // 2, args.gen_len})
    lines = [f"Decoding, bf16 weights, {args.prompt_len}-token prompt, {args.gen_len} generated tokens "
             "(recurrent kernels); allocated GiB after the given number of generated tokens", "",
             "| preset | batch | tokens/s | " + " | ".join(f"GiB @ {n}" for n in q) + " |",
             "|---|---|---|" + "---|" * len(q)]
    for preset in presets:
        _free()
        model = build(preset, "ttr", device).to(dtype=torch.bfloat16).eval()
        for batch in (int(b) for b in args.decode_batches.split(",")):
            r = decode_throughput(model, model.config.vocab_size, batch, args.prompt_len, args.gen_len, device)
            rows.append({"preset": preset, "batch": batch, **r})
            mem = " | ".join("" if r["memory_gib"][n] is None else f"{r['memory_gib'][n]:.3f}" for n in q)
            lines.append(f"| {preset} | {batch} | {r['tokens_per_s']:.1f} | {mem} |")
            print(lines[-1], flush=True)
        del model
    return "\n".join(lines)


def alternatives_table(presets: list[str], args, rows: list[dict], key: str, choices: list, apply, title: str) -> str:
    """ttr's model of each preset built once and trained by the plain loop under each of ``choices``
    in turn (``apply(choice)`` sets one), the choices alternated ``args.alternate_rounds`` times so
    that a drift of the GPU falls on all of them; one row per preset and choice (``key``: the
    choice's label) is appended to ``rows``, with every round's tokens/s, the peak memory and, for
    a ``TUNING`` choice, the stages it overrides that no launch read (``unread``)."""
    from ttr.kernels.common.index import reading_stages

    device = torch.device(args.device)
    lines = [f"{title}, ttr's models (plain loop, B={args.batch} T={args.seq_len}), one model per preset, the "
             f"choices alternated {args.alternate_rounds} times", "",
             f"| preset | {title} | tokens/s, each round | peak GiB |", "|---|---|---|---|"]

    def label(choice) -> str:  # a TUNING alternative as compact JSON
        return json.dumps(choice, separators=(",", ":")) if isinstance(choice, dict) else str(choice)

    for preset in presets:
        _free()
        model = build(preset, "ttr", device)
        found = [(c, {"preset": preset, key: label(c), "status": "ok", "tokens_per_s": [], "peak_gib": None})
                 for c in choices]
        for _ in range(args.alternate_rounds):
            for choice, row in found:
                if row["status"] != "ok":
                    continue
                _free()
                try:
                    with apply(choice), reading_stages() as read:
                        r = plain_loop(model, model.config.vocab_size, args.batch, args.seq_len, args.steps,
                                       args.warmup, device)
                except torch.cuda.OutOfMemoryError as e:  # this choice does not fit; the others still run
                    failed(row, e)
                    continue
                if isinstance(choice, dict):
                    row["unread"] = sorted(set(choice) - read)
                row["tokens_per_s"].append(r["tokens_per_s"])
                if device.type == "cuda":
                    row["peak_gib"] = max(row["peak_gib"] or 0.0, torch.cuda.max_memory_allocated(device) / GIB)
        for _, row in found:
            rows.append(row)
            peak = "" if row["peak_gib"] is None else f"{row['peak_gib']:.1f}"
            speeds = " / ".join(f"{t:,.0f}" for t in row["tokens_per_s"])
            if row["status"] == "oom":
                speeds = (speeds + " / " if speeds else "") + "out of memory"
            unread = f" (no launch read {', '.join(row['unread'])})" if row.get("unread") else ""
            lines.append(f"| {preset} | {row[key]}{unread} | {speeds} | {peak} |")
            print(lines[-1], flush=True)
        del model
    return "\n".join(lines)


def chunk_states_table(presets: list[str], args, rows: list[dict]) -> str:
    """The ``--chunk-states`` table (module docstring); each measurement is appended to ``rows``."""
    from ttr.kernels.utils import env_override

    return alternatives_table(presets, args, rows, "chunk_states", args.chunk_state_list,
                              lambda c: env_override("TTR_CHUNK_STATES", c), "TTR_CHUNK_STATES")


def tuning_table(presets: list[str], args, rows: list[dict]) -> str:
    """The ``--tuning`` table (module docstring); each measurement is appended to ``rows``."""
    return alternatives_table(presets, args, rows, "tuning", args.tuning_list, tuning_override, "TUNING")


def tuning_alternatives(text: str) -> list[dict]:
    """``--tuning``'s JSON: a list of objects, each mapping stage names to objects of launch
    parameters (``{}``: the built-in defaults). ValueError names what is wrong."""
    try:
        alts = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(alts, list) or not alts:
        raise ValueError("expected a non-empty JSON list of objects, e.g. '[{}, {\"wy_bwd\": {\"num_warps\": 8}}]'")
    for i, alt in enumerate(alts):
        try:
            launch_overrides(alt)
        except ValueError as e:
            raise ValueError(f"alternative {i}: {e}") from None
    return alts


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(prog="bench_model", description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default=None, help=f"comma-separated presets (default: every {SIZE} preset)")
    parser.add_argument("--references", action=argparse.BooleanOptionalAction, default=True,
                        help="also run each preset's reference model (default: yes)")
    parser.add_argument("--loop", choices=LOOPS, default="plain", help="plain user loop (default) or ttr's trainer")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation, autotuning)")
    parser.add_argument("--isolate", action="store_true", help="each model in its own process")
    parser.add_argument("--rounds", type=int, default=1,
                        help="plain loop: build each preset's models side by side and train them in turn this "
                             "many times, reporting each one's median (default 1: one model after the other)")
    parser.add_argument("--profile", action="store_true",
                        help="plain loop: also one profiled step per model, its GPU time by kind of work")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds; models not started by then are listed as skipped")
    parser.add_argument("--lift-fla-guard", action="store_true", help=LIFT_FLA_GUARD_HELP)
    parser.add_argument("--train", action=argparse.BooleanOptionalAction, default=True,
                        help="the training table (default: yes)")
    parser.add_argument("--decode", action=argparse.BooleanOptionalAction, default=False,
                        help="the decoding table of ttr's models (default: no)")
    parser.add_argument("--decode-batches", default="1,64")
    parser.add_argument("--chunk-states", default=None, metavar="CHOICES",
                        help="comma-separated TTR_CHUNK_STATES values: the table of ttr's models under each "
                             "(default: none)")
    parser.add_argument("--tuning", default=None, metavar="ALTS",
                        help="a JSON list of launch overrides for index.TUNING (each an object of stage name -> "
                             "launch parameters; {} the defaults): the table of ttr's models under each "
                             "(default: none)")
    parser.add_argument("--alternate-rounds", "--chunk-states-rounds", dest="alternate_rounds", type=int, default=2,
                        help="--chunk-states, --tuning: how many times the choices alternate (default: 2)")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--gen-len", type=int, default=512)
    parser.add_argument("--tokenizer", default="",
                        help="--loop trainer: tokenizer path (default: train the embedded BPE)")
    parser.add_argument("--run-root", default="runs/bench_model", help="--loop trainer: where its runs go")
    parser.add_argument("--device", default="cuda", help="cuda; cpu runs the code paths only (no measurement)")
    parser.add_argument("--out", help="also write the tables (markdown) to this file")
    parser.add_argument("--json", help="also write the rows and the environment to this JSON file")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # PRESET:IMPL, a child of --isolate
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from ttr.models.presets import list_presets

    args.preset_list = args.presets.split(",") if args.presets else default_presets()
    bad = [p for p in args.preset_list if p not in list_presets()]
    if bad:
        parser.error(f"--presets: unknown {bad}; expected some of {list_presets()}")
    args.chunk_state_list = chunk_state_choices(parser, args.chunk_states)
    try:
        args.tuning_list = tuning_alternatives(args.tuning) if args.tuning is not None else []
    except ValueError as e:
        parser.error(f"--tuning: {e}")
    for name in ("batch", "seq_len", "steps", "prompt_len", "gen_len", "alternate_rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.profile and args.loop != "plain":
        parser.error("--profile: profiles the plain loop only (drop --loop trainer)")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.rounds > 1 and (args.isolate or args.loop != "plain" or args.profile):
        parser.error("--rounds: alternates the plain loop's models in one process (drop --isolate, --loop trainer "
                     "and --profile)")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error("bench_model needs a CUDA GPU (--device cpu runs the code paths only)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    lifted = args.lift_fla_guard and args.references and args.train and lift_fla_guard() is not None
    if args.one:
        preset, impl = args.one.split(":")
        Path(args.result).write_text(json.dumps(measure(preset, impl, args)))
        return 0
    env = environment(device)
    timing = "median step, CUDA events" if device.type == "cuda" else "CPU: code paths only, nothing is measured"
    if args.rounds > 1:
        timing += f"; each preset's models side by side, trained in turn {args.rounds} times, the median round"
    header = [describe_environment(env), "",
              f"Training ({args.loop} loop), B={args.batch} T={args.seq_len}, bf16 autocast, fp32 master weights, "
              f"AdamW (fused on a GPU), {args.steps} timed steps after {args.warmup} warm-up ({timing})", ""]
    note = fla_guard_note(lifted) if args.references else None
    deadline = Deadline(args.time_budget)
    results: list[dict] = []
    decoded: list[dict] = []
    chunk_rows: list[dict] = []
    tuning_rows: list[dict] = []
    tables = []

    def write(text: str) -> None:
        data = {"environment": env, "settings": {k: getattr(args, k) for k in (
            "loop", "batch", "seq_len", "steps", "warmup", "isolate", "lift_fla_guard", "rounds")},
            "fla_note": note, "rows": results, "decode": decoded, "chunk_states": chunk_rows, "tuning": tuning_rows}
        if args.json:
            Path(args.json).write_text(json.dumps(data, indent=1))
        if args.out:
            Path(args.out).write_text(text + "\n")

    def preset_rows(preset: str):
        """The rows of ``preset``'s models (ttr's, then its reference's), each as it is measured: the
        pair together with ``--rounds``, else one model after the other."""
        impls = [i for i in IMPLS if i == "ttr" or (args.references and has_reference(preset, args.loop))]
        if args.rounds > 1:
            yield from ([{"preset": preset, "impl": i, "status": "skipped"} for i in impls] if deadline.expired()
                        else measure_rounds(preset, impls, args))
            return
        for impl in impls:
            if deadline.expired():
                yield {"preset": preset, "impl": impl, "status": "skipped"}
            elif args.isolate:
                left = None if deadline.end is None else max(deadline.end - time.monotonic(), 1.0)
                yield measure_isolated(preset, impl, args, left)
            else:
                yield measure(preset, impl, args)

    if args.train:
        for preset in args.preset_list:
            for row in preset_rows(preset):
                results.append(row)
                print(json.dumps(row), flush=True)
                write(format_table(results, header) + ("\n\n" + note if note else ""))
        tables.append(format_table(results, header) + ("\n\n" + note if note else ""))
        if args.profile:
            tables.append(breakdown_table(results))
        print("\n" + "\n\n".join(tables), flush=True)
    if args.decode:
        text = decode_table(args.preset_list, args, decoded)
        tables.append(text if args.train else describe_environment(env) + "\n\n" + text)
        print("\n" + tables[-1], flush=True)
    for alternatives, table, found in ((args.chunk_state_list, chunk_states_table, chunk_rows),
                                       (args.tuning_list, tuning_table, tuning_rows)):
        if alternatives:
            text = table(args.preset_list, args, found)
            tables.append(text if tables else describe_environment(env) + "\n\n" + text)
            print("\n" + tables[-1], flush=True)
    write("\n\n".join(tables))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
