"""State-tracking tasks in the style of Deletang et al. 2023 ("Neural Networks and the Chomsky
Hierarchy", arXiv:2207.02098), for the comparison of Grazzi et al. 2024 ("Unlocking State-Tracking
in Linear RNNs Through Negative Eigenvalues", arXiv:2411.12537): a delta rule with beta in (0, 2)
has transitions with negative eigenvalues and can solve parity at any length, with beta in (0, 1)
it cannot.

Tasks (one shared vocabulary: digits ``0 .. MOD - 1``, then ``+ - * ( ) =`` and a pad token):

* ``parity``: a random bit string; the label at every position is the parity of the prefix.
* ``modular_arithmetic``: ``d op d op ... d`` with ``op`` in ``+ - *`` evaluated left to right
  modulo ``MOD`` (a regular language: the state is the running value); the label at every digit
  is the running value.
* ``modular_arithmetic_brackets``: a random expression tree rendered with brackets around every
  compound operand, followed by ``=``; the only label, at ``=``, is its value modulo ``MOD``
  (context-free in Deletang et al.'s hierarchy).

Training supervises every labelled position of sequences of length ``train_min .. train_max``.
Evaluation scores only the **final** answer of sequences of exactly length ``L`` for each ``L``
of ``eval_lengths`` (most of them longer than anything seen in training).

Reporting follows Deletang et al.: a model's score is its best run over the learning rates and
seeds of the sweep. Which of the many solutions that fit the training lengths a run lands in
decides how far it extrapolates, and that varies with the seed, so the table also counts the seeds
that solve the task (every length beyond training at >= :data:`SOLVED`).
"""

from __future__ import annotations

import random
import time

import torch

from ttr.eval.progress import train_logging
from ttr.eval.synthetic import accuracy, build_model, failure_lines, job_device, train

MOD = 5
PLUS, MINUS, TIMES, OPEN, CLOSE, EQUALS, PAD = range(MOD, MOD + 7)
VOCAB_SIZE = PAD + 1
TASKS = ("parity", "modular_arithmetic", "modular_arithmetic_brackets")
CHANCE = {"parity": 0.5, "modular_arithmetic": 1 / MOD, "modular_arithmetic_brackets": 1 / MOD}
OPS = (PLUS, MINUS, TIMES)


def _apply(op: int, a: int, b: int) -> int:
    if op == PLUS:
        return (a + b) % MOD
    if op == MINUS:
        return (a - b) % MOD
    return (a * b) % MOD


def parity_example(length: int, rng: random.Random) -> tuple[list[int], list[int]]:
    bits = [rng.randrange(2) for _ in range(length)]
    labels, acc = [], 0
    for b in bits:
        acc ^= b
        labels.append(acc)
    return bits, labels


def modular_example(length: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """``length`` is rounded down to an odd number of tokens (digit, op, digit, ...)."""
    n_digits = (length + 1) // 2
    value = rng.randrange(MOD)
    tokens, labels = [value], [value]
    for _ in range(n_digits - 1):
        op, d = rng.choice(OPS), rng.randrange(MOD)
        value = _apply(op, value, d)
        tokens += [op, d]
        labels += [-100, value]
    return tokens, labels


def _expression(n_leaves: int, rng: random.Random) -> tuple[list[int], int]:
    if n_leaves == 1:
        d = rng.randrange(MOD)
        return [d], d
    left_n = rng.randrange(1, n_leaves)
    left, a = _expression(left_n, rng)
    right, b = _expression(n_leaves - left_n, rng)
    op = rng.choice(OPS)
    if left_n > 1:
        left = [OPEN, *left, CLOSE]
    if n_leaves - left_n > 1:
        right = [OPEN, *right, CLOSE]
    return [*left, op, *right], _apply(op, a, b)


def brackets_example(length: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """An expression of at most ``length`` tokens (``=`` included) and as close to it as sampled."""
    if length < 2:
        raise ValueError(f"length: modular_arithmetic_brackets needs >= 2 tokens, got {length}")
    best: tuple[list[int], int] | None = None
    n_leaves = max(1, length // 3)
    while best is None:
        for _ in range(8):
            tokens, value = _expression(n_leaves, rng)
            if len(tokens) + 1 <= length and (best is None or len(tokens) > len(best[0])):
                best = (tokens, value)
        n_leaves = max(1, n_leaves - 1)
    tokens, value = best
    return [*tokens, EQUALS], [-100] * len(tokens) + [value]


EXAMPLES = {
    "parity": parity_example,
    "modular_arithmetic": modular_example,
    "modular_arithmetic_brackets": brackets_example,
}


def make_batch(
    task: str, lengths: list[int], rng: random.Random, *, final_only: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``(inputs, labels)`` for one example per entry of ``lengths``; with
    ``final_only`` every label except the last real position's is dropped."""
    if task not in EXAMPLES:
        raise ValueError(f"task: expected one of {TASKS}, got {task!r}")
    examples = [EXAMPLES[task](n, rng) for n in lengths]
    width = max(len(t) for t, _ in examples)
    inputs = torch.full((len(examples), width), PAD, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for i, (t, y) in enumerate(examples):
        inputs[i, : len(t)] = torch.tensor(t)
        if final_only:
            labels[i, len(t) - 1] = y[-1]
        else:
            labels[i, : len(y)] = torch.tensor(y)
    return inputs, labels


def training_batches(task: str, batch_size: int, min_len: int, max_len: int, seed: int):
    """Endless fresh batches with lengths uniform in ``min_len .. max_len``."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"train lengths: need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    rng = random.Random(seed)
    while True:
        yield make_batch(task, [rng.randint(min_len, max_len) for _ in range(batch_size)], rng)


# (label, mixer, TTRConfig overrides) compared by default
VARIANTS = (
    ("delta_net beta(0,1)", "delta_net", {"allow_neg_eigval": False}),
    ("delta_net beta(0,2)", "delta_net", {"allow_neg_eigval": True}),
    ("gated_deltanet beta(0,1)", "gated_deltanet", {"allow_neg_eigval": False}),
    ("gated_deltanet beta(0,2)", "gated_deltanet", {"allow_neg_eigval": True}),
    ("mamba2 a(0,1)", "mamba2", {"allow_neg_eigval": False}),
    ("mamba2 a(-1,1)", "mamba2", {"allow_neg_eigval": True}),
)


# The parity model per family, (blocks, MLP width). A single delta-rule block without an MLP solves
# parity beyond training in far more seeds than two blocks with an MLP: a first block's decaying
# memory is not stationary within the training lengths and feeds the tracking block inputs it never
# saw beyond them (docs/benchmarks.md, "State tracking"). A single Mamba2 block does not even fit the
# training lengths (its dt scales both the decay and the input), so Mamba2 keeps two blocks with an
# MLP. The other tasks use DEFAULT_SHAPE for every family.
PARITY_SHAPES = {"delta_net": (1, 0), "gated_deltanet": (1, 0), "mamba2": (2, 128)}
DEFAULT_SHAPE = (2, 128)


def model_shape(task: str, mixer: str) -> tuple[int, int]:
    """(blocks, MLP width) of the model for ``task`` with ``mixer`` when the caller names none."""
    return PARITY_SHAPES.get(mixer, DEFAULT_SHAPE) if task == "parity" else DEFAULT_SHAPE


def make_job(
    task: str,
    label: str,
    lr: float,
    *,
    weight_decay: float = 0.1,
    seed: int = 0,
    d_model: int = 64,
    num_layers: int | None = None,
    intermediate_size: int | None = None,
    num_heads: int = 1,
    steps: int = 2000,
    batch_size: int = 128,
    train_min: int = 3,
    train_max: int = 40,
    eval_lengths: tuple[int, ...] = (40, 64, 128, 256),
    eval_examples: int = 512,
    eval_batch_size: int = 256,
    max_seconds: float | None = None,
    amp: bool = True,
    device: str | None = None,
) -> dict:
    """One (task, variant, lr) job for :func:`run_job`, as plain values; ``label`` is one of
    :data:`VARIANTS` (its mixer and config overrides are filled in), and ``num_layers`` /
    ``intermediate_size`` left out come from :func:`model_shape`. ``steps`` 0 trains on the clock
    alone (``max_seconds``)."""
    variants = {name: (mixer, ov) for name, mixer, ov in VARIANTS}
    if task not in TASKS:
        raise ValueError(f"task: expected one of {TASKS}, got {task!r}")
    if label not in variants:
        raise ValueError(f"label: expected one of {list(variants)}, got {label!r}")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay: expected >= 0, got {weight_decay}")
    if steps < 0 or not (steps or max_seconds):
        raise ValueError(f"steps: expected >= 1, or 0 with max_seconds, got {steps}")
    mixer, overrides = variants[label]
    layers, mlp = model_shape(task, mixer)
    num_layers = layers if num_layers is None else num_layers
    intermediate_size = mlp if intermediate_size is None else intermediate_size
    if num_layers < 1 or intermediate_size < 0:
        raise ValueError(f"num_layers, intermediate_size: expected >= 1 and >= 0, got {num_layers}, {intermediate_size}")
    return dict(
        kind="state", task=task, label=label, mixer=mixer, overrides=dict(overrides), lr=lr,
        weight_decay=weight_decay, seed=seed,
        d_model=d_model, num_layers=num_layers, intermediate_size=intermediate_size, num_heads=num_heads,
        steps=steps, batch_size=batch_size, train_min=train_min, train_max=train_max,
        eval_lengths=list(eval_lengths), eval_examples=eval_examples, eval_batch_size=eval_batch_size,
        max_seconds=max_seconds, amp=amp, device=device,
    )  # fmt: skip


def run_job(job: dict) -> dict:
    """Train one (task, variant, lr) model; evaluate final-answer accuracy at every eval length."""
    device = torch.device(job_device(job.get("index", 0), job.get("device")))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # Triton launches on the current device
    torch.manual_seed(job["seed"])
    model = build_model(
        job["mixer"],
        vocab_size=VOCAB_SIZE,
        d_model=job["d_model"],
        num_layers=job["num_layers"],
        intermediate_size=job["intermediate_size"],
        num_heads=job["num_heads"],
        context=max(job["eval_lengths"]),
        **job.get("overrides", {}),
    ).to(device)
    batches = training_batches(
        job["task"], job["batch_size"], job["train_min"], job["train_max"], job["seed"]
    )
    amp = torch.bfloat16 if (device.type == "cuda" and job.get("amp", True)) else None
    start = time.perf_counter()
    losses = train(
        model,
        batches,
        steps=job["steps"] or None,
        lr=job["lr"],
        weight_decay=job.get("weight_decay", 0.1),
        max_seconds=job.get("max_seconds"),
        amp_dtype=amp,
        **train_logging(job, job["steps"] or None),
    )
    rng = random.Random(10_000 + job["seed"])
    per_length = {}
    for n in job["eval_lengths"]:
        x, y = make_batch(job["task"], [n] * job["eval_examples"], rng, final_only=True)
        per_length[n] = accuracy(model, x, y, batch_size=job["eval_batch_size"], amp_dtype=amp)
    return {
        **job,
        "steps": len(losses),
        "final_loss": losses[-1],
        "per_length": per_length,
        "chance": CHANCE[job["task"]],
        "seconds": time.perf_counter() - start,
    }


# "accuracy 1.0 beyond training": every evaluated length beyond the training lengths at >= SOLVED
# (0.99 leaves room for sampling error on a finite test set, not for a systematic failure)
SOLVED = 0.99


def beyond_training(r: dict) -> dict[int, float]:
    """Accuracy at the eval lengths longer than the job's longest training length (every eval
    length when none is longer)."""
    per_length = {int(n): a for n, a in r["per_length"].items()}
    beyond = {n: a for n, a in per_length.items() if n > r["train_max"]}
    return beyond or per_length


def _score(r: dict) -> float:
    return sum(r["per_length"].values()) / len(r["per_length"])


def best_by_label(results: list[dict]) -> dict[tuple[str, str, float], dict]:
    """Best run per (task, variant, weight decay) over learning rates and seeds, by mean accuracy
    over the eval lengths: the score of Deletang et al., maximised over seeds and hyperparameters."""
    best: dict[tuple[str, str, float], dict] = {}
    for r in results:
        key = (r["task"], r["label"], r.get("weight_decay", 0.1))
        if key not in best or _score(r) > _score(best[key]):
            best[key] = r
    return best


def seeds_solved(results: list[dict]) -> dict[tuple[str, str, float], tuple[int, int]]:
    """Per (task, variant, weight decay): how many seeds solve the task, as ``(solved, seeds)``.

    A seed solves it when its best-lr run holds at least :data:`SOLVED` at every length beyond
    training, so the table shows how reliable the best score is, not only the best run."""
    per_seed = best_by_label([{**r, "label": (r["label"], r["seed"])} for r in results])
    counts: dict[tuple[str, str, float], tuple[int, int]] = {}
    for (task, (label, _), wd), r in per_seed.items():
        solved, seeds = counts.get((task, label, wd), (0, 0))
        counts[task, label, wd] = (solved + (min(beyond_training(r).values()) >= SOLVED), seeds + 1)
    return counts


def markdown_table(results: list[dict]) -> str:
    """Final-answer accuracy per task, variant, weight decay and evaluation length of the best run
    over learning rates and seeds, with how many seeds solve the task."""
    if not results:
        return "(no state-tracking runs finished)"
    best, solved = best_by_label(results), seeds_solved(results)
    lengths = list(results[0]["per_length"])
    head = ["task", "model", "blocks", "MLP", "weight decay", "best lr", "best seed", "seeds solved"]
    head += ["steps", "chance", *[f"L={n}" for n in lengths]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, r in sorted(best.items()):
        task, label, wd = key
        cells = [task, label, str(r["num_layers"]), str(r["intermediate_size"]), f"{wd:g}", f"{r['lr']:.1e}"]
        cells += [str(r["seed"]), "{}/{}".format(*solved[key])]
        cells += [str(r["steps"]), f"{r['chance']:.2f}"] + [f"{r['per_length'][n]:.3f}" for n in lengths]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep_jobs(tasks, labels, lrs, *, weight_decays=(0.1,), seeds=(0,), **settings) -> list[dict]:
    """Jobs of a sweep: every task, variant label, lr, weight decay and seed; ``settings`` are
    further :func:`make_job` arguments."""
    return [make_job(task, label, lr, weight_decay=wd, seed=seed, **settings)
            for task in tasks for label in labels for lr in lrs for wd in weight_decays for seed in seeds]


# the variants whose transitions have negative eigenvalues: they should solve parity at any length
NEGATIVE_EIGENVALUES = ("beta(0,2)", "a(-1,1)")


def parity_checks(results: list[dict]) -> list[str]:
    """One line per parity variant and weight decay: for the negative-eigenvalue variants whether the
    best run holds at least :data:`SOLVED` at every length beyond training, for the others how far
    above chance they get; with how many seeds solve it."""
    solved = seeds_solved(results)
    lines = []
    for key, r in sorted(best_by_label(results).items()):
        task, label, wd = key
        if task != "parity":
            continue
        beyond = beyond_training(r)
        seeds = "{} of {} seeds solve it".format(*solved[key])
        if any(tag in label for tag in NEGATIVE_EIGENVALUES):
            low = min(beyond.values())
            lines.append(f"- parity {label} wd={wd:g}: best run (lr {r['lr']:g}, seed {r['seed']}) min acc beyond "
                         f"training {low:.3f} (expected 1.0) {'PASS' if low >= SOLVED else 'FAIL'}; {seeds}")
        else:
            lines.append(f"- parity {label} wd={wd:g}: best run max acc beyond training {max(beyond.values()):.3f} "
                         f"(expected near 0.5); {seeds}")
    return lines


def report(results: list[dict], failed: list[dict]) -> str:
    """The sweep's table, the parity checks and the failed jobs."""
    lines = parity_checks(results) + failure_lines(failed)
    return markdown_table(results) + ("\n\n" + "\n".join(lines) if lines else "")
