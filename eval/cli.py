"""``ttr eval``: ``lm`` (lm-eval tasks), ``ppl`` (perplexity, extrapolation sweep), ``mqar``
(associative recall) and ``state`` (state tracking)."""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import sys
import time

from ttr.errors import DEBUG_HELP, TTRError
from ttr.eval.hub import offline_if_unreachable
from ttr.eval.progress import SweepProgress


def parse_csv(kind, *, above: float | None = None, at_least: float | None = None):
    """An argparse ``type``: comma-separated ``kind`` values, optionally each ``> above`` or
    ``>= at_least``; argparse names the flag in the error."""

    def parse(text: str):
        try:
            values = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {kind.__name__} values, got {text!r}"
            ) from None
        low = [v for v in values if above is not None and not v > above]
        bad = low + [v for v in values if at_least is not None and not v >= at_least]
        if bad:
            bound = f"> {above:g}" if above is not None else f">= {at_least:g}"
            raise argparse.ArgumentTypeError(f"expected values {bound}, got {bad}")
        return values

    return parse


def argument(parse):
    """An argparse ``type`` from a parser that raises ValueError: argparse then names the flag and
    shows the parser's own message."""

    def parse_argument(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse_argument


def _seconds(minutes: float | None) -> float | None:
    return None if minutes is None else 60.0 * minutes


def model_dir(path: str) -> str:
    """The ``save_pretrained`` folder to evaluate: ``path``, or ``path/export`` for a run directory."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    if os.path.isfile(os.path.join(path, "export", "config.json")):
        return os.path.join(path, "export")
    what = "does not exist" if not os.path.exists(path) else "has no config.json (nor export/config.json)"
    raise TTRError(f"checkpoint {path!r} {what}: give a `ttr export` folder or a run directory with export/")


@contextlib.contextmanager
def results_dir(output: str | None, kind: str, model: str | None = None):
    """The folder results go to: ``output``, else a new ``MODEL/eval/KIND-TIMESTAMP`` (``runs/KIND-
    TIMESTAMP`` for the synthetic sweeps, which have no model folder), so that no earlier result is
    overwritten. It is made first, so that one that cannot be written fails before the evaluation,
    and removed again (when made here and still empty) if the evaluation fails."""
    out = output
    if not output:
        base = os.path.join(model, "eval") if model else "runs"
        out = base = os.path.join(base, f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}")
        n = 1
        while os.path.exists(out):
            n += 1
            out = f"{base}-{n}"
    made, parent = [], os.path.abspath(out)
    while not os.path.exists(parent):
        made.append(parent)
        parent = os.path.dirname(parent)
    try:
        os.makedirs(out, exist_ok=True)
        if not os.access(out, os.W_OK):
            raise PermissionError(13, "not writable")
    except OSError as err:
        raise TTRError(f"cannot write results to {out!r} ({err.strerror or err}); choose a folder with --output") from None
    try:
        yield out
    except BaseException:
        for folder in made:  # deepest first
            if os.path.isdir(folder) and not os.listdir(folder):
                os.rmdir(folder)
        raise


def _write(out_dir: str, name: str, content) -> str:
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        if isinstance(content, str):
            f.write(content + "\n")
        else:
            json.dump(content, f, indent=2, default=str)
    return path


def _offline_check(command: str) -> None:
    note = offline_if_unreachable()
    if note:
        print(f"ttr eval {command}: {note}", file=sys.stderr)


def _lm(args) -> int:
    checkpoint = model_dir(args.checkpoint)
    _offline_check("lm")
    from ttr.eval.lm_harness import evaluate, markdown_table, write_results

    with results_dir(args.output, "lm", checkpoint) as out:
        results = evaluate(
            checkpoint,
            args.tasks,
            num_fewshot=args.num_fewshot,
            batch_size=args.batch_size,
            max_length=args.max_length,
            limit=args.limit,
            include_path=args.include_path or None,
            log_samples=args.log_samples,
            dtype=args.dtype,
            device=args.device,
        )
        print(markdown_table(results))
        json_path, md_path = write_results(results, out)
    print(f"wrote {json_path} and {md_path}")
    return 0


def _ppl(args) -> int:
    checkpoint = model_dir(args.checkpoint)
    if not glob.glob(args.data):  # a Hugging Face dataset name
        _offline_check("ppl")
    with results_dir(args.output, "ppl", checkpoint) as out:
        return _perplexity(args, checkpoint, out)


def _perplexity(args, checkpoint: str, out: str) -> int:
    from ttr.eval.common import load_checkpoint, training_context
    from ttr.eval.perplexity import extrapolation_sweep, perplexity, plot_sweep, read_documents

    docs = read_documents(  # before the model: a wrong path fails at once
        args.data,
        text_field=args.text_field,
        split=args.split,
        hf_config=args.hf_config,
        max_documents=args.max_documents,
    )
    model, tokenizer = load_checkpoint(checkpoint, dtype=args.dtype, device=args.device)
    context = training_context(model.config, args.max_length)
    window = args.window if args.window is not None else context
    result = perplexity(
        model,
        tokenizer,
        docs,
        mode=args.mode,
        window=window if args.mode == "window" else None,
        stride=args.stride,
    )
    print(
        f"{result['documents']} documents, {result['tokens']} tokens: token ppl {result['token_perplexity']:.4f}, "
        f"word ppl {result['word_perplexity']:.4f}, byte ppl {result['byte_perplexity']:.4f}, "
        f"bits/byte {result['bits_per_byte']:.4f}"
    )
    if args.sweep_factor:
        sweep = extrapolation_sweep(
            model,
            tokenizer,
            docs,
            context=context,
            factor=args.sweep_factor,
            max_sequences=args.sweep_sequences,
            batch_size=args.batch_size,
        )
        result["sweep"] = sweep
        for a, b, loss in zip(sweep["bucket_start"], sweep["bucket_end"], sweep["loss"]):
            print(f"  positions {a:>7}-{b - 1:<7} loss {loss:.4f}")
        png = os.path.join(out, "extrapolation.png")
        plot_sweep({os.path.basename(os.path.normpath(args.checkpoint)): sweep}, png)
        print(f"wrote {png}")
    print(f"wrote {_write(out, 'perplexity.json', result)}")
    return 0


def _sweep(task, jobs: list[dict], args, kind: str, stem: str) -> tuple[list, list, str]:
    """Run a synthetic benchmark's sweep (``task.run_job`` per job, ``--jobs`` processes, its steps
    and the time left on stderr), print ``task.report`` and write it and every result as ``stem``.md
    / .json under ``--output`` (default: a new ``runs/KIND-TIMESTAMP``); returns the results, the
    failed jobs and that folder."""
    from ttr.eval.synthetic import run_sweep

    with results_dir(args.output, kind) as out:
        with SweepProgress(jobs, f"ttr eval {kind}", args.jobs) as progress:
            results, failed = run_sweep(progress.wrap(task.run_job), jobs, args.jobs, out)
        report = task.report(results, failed)
        print(report)
        _write(out, f"{stem}.md", report)
        _write(out, f"{stem}.json", results + failed)
    print(f"wrote {out}/{stem}.md, {stem}.json")
    return results, failed, out


def _mqar(args) -> int:
    from ttr.eval import mqar
    from ttr.eval.synthetic import MIXERS

    unknown = [m for m in args.mixer if m not in MIXERS]
    if unknown:
        raise TTRError(f"--mixer: unknown {unknown}; expected some of {list(MIXERS)}")
    try:
        jobs = mqar.sweep_jobs(
            args.mixer, args.d_model, args.lrs, variants=args.variant or (), overrides=dict(args.set or []),
            num_heads=args.num_heads, seed=args.seed, vocab_size=args.vocab_size, batch_size=args.batch_size,
            eval_batch_size=args.eval_batch_size, steps=args.steps, epochs=args.epochs,
            train_configs=args.train_configs, test_configs=args.test_configs, max_seconds=_seconds(args.max_minutes),
            amp=not args.no_amp, device=args.device,
        )  # fmt: skip
    except ValueError as e:  # a bad size or step count, named by its make_job argument
        raise TTRError(str(e)) from None
    results, failed, out = _sweep(mqar, jobs, args, "mqar", "mqar")
    if results:
        try:
            mqar.plot(results, os.path.join(out, "mqar.png"))
        except ImportError:
            print("matplotlib is not installed (pip install 'ttr[eval]'): no mqar.png", file=sys.stderr)
        else:
            print(f"wrote {out}/mqar.png")
    return 1 if failed else 0


def _state(args) -> int:
    from ttr.eval import state_tracking as st

    variants = {label: (mixer, ov) for label, mixer, ov in st.VARIANTS}
    chosen = args.variants or list(variants)
    unknown = [v for v in chosen if v not in variants]
    if unknown:
        raise TTRError(f"--variants: unknown {unknown}; expected some of {list(variants)}")
    for task in args.task:
        if task not in st.TASKS:
            raise TTRError(f"--task: unknown {task!r}; expected some of {list(st.TASKS)}")
    try:
        jobs = st.sweep_jobs(
            args.task, chosen, args.lrs, weight_decays=args.weight_decays, seeds=args.seeds, d_model=args.d_model,
            num_layers=args.num_layers, intermediate_size=args.intermediate_size, num_heads=args.num_heads,
            steps=args.steps, batch_size=args.batch_size, train_min=args.train_min, train_max=args.train_max,
            eval_lengths=args.eval_lengths, eval_examples=args.eval_examples, eval_batch_size=args.eval_batch_size,
            max_seconds=_seconds(args.max_minutes), amp=not args.no_amp, device=args.device,
        )  # fmt: skip
    except ValueError as e:  # a bad model size or step count, named by its make_job argument
        raise TTRError(str(e)) from None
    _, failed, _ = _sweep(st, jobs, args, "state", "state_tracking")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    from ttr.eval.mqar import TEST_CONFIGS, TRAIN_CONFIGS, VOCAB_SIZE, parse_configs, parse_variant
    from ttr.overrides import parse_assignment

    parser = argparse.ArgumentParser(prog="ttr eval", description=__doc__, epilog=DEBUG_HELP)
    sub = parser.add_subparsers(dest="what", required=True, metavar="{lm,ppl,mqar,state}")

    p = sub.add_parser("lm", help="lm-evaluation-harness tasks on a checkpoint")
    p.add_argument("checkpoint", help="save_pretrained folder (ttr export output) or a run directory with export/")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    p.add_argument("--include-path", action="append", help="directory of extra task YAMLs (repeatable)")
    p.add_argument("--num-fewshot", type=int)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument(
        "--max-length", type=int, help="context length (default: the training context in the config)"
    )
    p.add_argument("--limit", type=float, help="examples per task (fraction if < 1)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device")
    p.add_argument("--log-samples", action="store_true")
    p.add_argument("--output", help="results folder (default: a new CHECKPOINT/eval/lm-TIMESTAMP)")
    p.set_defaults(fn=_lm)

    p = sub.add_parser("ppl", help="token/word/byte perplexity, bits per byte, length-extrapolation sweep")
    p.add_argument("checkpoint")
    p.add_argument(
        "data", help="file, directory or glob of .txt/.jsonl/.parquet, or a Hugging Face dataset name"
    )
    p.add_argument("--text-field", default="text")
    p.add_argument("--split", default="test", help="Hugging Face dataset split")
    p.add_argument("--hf-config", help="Hugging Face dataset configuration name")
    p.add_argument("--max-documents", type=int)
    p.add_argument("--mode", default="document", choices=["document", "window"])
    p.add_argument("--window", type=int, help="sliding window in tokens (default: the training context)")
    p.add_argument("--stride", type=int, help="window stride (default: window / 2)")
    p.add_argument("--max-length", type=int, help="training context (default: from the config)")
    p.add_argument(
        "--sweep-factor",
        type=int,
        default=0,
        help="extrapolation sweep to FACTOR x the training context (0: off)",
    )
    p.add_argument("--sweep-sequences", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=1, help="sequences per forward in the sweep")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device")
    p.add_argument("--output", help="results folder (default: a new CHECKPOINT/eval/ppl-TIMESTAMP)")
    p.set_defaults(fn=_ppl)

    p = sub.add_parser("mqar", help="multi-query associative recall (Zoology protocol), lr sweep, plot")
    p.add_argument("--mixer", type=parse_csv(str), default=["gated_deltanet"], help="comma-separated layer types")
    p.add_argument("--d-model", type=parse_csv(int), default=[128])
    p.add_argument("--num-heads", type=int, default=1)
    p.add_argument("--lrs", type=parse_csv(float, above=0), default=[1e-4, 4.6e-4, 2.2e-3, 1e-2])
    p.add_argument(
        "--steps", type=int, default=0,
        help="training steps (0: --epochs over the training set; both 0: the --max-minutes clock alone)",
    )  # fmt: skip
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--eval-batch-size", type=int, default=250)
    p.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    fmt = lambda cs: ",".join(f"{c.seq_len}:{c.num_kv_pairs}:{c.num_examples}" for c in cs)
    p.add_argument(
        "--train-configs", type=parse_configs, default=TRAIN_CONFIGS, help=f"default {fmt(TRAIN_CONFIGS)}"
    )
    p.add_argument(
        "--test-configs", type=parse_configs, default=TEST_CONFIGS, help=f"default {fmt(TEST_CONFIGS)}"
    )
    p.add_argument(
        "--set", type=argument(parse_assignment), action="append", metavar="KEY=VALUE",
        help="a TTRConfig field for every model (VALUE: TOML, else JSON, else a string)",
    )  # fmt: skip
    p.add_argument(
        "--variant", type=argument(parse_variant), action="append", metavar="MIXER:KEY=VALUE[,KEY=VALUE]",
        help="one more model: MIXER with these TTRConfig fields (repeatable), e.g. attn:rope_theta=10000.0",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1, help="parallel processes (several fit on one GPU)")
    p.add_argument(
        "--max-minutes", type=float, help="training time budget per job; the lr schedule follows it"
    )
    p.add_argument("--device")
    p.add_argument("--no-amp", action="store_true", help="fp32 on GPU instead of bf16 autocast")
    p.add_argument("--output", help="results folder (default: a new runs/mqar-TIMESTAMP)")
    p.set_defaults(fn=_mqar)

    p = sub.add_parser("state", help="state tracking: parity, modular arithmetic (with/without brackets)")
    p.add_argument("--task", type=parse_csv(str), default=["parity"])
    p.add_argument(
        "--variants",
        type=lambda s: [v.strip() for v in s.split(";") if v.strip()],
        help="';'-separated variant labels (default: all)",
    )
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument(
        "--num-layers", type=int, help="blocks (default: parity 1 for the delta rules, 2 for Mamba2; other tasks 2)"
    )  # fmt: skip
    p.add_argument(
        "--intermediate-size", type=int, help="MLP width, 0 for none (default: parity 0 for the delta rules; else 128)"
    )  # fmt: skip
    p.add_argument("--num-heads", type=int, default=1)
    p.add_argument("--lrs", type=parse_csv(float, above=0), default=[1e-3, 3e-3])
    p.add_argument(
        "--weight-decays", type=parse_csv(float, at_least=0), default=[0.1], help="AdamW weight decays (each run at every lr)"
    )
    p.add_argument("--steps", type=int, default=2000, help="training steps (0: the --max-minutes clock alone)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--train-min", type=int, default=3)
    p.add_argument("--train-max", type=int, default=40)
    p.add_argument("--eval-lengths", type=parse_csv(int), default=[40, 64, 128, 256])
    p.add_argument("--eval-examples", type=int, default=512)
    p.add_argument("--eval-batch-size", type=int, default=256)
    p.add_argument(
        "--seeds", type=parse_csv(int, at_least=0), default=[0],
        help="comma-separated seeds (each run at every lr and weight decay; the table keeps the best run "
        "and counts the seeds that solve the task)",
    )  # fmt: skip
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument(
        "--max-minutes", type=float, help="training time budget per job; the lr schedule follows it"
    )
    p.add_argument("--device")
    p.add_argument("--no-amp", action="store_true")
    p.add_argument("--output", help="results folder (default: a new runs/state-TIMESTAMP)")
    p.set_defaults(fn=_state)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return int(args.fn(args) or 0)
