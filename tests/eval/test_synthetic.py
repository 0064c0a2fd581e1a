"""Training helpers shared by MQAR and state tracking."""

from __future__ import annotations

import itertools

import pytest
import torch

from ttr.eval.synthetic import build_model, labelled_logits, run_jobs, state_size, train


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


def test_train_uses_the_shared_optimiser_and_schedule(monkeypatch):
    """The synthetic jobs get ttr train's parameter groups (matrices decay, gates and norms do not)
    and its warm-up + cosine schedule, from the one builder in ttr.optim."""
    from ttr import optim
    from ttr.eval import synthetic

    built = []
    monkeypatch.setattr(synthetic, "build_optimizer", lambda model, **kw: built.append(optim.build_optimizer(model, **kw)) or built[-1])
    model = build_model("gated_deltanet", vocab_size=16, d_model=16, context=16)
    batch = (torch.randint(16, (2, 8)), torch.randint(16, (2, 8)))
    train(model, itertools.repeat(batch), steps=20, lr=1e-3, weight_decay=0.1)
    decay, plain = built[0].param_groups
    assert (decay["weight_decay"], plain["weight_decay"]) == (0.1, 0.0)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.ndim >= 2 for p in decay["params"])
    assert {names[id(p)].rsplit(".", 1)[-1] for p in plain["params"]} >= {"A_log", "dt_bias"}
    assert decay["lr"] == pytest.approx(1e-3 * optim.lr_multiplier(19, max_steps=20, warmup_steps=2))


def test_state_size_asks_each_mixer():
    """A hybrid's state is the sum of its layers' own counts: a delta-rule state per head, the
    window's keys and values for sliding-window attention."""
    model = build_model("delta_net", vocab_size=16, d_model=32, num_layers=2, context=64, layer_types=["delta_net", "swa"],
                        window_size=16)
    cfg = model.config
    assert state_size(cfg, 100) == cfg.num_heads * cfg.head_dim * cfg.value_head_dim + 2 * 16 * cfg.attn_num_kv_heads * cfg.attn_head_dim
