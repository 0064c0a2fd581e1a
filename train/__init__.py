"""The trainer: configs, data, tokenizer, optimiser, loop, checkpoints, metrics, export.

``ttr train`` is :func:`ttr.train.cli.main`; ``ttr export`` is :func:`ttr.train.export.main`.
"""
