"""Progress of a sweep of synthetic training jobs (``ttr eval mqar``, ``ttr eval state``): one
tqdm bar on stderr over the training steps of all jobs, with the time left.

Jobs report their steps through :func:`train_logging` (the ``log`` callback of
``synthetic.train``) into a queue; a thread in the main process moves the bar. In a sweep over
several processes the queue is a ``multiprocessing.Manager`` queue, which, unlike a plain one,
can be handed to each job as an argument of the pool's function.
"""

from __future__ import annotations

import functools
import queue as queue_module
import sys
import threading

_QUEUE = None  # where this process's jobs report: set by tracked() for the job it runs


def train_logging(job: dict, steps: int | None) -> dict:
    """Keyword arguments of ``synthetic.train`` that report ``job``'s steps (about 100 updates per
    job, so the loss it reads back costs nothing); empty when no progress bar listens. A job on the
    clock alone (``steps=None``) reports every 100 steps, its total growing with them."""
    if _QUEUE is None:
        return {}
    index, sink = job.get("index", 0), _QUEUE
    if steps is None:
        return {"log": lambda step, loss: sink.put((index, step + 1, step + 1)), "log_every": 100}
    return {"log": lambda step, loss: sink.put((index, step + 1, steps)), "log_every": max(1, steps // 100)}


def tracked(fn, sink, job: dict):
    """Run ``fn(job)`` with its steps reported to ``sink``; says when the job is done."""
    global _QUEUE
    previous, _QUEUE = _QUEUE, sink
    try:
        result = fn(job)
    finally:
        _QUEUE = previous
    sink.put((job.get("index", 0), None, None))
    return result


class SweepProgress:
    """``with SweepProgress(jobs, "mqar", workers) as progress: run_jobs(progress.wrap(fn), ...)``."""

    def __init__(self, jobs: list[dict], desc: str, workers: int = 1):
        self.jobs, self.desc, self.workers = len(jobs), desc, workers
        self.totals: dict[int, int] = {}
        self.done: dict[int, int] = {}
        self.finished = 0

    def __enter__(self):
        from tqdm.auto import tqdm

        if self.workers > 1 and self.jobs > 1:
            import multiprocessing as mp

            self.manager = mp.get_context("spawn").Manager()
            self.queue = self.manager.Queue()
        else:
            self.manager, self.queue = None, queue_module.SimpleQueue()
        tty = sys.stderr.isatty()
        self.bar = tqdm(total=None, desc=self.desc, unit="step", file=sys.stderr, dynamic_ncols=True,
                        mininterval=0.5 if tty else 30.0, postfix=f"jobs 0/{self.jobs}")
        self.thread = threading.Thread(target=self._listen, daemon=True)
        self.thread.start()
        return self

    def wrap(self, fn):
        """``fn`` reporting to this bar (picklable when ``fn`` is, for a process pool)."""
        return functools.partial(tracked, fn, self.queue)

    def _listen(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            self.update(*item)

    def update(self, index: int, step: int | None, steps: int | None) -> None:
        if step is None:  # the job ended (a time budget may stop it before its last step)
            self.finished += 1
            self.bar.set_postfix_str(f"jobs {self.finished}/{self.jobs}", refresh=False)
            step = self.done.get(index, 0)
            self.totals[index] = step
        else:
            self.totals[index] = steps
        known = sum(self.totals.values())
        # jobs not started yet are taken to be as long as the average started one
        self.bar.total = round(known + (self.jobs - len(self.totals)) * known / len(self.totals))
        self.bar.update(step - self.done.get(index, 0))
        self.done[index] = step

    def __exit__(self, *exc) -> None:
        self.queue.put(None)
        self.thread.join()
        self.bar.close()
        if self.manager is not None:
            self.manager.shutdown()
