"""Fixtures of the store tests: a real Redis server, per-test Redis prefixes.

``CACHEDRAG_TEST_REDIS_URL`` points the Redis tests at an existing server (e.g. one that
``make test`` or CI started); otherwise a private redis-server is started on loopback.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

import pytest
import redis


@dataclass
class GivenServer:
    url: str

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server for the whole session (skipped only if none can be started)."""
    from cachedrag.store.redis_server import RedisUnavailableError, start_redis_server

    given = os.environ.get("CACHEDRAG_TEST_REDIS_URL")
    if given:
        yield GivenServer(given)
        return
    try:
        server = start_redis_server()
    except RedisUnavailableError as exc:
        pytest.skip(f"no redis-server could be started: {exc}")
    yield server
    server.stop()


@pytest.fixture
def redis_prefix(request):
    """A fresh key prefix per test, so accounting of different tests never mixes; its keys
    are deleted afterwards (tests that use no server leave nothing to delete)."""
    prefix = f"cdtest{uuid.uuid4().hex[:10]}"
    yield prefix
    if "redis_server" in request.fixturenames:
        client = request.getfixturevalue("redis_server").client()
        keys = list(client.scan_iter(match=f"{prefix}:*"))
        if keys:
            client.delete(*keys)
        client.close()
