"""``ttr eval``: ``lm`` (lm-eval tasks), ``ppl`` (perplexity, extrapolation sweep), ``mqar``
(associative recall) and ``state`` (state tracking)."""

from __future__ import annotations

import argparse
import json
import os
import sys


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


def _write(out_dir: str, name: str, content) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        if isinstance(content, str):
            f.write(content + "\n")
        else:
            json.dump(content, f, indent=2, default=str)
    return path


def _lm(args) -> int:
    from ttr.eval.lm_harness import evaluate, markdown_table, write_results

    results = evaluate(
        args.checkpoint,
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
    json_path, md_path = write_results(results, args.output)
    print(f"wrote {json_path} and {md_path}")
    return 0


def _ppl(args) -> int:
    from ttr.eval.common import load_checkpoint, training_context
    from ttr.eval.perplexity import extrapolation_sweep, perplexity, plot_sweep, read_documents

    model, tokenizer = load_checkpoint(args.checkpoint, dtype=args.dtype, device=args.device)
    docs = read_documents(
        args.data,
        text_field=args.text_field,
        split=args.split,
        hf_config=args.hf_config,
        max_documents=args.max_documents,
    )
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
        png = os.path.join(args.output, "extrapolation.png")
        os.makedirs(args.output, exist_ok=True)
        plot_sweep({os.path.basename(os.path.normpath(args.checkpoint)): sweep}, png)
        print(f"wrote {png}")
    print(f"wrote {_write(args.output, 'perplexity.json', result)}")
    return 0


def _sweep(task, jobs: list[dict], args, stem: str) -> tuple[list, list]:
    """Run a synthetic benchmark's sweep (``task.run_job`` per job, ``--jobs`` processes), print
    ``task.report`` and write it and every result under ``--output`` as ``stem``.md / .json."""
    from ttr.eval.synthetic import run_sweep

    results, failed = run_sweep(task.run_job, jobs, args.jobs, args.output)
    report = task.report(results, failed)
    print(report)
    _write(args.output, f"{stem}.md", report)
    _write(args.output, f"{stem}.json", results + failed)
    print(f"wrote {args.output}/{stem}.md, {stem}.json")
    return results, failed


def _mqar(args) -> int:
    from ttr.eval import mqar
    from ttr.eval.synthetic import MIXERS

    unknown = [m for m in args.mixer if m not in MIXERS]
    if unknown:
        raise SystemExit(f"ttr eval mqar: --mixer: unknown {unknown}; expected some of {list(MIXERS)}")
    try:
        jobs = mqar.sweep_jobs(
            args.mixer, args.d_model, args.lrs, variants=args.variant or (), overrides=dict(args.set or []),
            num_heads=args.num_heads, seed=args.seed, vocab_size=args.vocab_size, batch_size=args.batch_size,
            eval_batch_size=args.eval_batch_size, steps=args.steps, epochs=args.epochs,
            train_configs=args.train_configs, test_configs=args.test_configs, max_seconds=_seconds(args.max_minutes),
            amp=not args.no_amp, device=args.device,
        )  # fmt: skip
    except ValueError as e:  # a bad size or step count, named by its make_job argument
        raise SystemExit(f"ttr eval mqar: {e}") from None
    results, failed = _sweep(mqar, jobs, args, "mqar")
    try:
        if results:
            mqar.plot(results, os.path.join(args.output, "mqar.png"))
            print(f"wrote {args.output}/mqar.png")
    except ImportError:
        print("matplotlib is not installed: no mqar.png", file=sys.stderr)
    return 1 if failed else 0


def _state(args) -> int:
    from ttr.eval import state_tracking as st

    variants = {label: (mixer, ov) for label, mixer, ov in st.VARIANTS}
    chosen = args.variants or list(variants)
    unknown = [v for v in chosen if v not in variants]
    if unknown:
        raise SystemExit(f"ttr eval state: --variants: unknown {unknown}; expected some of {list(variants)}")
    for task in args.task:
        if task not in st.TASKS:
            raise SystemExit(f"ttr eval state: --task: unknown {task!r}; expected some of {list(st.TASKS)}")
    try:
        jobs = st.sweep_jobs(
            args.task, chosen, args.lrs, weight_decays=args.weight_decays, seeds=args.seeds, d_model=args.d_model,
            num_layers=args.num_layers, intermediate_size=args.intermediate_size, num_heads=args.num_heads,
            steps=args.steps, batch_size=args.batch_size, train_min=args.train_min, train_max=args.train_max,
            eval_lengths=args.eval_lengths, eval_examples=args.eval_examples, eval_batch_size=args.eval_batch_size,
            max_seconds=_seconds(args.max_minutes), amp=not args.no_amp, device=args.device,
        )  # fmt: skip
    except ValueError as e:  # a bad model size or step count, named by its make_job argument
        raise SystemExit(f"ttr eval state: {e}") from None
    _, failed = _sweep(st, jobs, args, "state_tracking")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    from ttr.eval.mqar import TEST_CONFIGS, TRAIN_CONFIGS, VOCAB_SIZE, parse_configs, parse_variant
    from ttr.overrides import parse_assignment

    parser = argparse.ArgumentParser(prog="ttr eval", description=__doc__)
    sub = parser.add_subparsers(dest="what", required=True, metavar="{lm,ppl,mqar,state}")

    p = sub.add_parser("lm", help="lm-evaluation-harness tasks on a checkpoint")
    p.add_argument("checkpoint", help="save_pretrained directory (ttr export output)")
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
    p.add_argument("--output", default="eval_results")
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
    p.add_argument("--output", default="eval_results")
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
    p.add_argument("--output", default="eval_results/mqar")
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
    p.add_argument("--output", default="eval_results/state")
    p.set_defaults(fn=_state)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return int(args.fn(args) or 0)
