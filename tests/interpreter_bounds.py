"""Under the Triton interpreter, every load, store and atomic of a kernel must address elements of
the launch's tensor arguments (each one's extent by its sizes and strides). A read past a tensor's
end that the kernel then discards gives right results, and on a GPU faults only where the address
beyond the tensor is unmapped; here it fails the test that launched it, naming the kernel.

It wraps the interpreter's launch (``GridExecutor.__call__``) and memory ops
(``InterpreterBuilder.create_masked_load`` and the rest), so ``install`` returns False, and checks
nothing, where the installed Triton has no such names."""

import numpy as np
import torch

_launches: list[tuple[str, np.ndarray, np.ndarray]] = []  # (kernel, starts, ends) of the launches running
INSTALLED = False


def _extents(args) -> tuple[np.ndarray, np.ndarray]:
    spans = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.numel():
            last = sum((size - 1) * stride for size, stride in zip(a.shape, a.stride()))
            spans.append((a.data_ptr(), a.data_ptr() + (last + 1) * a.element_size()))
    spans.sort()
    return np.array([s for s, _ in spans], dtype=np.uint64), np.array([e for _, e in spans], dtype=np.uint64)


def _check(interp, ptrs, mask, what: str) -> None:
    if not _launches:
        return
    kernel, starts, ends = _launches[-1]
    p = np.asarray(ptrs.data).astype(np.uint64)
    active = p if mask is None else p[np.broadcast_to(np.asarray(mask.data).astype(bool), p.shape)]
    if active.size == 0:
        return
    size = np.uint64(np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize)
    i = np.clip(np.searchsorted(starts, active, side="right") - 1, 0, None)
    inside = (active >= starts[i]) & (active + size <= ends[i]) if starts.size else np.zeros(active.shape, bool)
    if not inside.all():
        raise AssertionError(f"{kernel}: {what} of {int((~inside).sum())} element(s) outside every tensor argument")


def install() -> bool:
    """Wraps the interpreter's launch and memory ops with the check (once); False where it cannot."""
    global INSTALLED
    if INSTALLED:
        return True
    try:
        import triton.runtime.interpreter as interp

        builder, executor = interp.InterpreterBuilder, interp.GridExecutor
        load, store = builder.create_masked_load, builder.create_masked_store
        rmw, cas, launch = builder.create_atomic_rmw, builder.create_atomic_cas, executor.__call__
        interp._get_np_dtype  # noqa: B018  (the element size of a pointer's type)
    except (ImportError, AttributeError):
        return False

    def checked_launch(self, *args, **kwargs):
        _launches.append((getattr(self.fn, "__name__", "kernel"), *_extents([*args, *kwargs.values()])))
        try:
            return launch(self, *args, **kwargs)
        finally:
            _launches.pop()

    def checked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        _check(interp, ptrs, mask, "load")
        return load(self, ptrs, mask, other, cache_policy, is_volatile)

    def checked_store(self, ptrs, value, mask, cache_policy):
        _check(interp, ptrs, mask, "store")
        return store(self, ptrs, value, mask, cache_policy)

    def checked_rmw(self, op, ptr, val, mask, sem, scope):
        _check(interp, ptr, mask, "atomic")
        return rmw(self, op, ptr, val, mask, sem, scope)

    def checked_cas(self, ptr, cmp, val, sem, scope):
        _check(interp, ptr, None, "atomic")
        return cas(self, ptr, cmp, val, sem, scope)

    builder.create_masked_load, builder.create_masked_store = checked_load, checked_store
    builder.create_atomic_rmw, builder.create_atomic_cas = checked_rmw, checked_cas
    executor.__call__ = checked_launch
    INSTALLED = True
    return True
