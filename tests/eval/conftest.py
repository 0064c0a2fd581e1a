"""The eval tests train and run tiny models: one intra-op thread is faster for them than two, and
on a shared, busy CPU two threads spin-wait (measured here: a 50-step tiny MQAR run took 6 s with
one thread and 156 s with two under load)."""

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
