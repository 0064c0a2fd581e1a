"""The ``ttr`` command line: ``ttr train``, ``ttr export``, ``ttr eval``, ``ttr bench``.

Sub-commands import their package lazily so ``ttr --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# sub-command -> (module with a ``main(argv) -> int`` function, one-line help)
COMMANDS = {
    "train": ("ttr.train.cli", "train a model (no config: the embedded default run)"),
    "export": ("ttr.train.export", "export a run directory as a save_pretrained folder"),
    "convert": ("ttr.models.convert", "convert an HF llama / mamba2 or fla folder into a ttr folder"),
    "eval": ("ttr.eval.cli", "evaluate: lm-eval tasks, perplexity, MQAR, state tracking"),
    "bench": ("ttr.scripts.bench_kernels", "benchmark the kernels against fla and SDPA (GPU)"),
}


def _version() -> str:
    from ttr import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="ttr",
        description="Pretrain and evaluate language models with test-time-regressor mixers.",
        epilog="Run 'ttr COMMAND --help' for a command's options.",
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
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
