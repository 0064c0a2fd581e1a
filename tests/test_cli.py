import subprocess
import sys

import ttr
from ttr.__main__ import main


def test_version_and_help(capsys):
    assert main([]) == 0
    assert "train" in capsys.readouterr().out
    out = subprocess.run([sys.executable, "-m", "ttr", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"ttr {ttr.__version__}"
