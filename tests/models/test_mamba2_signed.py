"""Mamba2 with negative eigenvalues (``allow_neg_eigval``): ``a_t = 2 exp(dt_t A) - 1`` in (-1, 1)
through the log-space kernels via the sign-parity transform, against a plain signed recurrence."""

import pytest
import torch

from ttr.models import TTRForCausalLM, get_preset
from ttr.models.layers.mamba2 import Mamba2

from .test_models import VOCAB, decode_stepwise, rel_err


def signed_recurrence(a, dt, x, B, C, h0):
    """``S_t = a_t S_{t-1} + B_t (dt_t x_t)^T``, ``y_t = S_t^T C_t`` per token, float64; one sequence."""
    T, H = a.shape
    rep = H // B.shape[1]
    S, ys = h0.clone(), []
    for t in range(T):
        k, q = B[t].repeat_interleave(rep, 0), C[t].repeat_interleave(rep, 0)  # [H, N]
        S = a[t][:, None, None] * S + k[:, :, None] * (dt[t][:, None] * x[t])[:, None, :]
        ys.append(torch.einsum("hnp,hn->hp", S, q))
    return (torch.stack(ys) if ys else None), S


@pytest.mark.parametrize("packed", [False, True])
def test_signed_ssd_matches_signed_recurrence(packed):
    torch.manual_seed(0)
    cfg = get_preset("mamba2-debug", vocab_size=VOCAB, allow_neg_eigval=True, mamba_n_groups=2)
    layer = Mamba2(cfg, 0).double()
    H, P, N = layer.num_heads, layer.head_dim, layer.state_size
    lengths = [5, 0, 1, 70, 9] if packed else [37]
    T = sum(lengths)
    xs = torch.randn(1, T, H, P, dtype=torch.float64)
    dt = torch.rand(1, T, H, dtype=torch.float64) * 0.5
    A = -torch.rand(H, dtype=torch.float64) * 4 - 0.5
    Bm = torch.randn(1, T, 2, N, dtype=torch.float64)
    Cm = torch.randn(1, T, 2, N, dtype=torch.float64)
    h0 = torch.randn(len(lengths), H, N, P, dtype=torch.float64)
    a_signed = 2 * torch.exp(dt * A) - 1
    assert (a_signed < 0).any() and (a_signed > 0).any()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32) if packed else None
    y, state = layer._signed_ssd(xs, dt, A, Bm, Cm, h0, True, cu, False)
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    for i, (s, n) in enumerate(zip(starts, lengths)):
        sl = slice(s, s + n)
        y_ref, S_ref = signed_recurrence(a_signed[0, sl], dt[0, sl], xs[0, sl], Bm[0, sl], Cm[0, sl], h0[i])
        if n:
            assert rel_err(y[0, sl], y_ref) < 1e-10
        assert rel_err(state[i], S_ref) < 1e-10


@torch.no_grad()
def test_signed_mamba2_model_decoding_packing_padding():
    torch.manual_seed(0)
    model = TTRForCausalLM(get_preset("mamba2-debug", vocab_size=VOCAB, allow_neg_eigval=True)).eval()
    ids = torch.randint(0, VOCAB, (2, 12))
    full = model(ids, use_cache=False).logits
    for prefill in (1, 7):
        assert rel_err(decode_stepwise(model, ids, prefill), full) < 1e-5
    # packed == separate
    docs = [torch.randint(0, VOCAB, (1, n)) for n in (5, 1, 9)]
    separate = torch.cat([model(d, use_cache=False).logits for d in docs], 1)
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    assert rel_err(model(torch.cat(docs, 1), cu_seqlens=cu).logits, separate) < 1e-5
    # left padding leaves the (signed) state alone
    p = torch.randint(0, VOCAB, (1, 6))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), p], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)], 1)
    ref = model(p, use_cache=False).logits
    assert rel_err(decode_stepwise(model, padded, 4, mask)[:, 3:], ref) < 1e-5


def test_signed_mamba2_differs_from_positive():
    """The flag changes the transition (it is not silently ignored): same weights, same input."""
    outs = []
    for flag in (False, True):
        torch.manual_seed(0)
        # strong decays (dt ~ 0.5..1) so that 2 exp(dt A) - 1 is often negative; no D skip
        cfg = get_preset("mamba2-debug", vocab_size=VOCAB, allow_neg_eigval=flag, dt_min=0.5, dt_max=1.0)
        layer = TTRForCausalLM(cfg).model.layers[0].mixer
        layer.D.data.zero_()
        torch.manual_seed(1)
        outs.append(layer(torch.randn(1, 20, cfg.hidden_size)))
    assert rel_err(outs[0], outs[1]) > 1e-2
