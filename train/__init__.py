"""The trainer: configs, data, tokenizer, optimiser, loop, checkpoints, metrics, export.

``ttr train`` is :func:`ttr.train.cli.main`; ``ttr export`` is :func:`ttr.train.export.main`.

    ttr train                                   # embedded default (configs/default*.toml)
    ttr train configs/gla-340m.toml --train.max_steps=1000 --optim.lr=1e-3
    ttr train CONFIG --resume                   # continue run_dir from its newest good checkpoint
    ttr train CONFIG --resume=auto              # ... or start it when there is no checkpoint
    ttr train CONFIG --nproc 8                  # = torchrun --standalone --nproc_per_node 8 -m ttr.train
    ttr export runs/gla-340m out/gla-340m       # save_pretrained folder + tokenizer

A run directory holds ``run_config.json``, ``model/config.json`` (the TTRConfig),
``tokenizer/`` (HF files plus the sentencepiece model), ``metrics.jsonl`` (one record per log
step: loss, lr, grad_norm, tokens, tokens_per_s, mfu, peak_mem_gib, val_loss, val_ppl,
skipped), ``checkpoints/step_NNNNNNNN/`` (see checkpoint.py), ``export/`` and ``loss.png`` at the
end, ``.lock`` while a trainer runs in it, and ``wandb_id.txt`` when wandb is used. Modules:
config (TOML + overrides), sources (documents), data (order, workers, packing), tokenizer, optim
(groups, schedules), trainer (the loop), checkpoint, lock and rundir (one run per directory, what
to resume), ranks (rank-0 work for all ranks), metrics (FLOPs/MFU formulas, sinks), report (the
end-of-run summary and loss curve), export.
"""
