import subprocess
import sys

import pytest

import ttr
from ttr.__main__ import main


def test_version_and_help(capsys):
    assert main([]) == 0
    assert "train" in capsys.readouterr().out
    out = subprocess.run([sys.executable, "-m", "ttr", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"ttr {ttr.__version__}"


def test_package_imported_once_as_ttr():
    """The repository root is the `ttr` package; pytest must not import it a second time under
    the checkout directory's name (tests/ is deliberately not a package)."""
    import sys
    from pathlib import Path

    root = Path(ttr.__file__).resolve().parent
    others = [
        name for name, mod in list(sys.modules.items())
        if not name.startswith("ttr") and mod is not ttr and getattr(mod, "__file__", None)
        and Path(mod.__file__).resolve() == root / "__init__.py"
    ]
    assert others == []


def test_errors_are_one_line_and_debug_shows_the_traceback(monkeypatch, capsys):
    """Every sub-command's errors go through one handler: one line on stderr and an exit status;
    the traceback only with --debug (anywhere before a `--`)."""
    import types

    from ttr import __main__ as cli
    from ttr.errors import TTRError

    raised = []
    fake = types.ModuleType("ttr_fake_command")

    def fake_main(argv):
        assert "--debug" not in argv[: argv.index("--") if "--" in argv else None]
        raise raised[-1]

    fake.main = fake_main
    monkeypatch.setitem(sys.modules, "ttr_fake_command", fake)
    monkeypatch.setitem(cli.COMMANDS, "train", ("ttr_fake_command", "fake"))
    shared = TTRError("the run directory is in use")
    shared.same_on_all_ranks = True
    cases = [
        (ValueError("train.seq_len must be >= 1\nmore detail"), 2, "ttr train: error: train.seq_len must be >= 1 ..."),
        (FileNotFoundError(2, "No such file or directory", "data.jsonl"), 2,
         "ttr train: error: [Errno 2] No such file or directory: 'data.jsonl'"),
        (ModuleNotFoundError("No module named 'lm_eval'", name="lm_eval"), 2,
         "ttr train: error: this needs the 'lm_eval' package, which is not installed (pip install 'ttr[eval]')"),
        (RuntimeError("CUDA out of memory"), 1,
         "ttr train: error: unexpected RuntimeError: CUDA out of memory (run again with --debug for the traceback)"),
        (KeyboardInterrupt(), 130, "ttr train: interrupted"),
        (shared, 2, "ttr train: error: the run directory is in use"),
    ]
    for err, code, line in cases:
        raised.append(err)
        assert main(["train", "x.toml"]) == code
        assert capsys.readouterr().err == line + "\n"
    monkeypatch.setenv("RANK", "1")  # rank 0 reports an error every rank raised alike
    assert main(["train"]) == 2 and capsys.readouterr().err == ""
    raised.append(ValueError("bad"))
    assert main(["train"]) == 2 and capsys.readouterr().err == "ttr train: error: bad\n"
    for argv in (["--debug", "train"], ["train", "x.toml", "--debug"]):
        with pytest.raises(ValueError, match="bad"):
            main(argv)
    assert main(["train", "--", "--debug"]) == 2  # after `--` it is an argument like any other
