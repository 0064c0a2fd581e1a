"""``ttr convert`` of fla 0.6.0 folders on the GPU (``-m gpu``, fla from the carried wheels): the
converted model's logits equal fla's, fp32 max-abs <= 1e-4 and bf16 relative RMS <= 2e-2, for
every fla family and the Gated DeltaNet + SWA hybrid, each in a process of its own.

fla's Triton kernels (like ttr's) multiply fp32 blocks in tf32 unless Triton is told otherwise,
which alone moves logits by ~1e-3; the fp32 comparison therefore runs in a fresh process with
``TRITON_F32_DEFAULT=ieee``, so both sides compute in full fp32 and what is left is the
conversion's own error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

VOCAB = 256
FAMILIES = ["gated_deltanet", "delta_net", "gla", "gated_deltanet_h1"]


def compare(family: str, folder: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from ttr.models import get_preset
    from ttr.models.convert import convert_checkpoint
    from ttr.scripts.reference_models import build_reference

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    config = get_preset(
        f"{family}-debug", vocab_size=VOCAB, hidden_size=256, num_heads=2, head_dim=64 if family == "gla" else 128,
        attn_num_heads=2, window_size=48, allow_neg_eigval=family == "gated_deltanet",
    )
    ref = build_reference(config)
    with torch.no_grad():
        for p in ref.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    ref.save_pretrained(folder / "src")
    convert_checkpoint(folder / "src", folder / "dst")
    ref = ref.cuda().eval()
    mine = AutoModelForCausalLM.from_pretrained(folder / "dst").cuda().eval()
    ids = torch.randint(0, VOCAB, (2, 200), device="cuda")
    # the fp32 comparison runs fla's layers on their recurrent kernels, exact fp32 arithmetic of the
    # recurrence: fla's chunked delta rule refuses fp32 input, and its chunked gated one lands
    # further from its own recurrent kernel in fp32 than this test's bound (ttr's model stays far
    # inside it); the bf16 comparison runs the chunked kernels a user trains with
    chunked = [m for m in ref.modules() if getattr(m, "mode", None) == "chunk"]
    with torch.no_grad():
        for m in chunked:
            m.mode = "fused_recurrent"
        a, b = ref(ids).logits, mine(ids).logits
        fp32 = (a - b).abs().max().item() if torch.isfinite(b).all() else float("inf")
        for m in chunked:
            m.mode = "chunk"
        ref.bfloat16()
        mine.bfloat16()
        a, b = ref(ids).logits.float(), mine(ids).logits.float()
        bf16 = ((a - b).norm() / a.norm()).item() if torch.isfinite(b).all() else float("inf")
    return {"fp32_max_abs": fp32, "bf16_rel_rms": bf16}


def one_config_per_kernel() -> None:
    """fla's kernels are autotuned over up to 24 launch configs each, and every config compiles
    anew per dtype: minutes in full fp32 for a comparison of values, which any config gives. Keep
    the config with the fewest pipeline stages (the least SMEM) of each kernel's list."""
    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs

    def first_light_config(self, kwargs):
        configs = prune(self, kwargs)
        return [min(configs, key=lambda c: c.num_stages or 0)]

    Autotuner.prune_configs = first_light_config


@pytest.mark.parametrize("family", FAMILIES)
def test_fla_logits(family):
    pytest.importorskip("fla")
    env = dict(os.environ, TRITON_F32_DEFAULT="ieee")
    proc = subprocess.run([sys.executable, __file__, family], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert errors["fp32_max_abs"] <= 1e-4, errors
    assert errors["bf16_rel_rms"] <= 2e-2, errors


if __name__ == "__main__":
    import ttr  # noqa: F401

    one_config_per_kernel()
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(compare(sys.argv[1], Path(tmp))))
