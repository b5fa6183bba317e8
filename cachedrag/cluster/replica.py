"""One replica's engine: its own fast tiers plus the cluster's shared Redis tier.

Owns: ``ReplicaSettings`` (validated settings of every replica of a deployment: model, reuse
mode, per-replica budgets, the shared Redis tier), ``build_replica_engine`` (model -> runner ->
``TieredStore`` of a CPU tier within the replica's budget and, when a Redis URL is given, the
shared Redis tier written through, so what one replica computes is readable by all) and
``SharedCacheSync``, which keeps a replica's chunk-cache manager aware of entries the *other*
replicas wrote (``ChunkCacheManager.refresh``, rate-limited, off the request path on a
transient thread).

Does not own: Ray (``cachedrag.cluster.deployment``), the HTTP app or the engine loop
(``cachedrag.server``), the tiers themselves (``cachedrag.store``).

Placement stays within each replica's budgets: the CPU tier is capped by ``cache_gb`` (the
store demotes to Redis before it deletes), and the Redis tier's byte budget (``redis_gb``) is
one budget for the whole cluster, enforced atomically by the Redis tier's scripts.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from cachedrag.errors import ConfigError
from cachedrag.kvcache.config import EXACT_REPEAT_TIMINGS
from cachedrag.server.config import (
    FIDELITY_LEVELS,
    SERVER_EXACT_REPEATS_WHEN,
    PassageConfig,
    SchedulerConfig,
    server_mode,
)

log = logging.getLogger("cachedrag.cluster")

GB = 1 << 30


class ReplicaSettings(BaseModel):
    """What every replica of a cluster deployment is built from (picklable, validated)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str | None = Field(None, description="HF model id or path; None = the embedded SmolLM2-135M-Instruct")
    tiny: bool = Field(False, description="a tiny random-weight model (tests, smoke checks)")
    served_model_name: str | None = Field(None, description="the id clients send as `model`")
    mode: Literal["cachedrag", "prefix", "full"] | None = Field(
        None, description="chunk reuse mode (None: cachedrag, or the fidelity level's)")
    fidelity: Literal[FIDELITY_LEVELS] | None = Field(  # type: ignore[valid-type]
        None, description="a fidelity level (cachedrag.config.FIDELITY_PRESETS) of each replica's engine: its mode "
                          "and recompute policy; the tie_guard* fields given beside it win over its values")
    cache_gb: float = Field(2.0, gt=0, description="this replica's in-memory chunk-cache budget (GB)")
    redis_url: str | None = Field(None, description="shared Redis tier (redis://host:port/db); None = no sharing")
    redis_gb: float = Field(4.0, gt=0, description="the Redis tier's budget (GB), shared by all replicas")
    redis_prefix: str = Field("cachedrag", min_length=1, description="Redis key prefix of the shared tier")
    refresh_s: float = Field(1.0, ge=0, description="adopt entries other replicas wrote at most this often (s)")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig,
                                       description="how each replica's engine loop batches and orders its requests, "
                                                   "as in one server (max_batch, max_waiting, order and its bounds, "
                                                   "chunked prefill, pooled KV, heap trimming)")
    exact_repeats: int | None = Field(None, ge=0, description="CacheConfig.exact_repeats of each replica's engine "
                                                              "(None = the engine's default)")
    exact_repeats_when: Literal[EXACT_REPEAT_TIMINGS] = Field(  # type: ignore[valid-type]
        SERVER_EXACT_REPEATS_WHEN, description="CacheConfig.exact_repeats_when (default: as one server)")
    tie_guard: float | None = Field(None, ge=0, allow_inf_nan=False,
                                    description="CacheConfig.tie_guard of each replica's engine (None = the "
                                                "engine's default, off)")
    tie_guard_trend: float | None = Field(None, ge=0, allow_inf_nan=False,
                                          description="CacheConfig.tie_guard_trend of each replica's engine (None "
                                                      "= the engine's default, off)")
    tie_guard_floor: float | None = Field(None, ge=0, allow_inf_nan=False,
                                          description="CacheConfig.tie_guard_floor of each replica's engine (None "
                                                      "= the engine's default, 0)")
    tie_guard_decode: float | None = Field(None, ge=0, allow_inf_nan=True,  # inf: switch before every 2nd token
                                           description="CacheConfig.tie_guard_decode of each replica's engine (None "
                                                       "= the engine's default, off)")
    passages: PassageConfig = Field(default_factory=PassageConfig,
                                    description="how request text becomes segments, as in one server: automatic "
                                                "chunk detection (its min_chars also fingerprints requests for the "
                                                "affinity router), separators, tokenisation")
    max_tokens: int = Field(256, ge=1, description="max_tokens when a request gives none")
    api_key: SecretStr | None = Field(None, description="every replica's app requires it on /v1 routes (the ingress "
                                                        "forwards the client's Authorization header)")
    threads: int | None = Field(None, ge=1, description="torch threads per replica (None = torch's default)")
    engine_overrides: dict = Field(default_factory=dict, description="extra EngineConfig fields (advanced)")

    @model_validator(mode="after")
    def _mode_fits_fidelity(self):
        try:
            server_mode(self.fidelity, self.mode)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return self

    @property
    def reuse_mode(self) -> str:
        """The chunk reuse mode every replica runs (``mode``, or the fidelity level's)."""
        return server_mode(self.fidelity, self.mode)

    @property
    def model_name(self) -> str:
        return self.served_model_name or ("tiny-random" if self.tiny else (self.model or "SmolLM2-135M-Instruct"))


def build_replica_engine(settings: ReplicaSettings, runner=None):
    """The ``CachedEngine`` of one replica (CPU tier + optional shared Redis tier); ``runner``:
    reuse a loaded model (benchmarks running several engines in one process)."""
    import torch

    from cachedrag.engine import CachedEngine
    from cachedrag.fingerprint import namespace_for
    from cachedrag.model.runner import ModelRunner
    from cachedrag.server.config import server_engine_config, tie_guard_settings
    from cachedrag.store.config import StoreConfig
    from cachedrag.store.tiered import TieredStore

    if settings.threads:
        torch.set_num_threads(settings.threads)
    if runner is not None:
        pass
    elif settings.tiny:
        from cachedrag.testing import tiny_runner

        runner = tiny_runner()
    else:
        from cachedrag.model.loader import load_model

        runner = ModelRunner(*load_model(settings.model))
    config = server_engine_config(settings.fidelity, settings.mode, int(settings.cache_gb * GB),
                                  settings.exact_repeats, settings.exact_repeats_when, tie_guard_settings(settings),
                                  **settings.engine_overrides)
    if settings.redis_url is None:
        return CachedEngine(runner, config=config)
    ns = namespace_for(runner.model, runner.tokenizer).digest
    store = TieredStore.from_config(StoreConfig(
        namespace=ns, cpu_bytes=int(settings.cache_gb * GB), redis_url=settings.redis_url,
        redis_bytes=int(settings.redis_gb * GB), redis_prefix=settings.redis_prefix, write_through=True))
    return CachedEngine(runner, config=config, store=store)


class SharedCacheSync:
    """Adopts chunk caches other replicas wrote to the shared tier, at most every ``interval_s``.

    ``poke()`` is cheap and non-blocking (call it per request): when the last refresh is older
    than the interval and none is running, one ``manager.refresh()`` starts on a transient
    thread (it reads entry headers from Redis, never K/V). A request that arrives before the
    refresh finishes simply misses those chunks (computes them) — never a wrong answer.
    ``refresh_now()`` runs one synchronously (tests, startup)."""

    def __init__(self, manager, interval_s: float = 1.0):
        from cachedrag.executor import TransientThreadExecutor

        self.manager = manager
        self.interval_s = interval_s
        self.shared = bool(getattr(manager, "features", None) and manager.features.shared)
        self._executor = TransientThreadExecutor(1, "cachedrag-shared-sync")
        self._lock = threading.Lock()
        self._running = False
        self._last: float | None = None  # monotonic time the last refresh ended
        self.refreshes = 0
        self.adopted = 0
        self.errors = 0

    def poke(self) -> bool:
        """Start a background refresh if one is due; returns whether one started."""
        if not self.shared:
            return False
        with self._lock:
            if self._running or (self._last is not None and time.monotonic() - self._last < self.interval_s):
                return False
            self._running = True
        self._executor.submit(self._run)
        return True

    def refresh_now(self) -> int:
        """One refresh on this thread; returns how many entries were adopted."""
        with self._lock:
            self._running = True
        return self._run()

    def _run(self) -> int:
        try:
            report = self.manager.refresh()
            n = report.tree_nodes + report.variants
            self.adopted += n
            self.refreshes += 1
            return n
        except Exception as exc:  # a refresh is an optimisation: log it, keep serving
            self.errors += 1
            log.warning("shared-cache refresh failed: %r", exc)
            return 0
        finally:
            with self._lock:
                self._running = False
                self._last = time.monotonic()

    def stats(self) -> dict:
        return {"refreshes": self.refreshes, "adopted": self.adopted, "errors": self.errors}

    def close(self) -> None:
        self._executor.shutdown(wait=True)
