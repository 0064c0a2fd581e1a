"""Multi-query associative recall (MQAR), following the Zoology protocol (Arora et al. 2023,
arXiv:2312.04927), fully offline.

An example of length ``L`` with ``N`` key-value pairs starts with ``k_1 v_1 ... k_N v_N`` (keys drawn
without replacement from the first half of the vocabulary, ``1 .. V/2 - 1``, values from the
second, ``V/2 .. V - 1``); every key is then queried exactly once, at positions
``2N + 2 g`` whose gaps ``g`` follow the power law ``p(g) ~ g^(a - 1)`` (a = 0.01, so most
queries come soon after the context and a few far away). The label of a query position is the
value bound to its key; every other position is unlabelled (-100). Positions that are neither
context nor query hold random tokens. Labels are already shifted: ``labels[t]`` is what the model
must predict after reading ``inputs[..t]``.

The benchmark trains a 2-layer model (short conv, then the mixer; no MLP) on the mixture
``TRAIN_CONFIGS`` with AdamW for each learning rate of a sweep, and reports the accuracy on
``TEST_CONFIGS`` pooled over all queries (Zoology's ``valid/accuracy``) and per configuration,
for the best learning rate.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from ttr.eval.progress import train_logging
from ttr.eval.synthetic import MIXERS, accuracy, build_model, failure_lines, job_device, state_size, train
from ttr.overrides import parse_assignment

VOCAB_SIZE = 8192
POWER_A = 0.01


@dataclass(frozen=True)
class MQARConfig:
    seq_len: int
    num_kv_pairs: int
    num_examples: int

    def __str__(self) -> str:
        return f"({self.seq_len},{self.num_kv_pairs})"


TRAIN_CONFIGS = (
    MQARConfig(64, 4, 100_000),
    MQARConfig(128, 8, 20_000),
    MQARConfig(256, 16, 20_000),
    MQARConfig(256, 32, 20_000),
    MQARConfig(256, 64, 20_000),
)
TEST_CONFIGS = (
    MQARConfig(64, 4, 1_000),
    MQARConfig(64, 8, 1_000),
    MQARConfig(64, 16, 1_000),
    MQARConfig(128, 32, 1_000),
    MQARConfig(256, 64, 1_000),
    MQARConfig(512, 128, 1_000),
    MQARConfig(1024, 256, 1_000),
)


def parse_configs(text: str) -> tuple[MQARConfig, ...]:
    """``"64:4:100000,128:8:20000"`` (seq_len:num_kv_pairs:num_examples) -> configs."""
    configs = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"configs: expected seq_len:num_kv_pairs:num_examples items, got {item!r}")
        configs.append(MQARConfig(*map(int, parts)))
    return tuple(configs)


def generate_mqar(
    num_examples: int,
    seq_len: int,
    num_kv_pairs: int,
    *,
    vocab_size: int = VOCAB_SIZE,
    power_a: float = POWER_A,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """MQAR examples as ``(inputs [num_examples, seq_len], labels [num_examples, seq_len])`` int64."""
    key_vocab = vocab_size // 2
    if num_examples < 1:
        raise ValueError(f"num_examples: expected >= 1, got {num_examples}")
    if num_kv_pairs < 1 or 4 * num_kv_pairs > seq_len:
        raise ValueError(
            f"num_kv_pairs: expected 1 <= num_kv_pairs <= seq_len / 4 = {seq_len // 4}, got {num_kv_pairs}"
        )
    if num_kv_pairs > key_vocab - 1:
        raise ValueError(f"vocab_size: {vocab_size} has only {key_vocab - 1} keys for {num_kv_pairs} pairs")
    if not 0 < power_a <= 1:
        raise ValueError(f"power_a: expected in (0, 1], got {power_a}")
    gen = torch.Generator(device=device).manual_seed(seed)
    context = 2 * num_kv_pairs
    space = (seq_len - context) // 2
    gap_p = power_a * torch.arange(1, space + 1, device=device, dtype=torch.float64) ** (power_a - 1)
    inputs, labels = [], []
    chunk = max(1, 2**24 // max(key_vocab, space))  # bound the [rows, vocab] sampling weights
    for start in range(0, num_examples, chunk):
        n = min(chunk, num_examples - start)
        keys = torch.multinomial(torch.ones(n, key_vocab - 1, device=device), num_kv_pairs, generator=gen) + 1
        values = (
            torch.multinomial(
                torch.ones(n, vocab_size - key_vocab, device=device), num_kv_pairs, generator=gen
            )
            + key_vocab
        )
        gaps = torch.multinomial(gap_p.expand(n, space), num_kv_pairs, generator=gen)
        x = torch.randint(vocab_size, (n, seq_len), generator=gen, device=device)
        x[:, 0:context:2] = keys
        x[:, 1:context:2] = values
        query_pos = context + 2 * gaps
        x.scatter_(1, query_pos, keys)
        y = torch.full((n, seq_len), -100, dtype=torch.long, device=device)
        y.scatter_(1, query_pos, values)
        inputs.append(x)
        labels.append(y)
    return torch.cat(inputs), torch.cat(labels)


class MixtureBatches:
    """Epochs over a fixed training set: each batch comes from one configuration (one length), the
    order of batches is shuffled across configurations, as many epochs as asked for."""

    def __init__(self, data: list[tuple[torch.Tensor, torch.Tensor]], batch_size: int, seed: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size: expected >= 1, got {batch_size}")
        self.data = data
        self.batch_size = batch_size
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.queue: list[tuple[int, torch.Tensor]] = []

    def batches_per_epoch(self) -> int:
        return sum(max(1, x.shape[0] // self.batch_size) for x, _ in self.data)

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.queue:
            for i, (x, _) in enumerate(self.data):
                perm = torch.randperm(x.shape[0], generator=self.gen)
                n = max(1, x.shape[0] // self.batch_size)
                self.queue.extend(
                    (i, perm[j * self.batch_size : (j + 1) * self.batch_size]) for j in range(n)
                )
            self.rng.shuffle(self.queue)
        i, idx = self.queue.pop()
        x, y = self.data[i]
        idx = idx.to(x.device)
        return x[idx], y[idx]


def make_job(
    mixer: str,
    lr: float,
    *,
    d_model: int = 128,
    num_heads: int = 1,
    seed: int = 0,
    vocab_size: int = VOCAB_SIZE,
    batch_size: int = 256,
    eval_batch_size: int = 250,
    steps: int = 0,
    epochs: int = 0,
    train_configs: tuple[MQARConfig, ...] = TRAIN_CONFIGS,
    test_configs: tuple[MQARConfig, ...] = TEST_CONFIGS,
    overrides: dict | None = None,
    max_seconds: float | None = None,
    amp: bool = True,
    device: str | None = None,
) -> dict:
    """One (mixer, d_model, lr) job for :func:`run_job`, as plain values (it crosses a process
    boundary). ``steps`` 0 means ``epochs`` over the training set, and both 0 training on the clock
    alone (``max_seconds``); the label names the model (mixer, width, overrides), so
    :func:`best_by_label` picks the best lr per model."""
    if mixer not in MIXERS:
        raise ValueError(f"mixer: expected one of {list(MIXERS)}, got {mixer!r}")
    if steps < 0 or epochs < 0 or not (steps or epochs or max_seconds):
        raise ValueError(f"steps, epochs: expected >= 0, and both 0 only with max_seconds; got {steps}, {epochs}")
    overrides = dict(overrides or {})
    label = f"{mixer} d={d_model}" + "".join(f" {k}={v}" for k, v in sorted(overrides.items()))
    return dict(
        kind="mqar", mixer=mixer, d_model=d_model, num_heads=num_heads, lr=lr, label=label, seed=seed,
        vocab_size=vocab_size, batch_size=batch_size, eval_batch_size=eval_batch_size, steps=steps,
        epochs=epochs, train_configs=train_configs, test_configs=test_configs, overrides=overrides,
        max_seconds=max_seconds, amp=amp, device=device,
    )  # fmt: skip


def run_job(job: dict) -> dict:
    """Train one (mixer, d_model, lr) model and evaluate it; ``job`` is a dict of plain values so
    that it can cross a process boundary. Returns the job plus its results."""
    device = torch.device(job_device(job.get("index", 0), job.get("device")))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # Triton launches on the current device
    torch.manual_seed(job["seed"])
    vocab = job["vocab_size"]
    train_data = [
        generate_mqar(
            c.num_examples, c.seq_len, c.num_kv_pairs, vocab_size=vocab, seed=job["seed"] + i, device=device
        )
        for i, c in enumerate(job["train_configs"])
    ]
    test_data = [
        generate_mqar(
            c.num_examples,
            c.seq_len,
            c.num_kv_pairs,
            vocab_size=vocab,
            seed=10_000 + job["seed"] + i,
            device=device,
        )
        for i, c in enumerate(job["test_configs"])
    ]
    max_len = max(c.seq_len for c in (*job["train_configs"], *job["test_configs"]))
    model = build_model(
        job["mixer"],
        vocab_size=vocab,
        d_model=job["d_model"],
        num_layers=2,
        intermediate_size=0,
        num_heads=job["num_heads"],
        context=max_len,
        **job.get("overrides", {}),
    ).to(device)
    batches = MixtureBatches(train_data, job["batch_size"], seed=job["seed"])
    steps = job["steps"] or job["epochs"] * batches.batches_per_epoch() or None
    amp = torch.bfloat16 if (device.type == "cuda" and job.get("amp", True)) else None
    start = time.perf_counter()
    losses = train(
        model, batches, steps=steps, lr=job["lr"], max_seconds=job.get("max_seconds"), amp_dtype=amp,
        **train_logging(job, steps),
    )
    correct = total = 0
    per_config = {}
    for c, (x, y) in zip(job["test_configs"], test_data):
        acc = accuracy(model, x, y, batch_size=job["eval_batch_size"], amp_dtype=amp)
        per_config[str(c)] = acc
        queries = int((y != -100).sum())
        correct += acc * queries
        total += queries
    return {
        **{k: v for k, v in job.items() if k not in ("train_configs", "test_configs")},
        "steps": len(losses),
        "final_loss": losses[-1],
        "accuracy": correct / total,
        "config_mean": sum(per_config.values()) / len(per_config),
        "per_config": per_config,
        "state_size": state_size(model.config, max(c.seq_len for c in job["test_configs"])),
        "num_params": sum(p.numel() for p in model.parameters()),
        "seconds": time.perf_counter() - start,
    }


def parse_variant(text: str) -> tuple[str, dict]:
    """``"MIXER:KEY=VALUE,KEY=VALUE"`` -> (mixer, TTRConfig fields), the values in ``ttr.overrides``'
    grammar: one more model of a sweep, e.g. ``attn:rope_theta=10000.0``."""
    mixer, _, fields = text.partition(":")
    if mixer not in MIXERS or not fields:
        raise ValueError(f"expected MIXER:KEY=VALUE[,KEY=VALUE] with MIXER one of {list(MIXERS)}, got {text!r}")
    return mixer, dict(parse_assignment(item) for item in fields.split(","))


def sweep_jobs(mixers, d_models, lrs, *, variants=(), overrides=None, **settings) -> list[dict]:
    """Jobs of a sweep: every model (each of ``mixers`` with ``overrides``, and each ``(mixer,
    fields)`` of ``variants`` with ``overrides`` updated by its fields) at every width and lr;
    ``settings`` are further :func:`make_job` arguments."""
    overrides = dict(overrides or {})
    models = [(m, overrides) for m in mixers] + [(m, {**overrides, **fields}) for m, fields in variants]
    return [make_job(mixer, lr, d_model=d, overrides=fields, **settings)
            for mixer, fields in models for d in d_models for lr in lrs]


# Mean MQAR accuracy per mixer at d_model 128 read off the published MQAR figures (Zoology, and the
# DeltaNet / Gated DeltaNet papers): the reference each mixer's best run is checked against.
REFERENCE_ACCURACY = {"gated_deltanet": 0.99, "delta_net": 0.96, "gla": 0.77, "mamba2": 0.75, "attn": 1.0}


def reference_checks(results: list[dict]) -> list[str]:
    """One line per model of a mixer with a reference: its best run in both readings of "mean
    accuracy", pooled over every test query (Zoology's ``valid/accuracy``, three quarters of whose
    weight is on the two longest configurations) and the mean over the test configurations."""
    lines = []
    for label, r in sorted(best_by_label(results).items()):
        ref = REFERENCE_ACCURACY.get(r["mixer"])
        if ref is not None:
            verdict = {k: "PASS" if r[k] >= ref else "FAIL" for k in ("accuracy", "config_mean")}
            lines.append(f"- MQAR {label}: pooled {r['accuracy']:.4f} {verdict['accuracy']}, config mean "
                         f"{r['config_mean']:.4f} {verdict['config_mean']} (reference >= {ref})")
    return lines


def report(results: list[dict], failed: list[dict]) -> str:
    """The sweep's table, the best lr of every model, the reference checks and the failed jobs."""
    best = [f"- best: {label}: lr {r['lr']:.2e} accuracy {r['accuracy']:.4f} ({r['seconds']:.0f} s, {r['steps']} steps)"
            for label, r in sorted(best_by_label(results).items())]
    lines = best + reference_checks(results) + failure_lines(failed)
    return markdown_table(results) + ("\n\n" + "\n".join(lines) if lines else "")


def best_by_label(results: list[dict]) -> dict[str, dict]:
    """For every model label (mixer, d_model, overrides) the result with the best learning rate."""
    best: dict[str, dict] = {}
    for r in results:
        if r["label"] not in best or r["accuracy"] > best[r["label"]]["accuracy"]:
            best[r["label"]] = r
    return best


def markdown_table(results: list[dict]) -> str:
    """All runs, one row per (model, lr), best lr of each model in bold."""
    if not results:
        return "(no MQAR runs finished)"
    configs = list(results[0]["per_config"])
    best = {id(r) for r in best_by_label(results).values()}
    head = ["model", "lr", "state size", "steps", "accuracy", "config mean", *configs]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(results, key=lambda r: (r["label"], r["lr"])):
        acc = f"**{r['accuracy']:.4f}**" if id(r) in best else f"{r['accuracy']:.4f}"
        mean = r.get("config_mean", sum(r["per_config"].values()) / len(r["per_config"]))
        cells = [r["label"], f"{r['lr']:.2e}", str(r["state_size"]), str(r["steps"]), acc, f"{mean:.4f}"]
        cells += [f"{r['per_config'][c]:.3f}" for c in configs]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    """Accuracy (best lr) against state size, one series per mixer, PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    series: dict[str, list[tuple[int, float, str]]] = {}
    for r in best_by_label(results).values():
        series.setdefault(r["mixer"], []).append((r["state_size"], r["accuracy"], r["label"]))
    for mixer, points in sorted(series.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=mixer)
    ax.set_xscale("log")
    ax.set_xlabel("state size (elements, summed over layers)")
    ax.set_ylabel("MQAR accuracy")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
