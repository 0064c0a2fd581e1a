"""lm-eval adapter on a tiny checkpoint: local loglikelihood and generate_until tasks, checked
against a direct computation with the model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from .tiny import make_checkpoint

pytest.importorskip("lm_eval")

from ttr.errors import TTRError  # noqa: E402
from ttr.eval import evaluate  # noqa: E402
from ttr.eval.lm_harness import TTRLM, write_results  # noqa: E402

MC_DOCS = [
    {"question": "the cat sat on the", "choices": ["mat", "dog", "log"], "answer": 0},
    {"question": "a quick brown", "choices": ["fox", "cat"], "answer": 0},
    {
        "question": "one two three four five six seven eight nine",
        "choices": ["ten", "one", "seven"],
        "answer": 0,
    },
    {"question": "paris is the capital of", "choices": ["france", "italy"], "answer": 1},
]
GEN_DOCS = [
    {"prompt": "the cat", "target": "sat"},
    {"prompt": "question: what is two plus two? answer:", "target": "four"},
    {"prompt": "a quick brown fox jumps over", "target": "the lazy dog"},
]


def _write_tasks(root):
    (root / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (root / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in GEN_DOCS))
    (root / "ttr_mc.yaml").write_text(
        f"""task: ttr_test_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
    )
    (root / "ttr_gen.yaml").write_text(
        f"""task: ttr_test_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    model, tokenizer = make_checkpoint(root / "ckpt", context=64)
    tasks = root / "tasks"
    tasks.mkdir()
    _write_tasks(tasks)
    return root, model, tokenizer


def _loglikelihood(model, tokenizer, context, continuation):
    ctx = tokenizer(context).input_ids
    whole = tokenizer(context + continuation).input_ids
    ids = torch.tensor([whole])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.double(), -1)[0]
    return sum(logp[t - 1, whole[t]].item() for t in range(len(ctx), len(whole)))


def _greedy(model, tokenizer, prompt, max_new, stop):
    ids = tokenizer(prompt).input_ids
    new = []
    for _ in range(max_new):
        with torch.no_grad():
            nxt = int(model(torch.tensor([ids + new])).logits[0, -1].argmax())
        if nxt == tokenizer.eos_token_id:
            break
        new.append(nxt)
    return tokenizer.decode(new, skip_special_tokens=True).split(stop)[0]


def test_loglikelihood_task_matches_direct(setup, tmp_path):
    root, model, tokenizer = setup
    results = evaluate(
        str(root / "ckpt"), ["ttr_test_mc"], batch_size=2, include_path=root / "tasks", log_samples=True
    )
    samples = results["samples"]["ttr_test_mc"]
    assert len(samples) == len(MC_DOCS)
    correct = 0
    for s in samples:
        doc = s["doc"]
        direct = [_loglikelihood(model, tokenizer, doc["question"], " " + c) for c in doc["choices"]]
        got = [r[0] for r in s["filtered_resps"]]
        assert got == pytest.approx(direct, abs=1e-4)
        correct += int(max(range(len(direct)), key=direct.__getitem__) == doc["answer"])
    acc = results["results"]["ttr_test_mc"]["acc,none"]
    assert math.isclose(acc, correct / len(MC_DOCS))
    json_path, md_path = write_results(results, tmp_path / "out")
    assert json.load(open(json_path))["results"]["ttr_test_mc"]["acc,none"] == acc
    assert "ttr_test_mc" in open(md_path).read()


def test_generate_until_task_matches_direct(setup):
    root, model, tokenizer = setup
    results = evaluate(
        model,
        "ttr_test_gen",
        tokenizer=tokenizer,
        batch_size=2,
        include_path=root / "tasks",
        log_samples=True,
    )
    samples = results["samples"]["ttr_test_gen"]
    matches = 0
    for s in samples:
        doc = s["doc"]
        direct = _greedy(model, tokenizer, doc["prompt"], 6, "\n")
        assert s["filtered_resps"][0] == direct
        matches += int(direct == doc["target"])
    assert results["results"]["ttr_test_gen"]["exact_match,none"] == matches / len(GEN_DOCS)


def test_max_length_is_training_context_and_batch_size_fixed(setup):
    root, model, tokenizer = setup
    lm = TTRLM(str(root / "ckpt"), batch_size="3")
    assert lm.max_length == 64 and lm.batch_size == 3
    assert lm.tokenizer.padding_side == "left"
    model.config.train_seq_len = 32  # recorded by the trainer: wins over max_position_embeddings
    try:
        assert TTRLM(model, tokenizer=tokenizer).max_length == 32
        assert TTRLM(model, tokenizer=tokenizer, max_length="48").max_length == 48
    finally:
        del model.config.train_seq_len
    with pytest.raises(ValueError, match="batch_size"):
        TTRLM(model, tokenizer=tokenizer, batch_size="auto")
    with pytest.raises(ValueError, match="tokenizer"):
        TTRLM(model)
    with pytest.raises(ValueError, match="tasks"):
        evaluate(model, [], tokenizer=tokenizer)


def test_cli_lm_writes_json_and_markdown(setup, tmp_path, capsys):
    from ttr.eval.cli import main

    root, model, tokenizer = setup
    out = tmp_path / "out"
    rc = main(
        [
            "lm",
            str(root / "ckpt"),
            "--tasks",
            "ttr_test_mc",
            "--include-path",
            str(root / "tasks"),
            "--dtype",
            "float32",
            "--batch-size",
            "4",
            "--output",
            str(out),
        ]
    )
    assert rc == 0
    acc = json.loads((out / "results.json").read_text())["results"]["ttr_test_mc"]["acc,none"]
    correct = 0
    for doc in MC_DOCS:
        direct = [_loglikelihood(model, tokenizer, doc["question"], " " + c) for c in doc["choices"]]
        correct += int(max(range(len(direct)), key=direct.__getitem__) == doc["answer"])
    assert acc == correct / len(MC_DOCS)
    assert "ttr_test_mc" in (out / "results.md").read_text() and "acc" in capsys.readouterr().out
    with pytest.raises(TTRError, match="--mixer: unknown"):
        main(["mqar", "--mixer", "lstm"])


def test_training_context_has_no_silent_default():
    from types import SimpleNamespace

    from ttr.eval.common import training_context

    assert training_context(SimpleNamespace(max_position_embeddings=128)) == 128
    assert training_context(SimpleNamespace(max_position_embeddings=128, train_seq_len=64)) == 64
    with pytest.raises(ValueError, match="max_length"):
        training_context(SimpleNamespace(hidden_size=8))
    with pytest.raises(ValueError, match="max_length"):
        training_context(SimpleNamespace(), max_length=0)
