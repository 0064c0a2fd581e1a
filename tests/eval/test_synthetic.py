"""Training helpers shared by MQAR and state tracking."""

from __future__ import annotations

import itertools

import pytest
import torch

from ttr.eval.synthetic import build_model, cosine_lr, labelled_logits, run_jobs, train


def test_cosine_schedule():
    assert cosine_lr(0.0, 0.1) == pytest.approx(1e-3)
    assert cosine_lr(0.05, 0.1) == pytest.approx(0.5)
    assert cosine_lr(0.1, 0.1) == pytest.approx(1.0)
    assert cosine_lr(0.55, 0.1) == pytest.approx(0.5)
    assert cosine_lr(1.0, 0.1) == pytest.approx(0.0, abs=1e-12)


def test_labelled_logits_are_the_rows_of_the_full_logits():
    model = build_model("gated_deltanet", vocab_size=40, d_model=16, context=32).eval()
    x = torch.randint(40, (3, 20))
    y = torch.full((3, 20), -100)
    y[0, 4], y[1, 19], y[2, 0] = 7, 8, 9
    logits, targets = labelled_logits(model, x, y)
    with torch.no_grad():
        full = model(x).logits
    assert targets.tolist() == [7, 8, 9]
    torch.testing.assert_close(logits.detach(), torch.stack([full[0, 4], full[1, 19], full[2, 0]]).float())


def test_train_time_budget_stops_early_and_validates():
    model = build_model("delta_net", vocab_size=16, d_model=16, context=16)
    batch = (torch.randint(16, (4, 8)), torch.randint(16, (4, 8)))
    losses = train(model, itertools.repeat(batch), steps=10**6, lr=1e-3, max_seconds=0.5)
    assert 1 <= len(losses) < 10**6 and all(torch.isfinite(torch.tensor(losses)))
    with pytest.raises(ValueError, match="steps"):
        train(model, itertools.repeat(batch), steps=0, lr=1e-3)
    with pytest.raises(ValueError, match="max_seconds"):
        train(model, itertools.repeat(batch), steps=1, lr=1e-3, max_seconds=0)
    with pytest.raises(ValueError, match="mixer"):
        build_model("lstm", vocab_size=16, d_model=16)


def test_run_jobs_in_processes_keeps_order():
    jobs = [{"a": 1}, {"a": 1, "b": 2}, {}]
    assert run_jobs(len, jobs, 2) == [1, 2, 0]
    with pytest.raises(ValueError, match="workers"):
        run_jobs(len, jobs, 0)


def test_attention_models_follow_the_zoology_shape():
    """MQAR's attention blocks: a short conv on q/k/v, no position encoding (unless overridden),
    no MLP; the linear mixers keep their own convs."""
    model = build_model("attn", vocab_size=16, d_model=16, context=32)
    assert model.config.attn_short_conv and model.config.rope_theta is None
    assert model.model.layers[0].mixer.convs is not None and model.model.layers[0].mlp is None
    assert build_model("swa", vocab_size=16, d_model=16, rope_theta=1e4).config.rope_theta == 1e4
    assert not build_model("delta_net", vocab_size=16, d_model=16).config.attn_short_conv
