"""Every chunk op and attention with each input fenced by NaN (``conftest.fenced``): a kernel that
reads past an input's ends, forward or backward, turns a result non-finite, where on a GPU the same
read may fault only when the address beyond the tensor happens not to be mapped. The fenced run
must give the unfenced run's outputs and gradients. The short conv has its own such test against
its oracle (``test_conv.py``)."""

import pytest
import torch
import torch.nn.functional as F

from ttr.kernels import (
    attention,
    chunk_conv_ssd,
    chunk_delta_rule,
    chunk_gated_delta_rule,
    chunk_gla,
    chunk_simple_gla,
    chunk_ssd,
)

from .conftest import DEVICE, fenced, rel_rms

H, K, V = 2, 32, 32


def _inputs(op: str, b: int, t: int, n: int) -> tuple:
    """(fn, tensor inputs by name, other keywords) of ``op`` at b x t with n sequences."""
    r = lambda *s: torch.randn(*s, device=DEVICE)  # noqa: E731
    unit = lambda *s: F.normalize(r(*s), dim=-1)  # noqa: E731
    gate = F.logsigmoid(r(b, t, H))
    if op == "delta":
        return chunk_delta_rule, dict(q=unit(b, t, H, K), k=unit(b, t, H, K), v=r(b, t, H, V),
                                      beta=torch.rand(b, t, H, device=DEVICE), initial_state=r(n, H, K, V)), {}
    if op == "gated_delta":
        return chunk_gated_delta_rule, dict(q=unit(b, t, H, K), k=unit(b, t, H, K), v=r(b, t, H, V), g=gate,
                                            beta=torch.rand(b, t, H, device=DEVICE), initial_state=r(n, H, K, V)), {}
    if op == "gla":
        return chunk_gla, dict(q=r(b, t, H, K), k=r(b, t, H, K), v=r(b, t, H, V),
                               g=F.logsigmoid(r(b, t, H, K)) / 16, initial_state=r(n, H, K, V)), {}
    if op == "simple_gla":
        return chunk_simple_gla, dict(q=r(b, t, H, K), k=r(b, t, H, K), v=r(b, t, H, V), g=gate,
                                      initial_state=r(n, H, K, V)), {}
    heads, p, state, groups = 4, 16, 32, 2
    if op == "ssd":
        return chunk_ssd, dict(x=r(b, t, heads, p), dt=F.softplus(r(b, t, heads)), A=-torch.rand(heads, device=DEVICE),
                               B=r(b, t, groups, state), C=r(b, t, groups, state), D=r(heads),
                               initial_state=r(n, heads, state, p)), {}
    if op == "conv_ssd":
        state = 16  # the conv walks every channel of xBC token by token: slow in the interpreter
        d = heads * p + 2 * groups * state
        return chunk_conv_ssd, dict(xBC=r(b, t, d), conv_weight=r(d, 4) / 2, conv_bias=r(d),
                                    dt=F.softplus(r(b, t, heads)), A=-torch.rand(heads, device=DEVICE), D=r(heads),
                                    initial_state=r(n, heads, state, p)), dict(groups=groups, state_size=state)
    window = {"attention": None, "attention_window": 16}[op]
    return attention, dict(q=r(b, t, H, K), k=r(b, t, H, K), v=r(b, t, H, K)), dict(window=window)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(
    "op", ["delta", "gated_delta", "gla", "simple_gla", "ssd", "conv_ssd", "attention", "attention_window"]
)
def test_kernels_read_nothing_outside_their_inputs(monkeypatch, op, packed):
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    torch.manual_seed(0)
    b, t, lens = (1, 70, [7, 1, 30, 32]) if packed else (2, 70, None)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=DEVICE, dtype=torch.int32) if lens else None
    fn, tensors, kw = _inputs(op, b, t, len(lens) if lens else b)
    kw = dict(kw, cu_seqlens=cu, **({} if fn is attention else {"output_final_state": True}))
    runs = []
    for wrap in (fenced, lambda a: a.clone().requires_grad_()):
        ins = {name: wrap(a) for name, a in tensors.items()}
        out = fn(**ins, **kw)
        outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None]
        gen = torch.Generator().manual_seed(1)
        sum((o * torch.randn(o.shape, generator=gen).to(o)).sum() for o in outs).backward()
        runs.append((outs, {name: a.grad for name, a in ins.items()}))
    (outs, grads), (outs_ref, grads_ref) = runs
    for i, (o, o_ref) in enumerate(zip(outs, outs_ref)):
        assert rel_rms(o, o_ref) < 1e-5, f"output {i}"
    for name in tensors:
        assert rel_rms(grads[name], grads_ref[name]) < 1e-5, name
