"""Chunk bookkeeping shared by every stage: which chunk of which sequence a program handles, and the
packing of documents (``cu_seqlens``) resolved once for all the ops of a forward (``Packing``)."""

from __future__ import annotations

import contextlib
import functools
import os
from typing import NamedTuple

import torch

CHUNK_SIZE = 64
MAX_GRID_Y = 65535  # CUDA's bound on a launch grid's second and third dimensions


class ChunkPlan(NamedTuple):
    cu_seqlens: torch.Tensor  # [N+1] int32 token offsets into the flattened [B*T] axis
    chunk_indices: torch.Tensor  # [NT, 2] int32: (sequence, chunk within the sequence)
    chunk_offsets: torch.Tensor  # [N+1] int32: first global chunk of each sequence
    num_seqs: int
    num_chunks: int
    chunk_size: int
    # every sequence's length where all are equally long (a batch without cu_seqlens, or documents
    # of one length), else 0: the chunk stages then find a chunk's sequence and bounds without
    # reading the index (tile.chunk_span)
    seq_len: int = 0


class Packing(NamedTuple):
    """Packed documents (``B == 1`` plus ``cu_seqlens``), validated and indexed once.

    Every op that takes ``cu_seqlens`` also takes a ``Packing`` in its place. A plain tensor is
    checked on the host and indexed at every call (a device-to-host copy when it lives on a GPU,
    which stalls the host until the GPU has caught up); a ``Packing`` carries those host facts and
    the chunk plan already built, so a model resolves its packing once per forward
    (``prepare_packing``) and its ops launch their kernels without waiting for the GPU.

    Built by :func:`prepare_packing`. ``.to(device)`` moves it like a tensor (accelerate and DDP move
    forward arguments this way; DDP also moves the tensors of a NamedTuple field by field).
    """

    cu_seqlens: torch.Tensor  # [N+1] int32 on the device: the first token of each document, then T
    seq_ids: torch.Tensor  # [T] int32 on the device: the document of each token
    plan: ChunkPlan  # the chunk index of the chunkwise ops, on the device
    bounds: tuple[int, ...]  # cu_seqlens on the host
    max_len: int  # the longest document

    @property
    def num_seqs(self) -> int:
        return len(self.bounds) - 1

    @property
    def seqlen(self) -> int:
        """T, the total number of tokens."""
        return self.bounds[-1]

    def to(self, device, non_blocking: bool = False) -> Packing:
        """This packing with its tensors on ``device`` (itself when they are there already)."""
        device = _concrete(device)
        if self.cu_seqlens.device == device:
            return self

        def move(x):
            return x.to(device, non_blocking=non_blocking)

        cu, plan = move(self.cu_seqlens), self.plan
        plan = plan._replace(cu_seqlens=cu, chunk_indices=move(plan.chunk_indices),
                             chunk_offsets=move(plan.chunk_offsets))
        return self._replace(cu_seqlens=cu, seq_ids=move(self.seq_ids), plan=plan)


def _concrete(device) -> torch.device:
    """``device`` with the current GPU's index filled in for a bare ``"cuda"``."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def check_cu_seqlens_form(cu_seqlens) -> None:
    """Type, dtype and rank of a ``cu_seqlens`` tensor (what needs no look at its values)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor or a Packing, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")


def host_cu_seqlens(cu_seqlens: torch.Tensor, seqlen: int) -> torch.Tensor:
    """Validate ``cu_seqlens`` (from 0, non-decreasing, ending at ``seqlen``); return it as an int64
    CPU tensor. For a GPU tensor this is the device-to-host copy that a ``Packing`` spares its ops."""
    check_cu_seqlens_form(cu_seqlens)
    cpu = cu_seqlens.detach().to("cpu", torch.int64)
    if int(cpu[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {int(cpu[0])}")
    if bool((cpu[1:] < cpu[:-1]).any()):
        raise ValueError("cu_seqlens must be non-decreasing")
    if int(cpu[-1]) != seqlen:
        raise ValueError(f"cu_seqlens must end at T={seqlen}, got {int(cpu[-1])}")
    return cpu


def prepare_packing(cu_seqlens, seqlen: int, *, device=None, chunk_size: int = CHUNK_SIZE) -> Packing:
    """Validate packed-document offsets once and index them for every op of a forward.

    Args:
        cu_seqlens: ``[N + 1]`` int32/int64 tensor of document offsets (from 0, non-decreasing,
            ending at ``seqlen``), on any device, or a ``Packing`` (checked against ``seqlen`` and
            moved to ``device``). Offsets on the CPU cost no device synchronisation: the index is
            computed on the host and sent with one non-blocking copy. Offsets on a GPU are first
            copied to the host, which waits for the GPU once.
        seqlen: T, the number of tokens of the packed ``[1, T, ...]`` inputs.
        device: where the ops will run (default: the device of ``cu_seqlens``).
        chunk_size: tokens per chunk of the chunkwise ops (``CHUNK_SIZE``).

    Returns:
        A :class:`Packing`; pass it as ``cu_seqlens`` to any op.

    Raises:
        TypeError, ValueError: ``cu_seqlens`` breaks the convention above (the message says how).
    """
    if isinstance(cu_seqlens, Packing):
        if cu_seqlens.seqlen != seqlen:
            raise ValueError(f"cu_seqlens must end at T={seqlen}, got a Packing of {cu_seqlens.seqlen} tokens")
        packing = cu_seqlens if device is None else cu_seqlens.to(device)
        if packing.plan.chunk_size != chunk_size:
            packing = _build_packing(torch.tensor(packing.bounds), packing.cu_seqlens.device, chunk_size)
        return packing
    host = host_cu_seqlens(cu_seqlens, seqlen)
    return _build_packing(host, cu_seqlens.device if device is None else device, chunk_size)


def _build_packing(host: torch.Tensor, device, chunk_size: int) -> Packing:
    """Index the documents of ``host`` (validated int64 CPU offsets) on the host, then send every
    index tensor to ``device`` in one non-blocking copy (from pinned memory for a GPU, so the copy
    neither waits for the GPU nor holds up the host)."""
    device = _concrete(device)
    n = host.numel() - 1
    lens = host[1:] - host[:-1]
    counts = (lens + chunk_size - 1) // chunk_size
    offsets = torch.cat([host.new_zeros(1), counts.cumsum(0)])
    num_chunks, seqlen = int(offsets[-1]), int(host[-1])
    docs = torch.arange(n)
    seq = docs.repeat_interleave(counts, output_size=num_chunks)
    chunk_indices = torch.stack([seq, torch.arange(num_chunks) - offsets[seq]], 1)
    parts = [host, offsets, chunk_indices.flatten(), docs.repeat_interleave(lens, output_size=seqlen)]
    # Each part starts on a 16-byte boundary, as a tensor of its own would: Triton specialises a
    # kernel on the alignment of its pointers, so views at other offsets would compile variants.
    starts = [0]
    for part in parts:
        starts.append(starts[-1] + cdiv(part.numel(), 4) * 4)
    buf = torch.zeros(starts[-1], dtype=torch.int32, pin_memory=device.type == "cuda")
    for part, start in zip(parts, starts):
        buf[start : start + part.numel()] = part
    buf = buf.to(device, non_blocking=True)
    cu, offsets_d, indices_d, seq_ids = (buf[start : start + p.numel()] for p, start in zip(parts, starts))
    uniform = n > 0 and bool((lens == lens[0]).all())
    plan = ChunkPlan(cu, indices_d.view(num_chunks, 2), offsets_d, n, num_chunks, chunk_size,
                     int(lens[0]) if uniform else 0)
    return Packing(cu, seq_ids, plan, tuple(host.tolist()), int(lens.max()))


# Plans of unpacked batches, by (B, T, device, chunk size): a GPU plan costs a host-to-device copy,
# and a training run sees a few shapes again and again. The plan's tensors are read-only.
_PLANS: dict[tuple, ChunkPlan] = {}
_MAX_PLANS = 64


def prepare_chunks(cu_seqlens, batch: int, seqlen: int, device=None, chunk_size: int = CHUNK_SIZE) -> ChunkPlan:
    """Index chunks per sequence. Without ``cu_seqlens`` the batch is read as B packed sequences
    of length T (the memory of ``[B, T, ...]`` is that of ``[1, B*T, ...]``); those plans are cached.
    ``cu_seqlens`` may be a ``Packing``, whose plan is used as it is (on ``device``)."""
    if cu_seqlens is None:
        device = _concrete(device if device is not None else "cpu")
        key = (batch, seqlen, str(device), chunk_size)
        plan = _PLANS.get(key)
        if plan is None:
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            host = torch.arange(batch + 1, dtype=torch.int64) * seqlen
            plan = _PLANS[key] = _build_packing(host, device, chunk_size).plan
        return plan
    return prepare_packing(cu_seqlens, seqlen, device=device, chunk_size=chunk_size).plan


def segments(cu_seqlens, batch: int, seqlen: int) -> list[tuple[int, int, int]]:
    """(batch row, first token, end) of every sequence, in state order: B rows of T tokens, or the
    documents of ``cu_seqlens`` (a ``Packing``'s host copy, or a tensor read on the host)."""
    if cu_seqlens is None:
        return [(i, 0, seqlen) for i in range(batch)]
    bounds = cu_seqlens.bounds if isinstance(cu_seqlens, Packing) else cu_seqlens.detach().cpu().tolist()
    return [(0, s, e) for s, e in zip(bounds[:-1], bounds[1:])]


# Keep or recompute: the backward of every mixer needs the chunk states ``h`` of the forward. The
# state pass walks the chunks of a sequence one after another (or, without the delta term and for
# long sequences, in two levels), so for long sequences recomputing it dominates the backward; when
# the sequences average at least this many chunks the forward keeps ``h`` (``[NT, H, K, V]`` in the
# input dtype: V/64 times the size of k) and what else the mixer's backward would recompute.
# Shorter sequences (training batches of packed documents) recompute h; the delta rules still keep
# w and v_new (the size of k and v), with which the backward's walk needs neither the WY stage nor
# the ``w h`` product (``delta/chunk.py``), SSD keeps its chunks' ``C B^T`` where its output launch
# read them (``ssd/chunk.py``), and GLA keeps h at any length (``gla/chunk.py``): at its K = V / 2,
# h is twice the size of k, and the time it saves per byte kept, about half what the delta rules'
# w and v_new save, is more than Gated DeltaNet's or SSD's h would save, which are left to ``keep``
# (``ttr bench --chunk-states`` measures each; docs/benchmarks.md).
# ``TTR_CHUNK_STATES=keep`` / ``recompute`` overrides the rule for every op (``recompute``: nothing
# kept, the least memory): a run-time choice of memory against time, like the backend, never stored
# in a model.
KEEP_STATES_MIN_CHUNKS = 96
CHUNK_STATES = ("auto", "keep", "recompute")


def chunk_states() -> str:
    """``TTR_CHUNK_STATES`` (``auto`` when unset), checked: a bad value raises naming it."""
    choice = os.environ.get("TTR_CHUNK_STATES", "").strip().lower() or "auto"
    if choice not in CHUNK_STATES:
        raise ValueError(f"TTR_CHUNK_STATES must be one of {CHUNK_STATES}, got {choice!r}")
    return choice


def keep_states(plan: ChunkPlan, min_chunks: int = KEEP_STATES_MIN_CHUNKS) -> bool:
    """Whether the forward keeps its states for the backward: ``TTR_CHUNK_STATES`` (``auto``,
    ``keep`` or ``recompute``), by default (``auto``) when the sequences average at least
    ``min_chunks`` chunks (``KEEP_STATES_MIN_CHUNKS`` unless the op sets its own)."""
    choice = chunk_states()
    if choice != "auto":
        return choice == "keep"
    return plan.num_chunks >= min_chunks * plan.num_seqs


# Launch-parameter overrides per stage ("state_fwd", "state_fwd_again", "state_bwd", "wy_inverse", "wy_fwd",
# "wy_bwd", "output_fwd", "output_bwd_dv", "output_bwd_dqk", "output_bwd_dqk_walk") -> {"BV": ..,
# "num_warps": .., "num_stages": ..}
# ("output_bwd_dqk_walk" also {"walk": bool}: ``output.dqk_walks``), "overlap" -> {"enabled": False}
# to run the passes that ``overlap.beside`` puts on a second stream in turn, "qkv_columns" ->
# {"enabled": False} for the delta rules' q, k and v as three projections and convs
# (``models.layers.linear``; by default one projection, ``conv.causal_conv1d_columns``; {"narrow":
# False} keeps the narrow gate maps out of it), "mlp_columns" -> {"enabled": False} for the MLP's
# gate and up as two products, "gla_gate" -> {"fused": False} for GLA's gate formed before its op
# rather than inside it, and "gla_columns" -> {"enabled": False} for GLA's projections' gradients
# each by its own products rather than from one buffer (``models.layers.gla``), "bias_column" ->
# {"enabled": False} for a narrow map's bias gradient summed apart from its weight's product
# (``utils.weight_bias_grad``). Empty in normal use;
# scripts/bench_kernels.py --sweep fills it to measure alternatives to the built-in heuristics.
TUNING: dict[str, dict] = {}


def folds(rows: int) -> bool:
    """More rows than a grid's second dimension holds (``MAX_GRID_Y``): more than 4.19M tokens of
    chunks of 64 in a call, or more than 65,535 (sequence, head) pairs in a walk."""
    return rows > MAX_GRID_Y


def rows_grid(blocks: int, rows: int, heads: int = 1) -> tuple[tuple[int, ...], bool]:
    """``(grid, fold)`` for a stage of ``blocks`` programs (of values or keys) per row (a chunk, or a
    walk's sequence and head) and head, read back by ``tile.grid_ids(NX, FOLD=fold)``: ``(blocks,
    rows, heads)``, or past ``MAX_GRID_Y`` rows ``(blocks * rows, heads)``. The programs run in the
    same order either way; the folded grid is not the default because its stages timed slower
    (docs/benchmarks.md, launch choices)."""
    if folds(rows):
        return (blocks * rows, heads), True
    return (blocks, rows, heads), False


# Launch arithmetic on the host. ``triton.cdiv`` and ``triton.next_power_of_2`` are Triton's constexpr
# functions, and a call of one from Python costs about 2 us (its arguments are unwrapped first);
# an op's fwd+bwd makes 15 - 20 of them, and its host time is what a small call waits for.
def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of ints, as ``triton.cdiv``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (0 for n <= 0), as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 for any other), looked up once per device:
    ``torch.cuda.get_device_properties`` runs through Python on every call."""
    if device.type != "cuda":
        return 1
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def token_stride(name: str, t: torch.Tensor, shape) -> int:
    """The distance between consecutive tokens of ``t``, a ``[B, T, H, D]`` tensor of ``shape`` whose
    heads and channels are dense (strides ``(H * D, 1)`` over the last two dims) and whose tokens
    are evenly spaced across the batch (``stride(0) == T * stride(1)``), as a kernel that addresses
    the tokens of a flattened batch reads it: a column block of a wider ``[B, T, W]`` buffer is one.
    ``name`` is the argument's in the error."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    b, s, h, d = t.shape
    if t.stride(3) != 1 or (h > 1 and t.stride(2) != d) or (b > 1 and t.stride(0) != s * t.stride(1)):
        raise ValueError(f"{name} must have dense heads and channels and evenly spaced tokens, got strides "
                         f"{t.stride()}")
    return t.stride(1)


def block_size(n: int, cap: int) -> int:
    """A tile's size along a dimension of ``n``: the next power of two, at least 16 (``tl.dot``'s
    smallest) and at most ``cap``."""
    return min(cap, max(16, next_power_of_2(n)))


# The stage names ``tuned`` was asked for while ``reading_stages`` is active, else None: a benchmark
# that sets ``TUNING`` learns which of its overrides no launch read (a misspelt stage does nothing).
_READ: set[str] | None = None


def tuned(stage: str, **defaults) -> dict:
    """The stage's launch parameters: the heuristic defaults, overridden by ``TUNING[stage]``."""
    if _READ is not None:
        _READ.add(stage)
    return {**defaults, **TUNING.get(stage, {})}


@contextlib.contextmanager
def reading_stages():
    """Inside the block, the stage names that ``tuned`` is asked for collect in the set it yields."""
    global _READ
    before, _READ = _READ, set()
    try:
        yield _READ
    finally:
        read, _READ = _READ, before
        if before is not None:
            before |= read
