"""What a transformers user does with a causal LM, on every family's debug preset (CPU, fp32):
resize the vocabulary and train, get logits with the loss in eval mode (``Trainer.predict``),
generate from ``inputs_embeds``, feed bad input, ask for tuples or attention maps.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from ttr.models.modeling import LMHead

from .test_models import FAMILIES, VOCAB, make_model, rel_err


def unfused_loss(model, ids, labels) -> torch.Tensor:
    logits = model(ids, use_cache=False).logits
    return nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_resized_vocabulary_trains_with_the_fused_loss(family):
    for size in (VOCAB + 3, VOCAB - 5):
        model = make_model(family).train()
        model.resize_token_embeddings(size, mean_resizing=False)
        assert isinstance(model.lm_head, LMHead) and model.lm_head.weight.shape[0] == size
        assert model.config.vocab_size == size
        ids = torch.randint(0, size, (2, 9))
        ids[0, -1] = size - 1
        out = model(ids, labels=ids)
        assert out.logits is None  # training: the fused path, no logits
        out.loss.backward()
        assert model.lm_head.weight.grad[size - 1].abs().sum() > 0
        with torch.no_grad():
            torch.testing.assert_close(out.loss, unfused_loss(model, ids, ids), rtol=1e-5, atol=1e-6)


def test_resized_tied_embeddings_stay_tied():
    model = make_model("gated_deltanet", tie_word_embeddings=True).train()
    model.resize_token_embeddings(VOCAB + 8, mean_resizing=False)
    assert isinstance(model.lm_head, LMHead)
    assert model.lm_head.weight.data_ptr() == model.model.embeddings.weight.data_ptr()
    ids = torch.randint(0, VOCAB + 8, (2, 9))
    loss = model(ids, labels=ids).loss
    loss.backward()
    with torch.no_grad():
        torch.testing.assert_close(loss, unfused_loss(model, ids, ids), rtol=1e-5, atol=1e-6)


def test_head_of_another_class_gets_the_unfused_loss():
    """A head whose forward takes no targets (a module assigned directly, a PEFT wrapper) is
    still trained through its logits; set_output_embeddings adopts a plain bias-free Linear."""
    model = make_model("gated_deltanet").train()
    model.lm_head = nn.Linear(64, VOCAB, bias=True)
    ids = torch.randint(0, VOCAB, (2, 9))
    out = model(ids, labels=ids)
    assert out.logits is not None
    with torch.no_grad():
        torch.testing.assert_close(out.loss, unfused_loss(model, ids, ids))
    model.set_output_embeddings(nn.Linear(64, VOCAB, bias=False))
    assert isinstance(model.lm_head, LMHead) and model(ids, labels=ids).logits is None


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_with_labels_in_eval_mode(family):
    model = make_model(family)
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        plain = model(ids).logits
        out = model(ids, labels=ids)
        torch.testing.assert_close(out.logits, plain)
        torch.testing.assert_close(out.loss, unfused_loss(model, ids, ids))
        skipped = model(ids, labels=ids, return_logits=False)
        assert skipped.logits is None
        torch.testing.assert_close(skipped.loss, out.loss, rtol=1e-5, atol=1e-6)
    model.train()
    fused = model(ids, labels=ids)
    assert fused.logits is None
    asked = model(ids, labels=ids, return_logits=True)
    assert rel_err(asked.logits, plain) < 1e-6
    torch.testing.assert_close(asked.loss, fused.loss, rtol=1e-5, atol=1e-6)


def test_trainer_predict_and_compute_metrics(tmp_path):
    from transformers import Trainer, TrainingArguments

    model = make_model("gated_deltanet_h2")
    rows = [torch.randint(0, VOCAB, (8,)) for _ in range(5)]
    data = [{"input_ids": r, "labels": r} for r in rows]
    seen = {}

    def compute_metrics(pred):
        seen["shape"] = pred.predictions.shape
        return {"top1": float((pred.predictions[:, :-1].argmax(-1) == pred.label_ids[:, 1:]).mean())}

    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_eval_batch_size=2, report_to=[], use_cpu=True,
        dataloader_num_workers=0,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, compute_metrics=compute_metrics)
    result = trainer.predict(data)
    assert result.predictions.shape == (5, 8, VOCAB) == seen["shape"]
    with torch.no_grad():
        expected = model(torch.stack(rows)).logits
        losses = [unfused_loss(model, r[None], r[None]) for r in rows]
    torch.testing.assert_close(torch.from_numpy(result.predictions), expected, rtol=1e-5, atol=1e-5)
    assert abs(result.metrics["test_loss"] - float(sum(losses) / 5)) < 1e-4
    assert 0.0 <= result.metrics["test_top1"] <= 1.0


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_generate_from_inputs_embeds_matches_input_ids(family):
    """Greedy and beam search from the prompt's embeddings == from its ids (generated tokens
    only), on a left-padded batch, past the hybrids' window."""
    model = make_model(family, pad_token_id=0, eos_token_id=None)
    ids = torch.randint(3, VOCAB, (2, 7))
    ids[1, :3] = 0
    mask = (ids != 0).long()
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    from_ids = model.generate(input_ids=ids, attention_mask=mask, **kwargs)[:, ids.shape[1] :]
    embeds = model.get_input_embeddings()(ids)
    from_embeds = model.generate(inputs_embeds=embeds, attention_mask=mask, **kwargs)
    assert torch.equal(from_embeds, from_ids)
    single = model.generate(inputs_embeds=embeds[:1], **kwargs)
    assert torch.equal(single, from_ids[:1])
    beams = dict(kwargs, num_beams=2)
    from_ids = model.generate(input_ids=ids, attention_mask=mask, **beams)[:, ids.shape[1] :]
    assert torch.equal(model.generate(inputs_embeds=embeds, attention_mask=mask, **beams), from_ids)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_empty_and_malformed_input_raise_value_error(family):
    model = make_model(family)
    with pytest.raises(ValueError, match="input_ids is empty"):
        model(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="inputs_embeds is empty"):
        model(inputs_embeds=torch.zeros(0, 4, 64))
    with pytest.raises(ValueError, match=r"input_ids must be \[B, T\]"):
        model(torch.zeros(5, dtype=torch.long))


def caught(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in record if issubclass(w.category, UserWarning)]


@torch.no_grad()
def test_positions_past_max_position_embeddings_warn_once_per_model():
    model = make_model("transformer", max_position_embeddings=8)
    ids = torch.randint(0, VOCAB, (1, 12))
    assert caught(lambda: model(ids[:, :8])) == []
    first = caught(lambda: model(ids))
    assert len(first) == 1 and "max_position_embeddings=8" in first[0]
    assert caught(lambda: model(ids)) == []
    other = make_model("transformer", max_position_embeddings=8)
    out = other(ids[:, :6], use_cache=True)
    assert caught(lambda: other(ids[:, 6:8], past_key_values=out.past_key_values)) == []
    # decoding one token at a time crosses the limit through the cache offset
    assert len(caught(lambda: other(ids[:, 8:9], past_key_values=out.past_key_values))) == 1
    # sliding-window layers see offsets below their window only, linear mixers no positions
    assert caught(lambda: make_model("gated_deltanet_h1", max_position_embeddings=8)(ids)) == []


@pytest.mark.parametrize("family", ["gated_deltanet", "transformer"])
@torch.no_grad()
def test_return_dict_false_gives_tuples(family):
    model = make_model(family)
    ids = torch.randint(0, VOCAB, (2, 6))
    out = model(ids, return_dict=False)
    assert isinstance(out, tuple)
    torch.testing.assert_close(out[0], model(ids).logits)
    loss, logits = model(ids, labels=ids, use_cache=False, return_dict=False)
    torch.testing.assert_close(loss, model(ids, labels=ids).loss)
    base = model.model(ids, use_cache=False, return_dict=False)
    assert isinstance(base, tuple) and len(base) == 1
    torch.testing.assert_close(base[0], model.model(ids).last_hidden_state)
    model.config.return_dict = False
    assert isinstance(model(ids), tuple) and isinstance(model.model(ids), tuple)


@torch.no_grad()
def test_output_attentions_warns_once():
    model = make_model("gated_deltanet_h1")
    ids = torch.randint(0, VOCAB, (1, 6))
    first = caught(lambda: model(ids, output_attentions=True))
    assert len(first) == 1 and "no attention maps" in first[0]
    record = []
    assert caught(lambda: record.append(model(ids, output_attentions=True))) == []
    assert record[0].attentions is None


@pytest.mark.parametrize("family", ["gated_deltanet_h1", "mamba2"])
@torch.no_grad()
def test_cache_under_either_name(family):
    """The cache continues the same way passed as ``past_key_values`` or as ``cache`` (the name
    transformers >= 5.24 uses), and comes back in the output field of the installed version;
    passing both is an error."""
    from ttr.models.modeling import CACHE_FIELD

    model = make_model(family)
    ids = torch.randint(0, VOCAB, (2, 9))
    full = model(ids).logits
    for name in ("past_key_values", "cache"):
        out = model(ids[:, :6], use_cache=True)
        cache = getattr(out, CACHE_FIELD)
        step = model(ids[:, 6:], **{name: cache})
        assert getattr(step, CACHE_FIELD) is cache and cache.get_seq_length() == 9
        assert rel_err(step.logits, full[:, 6:]) < 1e-4
    with pytest.raises(ValueError, match="past_key_values or as cache"):
        model(ids[:, 6:], past_key_values=cache, cache=cache)
