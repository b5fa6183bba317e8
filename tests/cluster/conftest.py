"""Fixtures of the cluster tests: one real Redis server per session, a fresh key prefix per test."""

from __future__ import annotations

import uuid

import pytest

from tests.store.conftest import redis_server  # noqa: F401  (the same session-wide server fixture)


@pytest.fixture
def redis_prefix(request):
    prefix = f"cdcluster{uuid.uuid4().hex[:10]}"
    yield prefix
    if "redis_server" in request.fixturenames:
        client = request.getfixturevalue("redis_server").client()
        keys = list(client.scan_iter(match=f"{prefix}:*"))
        if keys:
            client.delete(*keys)
        client.close()
