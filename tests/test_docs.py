"""docs/benchmarks.json holds the numbers of docs/benchmarks.md: every row of the kernel,
attention and recall tables appears in the page as the JSON has it."""

import json
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.fixture(scope="module")
def page():
    return (DOCS / "benchmarks.md").read_text(), json.loads((DOCS / "benchmarks.json").read_text())


def _row(text: str, start: str) -> str:
    (line,) = [line for line in text.splitlines() if line.startswith(start)]
    return line.replace("**", "")


def test_kernel_rows_match(page):
    text, data = page
    for r in data["kernels"]["rows"]:
        line = _row(text, f"| {r['op']} | {r['B']} x {r['T']} |")
        keys = ["ttr_fwd_ms", "fla_fwd_ms", "sdpa_fwd_ms", "ttr_fwd_bwd_ms", "fla_fwd_bwd_ms", "sdpa_fwd_bwd_ms"]
        cells = [c.strip() for c in line.split("|")[3:9]]
        assert cells == ["" if r[k] is None else f"{r[k]:.3f}" for k in keys], line
        assert f"| {r['ttr_rel_err']:.1e} | {r['commit']} |" in line


def test_attention_rows_match(page):
    text, data = page
    for r in data["attention"]["rows"]:
        line = _row(text, f"| {r['mask']} | {r['T']} |")
        keys = ["ttr_fwd_ms", "ttr_fwd_bwd_ms", "flex_attention_fwd_bwd_ms", "sdpa_fwd_bwd_ms"]
        cells = [c.strip() for c in line.split("|")[3:7]]
        assert cells == ["" if r[k] is None else f"{r[k]:.3f}" for k in keys], line


def test_recall_rows_match(page):
    text, data = page
    for r in data["mqar"]["rows"]:
        cells = f"| {r['accuracy_pooled']:.4f} | {r['accuracy_config_mean']:.4f} |"
        long = f"| {r['per_config']['(512,128)']:.3f} | {r['per_config']['(1024,256)']:.3f} |"
        assert any(cells in line and line.endswith(long) for line in text.splitlines()), r["model"]
    for r in data["state_tracking"]["rows"]:
        accs = " | ".join(f"{a:.3f}" for a in r["accuracy"].values())
        assert f"| {r['seeds_solved']} | {accs} |" in text, r["variant"]
