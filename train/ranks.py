"""Rank helpers for the trainer: work that one rank does for all, and gathering from every rank.

Under several processes only rank 0 touches the run directory (lock, cleanup, metrics), but every
rank must learn the outcome: an error on rank 0 alone would leave the others waiting at the next
collective until the launcher's timeout. On one process both helpers are plain calls.
"""

from __future__ import annotations

from ttr.errors import TTRError


def on_main(acc, fn):
    """``fn()`` on rank 0 only; every rank returns its result or raises its error (marked as
    raised alike on every rank, so that only rank 0 reports it)."""
    result, error = None, None
    if acc.is_main_process:
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001 - handed to every rank below
            error = err
    if acc.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        box = [result, None if error is None else (type(error), str(error))]
        broadcast_object_list(box)
        result = box[0]
        if box[1] is not None and error is None:
            try:
                error = box[1][0](box[1][1])
            except Exception:  # noqa: BLE001 - an error type that takes other arguments
                error = TTRError(box[1][1])
            error.same_on_all_ranks = True
    if error is not None:
        raise error
    return result


def gather(acc, obj) -> list:
    """Every rank's ``obj``, in rank order, on every rank."""
    if acc.num_processes == 1:
        return [obj]
    from accelerate.utils import gather_object

    return gather_object([obj])
