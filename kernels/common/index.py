"""Chunk bookkeeping shared by every stage: which chunk of which sequence a program handles."""

from __future__ import annotations

from typing import NamedTuple

import torch

CHUNK_SIZE = 64


class ChunkPlan(NamedTuple):
    cu_seqlens: torch.Tensor  # [N+1] int32 token offsets into the flattened [B*T] axis
    chunk_indices: torch.Tensor  # [NT, 2] int32: (sequence, chunk within the sequence)
    chunk_offsets: torch.Tensor  # [N+1] int32: first global chunk of each sequence
    num_seqs: int
    num_chunks: int
    chunk_size: int


# Plans of unpacked batches, by (B, T, device, chunk size): building one takes ~10 small kernel
# launches, which at training sizes is CPU time the GPU waits for (a stage's kernel is short enough
# that a fwd+bwd call is bound by its launches). The plan's tensors are read-only.
_PLANS: dict[tuple, ChunkPlan] = {}
_MAX_PLANS = 64


def prepare_chunks(cu_seqlens: torch.Tensor | None, batch: int, seqlen: int, device=None,
                   chunk_size: int = CHUNK_SIZE) -> ChunkPlan:
    """Index chunks per sequence. Without ``cu_seqlens`` the batch is read as B packed sequences
    of length T (the memory of ``[B, T, ...]`` is that of ``[1, B*T, ...]``); those plans are cached."""
    if cu_seqlens is None:
        device = torch.device(device if device is not None else "cpu")
        if device.type == "cuda" and device.index is None:  # the cache holds tensors of one GPU
            device = torch.device("cuda", torch.cuda.current_device())
        key = (batch, seqlen, str(device), chunk_size)
        plan = _PLANS.get(key)
        if plan is None:
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            plan = _PLANS[key] = _build_plan(None, batch, seqlen, device, chunk_size)
        return plan
    return _build_plan(cu_seqlens, batch, seqlen, device, chunk_size)


def _build_plan(cu_seqlens: torch.Tensor | None, batch: int, seqlen: int, device, chunk_size: int) -> ChunkPlan:
    if cu_seqlens is None:
        cu = torch.arange(0, batch + 1, device=device, dtype=torch.int64) * seqlen
        n_per = (seqlen + chunk_size - 1) // chunk_size
        seq = torch.arange(batch, device=device).repeat_interleave(n_per)
        idx = torch.arange(n_per, device=device).repeat(batch)
        offsets = torch.arange(0, batch + 1, device=device, dtype=torch.int64) * n_per
        num_seqs, num_chunks = batch, batch * n_per
    else:
        cu = cu_seqlens.to(torch.int64)
        device = cu.device
        counts = (cu[1:] - cu[:-1] + chunk_size - 1) // chunk_size
        offsets = torch.cat([cu.new_zeros(1), counts.cumsum(0)])
        num_seqs, num_chunks = cu.numel() - 1, int(offsets[-1])
        seq = torch.arange(num_seqs, device=device).repeat_interleave(counts, output_size=num_chunks)
        idx = torch.arange(num_chunks, device=device) - offsets[seq]
    chunk_indices = torch.stack([seq, idx], 1).to(torch.int32).contiguous()
    return ChunkPlan(cu.to(torch.int32).contiguous(), chunk_indices, offsets.to(torch.int32).contiguous(),
                     num_seqs, num_chunks, chunk_size)


# Keep or recompute: the backward of every mixer needs the chunk states ``h`` of the forward. The
# state pass walks the chunks of a sequence one after another (or, without the delta term and for
# long sequences, in two levels), so for long sequences recomputing it dominates the backward; when
# the sequences average at least this many chunks the forward keeps ``h`` (``[NT, H, K, V]`` in the
# input dtype: K/64 times the size of k) and what else the mixer's backward would recompute.
# Shorter sequences (training batches of packed documents) recompute, which costs no memory.
KEEP_STATES_MIN_CHUNKS = 96


def keep_states(plan: ChunkPlan) -> bool:
    """Whether the forward keeps its states for the backward (see ``KEEP_STATES_MIN_CHUNKS``)."""
    return plan.num_chunks >= KEEP_STATES_MIN_CHUNKS * plan.num_seqs


# Launch-parameter overrides per stage ("state_fwd", "state_bwd", "wy_fwd", "wy_bwd", "output_fwd",
# "output_bwd_dv", "output_bwd_dqk") -> {"BV": .., "num_warps": .., "num_stages": ..}. Empty in normal
# use; scripts/bench_kernels.py --sweep fills it to measure alternatives to the built-in heuristics.
TUNING: dict[str, dict] = {}


def tuned(stage: str, **defaults) -> dict:
    """The stage's launch parameters: the heuristic defaults, overridden by ``TUNING[stage]``."""
    return {**defaults, **TUNING.get(stage, {})}
