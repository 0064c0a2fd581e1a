"""Saved folders load in a fresh interpreter that never imported ttr, through
``trust_remote_code=True`` and the module file ``save_pretrained`` writes; without ttr installed
that module says so. One subprocess loads every family's folder (interpreter start-up dominates).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import ttr
from ttr.models.remote_code import AUTO_MAP, MODULE_FILE

from .test_models import FAMILIES, VOCAB, make_model

LOAD_ALL = """
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
assert "ttr" not in sys.modules
for folder in sys.argv[1:]:
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(model).__module__ == "ttr.models.modeling", type(model)
    assert type(AutoConfig.from_pretrained(folder, trust_remote_code=True)).__name__ == "TTRConfig"
    ids = torch.load(folder + "/ids.pt")
    with torch.no_grad():
        torch.save(model(ids).logits, folder + "/loaded.pt")
print(sys.modules["ttr"].__file__)
"""

WITHOUT_TTR = """
import sys
sys.modules["ttr"] = None  # as if ttr were not installed: importing it raises ModuleNotFoundError
from transformers import AutoModelForCausalLM
AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
"""


def run_fresh(code: str, *args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """``python -c code args`` with only this checkout's ttr on the path (through a ``ttr`` link,
    the repository root being the package) and transformers' module cache under ``tmp_path``."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    link = site / "ttr"
    if not link.exists():
        link.symlink_to(Path(ttr.__file__).parent, target_is_directory=True)
    env = dict(
        os.environ, PYTHONPATH=str(site), HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=300
    )


@torch.no_grad()
def test_saved_folders_load_without_import_ttr(tmp_path):
    folders, expected = [], []
    for family in FAMILIES:
        model = make_model(family)
        folder = tmp_path / family
        model.save_pretrained(folder)
        config = json.loads((folder / "config.json").read_text())
        assert config["auto_map"] == AUTO_MAP and (folder / MODULE_FILE).is_file()
        assert "auto_map" not in model.config.to_dict()  # only the folder has the module file
        ids = torch.randint(0, VOCAB, (2, 9))
        torch.save(ids, folder / "ids.pt")
        folders.append(str(folder))
        expected.append(model(ids).logits)
    proc = run_fresh(LOAD_ALL, *folders, tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert Path(proc.stdout.strip().splitlines()[-1]).parent == tmp_path / "site" / "ttr"
    for folder, logits in zip(folders, expected):
        torch.testing.assert_close(torch.load(Path(folder) / "loaded.pt"), logits, rtol=0, atol=0)


def test_without_ttr_the_error_names_the_package(tmp_path):
    make_model("gated_deltanet").save_pretrained(tmp_path / "model")
    proc = run_fresh(WITHOUT_TTR, str(tmp_path / "model"), tmp_path=tmp_path)
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr and "pip install ttr" in proc.stderr, proc.stderr[-3000:]
