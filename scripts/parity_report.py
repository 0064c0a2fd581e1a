"""``bench_parity --report``: the parity runs' result files (``<family>.<label>.json``) merged into
the tables of ``docs/benchmarks.md`` (each family's ratio to its reference, from its own draws and
from the same initial weights; every run; the gradient checks; the op-error probes) and a plot of
the validation curves."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ttr.scripts.bench_parity import FAMILIES, TARGET


def op_error_table(records: list[dict]) -> list[str]:
    """``--op-errors`` results as markdown: per family and captured layer, ttr's and the
    reference's relative RMS error against float64 for the output and each input gradient."""
    lines = []
    for rec in sorted((r for r in records if r.get("rows")), key=lambda r: r["family"]):
        names = rec["outputs"]
        lines += ["", f"{rec['family']}: the chunkwise op on the inputs of ttr's model trained {rec['steps_trained']} "
                  "steps, relative RMS error against float64, ttr / reference", "",
                  "| layer call | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        lines += [f"| {row['call']} | " + " | ".join(
            f"{row['ttr'][n]['rel_err']:.1e} / {row['reference'][n]['rel_err']:.1e}" for n in names) + " |"
            for row in rec["rows"]]
    return lines


def report(paths: list[str], plot: str | None) -> str:
    files = []
    for p in map(Path, paths):
        files += sorted(p.glob("*.json")) if p.is_dir() else [p]
    results: dict[str, dict] = {}
    op_errors = []
    for f in files:
        if f.name.endswith(".operrors.json"):
            op_errors.append(json.loads(f.read_text()))
            continue
        run = json.loads(f.read_text())
        if "final_val" not in run:
            # cut short: keep its curve so far (written at every validation)
            run.update(run["partial"], final_val=None)
        entry = results.setdefault(run["family"], {"family": run["family"], "size": run["size"],
                                                    "reference": run["reference"], "runs": {}})
        # the file's name: a repeat of a run is saved as <family>.<label>.repeatN.json
        prefix = f"{run['family']}."
        label = f.stem[len(prefix):] if f.stem.startswith(prefix) else run.get("label", run["impl"])
        previous = entry["runs"].get(label)
        if previous is None or len(run["val"]) > len(previous["val"]):
            entry["runs"][label] = run
        if "grad_check" in run:
            entry["grad_check"] = run["grad_check"]
    results = sorted(results.values(), key=lambda r: FAMILIES.index(r["family"]) if r["family"] in FAMILIES else 99)
    lines = ["| family | reference | ttr, own initialisation | reference | ratio | same initial weights: ttr / "
             "reference, per draw | mean ratio |", "|---|---|---|---|---|---|---|"]

    def by_draw(runs: dict, impl: str) -> dict:
        """The runs of ``impl`` grouped by their draw of the weights (``init_seed``): repeats of one
        draw are one sample of the draw's quality, not several."""
        draws: dict = {}
        for run in runs.values():
            if run["impl"] == impl:  # files older than the field drew with the default seed, 0
                draws.setdefault(run.get("init_seed", 0), []).append(dict(map(tuple, run["val"])))
        return draws

    def curves(runs: dict, impl: str) -> list[list[dict]]:
        return list(by_draw(runs, impl).values())

    def last_step(every: list[dict]) -> int | None:
        """The last validation step that every one of the curves reached."""
        common = set.intersection(*(set(v) for v in every)) if every else set()
        return max(common) if common else None

    def at(draws: list[list[dict]], step: int) -> list[tuple[float, int]]:
        """(mean over the draw's runs, number of runs) per draw, at ``step``."""
        return [(float(np.mean([v[step] for v in runs])), len(runs)) for runs in draws]

    def verdict(value: float, se: float | None, step: int, extra: str = "") -> str:
        shown_se = "" if se is None else f" ± {se:.4f}"
        word = "meets" if value <= TARGET else "**misses**"
        return f"{value:.4f}{shown_se} at step {step} ({word} <= {TARGET}{extra})"

    def paired(runs: dict) -> tuple[str, str]:
        """Both sides from the same initial weights: ttr from the reference's draws (``ttr_refinit``
        against ``reference``) and the reference from ttr's (``reference_ttrinit`` against ``ttr``).
        The mean of the per-draw ratios ttr / reference, with its standard error, at the last step
        every run of those draws reached."""
        pairs = []
        for mine_impl, ref_impl in (("ttr_refinit", "reference"), ("ttr", "reference_ttrinit")):
            mine, ref = by_draw(runs, mine_impl), by_draw(runs, ref_impl)
            pairs += [(mine[k], ref[k]) for k in sorted(set(mine) & set(ref), key=str)]
        step = last_step([v for a, b in pairs for v in a + b])
        if step is None:
            return "", ""
        ratios = [x / y for (x, _), (y, _) in zip(at([a for a, _ in pairs], step), at([b for _, b in pairs], step))]
        se = float(np.std(ratios, ddof=1) / np.sqrt(len(ratios))) if len(ratios) > 1 else None
        extra = f"; {len(ratios)} pair{'s' * (len(ratios) > 1)}"
        return ", ".join(f"{r:.4f}" for r in ratios), verdict(float(np.mean(ratios)), se, step, extra)

    def compare(mine: list[list[dict]], ref: list[list[dict]]) -> tuple[str, str, str]:
        """(ttr's value, the reference's, the ratio of the means over draws with its standard error)
        at the last step every run reached."""
        step = last_step([v for runs in mine + ref for v in runs]) if mine and ref else None
        if step is None:
            return "", "", "not measured"
        a, b = at(mine, step), at(ref, step)
        ma, mb = np.mean([v for v, _ in a]), np.mean([v for v, _ in b])
        value = float(ma / mb)
        rel_se = [float(np.std([v for v, _ in x], ddof=1) / np.sqrt(len(x)) / m) for x, m in ((a, ma), (b, mb))
                  if len(x) > 1]
        se = value * float(np.sqrt(np.sum(np.square(rel_se)))) if rel_se else None
        return shown(a), shown(b), verdict(value, se, step)

    def shown(draws: list[tuple[float, int]]) -> str:
        mean = float(np.mean([v for v, _ in draws]))
        if len(draws) == 1 and draws[0][1] == 1:
            return f"{mean:.4f}"
        each = ", ".join(f"{v:.4f}" + (f" ({n} runs)" if n > 1 else "") for v, n in draws)
        return f"{mean:.4f} (mean of {len(draws)} draw{'s' if len(draws) > 1 else ''}: {each})"

    for r in results:
        runs = r["runs"]
        ref = curves(runs, "reference")
        mine, ref_shown, ratio = compare(curves(runs, "ttr"), ref)
        same, same_ratio = paired(runs)
        if not ref:
            ref_shown = "not measured"
        lines.append(f"| {r['family']} | {r['reference']} | {mine} | {ref_shown} | {ratio} | {same} | "
                     f"{same_ratio if same else ''} |")
    others = [(r, label) for r in results for label in r["runs"] if len(r["runs"]) > 2 or label not in ("ttr", "reference")]
    if others:
        lines += ["", "Every run, at the last step it shares with the reference's runs:", "",
                  "| family | run | val loss | at step | ratio to the reference |", "|---|---|---|---|---|"]
        for r, label in others:
            run = dict(map(tuple, r["runs"][label]["val"]))
            refs = curves(r["runs"], "reference")
            shared = last_step([run] + [v for runs in refs for v in runs]) if refs else None
            step = max(run) if shared is None else shared
            ratio = (f"{run[step] / np.mean([v for v, _ in at(refs, step)]):.4f}" if shared is not None
                     else "no reference run")
            lines.append(f"| {r['family']} | {label} | {run[step]:.4f} | {step} | {ratio} |")
    checks = [(r["family"], r["grad_check"]) for r in results if "grad_check" in r]
    if checks:
        lines += ["", "| family | loss, reference / ttr (same weights, bf16 autocast) | gradient rel. error, "
                  "all / worst tensor | against ttr's fp32 gradients: reference bf16 / ttr bf16 / reference fp32 |",
                  "|---|---|---|---|"]
        def cell(c: dict, key: str) -> str:  # checks of earlier runs lack the later columns
            return f"{c[key]:.1e}" if key in c else "-"

        lines += [f"| {f} | {c['loss_reference']:.5f} / {c['loss_ttr']:.5f} | {cell(c, 'grad_rel_err_all')} / "
                  f"{cell(c, 'grad_rel_err_max')} (`{c['grad_worst']}`) | "
                  + " / ".join(cell(c, k + "_vs_ttr_fp32") for k in ("reference_bf16", "ttr_bf16", "reference_fp32"))
                  + " |" for f, c in checks]
    lines += op_error_table(op_errors)
    if plot and results:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        n = len(results)
        fig, axes = plt.subplots(1, n, figsize=(4 * n, 3.4), squeeze=False)
        # colour: whose code trained the run; line: whose draw of the weights it started from
        # (solid its own, dotted the other side's; dash-dot ttr with the reference's kernel)
        kinds = {"ttr": ("C0", "-", "ttr"), "reference": ("C1", "-", "{ref}"),
                 "ttr_refinit": ("C0", ":", "ttr from {ref}'s weights"),
                 "reference_ttrinit": ("C1", ":", "{ref} from ttr's weights"),
                 "swap": ("C2", "-.", "ttr, reference kernel"),
                 "swap_l2": ("C3", "-.", "ttr, reference kernel, l2 in it")}
        for ax, r in zip(axes[0], results):
            ref_name = r["reference"].split()[0]  # "fla" or "HF"; the title names the model
            shown_kinds = set()
            for _, run in sorted(r["runs"].items()):
                steps, values = zip(*run["val"])
                colour, style, name = kinds.get(run["impl"], ("C7", "--", run["impl"]))
                ax.plot(steps, values, style, color=colour, linewidth=1.2, alpha=0.8,
                        label=None if run["impl"] in shown_kinds else name.format(ref=ref_name))
                shown_kinds.add(run["impl"])
            ax.set_title(f"{r['family']}-{r['size']}")
            ax.set_xlabel("step")
            ax.set_ylabel("validation loss")
            ax.legend(fontsize=6)
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(plot, dpi=110)
    return "\n".join(lines)
