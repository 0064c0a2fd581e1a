"""Every public op (each function in the ``__all__`` of ``ttr.kernels`` and of its subpackages)
documents its arguments and its result: an ``Args:`` section naming every parameter and a
``Returns:`` section."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

import pytest

import ttr.kernels


def public_ops():
    names = ["ttr.kernels"] + [f"ttr.kernels.{m.name}" for m in pkgutil.iter_modules(ttr.kernels.__path__) if m.ispkg]
    ops = {}
    for name in names:
        module = importlib.import_module(name)
        for attr in getattr(module, "__all__", ()):
            obj = getattr(module, attr)
            if inspect.isfunction(obj):
                ops.setdefault(f"{obj.__module__}.{obj.__qualname__}", obj)
    return sorted(ops.items())


def test_the_public_ops_are_found():
    names = {name.rsplit(".", 1)[1] for name, _ in public_ops()}
    assert {"chunk_gated_delta_rule", "attention", "causal_conv1d", "linear_cross_entropy", "prepare_packing"} <= names


@pytest.mark.parametrize("name, op", public_ops(), ids=lambda x: x if isinstance(x, str) else "")
def test_public_op_documents_args_and_returns(name, op):
    doc = inspect.getdoc(op) or ""
    assert re.search(r"^Args:$", doc, re.M) and re.search(r"^Returns:$", doc, re.M), name
    args = doc.split("Args:", 1)[1].split("Returns:", 1)[0]
    for param in inspect.signature(op).parameters:
        assert re.search(rf"\b{param}\b", args), f"{name}: Args does not describe {param!r}"
