"""Two independent passes of a backward, side by side on two CUDA streams.

Where the forward did not keep the chunk states, a chunk op's backward forms them again by a walk
over the chunks, one program per (sequence, head, value block) through its chunks in turn, bound
by the latency of its steps: at training shapes one walk leaves most of the GPU's SMs idle. GLA's
backward runs that walk beside its stages up to dq/dk (the intra-chunk dv and dA, the reverse
walk for dh, the intra-chunk dq/dk), none of which reads the states, and measured faster for it.
The delta rules and SSD run theirs in turn: beside their shorter run of stages (a launch and the
reverse walk) the two walks contend for the same SMs, and the op measured slower at some lengths
(docs/benchmarks.md holds both measurements).

``beside(fn, device)`` queues ``fn`` (kernel launches that return a tensor) on a second stream of
``device`` after the work already queued on the current one, and returns ``join``: join makes the
current stream wait for ``fn``'s kernels and returns fn's tensor, marked as used by the current
stream (so the caching allocator does not hand its memory to another tensor before the current
stream is done with it). Whatever ``fn`` reads was allocated on the current stream and outlives ``join``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ttr.kernels.common.index import tuned

_SIDE: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE:
        _SIDE[index] = torch.cuda.Stream(device=index)
    return _SIDE[index]


def overlapping(device: torch.device) -> bool:
    """Whether ``beside`` runs its work on a second stream: on a CUDA device, unless
    ``TUNING["overlap"] = {"enabled": False}`` (for measurement) or a CUDA graph is being captured."""
    return (device.type == "cuda" and tuned("overlap", enabled=True)["enabled"]
            and not torch.cuda.is_current_stream_capturing())


def beside(fn: Callable[[], torch.Tensor], device: torch.device) -> Callable[[], torch.Tensor]:
    """Start ``fn()`` on a second stream of ``device`` (see the module docstring) and return the
    join; where ``overlapping`` is false, fn runs at once and the join returns its result."""
    if not overlapping(device):
        result = fn()
        return lambda: result
    main = torch.cuda.current_stream(device)
    side = _side_stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        result = fn()

    def join() -> torch.Tensor:
        main.wait_stream(side)
        result.record_stream(main)
        return result

    return join


def kept_or_beside(kept: torch.Tensor | None, form: Callable[[], torch.Tensor],
                   device: torch.device) -> Callable[[], torch.Tensor]:
    """The join of ``beside(form, device)``, or, where the forward kept the result (``kept`` is not
    None), a join that returns it."""
    if kept is not None:
        return lambda: kept
    return beside(form, device)
