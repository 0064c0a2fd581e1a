"""``ttr export RUN_DIR OUT [--checkpoint DIR]``: a ``save_pretrained`` folder with the tokenizer.

The folder loads with ``AutoModelForCausalLM.from_pretrained(OUT)`` and
``AutoTokenizer.from_pretrained(OUT)`` after ``import ttr``, offline.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from .checkpoint import latest_checkpoint, load_model_weights


def export_model(model, tokenizer, out: Path, accelerator) -> None:
    """Collective under FSDP (every rank calls it); rank 0 writes ``out``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if accelerator.is_main_process:
        model.save_pretrained(str(out), state_dict=full)
        tokenizer.save_hf(out)
    accelerator.wait_for_everyone()


def export_run(run_dir: Path, out: Path, checkpoint: Path | None = None) -> Path:
    import ttr  # noqa: F401  (registers the Auto classes)
    from ttr.models import TTRConfig, TTRForCausalLM

    run_dir = Path(run_dir)
    if not (run_dir / "model" / "config.json").is_file():
        raise ValueError(f"RUN_DIR {str(run_dir)!r} is not a ttr run directory (no model/config.json)")
    ckpt = Path(checkpoint) if checkpoint else latest_checkpoint(run_dir)
    if ckpt is None or not (ckpt / "trainer_state.json").is_file():
        raise ValueError(f"no checkpoint found in {str(run_dir / 'checkpoints')!r}")
    model = TTRForCausalLM(TTRConfig.from_pretrained(str(run_dir / "model")))
    load_model_weights(ckpt, model)
    out = Path(out)
    model.save_pretrained(str(out))
    for f in (run_dir / "tokenizer").iterdir():
        shutil.copy2(f, out / f.name)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ttr export", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a directory written by ttr train")
    parser.add_argument("out", help="output folder (save_pretrained layout)")
    parser.add_argument("--checkpoint", help="a specific checkpoint folder (default: the latest)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        out = export_run(Path(args.run_dir), Path(args.out), args.checkpoint)
    except ValueError as err:
        print(f"ttr export: error: {err}", file=sys.stderr)
        return 2
    print(f"exported {args.run_dir} to {out}")
    return 0
