"""The eval tests train and run tiny models: one intra-op thread is faster for them than two, and
on a shared, busy CPU a second thread that loses its core leaves the first spin-waiting at every
small matmul, which slows a tiny run down many times over."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _no_hub_check(monkeypatch):
    """`ttr eval` checks that the Hub is reachable unless an offline mode is set: the tests never
    touch the network (tests of the check itself remove the variable)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
