"""The Redis tier: chunk caches shared by processes and machines through one Redis server.

Owns: the Redis key layout, the shared byte accounting and its LRU-ish eviction (atomic
Lua scripts, so many processes can write at once), TTLs and Redis-error handling. Does not
own: the byte format (``codec``: values are the same safetensors blobs as disk files) or
cross-tier placement.

Layout under ``prefix`` (default ``cachedrag``):

- ``{prefix}:{namespace}:{key}`` — the entry's safetensors bytes (optional TTL);
- ``{prefix}:__sizes`` — hash: value key -> charged bytes;
- ``{prefix}:__lru`` — sorted set: value key -> logical access time (``{prefix}:__clock``);
- ``{prefix}:__used`` — total charged bytes.

The accounting spans every namespace under ``prefix``: ``budget_bytes`` caps everything
cachedrag keeps in that server. A value is charged ``MEMORY USAGE`` of its key (the real
allocation, measured inside the write script) plus ``overhead_bytes`` for its hash and
sorted-set fields. A write that would exceed the budget evicts the least recently used
values (any process's) inside the same script, or is refused if the value alone is larger
than the budget. Values that expire by TTL are uncharged lazily (on the next miss or as
eviction victims). A standalone server is assumed (the scripts touch keys they were not
passed, which Redis Cluster forbids).

Errors: a Redis error on write skips it with a ``RuntimeWarning`` (``skipped_writes``); on
read it is a miss with a warning; bad blobs are counted, deleted and served as misses.
"""

from __future__ import annotations

import logging
import time
import warnings

import redis
import torch

from cachedrag.errors import CorruptCacheError
from cachedrag.store.base import EntryInfo, HeaderTier, Prepared, check_key
from cachedrag.store.codec import ForeignEntryError, check_namespace, decode, decode_extras, encode, read_header
from cachedrag.store.entry import KVEntry
from cachedrag.store.source import BlobSource, LayerSource

logger = logging.getLogger(__name__)

_DROP = """
local function drop(k)
  local s = tonumber(redis.call('HGET', KEYS[2], k) or '0')
  redis.call('DEL', k)
  redis.call('HDEL', KEYS[2], k)
  redis.call('ZREM', KEYS[3], k)
  return s
end
"""

# KEYS: value, sizes, lru, used, clock. ARGV: blob, budget, ttl_ms, overhead, may_evict
_PUT = _DROP + """
local budget = tonumber(ARGV[2])
local ttl = tonumber(ARGV[3])
local used = tonumber(redis.call('GET', KEYS[4]) or '0') - drop(KEYS[1])
if used < 0 then used = 0 end
if ttl > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
else
  redis.call('SET', KEYS[1], ARGV[1])
end
local size = tonumber(redis.call('MEMORY', 'USAGE', KEYS[1])) + tonumber(ARGV[4])
if size > budget then
  redis.call('DEL', KEYS[1])
  redis.call('SET', KEYS[4], used)
  return {0, 0, size}
end
local evicted = 0
while used + size > budget do
  local victim = redis.call('ZRANGE', KEYS[3], 0, 0)[1]
  if ARGV[5] ~= '1' or not victim then
    redis.call('DEL', KEYS[1])
    redis.call('SET', KEYS[4], used)
    return {-1, evicted, size}
  end
  used = used - drop(victim)
  evicted = evicted + 1
end
if used < 0 then used = 0 end
redis.call('HSET', KEYS[2], KEYS[1], size)
redis.call('ZADD', KEYS[3], redis.call('INCR', KEYS[5]), KEYS[1])
redis.call('SET', KEYS[4], used + size)
return {1, evicted, size}
"""

# KEYS: value, sizes, lru, used, clock. Returns the value (touching it) or false (uncharging a lapsed one).
_GET = _DROP + """
local v = redis.call('GET', KEYS[1])
if v then
  redis.call('ZADD', KEYS[3], 'XX', redis.call('INCR', KEYS[5]), KEYS[1])
  return v
end
if redis.call('HEXISTS', KEYS[2], KEYS[1]) == 1 then
  redis.call('DECRBY', KEYS[4], drop(KEYS[1]))
end
return false
"""

# KEYS: value, sizes, lru, used. Returns 1 if the value existed.
_REMOVE = _DROP + """
local existed = redis.call('EXISTS', KEYS[1])
redis.call('DECRBY', KEYS[4], drop(KEYS[1]))
return existed
"""


class RedisTier(HeaderTier):
    """Entries as safetensors values in Redis, shared by every process using the server."""

    shared = True
    persistent = True
    serialized = True

    def __init__(
        self,
        url_or_client: str | redis.Redis,
        budget_bytes: int,
        *,
        namespace: str,
        ttl_s: float | None = None,
        prefix: str = "cachedrag",
        overhead_bytes: int = 256,
        self_evict: bool = True,
        name: str = "redis",
    ) -> None:
        super().__init__(name, budget_bytes, namespace, self_evict=self_evict)
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 or None, got {ttl_s}")
        if isinstance(url_or_client, str):
            self._client = redis.Redis.from_url(url_or_client)
            self._owns_client = True
        else:
            self._client = url_or_client
            self._owns_client = False
        self.ttl_ms = 0 if ttl_s is None else int(ttl_s * 1000)
        self.overhead_bytes = overhead_bytes
        self._vprefix = f"{prefix}:{namespace}:"
        self._acct = [f"{prefix}:__sizes", f"{prefix}:__lru", f"{prefix}:__used", f"{prefix}:__clock"]
        self._put = self._client.register_script(_PUT)
        self._get_script = self._client.register_script(_GET)
        self._remove = self._client.register_script(_REMOVE)

    @property
    def client(self) -> redis.Redis:
        return self._client

    def vkey(self, key: str) -> str:
        """The Redis key holding ``key``'s value."""
        return self._vprefix + key

    # ---- accounting ----------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        try:
            return int(self._client.get(self._acct[2]) or 0)
        except redis.RedisError as exc:
            warnings.warn(f"{self.name}: cannot read usage ({exc})", RuntimeWarning, stacklevel=2)
            return 0

    def entry_bytes(self, key: str) -> int | None:
        size = self._call(lambda: self._client.hget(self._acct[0], self.vkey(key)), "size lookup")
        return None if size is None else int(size)

    def contains(self, key: str) -> bool:
        return bool(self._call(lambda: self._client.exists(self.vkey(key)), "exists"))

    def keys(self) -> list[str]:
        n = len(self._vprefix)
        found = self._call(lambda: list(self._client.zscan_iter(self._acct[1], match=self._vprefix + "*")), "scan")
        return [m.decode()[n:] for m, _ in (found or [])]

    # ---- reads ---------------------------------------------------------------------------
    def _get(self, key: str) -> KVEntry | None:
        blob = self._call(lambda: self._get_script(keys=[self.vkey(key), *self._acct], args=[]), "get")
        if not blob:
            return None
        try:
            return decode(blob, key, self.namespace)
        except CorruptCacheError as exc:
            self._discard_bad(key, exc)
            return None

    def _read_header(self, key: str, *, extras: bool) -> tuple[EntryInfo, dict[str, torch.Tensor]] | None:
        """Header (and with ``extras`` the non-layered tensors) of ``key``'s value through
        ``GETRANGE``; K/V are not transferred. Does not touch the LRU time."""
        vkey = self.vkey(key)

        def read_at(offset: int, length: int) -> bytes:
            return b"" if length == 0 else self._client.getrange(vkey, offset, offset + length - 1)

        try:
            size = self._client.strlen(vkey)
            if not size:
                return None
            header = read_header(read_at, int(size), key, self.namespace)
            tensors = decode_extras(header, read_at) if extras else {}
        except CorruptCacheError as exc:
            self._discard_bad(key, exc)
            return None
        except redis.RedisError as exc:
            warnings.warn(f"{self.name}: header read of {key} failed ({exc}); a miss", RuntimeWarning, stacklevel=3)
            return None
        return EntryInfo(dict(header.meta), header.nbytes, header.n_layers, header.n_tokens), tensors

    def open_source(self, key: str) -> LayerSource | None:
        vkey = self.vkey(key)
        size = self._call(lambda: self._client.strlen(vkey), "strlen")
        if not size:
            with self._lock:
                self.stats.misses += 1
            return None

        def read_at(offset: int, length: int) -> bytes:
            if length == 0:
                return b""
            return self._client.getrange(vkey, offset, offset + length - 1)

        try:
            header = read_header(read_at, int(size), key, self.namespace)
        except CorruptCacheError as exc:
            self._discard_bad(key, exc)
            return None
        except redis.RedisError as exc:
            warnings.warn(f"{self.name}: header read of {key} failed ({exc}); a miss", RuntimeWarning, stacklevel=2)
            return None
        with self._lock:
            self.stats.hits += 1
        return BlobSource(header, read_at, self.name, on_corrupt=lambda exc: self._discard_bad(key, exc))

    # ---- writes --------------------------------------------------------------------------
    def prepare(self, key: str, entry: KVEntry, *, blob: bytes | None = None, copy: bool = True) -> Prepared:
        check_key(key)
        check_namespace(entry, self.namespace)
        if blob is None:
            blob = encode(key, entry, self.namespace)
        return Prepared(key, len(blob) + len(self.vkey(key)) + self.overhead_bytes, blob)

    def commit(self, prepared: Prepared) -> bool:
        blob = prepared.payload
        assert isinstance(blob, bytes)
        if prepared.nbytes > self._budget:
            with self._lock:
                self.stats.refused += 1
            return False
        t0 = time.perf_counter()
        args = [blob, self._budget, self.ttl_ms, self.overhead_bytes, "1" if self.self_evict else "0"]
        try:
            status, evicted, size = self._put(keys=[self.vkey(prepared.key), *self._acct], args=args)
        except redis.RedisError as exc:
            warnings.warn(f"{self.name}: write of {prepared.key} skipped ({exc}); serving continues", RuntimeWarning, stacklevel=2)
            with self._lock:
                self.stats.skipped_writes += 1
            return False
        with self._lock:
            self.stats.evictions += int(evicted)
            if int(status) != 1:
                self.stats.refused += 1
                return False
            self.stats.puts += 1
            self.stats.put_bytes += int(size)
            self.stats.store_seconds += time.perf_counter() - t0
        return True

    def remove(self, key: str) -> bool:
        existed = self._call(lambda: self._remove(keys=[self.vkey(key), *self._acct[:3]], args=[]), "remove")
        if existed:
            with self._lock:
                self.stats.removes += 1
        return bool(existed)

    def _discard_bad(self, key: str, exc: CorruptCacheError) -> None:
        kind = "foreign" if isinstance(exc, ForeignEntryError) else "corrupt"
        logger.warning("%s: %s value for %s removed (%s)", self.name, kind, key, exc)
        with self._lock:
            if kind == "foreign":
                self.stats.foreign += 1
            else:
                self.stats.corrupt += 1
        self._call(lambda: self._remove(keys=[self.vkey(key), *self._acct[:3]], args=[]), "remove")

    def _call(self, fn, what: str):
        """Run a Redis call; a Redis error becomes a warning and ``None`` (served as a miss)."""
        try:
            return fn()
        except redis.RedisError as exc:
            warnings.warn(f"{self.name}: {what} failed ({exc}); treated as a miss", RuntimeWarning, stacklevel=3)
            return None

    def clear_namespace(self) -> int:
        """Remove every value of this namespace (tests, benchmarks); returns how many."""
        keys = self.keys()
        for key in keys:
            self.remove(key)
        return len(keys)

    def close(self) -> None:
        if self._owns_client:
            self._client.close()
