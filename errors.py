"""Errors a user can cause and fix, and how the ``ttr`` command line reports any error.

Library code raises :class:`TTRError` (or ``ValueError`` / ``TypeError`` naming the argument,
``OSError`` naming the file) for problems in what the user gave it: a bad flag, key, file or run
directory. The command line (``ttr.__main__``) prints such an error as one line on stderr and
exits non-zero; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import os

DEBUG_HELP = "Errors are reported in one line; add --debug to any ttr command to see the traceback."

# optional packages -> the extra of pyproject.toml that installs them
EXTRAS = {"lm_eval": "eval", "matplotlib": "eval", "datasets": "data", "pyarrow": "data", "wandb": "wandb"}


class TTRError(Exception):
    """A problem in the user's input or environment, reported without a traceback.

    ``exit_code`` is the process exit status the command line returns for it.
    """

    exit_code = 2


def one_line(text: str) -> str:
    """The first non-empty line of ``text`` (library messages sometimes carry whole tracebacks)."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    if not lines:
        return ""
    return lines[0] + (" ..." if len(lines) > 1 else "")


def describe(err: BaseException) -> tuple[str, int]:
    """``(line to print, exit code)`` for an error that reached the command line."""
    if isinstance(err, KeyboardInterrupt):  # Ctrl-C, or a second stop signal
        return one_line(str(err)) or "interrupted", getattr(err, "exit_code", 130)
    if isinstance(err, TTRError):
        return "error: " + one_line(str(err)), err.exit_code
    if isinstance(err, ImportError) and err.name:
        top = err.name.split(".")[0]
        extra = EXTRAS.get(top)
        hint = f" (pip install 'ttr[{extra}]')" if extra else ""
        return f"error: this needs the {top!r} package, which is not installed{hint}", 2
    if isinstance(err, (ValueError, TypeError, OSError)):
        return "error: " + (one_line(str(err)) or type(err).__name__), 2
    text = one_line(str(err))
    return f"error: unexpected {type(err).__name__}{': ' + text if text else ''} (run again with --debug for the traceback)", 1


def quiet_on_this_rank(err: BaseException) -> bool:
    """True on ranks other than 0 for an error every rank raised alike (rank 0 reports it)."""
    return getattr(err, "same_on_all_ranks", False) and os.environ.get("RANK", "0") != "0"
