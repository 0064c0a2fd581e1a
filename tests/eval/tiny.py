"""Tiny offline checkpoints for the eval tests: a byte-level BPE tokenizer and a small model."""

from __future__ import annotations

import torch

CORPUS = [
    "the cat sat on the mat and the dog sat on the log",
    "a quick brown fox jumps over the lazy dog",
    "one two three four five six seven eight nine ten",
    "question: what is two plus two? answer: four",
    "paris is the capital of france and rome is the capital of italy",
] * 4


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def make_model(tokenizer, *, context: int = 64, hidden: int = 32, layer_types=("gated_deltanet", "swa")):
    """A tiny randomly initialised ttr model whose config records ``context`` as its training length."""
    from ttr.models import TTRConfig, TTRForCausalLM

    torch.manual_seed(0)
    config = TTRConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=len(layer_types),
        layer_types=list(layer_types),
        intermediate_size=2 * hidden,
        num_heads=2,
        window_size=8,
        max_position_embeddings=context,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = TTRForCausalLM(config).eval()
    # random init is near-uniform; sharpen it so greedy decoding and choices are not ties
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


def make_checkpoint(path, *, context: int = 64):
    tokenizer = make_tokenizer()
    model = make_model(tokenizer, context=context)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer
