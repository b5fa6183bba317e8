"""The Redis tier: chunk caches shared by processes and machines through one Redis server.

Owns: the Redis key layout, running the accounting scripts (and their repair when they find
the accounting malformed), TTLs, timeouts, the circuit breaker, and Redis-error handling. Does
not own: the scripts themselves (``redis_scripts``: the shared byte accounting and its LRU-ish
eviction), the byte format (``codec``: values are the same safetensors blobs as disk files) or
cross-tier placement.

Layout under ``prefix`` (default ``cachedrag``):

- ``{prefix}:{namespace}:{key}`` — the entry's safetensors bytes (optional TTL);
- ``{prefix}:__sizes`` — hash: value key -> charged bytes;
- ``{prefix}:__lru`` — sorted set: value key -> logical access time (``{prefix}:__clock``);
- ``{prefix}:__used`` — total charged bytes.

The accounting and its eviction run as atomic Lua scripts (``redis_scripts``), so every
process writing to the server keeps within one budget.

Hanging or lost servers: every call has a socket timeout (``timeout_s``), redis-py's own
retries are off, and a circuit breaker (``pybreaker``) opens after ``breaker_failures``
consecutive connection errors or timeouts: for ``breaker_reset_s`` every call is skipped at
once (a miss, a skipped write), so requests are served from the other tiers in bounded time;
then one trial call closes it again if the server answers.

Errors: a Redis error on write skips it with a ``RuntimeWarning`` (``skipped_writes``); on
read it is a miss with a warning; bad blobs are counted, deleted and served as misses; a
value that disappears between two reads of one entry (another process evicted it) is a
miss counted as ``vanished``, never as corrupt.
"""

from __future__ import annotations

import logging
import re
import time
import warnings

import pybreaker
import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from cachedrag.errors import CorruptCacheError
from cachedrag.store.base import EntryInfo, HeaderTier, Prepared, check_key
from cachedrag.store.codec import ForeignEntryError, check_namespace, decode, decode_extras, encode, read_header
from cachedrag.store import redis_scripts as scripts
from cachedrag.store.entry import KVEntry
from cachedrag.store.source import BlobSource, LayerSource

logger = logging.getLogger(__name__)

_DOWN = (redis.ConnectionError, redis.TimeoutError)  # what trips the breaker (not script/data errors)


class _Skipped(redis.RedisError):
    """A call not made: the circuit breaker is open (the server hung or went away)."""


class _Malformed(Exception):
    """A script found the shared accounting malformed (and wrote nothing)."""


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
        timeout_s: float = 0.5,
        breaker_failures: int = 2,
        breaker_reset_s: float = 5.0,
        name: str = "redis",
    ) -> None:
        super().__init__(name, budget_bytes, namespace, self_evict=self_evict)
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 or None, got {ttl_s}")
        if timeout_s <= 0 or breaker_failures < 1 or breaker_reset_s <= 0:
            raise ValueError("timeout_s and breaker_reset_s must be > 0, breaker_failures >= 1")
        if isinstance(url_or_client, str):
            # no redis-py retries: a hanging server costs one timeout per call, then the breaker opens
            self._client = redis.Redis.from_url(url_or_client, socket_timeout=timeout_s,
                                                socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
            self._owns_client = True
        else:
            self._client = url_or_client
            self._owns_client = False
        self.ttl_ms = 0 if ttl_s is None else int(ttl_s * 1000)
        self.overhead_bytes = overhead_bytes
        self._prefix = prefix
        self._vprefix = f"{prefix}:{namespace}:"
        self._acct = [f"{prefix}:__sizes", f"{prefix}:__lru", f"{prefix}:__used", f"{prefix}:__clock"]
        self._breaker = pybreaker.CircuitBreaker(
            fail_max=breaker_failures, reset_timeout=breaker_reset_s,
            exclude=[lambda exc: not isinstance(exc, _DOWN)], name=f"{name}-breaker")
        self._put = self._client.register_script(scripts.PUT)
        self._get_script = self._client.register_script(scripts.GET)
        self._remove = self._client.register_script(scripts.REMOVE)
        self._repair = self._client.register_script(scripts.REPAIR)

    @property
    def client(self) -> redis.Redis:
        return self._client

    @property
    def circuit_open(self) -> bool:
        """Whether calls are being skipped now (the server hung or went away recently)."""
        return self._breaker.current_state == pybreaker.STATE_OPEN

    def vkey(self, key: str) -> str:
        """The Redis key holding ``key``'s value."""
        return self._vprefix + key

    # ---- guarded calls -------------------------------------------------------------------
    def _guarded(self, fn):
        """Run one Redis call through the circuit breaker; ``_Skipped`` while it is open. A
        connection error or timeout counts toward opening it; other errors do not."""
        try:
            return self._breaker.call(fn)
        except pybreaker.CircuitBreakerError as exc:
            with self._lock:
                self.stats.unavailable += 1
            cause = exc.__cause__ or exc.__context__
            raise _Skipped(f"server unavailable, circuit open ({cause or exc})") from None
        except _DOWN:
            with self._lock:
                self.stats.unavailable += 1
            raise

    def _call(self, fn, what: str):
        """A guarded Redis call; a Redis error becomes a warning and ``None`` (served as a miss)."""
        try:
            return self._guarded(fn)
        except redis.RedisError as exc:
            warnings.warn(f"{self.name}: {what} failed ({exc}); treated as a miss", RuntimeWarning, stacklevel=3)
            return None

    def _script(self, script, keys: list[str], args: list):
        """Run an accounting script; on a "malformed" answer repair once (warning) and rerun."""
        for attempt in range(2):
            out = self._guarded(lambda: script(keys=keys, args=args))
            if int(out[0]) != scripts.MALFORMED:
                return out
            why = out[-1].decode(errors="replace") if isinstance(out[-1], bytes) else str(out[-1])
            if attempt == 0:
                self.repair(why)
        raise _Malformed(why)

    def repair(self, why: str = "asked") -> list[str]:
        """Reset malformed shared accounting and reconcile it with the values present (one atomic
        script: it scans every key under the prefix, so it blocks the server for a moment)."""
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", self._prefix) + ":*"
        fixed = self._guarded(lambda: self._repair(
            keys=self._acct, args=[pattern, self._budget, self.overhead_bytes, f"{self._prefix}:__"]))
        fixed = [f.decode(errors="replace") if isinstance(f, bytes) else str(f) for f in fixed]
        with self._lock:
            self.stats.repairs += 1
        warnings.warn(f"{self.name}: shared accounting under {self._prefix!r} was malformed ({why}); repaired: "
                      f"{', '.join(fixed[:8]) or 'nothing else to fix'}", RuntimeWarning, stacklevel=3)
        return fixed

    # ---- accounting ----------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        try:
            raw = self._guarded(lambda: self._client.get(self._acct[2]))
        except redis.RedisError as exc:
            warnings.warn(f"{self.name}: cannot read usage ({exc})", RuntimeWarning, stacklevel=2)
            return 0
        try:
            return int(raw or 0)
        except ValueError:
            return 0  # malformed: the next script call repairs it

    def entry_bytes(self, key: str) -> int | None:
        size = self._call(lambda: self._client.hget(self._acct[0], self.vkey(key)), "size lookup")
        try:
            return None if size is None else int(size)
        except ValueError:
            return None

    def contains(self, key: str) -> bool:
        return bool(self._call(lambda: self._client.exists(self.vkey(key)), "exists"))

    def keys(self) -> list[str]:
        n = len(self._vprefix)
        found = self._call(lambda: list(self._client.zscan_iter(self._acct[1], match=self._vprefix + "*")), "scan")
        return [m.decode()[n:] for m, _ in (found or [])]

    # ---- reads ---------------------------------------------------------------------------
    def _get(self, key: str) -> KVEntry | None:
        try:
            out = self._script(self._get_script, [self.vkey(key), *self._acct], [])
        except _Malformed as exc:
            warnings.warn(f"{self.name}: get of {key} failed (accounting still malformed: {exc}); a miss",
                          RuntimeWarning, stacklevel=3)
            return None
        except redis.RedisError as exc:
            warnings.warn(f"{self.name}: get failed ({exc}); treated as a miss", RuntimeWarning, stacklevel=3)
            return None
        blob = out[1] if int(out[0]) == 1 and len(out) > 1 else None
        if not blob:
            return None
        try:
            return decode(blob, key, self.namespace)
        except CorruptCacheError as exc:
            self._discard_bad(key, exc)
            return None

    def _ranged(self, vkey: str):
        """``read_at`` over a value through guarded ``GETRANGE`` calls."""

        def read_at(offset: int, length: int) -> bytes:
            if length == 0:
                return b""
            return self._guarded(lambda: self._client.getrange(vkey, offset, offset + length - 1))

        return read_at

    def _read_header(self, key: str, *, extras: bool) -> tuple[EntryInfo, dict[str, torch.Tensor]] | None:
        """Header (and with ``extras`` the non-layered tensors) of ``key``'s value through
        ``GETRANGE``; K/V are not transferred. Does not touch the LRU time."""
        vkey = self.vkey(key)
        read_at = self._ranged(vkey)
        size = 0
        try:
            size = int(self._guarded(lambda: self._client.strlen(vkey)) or 0)
            if not size:
                return None
            header = read_header(read_at, size, key, self.namespace)
            tensors = decode_extras(header, read_at) if extras else {}
        except CorruptCacheError as exc:
            self._discard_bad(key, exc, size)
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
        size = int(size)
        read_at = self._ranged(vkey)
        try:
            header = read_header(read_at, size, key, self.namespace)
        except CorruptCacheError as exc:
            self._discard_bad(key, exc, size)
            return None
        except redis.RedisError as exc:
            warnings.warn(f"{self.name}: header read of {key} failed ({exc}); a miss", RuntimeWarning, stacklevel=2)
            return None
        with self._lock:
            self.stats.hits += 1
        return BlobSource(header, read_at, self.name, on_corrupt=lambda exc: self._discard_bad(key, exc, size))

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
            status, evicted, size = self._script(self._put, [self.vkey(prepared.key), *self._acct], args)[:3]
        except (redis.RedisError, _Malformed) as exc:
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
        try:
            existed = int(self._script(self._remove, [self.vkey(key), *self._acct], [])[0])
        except (redis.RedisError, _Malformed) as exc:
            warnings.warn(f"{self.name}: remove of {key} failed ({exc})", RuntimeWarning, stacklevel=2)
            return False
        if existed:
            with self._lock:
                self.stats.removes += 1
        return bool(existed)

    def _discard_bad(self, key: str, exc: CorruptCacheError, size: int | None = None) -> None:
        """Count a bad value and delete it. When the value read in pieces (``size`` bytes at
        first) is gone or changed meanwhile, another process evicted or rewrote it: a miss
        counted as ``vanished``, and nothing is deleted."""
        if size is not None:
            now = self._call(lambda: self._client.strlen(self.vkey(key)), "strlen")
            if now is None or int(now) != size:
                with self._lock:
                    self.stats.vanished += 1
                return
        kind = "foreign" if isinstance(exc, ForeignEntryError) else "corrupt"
        logger.warning("%s: %s value for %s removed (%s)", self.name, kind, key, exc)
        with self._lock:
            if kind == "foreign":
                self.stats.foreign += 1
            else:
                self.stats.corrupt += 1
        self.remove(key)

    def clear_namespace(self) -> int:
        """Remove every value of this namespace (tests, benchmarks); returns how many."""
        keys = self.keys()
        for key in keys:
            self.remove(key)
        return len(keys)

    def close(self) -> None:
        if self._owns_client:
            self._client.close()
