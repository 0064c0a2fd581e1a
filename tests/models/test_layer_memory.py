"""What a block keeps for its backward: the MLP's product and the mixer's output norm (the inputs
of the down and output projections) are formed again by the backward's kernels
(``swiglu_linear``, ``norm_linear``), not kept from the forward. A forward hook on the projection
makes the block call it as a module, which keeps its input: the difference is exactly that input.
"""

from __future__ import annotations

import pytest
import torch

from ttr.scripts.activation_memory import saved_per_site

from .test_models import make_model, require_interpreter


def kept_per_token(block, hidden: int) -> float:
    """Bytes per token that one forward of ``block`` keeps for its backward (fp32, two packed
    documents)."""

    def run(n):
        x = torch.randn(1, n, hidden, requires_grad=True)
        cu = torch.tensor([0, n // 2, n], dtype=torch.int32)
        pos = torch.cat([torch.arange(n // 2), torch.arange(n - n // 2)])[None]
        return block(x, cu_seqlens=cu, position_ids=pos)

    return sum(b for b, _ in saved_per_site(run, block.parameters(), 64).values())


@pytest.mark.parametrize("family", ["gated_deltanet", "gla", "delta_net", "mamba2", "transformer"])
def test_block_keeps_no_projection_inputs(monkeypatch, family):
    require_interpreter()
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    model = make_model(family)
    cfg = model.config
    block = model.model.layers[0]
    block.train()
    base = kept_per_token(block, cfg.hidden_size)
    mixer = block.mixer
    checks = []
    if hasattr(mixer, "o_norm"):  # the linear mixers' output norm before o_proj
        checks.append((mixer.o_proj, mixer.o_proj.in_features))
    if family == "mamba2":  # the gated norm before out_proj
        checks.append((mixer.out_proj, mixer.out_proj.in_features))
    if getattr(block, "mlp", None) is not None:
        checks.append((block.mlp.down_proj, block.mlp.down_proj.in_features))
    assert checks, "no fused projection in this block"
    for proj, width in checks:
        handle = proj.register_forward_hook(lambda m, i, o: None)
        try:
            hooked = kept_per_token(block, cfg.hidden_size)
        finally:
            handle.remove()
        assert hooked - base == 4 * width, (proj, base, hooked)
