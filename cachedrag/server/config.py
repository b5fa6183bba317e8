"""Settings of ``cachedrag serve``, validated once.

Owns: ``SchedulerConfig`` (batching and admission order), ``PassageConfig`` (automatic chunk
detection) and ``ServerConfig`` (address, model name, mode, both of the above), and how a server's
flags become its engine's settings (``server_mode``, ``server_cache_config``, ``server_engine_config``: a
fidelity level's preset, then the flags given beside it). Does not own the engine settings themselves
(``cachedrag.config.EngineConfig``, ``FIDELITY_PRESETS``) or policy thresholds of the chunk cache.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from cachedrag.errors import ConfigError
from cachedrag.prompt.planning import PassageConfig  # noqa: F401  (ServerConfig.passages; defined with the planner)
from cachedrag.server.policy import MAX_DELAY_S, PREEMPT_RATIO


class SchedulerConfig(BaseModel):
    """How the engine loop batches and orders requests."""

    model_config = ConfigDict(frozen=True)

    max_batch: int = Field(8, ge=1, le=256, description="most requests decoding together (one batched forward)")
    max_waiting: int = Field(256, ge=1, description="most requests waiting for prefill; beyond it the server answers 503")
    order: Literal["fifo", "cache_aware"] = Field(
        "cache_aware", description="admission order: arrival, or RAGCache's cached/compute length ratio")
    starvation_s: float = Field(
        10.0, ge=0.0, description="a request waiting this long is admitted before any younger one (cache_aware)")
    max_delay_s: float | None = Field(
        MAX_DELAY_S, ge=0.0, description="cache_aware: a younger request goes ahead only while every waiting request is "
                                         "forecast to be admitted at most this much later than arrival order would "
                                         "admit it (None = no forecast bound)")
    max_overtakes: int | None = Field(
        None, ge=0, description="cache_aware: a request passed by this many younger ones is admitted before any "
                                "younger one (None = no cap; 0 = arrival order)")
    preempt_ratio: float = Field(
        PREEMPT_RATIO, ge=0.0, le=1.0,
        description="cache_aware: between the layers of a running prefill, the order's next waiting request, when "
                    "no older one waits, is prefilled first if its whole prefill is forecast to take at most this "
                    "fraction of what the running prefill has left (a mostly cached request does not wait behind a "
                    "cold one); at most one preemption per prefill; 0 = off")
    hold_waiting: bool = Field(
        True, description="while requests wait, the chunk cache evicts their chunks last (ChunkCacheManager.hold), "
                          "so a request finds what was cached when it arrived; matters when the cache budget is "
                          "below the working set")
    prefills_per_step: int = Field(
        1, ge=1, description="prefills admitted between two decode steps (more: better TTFT under bursts, "
                             "longer stalls of the running requests)")
    prefill_chunk_tokens: int = Field(
        256, ge=0, description="chunked prefill: after this many prompt tokens' worth of prefill compute (counted "
                               "per layer), the running requests get a decode step before the prefill goes on; "
                               "0 = a prefill runs to its end first")
    kv_pool_tokens: int = Field(
        0, ge=0, description="pooled KV: a running request whose buffer (prompt + max_tokens) fits this many "
                             "positions decodes from one shared slot tensor, so a batched step attends over "
                             "all such requests in one call over whole 512-key blocks (larger ones decode from "
                             "their own buffer); a request's answer does not depend on its batch-mates, but the "
                             "block-aligned call rounds apart from the runner's own step (CachedEngine.generate), "
                             "and it is no faster at batch 1-4; 0 = off, the default (docs/serving.md)")
    exact_when_waiting: int = Field(
        1, ge=0, description="with the tie guard during decoding at every token (tie_guard_decode=inf, fidelity "
                             "'faithful'), admit a request with prefix caching's exact prefill instead of an "
                             "approximate one while at least this many requests wait behind it: its answer would "
                             "be prefilled exactly before its second token anyway, and under a queue the second "
                             "prefill delays everyone waiting more than the earlier first token gains (0 = never; "
                             "docs/fidelity.md, round 23)")
    exact_whole_answers: bool = Field(
        True, description="with the tie guard during decoding at every token (tie_guard_decode=inf, fidelity "
                          "'faithful'), admit a non-streaming request (its answer is sent whole) with prefix "
                          "caching's exact prefill: nobody sees its first token early, and its answer would be "
                          "prefilled exactly before its second token anyway, so an approximate prefill first "
                          "would only add work (docs/fidelity.md, round 24)")
    trim_heap_idle_s: float | None = Field(
        1.0, ge=0.0, description="after this many seconds with nothing waiting, running or to promote, the loop "
                                 "returns the C heap's freed memory (finished requests' KV buffers) to the OS "
                                 "(glibc malloc_trim, ~40 ms per 0.5 GB; cachedrag.heap); None = never")


#: ``CacheConfig.exact_repeats_when`` of a server's engine: the loop computes exact-repeat promotions
#: only in idle time, which a loaded server lacks, so a sequence whose promotion has not landed is
#: prefilled exactly at its next sighting (docs/serving.md, "Exact repeats under load")
SERVER_EXACT_REPEATS_WHEN = "after_response_else_inline"


def server_cache_config(exact_repeats: int | None = None, exact_repeats_when: str | None = None,
                        tie_guard: float | None = None, tie_guard_trend: float | None = None,
                        tie_guard_floor: float | None = None, tie_guard_decode: float | None = None):
    """The ``CacheConfig`` of a server's engine (one process or each replica): ``exact_repeats``,
    ``tie_guard``, ``tie_guard_trend``, ``tie_guard_floor`` and ``tie_guard_decode`` None = the engine's defaults,
    ``exact_repeats_when`` None = ``SERVER_EXACT_REPEATS_WHEN``."""
    from cachedrag.kvcache.config import CacheConfig

    given = {"exact_repeats": exact_repeats, "tie_guard": tie_guard, "tie_guard_trend": tie_guard_trend,
             "tie_guard_floor": tie_guard_floor, "tie_guard_decode": tie_guard_decode}
    return CacheConfig(exact_repeats_when=exact_repeats_when or SERVER_EXACT_REPEATS_WHEN,
                       **{k: v for k, v in given.items() if v is not None})


#: ``cachedrag.config.FIDELITY_PRESETS``' levels, named here because importing that module loads torch
#: (argument parsing stays light; tests/server/test_cli.py keeps the two equal)
FIDELITY_LEVELS = ("exact", "faithful", "guarded", "balanced", "fast")


def server_mode(fidelity: str | None, mode: str | None) -> str:
    """The reuse mode a server (or each replica) runs: the fidelity level's (``FIDELITY_PRESETS``) when one
    is given, else ``mode`` (default ``"cachedrag"``). A ``mode`` that contradicts the level is refused."""
    if fidelity is None:
        return mode or "cachedrag"
    from cachedrag.config import FIDELITY_PRESETS

    if fidelity not in FIDELITY_PRESETS:
        raise ConfigError(f"bad fidelity {fidelity!r}: choose from {', '.join(FIDELITY_PRESETS)}")
    preset = FIDELITY_PRESETS[fidelity]["mode"]
    if mode is not None and mode != preset:
        raise ConfigError(f"--fidelity {fidelity} runs mode {preset}; drop --mode {mode} or the fidelity level")
    return preset


#: the tie-guard settings a server's flags and ``ReplicaSettings`` share (``CacheConfig`` fields, same names)
TIE_GUARD_FIELDS = ("tie_guard", "tie_guard_trend", "tie_guard_floor", "tie_guard_decode")


def tie_guard_settings(source) -> dict:
    """The tie-guard settings of ``source`` (``cachedrag serve``'s arguments or ``ReplicaSettings``; None:
    not given)."""
    return {name: getattr(source, name) for name in TIE_GUARD_FIELDS}


def server_engine_config(fidelity: str | None, mode: str | None, cache_bytes: int,
                         exact_repeats: int | None = None, exact_repeats_when: str | None = None,
                         guards: dict | None = None, cache=None, **overrides):
    """The ``EngineConfig`` of a server's engine (one process or each replica): ``cache`` (default
    ``server_cache_config`` of the exact-repeat settings and ``guards``, the tie-guard settings given) under
    the fidelity level's preset, then ``guards`` again, which win over the preset's. ``ConfigError`` if bad."""
    import dataclasses

    from cachedrag.config import EngineConfig

    guards = guards or {}
    if cache is None:
        cache = server_cache_config(exact_repeats, exact_repeats_when, **guards)
    try:
        config = EngineConfig(fidelity=fidelity, mode=server_mode(fidelity, mode), cache_bytes=cache_bytes,
                              cache=cache, **overrides)
        given = {k: v for k, v in guards.items() if v is not None}
        if given and fidelity is not None:
            config = config.model_copy(update={"cache": dataclasses.replace(config.cache, **given)})
    except ValueError as exc:
        raise ConfigError(f"bad engine setting: {exc}") from None
    return config


class ServerConfig(BaseModel):
    """Everything ``cachedrag serve`` takes."""

    model_config = ConfigDict(frozen=True)

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="TCP port (0 = any free port)")
    model_name: str = Field("SmolLM2-135M-Instruct", description="the model id /v1/models lists and requests name")
    mode: Literal["cachedrag", "prefix", "full"] = Field("cachedrag", description="chunk reuse mode of every request")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    passages: PassageConfig = Field(default_factory=PassageConfig)
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request gives none")
    index: str | None = Field(None, description="an index directory (``cachedrag index``): /v1/embeddings embeds "
                                                "with its embedder, loaded on the first embeddings request")
    api_key: SecretStr | None = Field(None, description="when set, every /v1 route needs 'Authorization: Bearer "
                                                        "<key>' (401 otherwise); /health and /metrics stay open")
