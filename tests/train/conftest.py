"""Shared fixtures for the trainer tests: a tiny corpus, a cached tokenizer, a stand-in model."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
         "sigma tau upsilon phi chi psi omega def return class import self value").split()


def make_docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(rng.randint(1, 8))]
        docs.append(f"# doc {i}\n" + "\n".join(lines) + "\n")
    return docs


@pytest.fixture(autouse=True)
def _one_thread():
    """The models here are tiny: one intra-op thread is faster, and far faster on a busy machine
    (spinning OpenMP threads that lose their core stall every small matmul)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    for i, doc in enumerate(make_docs(60)):
        (root / f"doc{i:03d}.txt").write_text(doc)
    return root


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tokcache")


def tiny_config(corpus_dir, cache_dir, run_dir, **sections) -> dict:
    """A CPU-sized run: 320-piece tokenizer, 2 rows of 32 tokens per micro-batch."""
    table = {
        "run_dir": str(run_dir),
        "seed": 1,
        "model": {"preset": "gated_deltanet-debug",
                  "overrides": {"hidden_size": 32, "num_hidden_layers": 2, "num_heads": 2, "intermediate_size": 64}},
        "data": {"source": str(corpus_dir), "val_docs": 4, "num_workers": 0},
        "tokenizer": {"vocab_size": 320, "cache_dir": str(cache_dir)},
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "train": {"max_steps": 6, "seq_len": 32, "micro_batch_size": 2, "export_at_end": False},
        "checkpoint": {"every": 0, "keep_last": 2},
        "log": {"every": 1, "val_every": 0, "val_batches": 1, "wandb": "off", "progress": False},
    }
    for name, values in sections.items():
        if isinstance(values, dict):
            table.setdefault(name, {}).update(values)
        else:
            table[name] = values
    return table


class StandIn(torch.nn.Module):
    """Embedding -> tanh -> linear head with the TTRForCausalLM loss contract (shifted labels,
    no target across cu_seqlens boundaries, sum / num_items_in_batch). ``nan_at`` makes chosen
    forward calls return NaN; ``on_call`` runs a hook at each forward call."""

    def __init__(self, vocab: int, width: int = 16, nan_at=(), on_call=None):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.proj = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.calls, self.nan_at, self.on_call = 0, set(nan_at), on_call
        self.config = None

    def forward(self, input_ids, labels, cu_seqlens, num_items_in_batch, use_cache=False, return_logits=None):
        self.calls += 1
        if self.on_call is not None:
            self.on_call(self.calls)
        h = self.norm(torch.tanh(self.proj(self.embed(input_ids))))
        logits = self.head(h)
        targets = torch.cat([labels[:, 1:], labels.new_full((1, 1), -100)], dim=1)
        targets[0, cu_seqlens.cu_seqlens[1:].long() - 1] = -100  # the trainer passes a Packing
        loss = F.cross_entropy(logits[0].float(), targets[0], ignore_index=-100, reduction="sum") / num_items_in_batch
        if self.calls in self.nan_at:
            loss = loss * float("nan")
        return type("Out", (), {"loss": loss})()


def standin_factory(**kwargs):
    return lambda cfg, tok: StandIn(tok.vocab_size, **kwargs)
