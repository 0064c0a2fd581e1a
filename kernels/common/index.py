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


def prepare_chunks(cu_seqlens: torch.Tensor | None, batch: int, seqlen: int, device=None,
                   chunk_size: int = CHUNK_SIZE) -> ChunkPlan:
    """Index chunks per sequence. Without ``cu_seqlens`` the batch is read as B packed sequences
    of length T (the memory of ``[B, T, ...]`` is that of ``[1, B*T, ...]``)."""
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


# Launch-parameter overrides per stage ("state_fwd", "state_bwd", "wy_fwd", "wy_bwd", "output_fwd",
# "output_bwd_dv", "output_bwd_dqk") -> {"BV": .., "num_warps": .., "num_stages": ..}. Empty in normal
# use; scripts/bench_kernels.py --sweep fills it to measure alternatives to the built-in heuristics.
TUNING: dict[str, dict] = {}


def tuned(stage: str, **defaults) -> dict:
    """The stage's launch parameters: the heuristic defaults, overridden by ``TUNING[stage]``."""
    return {**defaults, **TUNING.get(stage, {})}
