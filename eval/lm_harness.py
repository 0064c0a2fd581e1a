"""lm-evaluation-harness adapter: the ``ttr`` model type and :func:`evaluate`.

``TTRLM`` is lm-eval's ``HFLM`` with the settings that matter for recurrent models made explicit:
``max_length`` is the training context from the config (never lm-eval's 2048 fallback), the
batch size is fixed (no "auto" probing, which allocates at ``max_length`` and is meaningless for
models whose memory does not grow with context), the dtype is chosen by the caller, and the
tokenizer pads on the left so that batched generation ends every prompt at the last column.

Importing this module imports lm-eval (not installed on every machine, hence the lazy import
from ``ttr.eval``) and registers ``--model ttr`` with it, so
``lm_eval --model ttr --model_args pretrained=DIR`` works too once this module is imported.
"""

from __future__ import annotations

import json
import os

import torch
from lm_eval import simple_evaluate
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from lm_eval.utils import make_table

from ttr.eval.common import load_checkpoint, training_context
from ttr.eval.hub import dataset_unavailable, is_offline_error


@register_model("ttr")
class TTRLM(HFLM):
    """An lm-eval ``LM`` over a ttr (or any causal HF) model.

    Args:
        pretrained: a ``save_pretrained`` directory, or a loaded ``PreTrainedModel``.
        tokenizer: required with a loaded model; with a directory, defaults to the one in it.
        max_length: context length; defaults to the training context stored in the config.
        batch_size: fixed batch size (an int; "auto" is refused).
        dtype: weights dtype when loading from a directory ("float32", "bfloat16", "float16").
        device: defaults to CUDA when present.
        max_gen_toks: default generation budget when a task does not set one.
    """

    def __init__(
        self,
        pretrained,
        tokenizer=None,
        max_length: int | str | None = None,
        batch_size: int | str = 8,
        dtype: str | torch.dtype = "float32",
        device: str | None = None,
        max_gen_toks: int | str = 256,
        **kwargs,
    ) -> None:
        try:
            batch_size = int(batch_size)
        except (TypeError, ValueError):
            raise ValueError(f"batch_size: expected a fixed positive integer, got {batch_size!r}") from None
        if batch_size < 1:
            raise ValueError(f"batch_size: expected a fixed positive integer, got {batch_size}")
        if isinstance(pretrained, (str, os.PathLike)):
            model, loaded_tokenizer = load_checkpoint(pretrained, dtype=dtype, device=device)
            tokenizer = loaded_tokenizer if tokenizer is None else tokenizer
        else:
            model = pretrained
            if tokenizer is None:
                raise ValueError("tokenizer: required when pretrained is a loaded model")
        if isinstance(tokenizer, (str, os.PathLike)):
            import transformers

            tokenizer = transformers.AutoTokenizer.from_pretrained(os.fspath(tokenizer))
        tokenizer.padding_side = "left"
        context = training_context(model.config, None if max_length is None else int(max_length))
        super().__init__(
            pretrained=model,
            tokenizer=tokenizer,
            max_length=context,
            batch_size=batch_size,
            backend="causal",
            **kwargs,
        )
        self._max_gen_toks = int(max_gen_toks)

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks


def evaluate(
    model,
    tasks: str | list[str],
    *,
    tokenizer=None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    max_length: int | None = None,
    limit: int | float | None = None,
    include_path: str | os.PathLike | list | None = None,
    log_samples: bool = False,
    bootstrap_iters: int = 0,
    seed: int = 1234,
    dtype: str = "float32",
    device: str | None = None,
) -> dict:
    """Run lm-eval ``tasks`` on ``model`` (a loaded model or a checkpoint directory).

    This is the call the trainer makes for in-loop evaluation: the model stays where it is
    (device, dtype) and is put back in its previous train/eval mode afterwards. Returns lm-eval's
    result dict (``results``, ``configs``, ``versions``, ... and ``samples`` with
    ``log_samples``). ``dtype`` and ``device`` apply when ``model`` is a directory.
    """
    if isinstance(tasks, str):
        tasks = [t for t in tasks.split(",") if t]
    if not tasks or not all(isinstance(t, str) and t for t in tasks):
        raise ValueError(f"tasks: expected task names, got {tasks!r}")
    if include_path is not None:
        paths = include_path if isinstance(include_path, (list, tuple)) else [include_path]
        for p in paths:
            if not os.path.isdir(p):
                raise ValueError(f"include_path: {p!r} is not a directory")
        include_path = [os.fspath(p) for p in paths]
    manager = TaskManager(include_path=include_path)
    known = set(manager.all_tasks)
    unknown = [t for t in tasks if t not in known and not os.path.isfile(t)]
    if unknown:
        raise ValueError(f"tasks: unknown {unknown} (lm-eval knows {len(known)} names: "
                         "`lm_eval --tasks list`; local task YAMLs come in with include_path)")
    was_training = getattr(model, "training", False)
    try:
        lm = TTRLM(
            model,
            tokenizer=tokenizer,
            batch_size=batch_size,
            max_length=max_length,
            dtype=dtype,
            device=device,
        )
        results = simple_evaluate(
            model=lm,
            tasks=list(tasks),
            num_fewshot=num_fewshot,
            limit=limit,
            log_samples=log_samples,
            bootstrap_iters=bootstrap_iters,
            task_manager=manager,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
    except Exception as err:
        if is_offline_error(err):
            raise dataset_unavailable(err) from err
        raise
    finally:
        if was_training:
            model.train()
    if results is None:
        raise RuntimeError("lm-eval returned no results (non-zero rank?)")
    return results


def markdown_table(results: dict) -> str:
    """lm-eval's markdown table of ``results`` (and of groups, when there are any)."""
    table = make_table(results)
    if results.get("groups"):
        table += "\n" + make_table(results, "groups")
    return table


def write_results(results: dict, out_dir: str | os.PathLike) -> tuple[str, str]:
    """Write ``results.json`` (without per-sample logs) and ``results.md``; return their paths."""
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "results.json")
    md_path = os.path.join(out_dir, "results.md")
    summary = {k: v for k, v in results.items() if k != "samples"}
    with open(json_path, "w") as f:
        json.dump(summary, f, indent=2, default=str)
    with open(md_path, "w") as f:
        f.write(markdown_table(results) + "\n")
    if "samples" in results:
        with open(os.path.join(out_dir, "samples.json"), "w") as f:
            json.dump(results["samples"], f, default=str)
    return json_path, md_path
