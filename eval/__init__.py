"""Evaluation: lm-eval harness adapter, perplexity, MQAR and state tracking (``ttr eval``).

    ttr eval lm CKPT --tasks hellaswag,lambada_openai [--include-path DIR] [--batch-size 8]
    ttr eval ppl CKPT DATA [--mode window --window 2048 --stride 1024] [--sweep-factor 4]
    ttr eval mqar --mixer gated_deltanet,delta_net --d-model 128 [--jobs 8] [--max-minutes 5]
    ttr eval state --task parity,modular_arithmetic [--variants "delta_net beta(0,2);mamba2"]

Each writes JSON and a markdown table under ``--output`` (plots as PNG where there are any).
lm-eval is imported only when :func:`evaluate` is called (it is not installed everywhere).
"""

from __future__ import annotations


def evaluate(model, tasks, **kwargs) -> dict:
    """Run lm-eval ``tasks`` on ``model``; see :func:`ttr.eval.lm_harness.evaluate`."""
    from ttr.eval.lm_harness import evaluate as _evaluate

    return _evaluate(model, tasks, **kwargs)


__all__ = ["evaluate"]
