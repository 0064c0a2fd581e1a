"""The training loop: accelerate (FSDP2 / DDP / one device), gradient accumulation normalised by
target tokens, non-finite skipping, validation, checkpoints, signals.

Loss normalisation: one optimizer step consumes ``accum`` micro-batches on each of ``W`` ranks.
Their target tokens (labels != -100 after the shift) are counted first and summed over ranks
(``N``); every micro-batch's loss is its summed token loss divided by ``N / W`` (passed to the
model as ``num_items_in_batch``), and DDP/FSDP average gradients over ranks, so the gradient is
exactly that of the mean loss over the ``N`` tokens, however documents fall into micro-batches.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ttr.errors import TTRError, one_line
from ttr.models.modeling import prepare_packing
from ttr.optim import build_optimizer, lr_multiplier, set_lr

from .checkpoint import (
    load_checkpoint,
    read_trainer_state,
    save_checkpoint,
    shape_mismatch,
    verify_checkpoint,
)
from .data import BatchStream, Encoder, HFDocStream, MapDocStream, validation_batches, validation_ids
from .lock import RunLock
from .metrics import MetricsSink, peak_flops, peak_memory_gib, train_flops_per_token
from .ranks import gather, on_main
from .report import finish_report
from .rundir import RESUME_MODES, after_resume, claim, config_changes, remove_created
from .sources import open_source
from .tokenizer import SentencePieceTokenizer, load_tokenizer


class TrainingStopped(TTRError):
    """Raised when the run cannot continue (too many non-finite steps in a row)."""

    exit_code = 1


class Aborted(KeyboardInterrupt):
    """A second stop signal before the checkpoint was begun: stop at once, without saving.
    A ``KeyboardInterrupt`` so that no ``except Exception`` on the way swallows it."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class Trainer:
    """``resume``: False (a fresh start into an empty ``run_dir``), True or ``"latest"`` (continue
    from the newest checkpoint that loads; an error when there is none) or ``"auto"`` (the same,
    or a fresh start when there is no checkpoint); ``resume_from`` names the checkpoint instead.
    ``overwrite`` empties ``run_dir`` first."""

    def __init__(self, cfg, *, resume: bool | str = False, resume_from: str | None = None, overwrite: bool = False,
                 model_factory=None):
        mode = {False: None, True: "latest"}.get(resume, resume) if isinstance(resume, (bool, str)) else resume
        if mode not in (None, *RESUME_MODES):
            raise ValueError(f"resume: expected a bool, 'latest' or 'auto', got {resume!r}")
        if (mode or resume_from) and overwrite:
            raise ValueError("resume and overwrite are mutually exclusive")
        self.cfg, self.resume, self.resume_from, self.overwrite = cfg, mode, resume_from, overwrite
        self.model_factory = model_factory or build_model
        self.stop_signal, self.signals_received, self.saving = None, 0, False
        self.encoder = self.sink = self.claim = self.lock = None
        self.last_checkpoint = self.export_dir = None

    # ---- setup ---------------------------------------------------------------------------

    def _accelerator(self):
        from accelerate import Accelerator

        t = self.cfg.train
        cuda = torch.cuda.is_available()
        precision = t.precision if t.precision != "auto" else ("bf16" if cuda else "fp32")
        kwargs = {"mixed_precision": "bf16" if precision == "bf16" else "no", "cpu": not cuda}
        world = int(os.environ.get("WORLD_SIZE", "1"))
        mode = t.distributed
        if mode == "auto":
            mode = "fsdp" if world > 1 and cuda else ("ddp" if world > 1 else "none")
        if mode == "fsdp" and not cuda:
            # accelerate shards only on accelerators (MULTI_CPU ignores the FSDP plugin): refuse
            # rather than silently run DDP
            raise ValueError("train.distributed='fsdp' needs CUDA GPUs; use 'ddp' or 'auto' on CPU")
        if mode == "fsdp":
            from accelerate.utils import FullyShardedDataParallelPlugin

            policy = None
            if precision == "bf16":  # bf16 compute, fp32 gradient reduction; sharded params stay fp32
                from torch.distributed.fsdp import MixedPrecisionPolicy

                policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                              output_dtype=torch.bfloat16)
            kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(
                fsdp_version=2,
                mixed_precision_policy=policy,
                reshard_after_forward=True,
                auto_wrap_policy="transformer_based_wrap",
                state_dict_type="SHARDED_STATE_DICT",
                activation_checkpointing=False,  # done by the model (gradient_checkpointing_enable)
            )
        self.mode = mode
        return Accelerator(**kwargs)

    def _note(self, text: str) -> None:
        if self.acc.is_main_process:
            if self.sink is not None:
                self.sink.message(text)
            else:
                print(f"ttr train: {text}", file=sys.stderr, flush=True)

    def _tokenizer(self, source):
        cfg = self.cfg
        saved = self.run_dir / "tokenizer" / "ttr_tokenizer.model"
        if saved.is_file():  # a resumed run keeps the tokenizer it started with
            return SentencePieceTokenizer(saved.read_bytes())
        if cfg.tokenizer.path:
            return load_tokenizer(cfg.tokenizer.path)
        if source is None:
            raise ValueError("data.source 'hf:...' needs tokenizer.path (ttr trains tokenizers on local data only)")

        ids = np.random.default_rng(0).permutation(len(source))[: cfg.tokenizer.train_docs]
        if not any(len(source.get(int(i))) for i in ids):  # stops at the first document with text
            raise ValueError(f"data.source {cfg.data.source!r}: no text to train a tokenizer on "
                             f"({len(source)} documents, all empty)")

        def texts():
            for i in ids:
                doc = source.get(int(i))
                if not isinstance(doc, str):
                    raise ValueError("token shards carry their own tokenizer: set tokenizer.path to it")
                yield doc

        kwargs = {"texts": texts, "fingerprint": source.fingerprint(), "vocab_size": cfg.tokenizer.vocab_size,
                  "cache_dir": cfg.tokenizer.cache_dir}
        if self.acc.is_main_process:  # rank 0 trains and caches, the others read the cache
            tok = load_tokenizer("", **kwargs)
        self.acc.wait_for_everyone()
        if not self.acc.is_main_process:
            tok = load_tokenizer("", **kwargs)
        return tok

    def _data(self, source, tokenizer):
        cfg, d, t = self.cfg, self.cfg.data, self.cfg.train
        rank, world = self.acc.process_index, self.acc.num_processes
        self.encoder = Encoder(source, tokenizer, d.num_workers)
        if d.val_source:
            val_source = open_source(d.val_source, d.text_key)
            if val_source is None:
                raise ValueError("data.val_source must be a local path or 'embedded'")
            val_items, held = range(min(len(val_source), max(d.val_docs, 1))), np.zeros(0, np.int64)
        elif source is None:
            val_source, held = None, None
        else:
            val_source, held = source, validation_ids(len(source), d.val_docs)
            val_items = [int(i) for i in held]
        if source is None:
            stream = HFDocStream(d.source[3:], d.hf_config, d.hf_split, d.text_key, self.encoder, cfg.seed, rank,
                                 world, 0 if d.val_source else d.val_docs, d.shuffle_buffer)
            if not d.val_source:
                val_items = stream.validation_texts()
        else:
            stream = MapDocStream(source, self.encoder, cfg.seed, rank, world, held)
        val_docs = list(Encoder(val_source, tokenizer, 0).map(iter(val_items)))
        everyone = validation_batches(val_docs, t.micro_batch_size, t.seq_len, cfg.log.val_batches * world)
        self.val_batches = everyone[rank::world]
        return stream

    def setup(self) -> None:
        cfg = self.cfg
        self.acc = self._accelerator()
        if self.acc.device.type == "cpu" and cfg.train.cpu_threads:
            torch.set_num_threads(cfg.train.cpu_threads)
        self.rank, self.world = self.acc.process_index, self.acc.num_processes
        self.run_dir = Path(cfg.run_dir or f"runs/{cfg.model.preset}-{time.strftime('%Y%m%d-%H%M%S')}")
        self.lock = RunLock(self.run_dir)  # taken and held by rank 0 only
        self.claim = on_main(self.acc, lambda: claim(self.run_dir, self.lock, resume=self.resume,
                                                     resume_from=self.resume_from, overwrite=self.overwrite))
        for note in self.claim.notes:
            self._note(note)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        source = open_source(cfg.data.source, cfg.data.text_key)
        if source is not None and len(source) == 0:
            raise ValueError(f"data.source {cfg.data.source!r} holds no documents")
        self.tokenizer = self._tokenizer(source)
        doc_stream = self._data(source, self.tokenizer)

        t = cfg.train
        per_step = t.micro_batch_size * t.seq_len * self.world
        batch_tokens = t.batch_tokens or per_step
        if batch_tokens % per_step:
            raise ValueError(
                f"train.batch_tokens={batch_tokens} must be a multiple of micro_batch_size * seq_len * "
                f"processes = {per_step}"
            )
        self.accum, self.batch_tokens = batch_tokens // per_step, batch_tokens

        model = self.model_factory(cfg, self.tokenizer)
        if t.activation_checkpointing:
            if not getattr(model, "supports_gradient_checkpointing", False):
                raise ValueError("train.activation_checkpointing: this model does not support it")
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.config = getattr(model, "config", None)
        self.flops_per_token = train_flops_per_token(model, self.config, t.seq_len) if self.config else None
        self.num_params = sum(p.numel() for p in model.parameters())
        fused = torch.cuda.is_available() and self.mode != "fsdp"
        o = cfg.optim
        optimizer = build_optimizer(model, lr=o.lr, weight_decay=o.weight_decay, betas=o.betas, eps=o.eps,
                                    fused=fused or None)
        self.model, self.optimizer = self.acc.prepare(model, optimizer)
        if t.compile:
            self.model = torch.compile(self.model)
        self.inner = self.acc.unwrap_model(self.model, keep_torch_compile=False)

        self.step, self.tokens, self.nonfinite_total, self.nonfinite_streak = 0, 0, 0, 0
        data_state = self._resume(self.claim.candidates)
        self.batches = BatchStream(doc_stream, t.micro_batch_size, t.seq_len, data_state)
        if self.acc.is_main_process:
            (self.run_dir / "run_config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
            if hasattr(self.config, "save_pretrained"):
                self.config.save_pretrained(str(self.run_dir / "model"))
            tok_dir = self.run_dir / "tokenizer"
            if not tok_dir.exists():
                self.tokenizer.save_hf(tok_dir)
        self.sink = MetricsSink(self.run_dir, cfg, enabled=self.acc.is_main_process,
                                total_steps=t.max_steps, start_step=self.step)

    def _resume(self, candidates: list[str]) -> dict | None:
        """Load the first of ``candidates`` that is intact and loads (collective); returns this
        rank's data position, None for a fresh start. A damaged one is reported and skipped,
        unless named by ``resume_from``; a model that does not fit the checkpoint is an error."""
        try:
            data_state, bad = self._load_first_good(candidates)
        except TTRError as err:
            err.same_on_all_ranks = True  # decided on gathered facts: rank 0 reports it
            raise
        if self.resume or self.resume_from:
            for note in on_main(self.acc, lambda: after_resume(self.run_dir, bad, self.step)):
                self._note(note)
        return data_state

    def _load_first_good(self, candidates: list[str]) -> tuple[dict | None, list[str]]:
        bad = []
        for path in map(Path, candidates):
            reasons = gather(self.acc, verify_checkpoint(path, part=(self.rank, self.world)))
            reason = next((r for r in reasons if r), None)
            if reason is None:
                before = read_trainer_state(path).get("config", {})
                mismatch = shape_mismatch(path, self.inner)
                if mismatch:
                    changes = [c for c in config_changes(before, self.cfg.to_dict()) if c.startswith("model.")]
                    raise TTRError(
                        f"cannot resume from {path}: the model does not fit it ({mismatch}); "
                        + (f"config changes: {'; '.join(changes)}" if changes else "the model config is unchanged")
                    )
                try:
                    state = load_checkpoint(path, self.inner, self.optimizer, rank=self.rank)
                except Exception as err:  # noqa: BLE001 - any failure to load makes it unusable
                    reason = f"it does not load ({type(err).__name__}: {one_line(str(err))})"
            if reason is not None:
                if self.resume_from:
                    raise TTRError(f"cannot resume from {path}: {reason}")
                self._note(f"skipping checkpoint {path}: {reason}")
                bad.append(path.name)
                continue
            if state["world_size"] != self.world:
                raise TTRError(
                    f"checkpoint {path} was written by {state['world_size']} processes; resume it with the same "
                    f"number (now {self.world}) so every rank continues its data exactly"
                )
            self.step, self.tokens = state["step"], state["tokens"]
            self.nonfinite_total, self.nonfinite_streak = state["nonfinite_total"], state["nonfinite_streak"]
            self._note(f"resuming from {path} (step {self.step})")
            self.last_checkpoint = path
            changes = config_changes(before, self.cfg.to_dict())
            if changes:
                self._note(f"config changed since that checkpoint: {'; '.join(changes)}")
            return state["data"][self.rank], bad
        if candidates:
            raise TTRError(f"no checkpoint in {self.run_dir / 'checkpoints'} can be resumed (see the reasons above)")
        return None, bad

    # ---- helpers -------------------------------------------------------------------------

    def _sum(self, value: float) -> float:
        if self.world == 1:
            return value
        x = torch.tensor([value], dtype=torch.float64, device=self.acc.device)
        return float(self.acc.reduce(x, reduction="sum").item())

    def _forward(self, batch: dict, num_items: float):
        dev = self.acc.device
        ids = batch["input_ids"].to(dev, non_blocking=True)
        return self.model(
            input_ids=ids,
            labels=batch["labels"].to(dev, non_blocking=True),
            # Indexed on the host from the batch's CPU offsets and sent in one non-blocking copy:
            # no op then reads offsets back from the GPU, so the step never waits for it. A
            # Packing also passes DDP and FSDP, which move tensor arguments with a blocking copy.
            cu_seqlens=prepare_packing(batch["cu_seqlens"], ids.shape[1], device=dev),
            num_items_in_batch=num_items,
            use_cache=False,
            return_logits=False,  # validation runs in eval mode, which would build the logits too
        ).loss

    def _trainer_state(self) -> dict:
        return {
            "step": self.step, "tokens": self.tokens, "world_size": self.world,
            "data": gather(self.acc, self.batches.state()),
            "nonfinite_total": self.nonfinite_total, "nonfinite_streak": self.nonfinite_streak,
            "config": self.cfg.to_dict(),
        }

    def save(self) -> Path:
        state = self._trainer_state()
        was, self.saving = self.saving, True  # a second signal now waits for the checkpoint
        try:
            path = save_checkpoint(self.run_dir, self.step, self.inner, self.optimizer, state, rank=self.rank,
                                   world=self.world, barrier=self.acc.wait_for_everyone,
                                   gather=lambda obj: gather(self.acc, obj), keep_last=self.cfg.checkpoint.keep_last)
        finally:
            self.saving = was
        self.last_checkpoint = path
        self.sink.message(f"checkpoint saved: {path}")
        return path

    @torch.no_grad()
    def validate(self) -> dict:
        self.model.eval()
        total, count = 0.0, 0
        for batch in self.val_batches:
            total += float(self._forward(batch, 1.0).float())
            count += batch["num_targets"]
        self.model.train()
        total, count = self._sum(total), self._sum(count)
        loss = total / max(count, 1)
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}

    def _handle_signal(self, signum, frame):
        # Signals often come in pairs (a scheduler signals the process group and a launcher
        # forwards the same signal; Ctrl-C pressed twice), so a second one never costs the
        # checkpoint; a third stops at once, unless the checkpoint is being written.
        name = signal.Signals(signum).name
        self.signals_received += 1
        if self.stop_signal is None:
            self.stop_signal = signum
            self.sink.message(f"received {name}: saving a checkpoint after this step (a third signal stops at once, "
                              "without it)")
        elif self.saving or self.signals_received < 3:
            self.sink.message(f"received {name} again: still stopping, after the checkpoint")
        else:
            raise Aborted(f"third stop signal ({name}): stopped during step {self.step + 1} without saving it; the "
                          f"last checkpoint is {self.last_checkpoint or 'none'}", 128 + self.stop_signal)

    def _stop_requested(self) -> bool:
        return self._sum(1.0 if self.stop_signal is not None else 0.0) > 0

    # ---- the loop ------------------------------------------------------------------------

    def train_step(self) -> dict:
        cfg = self.cfg
        micro = [next(self.batches) for _ in range(self.accum)]
        targets = self._sum(sum(b["num_targets"] for b in micro))
        num_items = targets / self.world
        lr = cfg.optim.lr * lr_multiplier(
            self.step, max_steps=cfg.train.max_steps, schedule=cfg.optim.schedule,
            warmup_steps=cfg.optim.warmup_steps, min_lr_ratio=cfg.optim.min_lr_ratio,
            decay_fraction=cfg.optim.decay_fraction,
        )
        set_lr(self.optimizer, lr)
        loss_sum = torch.zeros((), device=self.acc.device, dtype=torch.float32)
        for i, batch in enumerate(micro):
            sync = i == len(micro) - 1
            ctx = self.acc.no_sync(self.model) if not sync and self.mode == "ddp" else contextlib.nullcontext()
            with ctx:
                loss = self._forward(batch, num_items)
                self.acc.backward(loss)
            loss_sum += loss.detach().float()
        max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        grad_norm = self.acc.clip_grad_norm_(self.model.parameters(), max_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        loss_value = self._sum(float(loss_sum)) / self.world
        grad_norm = float(grad_norm)
        finite = math.isfinite(loss_value) and math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
            self.nonfinite_streak = 0
        else:
            self.nonfinite_total += 1
            self.nonfinite_streak += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens += self.batch_tokens
        if self.nonfinite_streak >= cfg.train.max_nonfinite:
            raise TrainingStopped(
                f"stopping at step {self.step}: {self.nonfinite_streak} non-finite steps in a row "
                f"(loss={loss_value}, grad_norm={grad_norm}); lower optim.lr or check the data. The last good "
                f"checkpoint is in {self.run_dir / 'checkpoints'}"
            )
        return {"step": self.step, "loss": loss_value, "lr": lr, "grad_norm": grad_norm, "skipped": not finite,
                "tokens": self.tokens, "nonfinite_total": self.nonfinite_total}

    def run(self) -> dict:
        """Train to ``train.max_steps``; returns the last metrics record (with ``stopped_by`` when
        a signal stopped the run)."""
        try:
            try:
                self.setup()
            except BaseException:
                if self.claim is not None and self.claim.created and self.acc.is_main_process:
                    remove_created(self.run_dir, self.lock)  # a failed first start leaves nothing behind
                raise
            old = {s: signal.signal(s, self._handle_signal) for s in (signal.SIGTERM, signal.SIGINT)}
            try:
                return self._loop()
            finally:
                for s, handler in old.items():
                    signal.signal(s, handler)
        finally:
            if self.encoder is not None:  # no orphaned tokenisation workers
                self.encoder.close()
            if self.sink is not None:
                self.sink.close()
            if self.lock is not None:
                self.lock.release()

    def _loop(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        record: dict = {}
        self.history: list[dict] = []
        self.sink.message(
            f"run {self.run_dir}: {self.num_params / 1e6:.2f}M parameters, {self.world} process(es) "
            f"({self.mode}: {self.acc.distributed_type.value}, {self.acc.mixed_precision} mixed precision, "
            f"sharded params: {type(next(self.inner.parameters())).__name__}), {self.batch_tokens} tokens/step "
            f"({self.accum} micro-batches per rank), from step {self.step}"
        )
        peak = peak_flops(self.acc.device)
        start_step, start = self.step, time.perf_counter()
        window_start, window_steps = time.perf_counter(), 0
        stop = False
        while self.step < t.max_steps and not stop:
            record = self.train_step()
            self.history.append(record)
            window_steps += 1
            stop = self._stop_requested()
            self.saving = stop  # from here a second signal waits for the checkpoint
            last = self.step == t.max_steps
            if self.step % cfg.log.every == 0 or last or stop:
                if self.acc.device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - window_start
                tps = window_steps * self.batch_tokens / elapsed
                record["tokens_per_s"] = tps
                if self.flops_per_token and peak:
                    record["mfu"] = self.flops_per_token * tps / (peak * self.world)
                mem = peak_memory_gib(self.acc.device)
                if mem is not None:
                    record["peak_mem_gib"] = mem
                if cfg.log.val_every and self.val_batches and (self.step % cfg.log.val_every == 0 or last):
                    record.update(self.validate())
                self.sink.log(record)
                postfix = {"loss": f"{record['loss']:.3f}", "tok/s": f"{tps:,.0f}"}
                if "mfu" in record:
                    postfix["mfu"] = f"{100 * record['mfu']:.1f}%"
                if "val_loss" in record:
                    postfix["val"] = f"{record['val_loss']:.3f}"
                self.sink.progress(window_steps, postfix)
                window_start, window_steps = time.perf_counter(), 0
            every = cfg.checkpoint.every
            if stop or last or (every and self.step % every == 0):
                self.save()
                stop = stop or self._stop_requested()  # a signal during the save: it is saved already
        if stop:
            record["stopped_by"] = signal.Signals(self.stop_signal or signal.SIGTERM).name
        elif t.export_at_end and (record or not (self.run_dir / "export").is_dir()):
            from .export import export_model

            self.export_dir = self.run_dir / "export"
            export_model(self.inner, self.tokenizer, self.export_dir, self.acc)
            self.sink.message(f"exported to {self.export_dir}")
        if self.acc.is_main_process:
            self.sink.close()  # the summary comes after the progress bar
            finish_report(self, record, seconds=time.perf_counter() - start, steps=self.step - start_step)
        return record


def build_model(cfg, tokenizer):
    """A ``TTRForCausalLM`` from ``model.preset`` + ``model.overrides``, sized to the tokenizer
    (vocab rounded up to a multiple of 64), or loaded from ``model.init_from``."""
    from ttr.models import TTRForCausalLM
    from ttr.models.presets import get_preset

    if cfg.model.init_from:
        model = TTRForCausalLM.from_pretrained(cfg.model.init_from)
        if model.config.vocab_size < tokenizer.vocab_size:
            raise ValueError(f"model.init_from has vocab {model.config.vocab_size} < the tokenizer's")
        model.config.train_seq_len = cfg.train.seq_len
        return model
    overrides = dict(cfg.model.overrides)
    vocab = overrides.pop("vocab_size", 64 * -(-tokenizer.vocab_size // 64))
    if vocab < tokenizer.vocab_size:
        raise ValueError(f"model.overrides.vocab_size={vocab} is smaller than the tokenizer ({tokenizer.vocab_size})")
    overrides.setdefault("max_position_embeddings", max(cfg.train.seq_len, 2048))
    config = get_preset(
        cfg.model.preset, vocab_size=vocab, bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id, **overrides,
    )
    # the context the model is trained on, which `ttr eval` uses as lm-eval's max_length
    # (max_position_embeddings may be larger)
    config.train_seq_len = cfg.train.seq_len
    return TTRForCausalLM(config)
