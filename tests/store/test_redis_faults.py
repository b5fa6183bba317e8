"""RedisTier under faults: another process's eviction mid-read, a server that accepts and never
answers (timeouts + circuit breaker), malformed shared accounting (validated before any write,
repaired with a warning)."""

from __future__ import annotations

import socket
import threading
import time
import warnings

import pytest

from cachedrag.errors import CorruptCacheError
from cachedrag.store.config import StoreConfig
from cachedrag.store.redis_scripts import PUT
from cachedrag.store.redis_tier import RedisTier
from cachedrag.store.tiered import TieredStore
from tests.store.helpers import NS, key_of, make_entry

pytestmark = pytest.mark.redis


def tier_of(server, prefix, budget=1 << 20, **kw) -> RedisTier:
    return RedisTier(server.url, budget, namespace=kw.pop("namespace", NS), prefix=prefix, **kw)


class HangingServer:
    """A TCP server that accepts connections and never answers (a wedged Redis)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.conns: list[socket.socket] = []
        self._stop = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
                self.conns.append(conn)  # held open, never read or answered
            except OSError:
                continue

    def close(self) -> None:
        self._stop = True
        self.thread.join()
        for c in self.conns:
            c.close()
        self.sock.close()


@pytest.fixture
def hanging():
    server = HangingServer()
    yield server
    server.close()


def accounting_consistent(client, tier: RedisTier, prefix: str) -> None:
    sizes = {k: int(v) for k, v in client.hgetall(f"{prefix}:__sizes").items()}
    values = [k for k in client.scan_iter(match=f"{prefix}:*") if not k.startswith(f"{prefix}:__".encode())]
    assert sorted(values) == sorted(sizes), "a value outside the accounting (or a size without a value)"
    assert int(client.get(f"{prefix}:__used") or 0) == sum(sizes.values()) <= tier.budget_bytes
    assert sorted(m for m, _ in client.zscan_iter(f"{prefix}:__lru")) == sorted(sizes)


def test_another_process_eviction_mid_read_is_a_miss_not_corrupt(redis_server, redis_prefix):
    a = tier_of(redis_server, redis_prefix)
    entry = make_entry(1, layers=4)
    assert a.put(key_of(1), entry)
    source = a.open_source(key_of(1))
    assert source.load_layer(0)["k"].equal(entry.k[0])
    other = tier_of(redis_server, redis_prefix)  # another process removes (or evicts) the value
    assert other.remove(key_of(1))
    with pytest.raises(CorruptCacheError):
        source.load_layer(1)  # the bytes are gone: this load fails ...
    assert a.stats.corrupt == 0 and a.stats.vanished == 1  # ... but nothing is called corrupt
    # a value truly damaged in place is still corrupt
    assert a.put(key_of(2), entry)
    source = a.open_source(key_of(2))
    client = redis_server.client()
    blob = bytearray(client.get(a.vkey(key_of(2))))
    blob[-20] ^= 0x10
    client.set(a.vkey(key_of(2)), bytes(blob))
    with pytest.raises(CorruptCacheError):
        for layer in range(4):
            source.load_layer(layer)
    assert a.stats.corrupt == 1 and not client.exists(a.vkey(key_of(2)))


def test_hanging_server_costs_bounded_time_and_the_breaker_opens(hanging, redis_prefix):
    tier = RedisTier(hanging.url, 1 << 20, namespace=NS, prefix=redis_prefix, timeout_s=0.2, breaker_failures=2,
                     breaker_reset_s=30)
    t0 = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for i in range(20):
            assert tier.get(key_of(i)) is None
            assert not tier.put(key_of(i), make_entry(i))
            assert not tier.contains(key_of(i))
    elapsed = time.monotonic() - t0
    assert elapsed < 2.0, f"60 calls against a hanging server took {elapsed:.1f} s"
    assert tier.circuit_open and tier.stats.unavailable >= 60
    assert tier.stats.skipped_writes == 20


def test_breaker_closes_again_when_the_server_answers(redis_server, redis_prefix, monkeypatch):
    tier = tier_of(redis_server, redis_prefix, timeout_s=0.2, breaker_failures=1, breaker_reset_s=0.3)
    import redis

    real = tier.client.exists
    monkeypatch.setattr(tier.client, "exists", lambda *a: (_ for _ in ()).throw(redis.TimeoutError("hung")))
    with pytest.warns(RuntimeWarning):
        assert not tier.contains(key_of(1))
    assert tier.circuit_open
    monkeypatch.setattr(tier.client, "exists", real)
    with pytest.warns(RuntimeWarning, match="circuit open"):
        assert not tier.contains(key_of(1))  # skipped at once while open
    time.sleep(0.35)
    assert tier.put(key_of(1), make_entry(1))  # the trial call succeeds: closed again
    assert not tier.circuit_open and tier.contains(key_of(1))


def test_store_serves_from_lower_tiers_while_redis_hangs(hanging, tmp_path):
    cfg = StoreConfig(namespace=NS, cpu_bytes=1 << 20, redis_url=hanging.url, redis_bytes=1 << 20,
                      redis_timeout_s=0.2, redis_breaker_failures=2, redis_breaker_reset_s=30, write_through=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        store = TieredStore.from_config(cfg)
        t0 = time.monotonic()
        for i in range(10):
            assert store.put(key_of(i), make_entry(i))
            assert store.get(key_of(i)).equal(make_entry(i))
            assert store.get(key_of(100 + i)) is None  # a miss probes Redis: skipped while open
        elapsed = time.monotonic() - t0
        store.close()
    assert elapsed < 2.0, f"{elapsed:.1f} s"


MALFORMED = {
    "used_text": lambda c, p: c.set(f"{p}:__used", "lots"),
    "used_negative": lambda c, p: c.set(f"{p}:__used", "-5"),
    "used_wrong_type": lambda c, p: (c.delete(f"{p}:__used"), c.rpush(f"{p}:__used", "x")),
    "clock_text": lambda c, p: c.set(f"{p}:__clock", "tick"),
    "clock_float": lambda c, p: c.set(f"{p}:__clock", "1.5"),
    "sizes_wrong_type": lambda c, p: (c.delete(f"{p}:__sizes"), c.set(f"{p}:__sizes", "oops")),
    "lru_wrong_type": lambda c, p: (c.delete(f"{p}:__lru"), c.set(f"{p}:__lru", "oops")),
    "size_text": lambda c, p: c.hset(f"{p}:__sizes", f"{p}:{NS}:{key_of(0)}", "big"),
}


@pytest.mark.parametrize("damage", sorted(MALFORMED))
def test_malformed_accounting_is_repaired_with_a_warning(redis_server, redis_prefix, damage):
    budget = 40_000
    tier = tier_of(redis_server, redis_prefix, budget)
    for i in range(3):
        assert tier.put(key_of(i), make_entry(i))
    client = redis_server.client()
    MALFORMED[damage](client, redis_prefix)
    with pytest.warns(RuntimeWarning, match="malformed"):
        assert tier.put(key_of(0), make_entry(0, tokens=4))  # not wedged: repaired, then written
    assert tier.stats.repairs == 1
    for i in range(20, 40):  # and the budget holds from then on
        assert tier.put(key_of(i), make_entry(i, tokens=16))
        got = tier.get(key_of(i))
        assert got is not None and got.equal(make_entry(i, tokens=16))
    accounting_consistent(client, tier, redis_prefix)
    assert tier.remove(key_of(39)) and tier.get(key_of(39)) is None
    accounting_consistent(client, tier, redis_prefix)


def test_get_and_remove_are_not_wedged_by_a_bad_clock(redis_server, redis_prefix):
    tier = tier_of(redis_server, redis_prefix)
    assert tier.put(key_of(1), make_entry(1))
    client = redis_server.client()
    client.set(f"{redis_prefix}:__clock", "not-a-number")
    with pytest.warns(RuntimeWarning, match="malformed"):
        assert tier.get(key_of(1)).equal(make_entry(1))
    client.set(f"{redis_prefix}:__used", "x")
    with pytest.warns(RuntimeWarning, match="malformed"):
        assert tier.remove(key_of(1))
    accounting_consistent(client, tier, redis_prefix)


def test_write_script_validates_before_writing(redis_server, redis_prefix):
    """The raw script, on malformed accounting, answers "malformed" and stores nothing."""
    client = redis_server.client()
    client.set(f"{redis_prefix}:__clock", "tick")
    script = client.register_script(PUT)
    vkey = f"{redis_prefix}:{NS}:{key_of(1)}"
    keys = [vkey, *(f"{redis_prefix}:__{n}" for n in ("sizes", "lru", "used", "clock"))]
    out = script(keys=keys, args=[b"blob", 1 << 20, 0, 256, "1"])
    assert int(out[0]) == -2 and b"clock" in out[-1]
    assert not client.exists(vkey) and not client.exists(f"{redis_prefix}:__sizes")
