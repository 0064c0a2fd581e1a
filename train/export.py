"""``ttr export RUN_DIR OUT [--checkpoint DIR] [--overwrite]``: a ``save_pretrained`` folder with
the tokenizer.

The folder loads with ``AutoModelForCausalLM.from_pretrained(OUT)`` and
``AutoTokenizer.from_pretrained(OUT)`` after ``import ttr``, offline. Without ``--checkpoint`` the
newest checkpoint that is intact is exported (damaged ones are named and skipped).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from ttr.errors import DEBUG_HELP, TTRError, one_line

from .checkpoint import checkpoint_dirs, load_model_weights, verify_checkpoint


def export_model(model, tokenizer, out: Path, accelerator) -> None:
    """Collective under FSDP (every rank calls it); rank 0 writes ``out``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if accelerator.is_main_process:
        model.save_pretrained(str(out), state_dict=full)
        tokenizer.save_hf(out)
    accelerator.wait_for_everyone()


def pick_checkpoint(run_dir: Path, checkpoint: str | Path | None = None, note=print) -> Path:
    """``checkpoint`` when it is intact, else the newest intact checkpoint of ``run_dir``; ``note``
    receives a line for each damaged one skipped."""
    if checkpoint is not None:
        reason = verify_checkpoint(Path(checkpoint))
        if reason:
            raise TTRError(f"--checkpoint {str(checkpoint)!r} cannot be used: {reason}")
        return Path(checkpoint)
    found = list(reversed(checkpoint_dirs(run_dir)))
    for path in found:
        reason = verify_checkpoint(path)
        if reason is None:
            return path
        note(f"skipping checkpoint {path}: {reason}")
    raise TTRError(f"no {'intact ' if found else ''}checkpoint in {str(run_dir / 'checkpoints')!r}")


def export_run(run_dir: Path, out: Path, checkpoint: Path | None = None, *, overwrite: bool = False,
               note=print) -> Path:
    import ttr  # noqa: F401  (registers the Auto classes)
    from ttr.models import TTRConfig, TTRForCausalLM

    run_dir, out = Path(run_dir), Path(out)
    if not (run_dir / "model" / "config.json").is_file():
        raise ValueError(f"RUN_DIR {str(run_dir)!r} is not a ttr run directory (no model/config.json)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise FileExistsError(f"OUT {str(out)!r} already exists and is not empty; pass --overwrite to replace "
                              "the model files in it")
    ckpt = pick_checkpoint(run_dir, checkpoint, note)
    model = TTRForCausalLM(TTRConfig.from_pretrained(str(run_dir / "model")))
    try:
        load_model_weights(ckpt, model)
    except Exception as err:  # noqa: BLE001 - e.g. a model config changed after the checkpoint
        raise TTRError(f"checkpoint {ckpt} does not load into {run_dir / 'model'}: {one_line(str(err))}") from err
    model.save_pretrained(str(out))
    for f in (run_dir / "tokenizer").iterdir():
        shutil.copy2(f, out / f.name)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ttr export", description=__doc__.splitlines()[0], epilog=DEBUG_HELP)
    parser.add_argument("run_dir", help="a directory written by ttr train")
    parser.add_argument("out", help="output folder (save_pretrained layout)")
    parser.add_argument("--checkpoint", help="a specific checkpoint folder (default: the newest intact one)")
    parser.add_argument("--overwrite", action="store_true", help="replace the model files in an existing OUT")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    note = lambda text: print(f"ttr export: {text}", file=sys.stderr)  # noqa: E731
    out = export_run(Path(args.run_dir), Path(args.out), args.checkpoint, overwrite=args.overwrite, note=note)
    print(f"exported {args.run_dir} to {out}")
    return 0
