"""The ``ttr`` command line: ``ttr train``, ``ttr export``, ``ttr convert``, ``ttr eval``, ``ttr bench``.

Sub-commands import their package lazily so ``ttr --help`` stays fast. Errors are caught here,
once for every sub-command, and printed as one line (see ``ttr.errors``); ``--debug``, accepted
anywhere on the command line, shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# sub-command -> (module with a ``main(argv) -> int`` function, one-line help)
COMMANDS = {
    "train": ("ttr.train.cli", "train a model (no config: the embedded default run)"),
    "export": ("ttr.train.export", "export a run directory as a save_pretrained folder"),
    "convert": ("ttr.models.convert", "convert an HF llama / mamba2 or fla folder into a ttr folder"),
    "eval": ("ttr.eval.cli", "evaluate: lm-eval tasks, perplexity, MQAR, state tracking"),
    "bench": ("ttr.scripts.bench_kernels", "benchmark the kernels at the presets' shapes against fla and SDPA (GPU)"),
}


def _version() -> str:
    from ttr import __version__

    return __version__


def split_debug(argv: list[str]) -> tuple[list[str], bool]:
    """Remove ``--debug`` (before a ``--`` separator) from ``argv``; report whether it was there
    or ``TTR_DEBUG=1`` is set (which passes the flag on to processes ``ttr train --nproc`` starts)."""
    end = argv.index("--") if "--" in argv else len(argv)
    head = [a for a in argv[:end] if a != "--debug"]
    return head + argv[end:], len(head) < end or os.environ.get("TTR_DEBUG") == "1"


def main(argv: list[str] | None = None) -> int:
    argv, debug = split_debug(list(sys.argv[1:] if argv is None else argv))
    parser = argparse.ArgumentParser(
        prog="ttr",
        description="Pretrain and evaluate language models with test-time-regressor mixers.",
        epilog="Run 'ttr COMMAND --help' for a command's options. Errors are reported in one line; "
        "add --debug to any command to see the traceback.",
    )
    parser.add_argument("--version", action="version", version=f"ttr {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv:
        parser.print_help()
        return 0
    if argv[0] not in COMMANDS:
        parser.parse_args(argv[:1])  # prints --help / --version or the usage error
        return 0
    module_name = COMMANDS[argv[0]][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and err.name.startswith(module_name):
            print(f"ttr {argv[0]}: not available in this build ({err})", file=sys.stderr)
            return 2
        raise
    if debug:
        previous = os.environ.get("TTR_DEBUG")
        os.environ["TTR_DEBUG"] = "1"  # for the processes `ttr train --nproc` starts
        try:
            return int(module.main(argv[1:]) or 0)
        finally:
            if previous is None:
                del os.environ["TTR_DEBUG"]
    from ttr.errors import describe, quiet_on_this_rank

    try:
        return int(module.main(argv[1:]) or 0)
    except (Exception, KeyboardInterrupt) as err:  # SystemExit (argparse, --help) passes through
        message, code = describe(err)
        if not quiet_on_this_rank(err):
            print(f"ttr {argv[0]}: {message}", file=sys.stderr, flush=True)
        return code


if __name__ == "__main__":
    sys.exit(main())
