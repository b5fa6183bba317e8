"""One replica's engine: its own fast tiers plus the cluster's shared Redis tier.

Owns: ``ReplicaSettings`` (validated settings of every replica of a deployment, composed of one
server's ``EngineSettings`` and ``ServerConfig``: model, reuse mode, per-replica budgets, the shared
Redis tier, scheduler and passages), ``build_replica_engine`` (model -> runner ->
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

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cachedrag.server.config import SINGLE_PROCESS_ONLY, EngineSettings, ServerConfig

log = logging.getLogger("cachedrag.cluster")

GB = 1 << 30


class ReplicaSettings(BaseModel):
    """What every replica of a cluster deployment is built from (picklable, validated): one server's
    engine settings and server settings, plus the shared tier's key prefix and refresh rate."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: EngineSettings = Field(default_factory=EngineSettings,
                                   description="each replica's engine, as one server's (its redis_url: the shared "
                                               "tier, None = no sharing; redis_gb: that tier's budget for all "
                                               "replicas); replicas run the model's float32 dense weights on the CPU")
    server: ServerConfig = Field(default_factory=ServerConfig,
                                 description="each replica's app, as one server's: scheduler, passages (their "
                                             "min_chars also fingerprints requests for the affinity router), "
                                             "default max_tokens, API key; host and port are the ingress's, the "
                                             "mode the engine's, and model_name (unless given) the engine's model")
    redis_prefix: str = Field("cachedrag", min_length=1, description="Redis key prefix of the shared tier")
    refresh_s: float = Field(1.0, ge=0, description="adopt entries other replicas wrote at most this often (s)")
    engine_overrides: dict = Field(default_factory=dict, description="extra EngineConfig fields (advanced)")

    @model_validator(mode="after")
    def _one_process_settings_stay_default(self):
        given = sorted(name for name, default in SINGLE_PROCESS_ONLY.items() if getattr(self.engine, name) != default)
        if given:
            raise ValueError(f"engine.{', engine.'.join(given)}: only one server process honours this; replicas run "
                             "the model's float32 dense weights on the CPU and share the Redis tier")
        return self

    @property
    def server_config(self) -> ServerConfig:
        """The ``ServerConfig`` of each replica's app: ``server`` with the engine's reuse mode and, unless
        given, its model name."""
        update = {"mode": self.engine.reuse_mode}
        if "model_name" not in self.server.model_fields_set:
            update["model_name"] = self.engine.model_name
        return self.server.model_copy(update=update)


def build_replica_engine(settings: ReplicaSettings, runner=None):
    """The ``CachedEngine`` of one replica (CPU tier + optional shared Redis tier); ``runner``:
    reuse a loaded model (benchmarks running several engines in one process)."""
    import torch

    from cachedrag.engine import CachedEngine
    from cachedrag.fingerprint import namespace_for
    from cachedrag.model.runner import ModelRunner
    from cachedrag.store.config import StoreConfig
    from cachedrag.store.tiered import TieredStore

    engine = settings.engine
    if engine.threads:
        torch.set_num_threads(engine.threads)
    if runner is not None:
        pass
    elif engine.tiny:
        from cachedrag.testing import tiny_runner

        runner = tiny_runner()
    else:
        from cachedrag.model.loader import load_model

        runner = ModelRunner(*load_model(engine.model))
    config = engine.engine_config(**settings.engine_overrides)
    if engine.redis_url is None:
        return CachedEngine(runner, config=config)
    ns = namespace_for(runner.model, runner.tokenizer).digest
    store = TieredStore.from_config(StoreConfig(
        namespace=ns, cpu_bytes=int(engine.cache_gb * GB), redis_url=engine.redis_url,
        redis_bytes=int(engine.redis_gb * GB), redis_prefix=settings.redis_prefix, write_through=True))
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
