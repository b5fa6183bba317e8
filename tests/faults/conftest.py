"""Fixtures of the fault-injection suite: one tiny runner per module, one thread (tiny tensors)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def runner():
    import torch

    from cachedrag.testing import tiny_runner

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_runner()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def expected(runner):
    from tests.faults.helpers import reference

    return reference(runner)


from tests.store.conftest import redis_server  # noqa: E402,F401  (a real redis-server for the Redis faults)
