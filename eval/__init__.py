"""Evaluation: lm-eval harness adapter, perplexity, MQAR and state tracking (``ttr eval``).

lm-eval is imported only when :func:`evaluate` is called (it is not installed everywhere).
"""

from __future__ import annotations


def evaluate(model, tasks, **kwargs) -> dict:
    """Run lm-eval ``tasks`` on ``model``; see :func:`ttr.eval.lm_harness.evaluate`."""
    from ttr.eval.lm_harness import evaluate as _evaluate

    return _evaluate(model, tasks, **kwargs)


__all__ = ["evaluate"]
