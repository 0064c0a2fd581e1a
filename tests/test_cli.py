import subprocess
import sys

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
