"""The end of a ``ttr train`` session: a summary on stdout and ``loss.png`` in the run directory.

The loss curve covers the whole run (every session's records in ``metrics.jsonl``): training loss
at each logged step, validation loss where it was measured. matplotlib comes with the ``eval``
extra; without it the image is skipped with a one-line note.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


def read_metrics(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` (lines that do not parse are left out)."""
    if not Path(path).is_file():
        return []
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "step" in record:
            out.append(record)
    return out


def plot_loss(records: list[dict], png: Path) -> Path:
    """Training loss (and validation loss where measured) against step; raises ImportError
    without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if _finite(r.get("loss"))]
    val = [(r["step"], r["val_loss"]) for r in records if _finite(r.get("val_loss"))]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), lw=1, label="train loss")
    if val:
        ax.plot(*zip(*val), marker="o", lw=1.5, label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(png.parent.name)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, sec = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{sec:02d}s"
    return f"{minutes // 60}h{minutes % 60:02d}m"


def summary(*, how: str, step: int, max_steps: int, steps: int, tokens: int, session_tokens: int, seconds: float,
            records: list[dict], checkpoint, export, curve) -> list[str]:
    """The lines printed at the end of a session."""
    rate = f", {session_tokens / seconds:,.0f} tokens/s" if seconds > 0 and steps else ""
    lines = [f"{how} at step {step}/{max_steps}: {steps} step(s) and {session_tokens:,} tokens in "
             f"{duration(seconds)} this session{rate}; {tokens:,} tokens in all"]
    train = [r for r in records if _finite(r.get("loss"))]
    val = [r for r in records if _finite(r.get("val_loss"))]
    losses = []
    if train:
        losses.append(f"train loss {train[-1]['loss']:.4f} (step {train[-1]['step']})")
    if val:
        losses.append(f"validation loss {val[-1]['val_loss']:.4f} (step {val[-1]['step']})")
    if losses:
        lines.append(", ".join(losses))
    for label, where in (("checkpoint", checkpoint), ("export", export), ("loss curve", curve)):
        if where is not None:
            lines.append(f"{label}: {where}")
    return lines


def finish_report(trainer, record: dict, *, seconds: float, steps: int) -> None:
    """Rank 0: write the loss curve and print the summary of ``trainer``'s session."""
    run_dir = trainer.run_dir
    records = read_metrics(run_dir / "metrics.jsonl")
    curve = None
    if records:
        try:
            curve = plot_loss(records, run_dir / "loss.png")
        except ImportError:
            print("matplotlib is not installed (pip install 'ttr[eval]'): no loss curve image")
    how = f"stopped by {record['stopped_by']}" if record.get("stopped_by") else "finished"
    if not steps:
        how = "nothing to do (already trained)" if trainer.step >= trainer.cfg.train.max_steps else how
    lines = summary(how=how, step=trainer.step, max_steps=trainer.cfg.train.max_steps, steps=steps,
                    tokens=trainer.tokens, session_tokens=steps * trainer.batch_tokens, seconds=seconds,
                    records=records, checkpoint=trainer.last_checkpoint, export=trainer.export_dir, curve=curve)
    print("\n".join(lines), flush=True)
