"""Settings of ``cachedrag serve``, validated once.

Owns: ``SchedulerConfig`` (batching and admission order), ``ServerConfig`` (address, model name,
mode, the scheduler and the automatic chunk detection's ``PassageConfig``, which
``cachedrag.prompt.planning`` defines), ``EngineSettings``
(what a server's engine is built from: model, numerics, fidelity level and the fields beside it,
chunk-cache tiers), ``ServeSettings`` (what ``cachedrag serve --config FILE`` holds: a
``ServerConfig`` and an ``EngineSettings``), how a server's engine settings become its
``EngineConfig`` (``server_mode``, ``server_engine_config``: a fidelity level's preset, then the
exact-fallback settings given beside it, ``ExactSettings``), and the mapping between ``cachedrag serve``'s
parsed arguments and these models (``scheduler_config``, ``passage_config``, ``engine_settings``,
``server_config`` one way, ``flag_values`` of a config file the other). Replicas of a cluster are
built from the same models (``cachedrag.cluster.replica.ReplicaSettings``).

Does not own the engine settings themselves (``cachedrag.config.EngineConfig``,
``FIDELITY_PRESETS``), policy thresholds of the chunk cache, or the argument parser
(``cachedrag.server.cli``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from cachedrag.errors import ConfigError
from cachedrag.kvcache.config import EXACT_REPEAT_TIMINGS
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
    exact_when_waiting: int = Field(
        1, ge=0, description="with the tie guard during decoding at every token (tie_guard_decode=inf, fidelity "
                             "'faithful'), admit a request with prefix caching's exact prefill instead of an "
                             "approximate one while at least this many requests wait behind it: its answer would "
                             "be prefilled exactly before its second token anyway, and under a queue the second "
                             "prefill delays everyone waiting more than the earlier first token gains (0 = never; "
                             "docs/notes/fidelity.md, round 23)")
    exact_whole_answers: bool = Field(
        True, description="with the tie guard during decoding at every token (tie_guard_decode=inf, fidelity "
                          "'faithful'), admit a non-streaming request (its answer is sent whole) with prefix "
                          "caching's exact prefill: nobody sees its first token early, and its answer would be "
                          "prefilled exactly before its second token anyway, so an approximate prefill first "
                          "would only add work (docs/notes/fidelity.md, round 24)")
    trim_heap_idle_s: float | None = Field(
        1.0, ge=0.0, description="after this many seconds with nothing waiting, running or to promote, the loop "
                                 "returns the C heap's freed memory (finished requests' KV buffers) to the OS "
                                 "(glibc malloc_trim, ~40 ms per 0.5 GB; cachedrag.heap); None = never")


#: ``CacheConfig.exact.repeats_when`` of a server's engine: the loop computes exact-repeat promotions
#: only in idle time, which a loaded server lacks, so a sequence whose promotion has not landed is
#: prefilled exactly at its next sighting (docs/serving.md, "Exact repeats under load")
SERVER_EXACT_REPEATS_WHEN = "after_response_else_inline"


class ExactSettings(BaseModel):
    """The exact fallbacks of a server's engine (``CacheConfig.exact``, same field names); None = the
    engine's default (or the fidelity level's, for the tie guards)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    repeats: int | None = Field(None, ge=0, description="CacheConfig.exact.repeats (None = the engine's default)")
    repeats_when: Literal[EXACT_REPEAT_TIMINGS] = Field(  # type: ignore[valid-type]
        SERVER_EXACT_REPEATS_WHEN, description="CacheConfig.exact.repeats_when (a server's default: in idle time, "
                                               "else inline at the next sighting)")
    tie_guard: float | None = Field(None, ge=0, allow_inf_nan=False,
                                    description="CacheConfig.exact.tie_guard (None = the engine's default, off)")
    tie_guard_decode: float | None = Field(None, ge=0, allow_inf_nan=True,  # inf: switch before every 2nd token
                                           description="CacheConfig.exact.tie_guard_decode (None = the engine's "
                                                       "default, off)")

    def given(self) -> dict:
        """The fields set to a value (``CacheConfig.exact`` updates)."""
        return {name: value for name, value in self.model_dump().items() if value is not None}


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


def server_engine_config(fidelity: str | None, mode: str | None, cache_bytes: int,
                         exact: ExactSettings | None = None, cache=None, **overrides):
    """The ``EngineConfig`` of a server's engine (one process or each replica): ``cache`` (default: the
    engine's ``CacheConfig`` with the ``exact`` settings given) under the fidelity level's preset, then the
    ``exact`` settings again, which win over the preset's. ``ConfigError`` if bad."""
    from cachedrag.config import EngineConfig
    from cachedrag.kvcache.config import CacheConfig

    given = (exact or ExactSettings()).given()
    try:
        if cache is None:
            cache = CacheConfig().replace(exact=given)
        config = EngineConfig(fidelity=fidelity, mode=server_mode(fidelity, mode), cache_bytes=cache_bytes,
                              cache=cache, **overrides)
        if fidelity is not None:
            config = config.model_copy(update={"cache": config.cache.replace(exact=given)})
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
    index: str | None = Field(None, description="an index directory (``cachedrag index``): its chunks are known "
                                                "passages from the start (found whole in prompts and tool results); "
                                                "/v1/embeddings embeds with its embedder, loaded on the first "
                                                "embeddings request")
    api_key: SecretStr | None = Field(None, description="when set, every /v1 route needs 'Authorization: Bearer "
                                                        "<key>' (401 otherwise); /health and /metrics stay open")


#: ``EngineSettings`` fields only one server process honours, with their defaults: replicas load the
#: model's float32 dense weights on the CPU and share the Redis tier
SINGLE_PROCESS_ONLY = {"device": "auto", "dtype": None, "weights": "dense", "prefill_pairs": "scores",
                       "disk_dir": None}


#: former flat ``EngineSettings`` fields -> their ``ExactSettings`` names (and ``cachedrag serve``'s
#: argument destinations of those)
FLAT_EXACT_NAMES = {"exact_repeats": "repeats", "exact_repeats_when": "repeats_when", "tie_guard": "tie_guard",
                    "tie_guard_decode": "tie_guard_decode"}


class EngineSettings(BaseModel):
    """What a server's engine is built from (one process, or each replica of a cluster): the model
    and its numerics, the reuse policy (a fidelity level, then the fields given beside it, which win
    over its values) and the chunk-cache tiers. ``engine_config`` turns it into an ``EngineConfig``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str | None = Field(None, description="HF model id, path or .gguf file; None = the embedded "
                              "SmolLM2-135M-Instruct")
    tiny: bool = Field(False, description="a tiny random-weight model (tests, smoke checks)")
    mode: Literal["cachedrag", "prefix", "full"] | None = Field(
        None, description="chunk reuse mode (None: cachedrag, or the fidelity level's)")
    fidelity: Literal[FIDELITY_LEVELS] | None = Field(  # type: ignore[valid-type]
        None, description="a fidelity level (cachedrag.config.FIDELITY_PRESETS): the mode and recompute policy; "
                          "the exact.tie_guard* fields given beside it win over its values")
    device: str = Field("auto", description="auto (CUDA where present), cpu, cuda or cuda:N")
    dtype: Literal["float32", "bfloat16"] | None = Field(
        None, description="activations, working KV and dense weights (None: float32; bfloat16 with int8/int4)")
    weights: Literal["dense", "int8", "int8-dynamic", "int4"] = Field("dense", description="weight format")
    threads: int | None = Field(None, description="torch intra-op threads (None: the cores this process may use)")
    prefill_pairs: Literal["scores", "scores+values", "none"] = Field(
        "scores", description="bf16 prefill attention on AVX512-BF16 CPUs (docs/speed.md)")
    cache_gb: float = Field(2.0, ge=0, allow_inf_nan=False, description="in-memory chunk-cache budget (GB)")
    disk_dir: str | None = Field(None, description="a disk tier in this directory (persists across restarts)")
    disk_gb: float = Field(10.0, ge=0, allow_inf_nan=False, description="disk tier budget (GB) with disk_dir")
    redis_url: str | None = Field(None, description="a shared Redis tier (redis://host:port/db)")
    redis_gb: float = Field(4.0, gt=0, allow_inf_nan=False, description="Redis tier budget (GB), one for all "
                                                                         "processes sharing it")
    exact: ExactSettings = Field(default_factory=ExactSettings,
                                 description="exact fallbacks: tie guards and exact repeats (CacheConfig.exact)")

    @model_validator(mode="before")
    @classmethod
    def _no_flat_exact_names(cls, data):
        if isinstance(data, dict):
            for name, new in FLAT_EXACT_NAMES.items():
                if name in data:
                    raise ValueError(f"{name} is now exact.{new} (nested: {{\"exact\": {{\"{new}\": ...}}}}; "
                                     "in TOML an [engine.exact] table)")
        return data

    @model_validator(mode="after")
    def _mode_fits_fidelity(self):
        try:
            server_mode(self.fidelity, self.mode)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return self

    @property
    def reuse_mode(self) -> str:
        """The chunk reuse mode the engine runs (``mode``, or the fidelity level's)."""
        return server_mode(self.fidelity, self.mode)

    @property
    def model_name(self) -> str:
        """The id a server lists for this model when no other is given."""
        return "tiny-random" if self.tiny else (self.model or "SmolLM2-135M-Instruct")

    def engine_config(self, **overrides):
        """The ``EngineConfig`` (``server_engine_config``); ``overrides``: extra ``EngineConfig`` fields."""
        return server_engine_config(self.fidelity, self.mode, int(self.cache_gb * (1 << 30)), self.exact,
                                    **overrides)


class ServeSettings(BaseModel):
    """What ``cachedrag serve --config FILE`` holds (JSON, or TOML on Python >= 3.11): a ``server``
    table (``ServerConfig``: address, model name, default max_tokens, API key, and its ``scheduler``
    and ``passages`` tables) and an ``engine`` table (``EngineSettings``). Flags given on the
    command line win over the file. The server's ``mode`` is the engine's (``engine.mode`` or
    ``engine.fidelity``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    server: ServerConfig = Field(default_factory=ServerConfig)
    engine: EngineSettings = Field(default_factory=EngineSettings)

    @model_validator(mode="after")
    def _mode_is_the_engines(self):
        if "mode" in self.server.model_fields_set:
            raise ValueError("server.mode is the engine's: set engine.mode or engine.fidelity")
        return self


def _bound(seconds: float | None) -> float | None:
    return None if seconds is None or seconds == math.inf else seconds


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    """The ``SchedulerConfig`` of ``cachedrag serve``'s arguments (one server or every replica)."""
    return SchedulerConfig(max_batch=args.max_batch, max_waiting=args.max_waiting, order=args.order,
                           starvation_s=args.starvation_s, max_overtakes=args.max_overtakes,
                           max_delay_s=_bound(args.max_delay_s), preempt_ratio=args.preempt_ratio,
                           hold_waiting=args.hold_waiting, prefills_per_step=args.prefills_per_step,
                           prefill_chunk_tokens=args.prefill_chunk_tokens, exact_when_waiting=args.exact_when_waiting,
                           exact_whole_answers=args.exact_whole_answers,
                           trim_heap_idle_s=_bound(args.trim_heap_idle_s))


def passage_config(args: argparse.Namespace) -> PassageConfig:
    """The ``PassageConfig`` of ``cachedrag serve``'s arguments (one server or every replica)."""
    return PassageConfig(enabled=not args.no_auto_chunks, min_chars=args.passage_chars,
                         capacity=args.passage_capacity, attach_separators=args.attach_separators,
                         tokenization=args.tokenization)


def engine_settings(args: argparse.Namespace, **update) -> EngineSettings:
    """The ``EngineSettings`` of ``cachedrag serve``'s arguments; ``update``: fields set otherwise
    (a cluster's Redis URL)."""
    values = {name: getattr(args, name) for name in EngineSettings.model_fields if name != "exact"}
    exact = {new: getattr(args, dest) for dest, new in FLAT_EXACT_NAMES.items()}
    if exact["repeats_when"] is None:
        exact["repeats_when"] = SERVER_EXACT_REPEATS_WHEN
    return EngineSettings(**{**values, "exact": exact, **update})  # validated there: errors name exact.<field>


def server_config(args: argparse.Namespace, engine: EngineSettings) -> ServerConfig:
    """The ``ServerConfig`` of ``cachedrag serve``'s arguments, for a server running ``engine``."""
    index = getattr(args, "index", None)
    if index is not None and not Path(index).is_dir():
        raise ConfigError(f"--index {index}: no such index directory (build one with `cachedrag index build`)")
    return ServerConfig(host=args.host, port=args.port, model_name=args.served_model_name or engine.model_name,
                        mode=engine.reuse_mode, scheduler=scheduler_config(args), passages=passage_config(args),
                        default_max_tokens=args.max_tokens, index=index, api_key=args.api_key)


#: ``ServerConfig`` fields whose flag is named otherwise (the rest: the same name)
_SERVER_FLAGS = {"model_name": "served_model_name", "default_max_tokens": "max_tokens"}
#: ``PassageConfig`` fields -> (flag destination, value of the flag for the field's value)
_PASSAGE_FLAGS = {"enabled": ("no_auto_chunks", lambda v: not v), "min_chars": ("passage_chars", None),
                  "capacity": ("passage_capacity", None)}


def flag_values(settings: ServeSettings) -> dict:
    """The ``cachedrag serve`` argument values (destination -> value) of what ``settings`` set
    explicitly (fields left out of a config file keep their flags' defaults)."""
    data = settings.model_dump(exclude_unset=True)
    server = data.get("server", {})
    out = dict(data.get("engine", {}))
    exact = {new: dest for dest, new in FLAT_EXACT_NAMES.items()}
    out.update({exact[name]: value for name, value in out.pop("exact", {}).items()})
    for name, value in server.get("scheduler", {}).items():
        out[name] = math.inf if value is None and name in ("max_delay_s", "trim_heap_idle_s") else value
    for name, value in server.get("passages", {}).items():
        dest, convert = _PASSAGE_FLAGS.get(name, (name, None))
        out[dest] = convert(value) if convert else value
    for name, value in server.items():
        if name not in ("scheduler", "passages"):
            out[_SERVER_FLAGS.get(name, name)] = value.get_secret_value() if isinstance(value, SecretStr) else value
    return out


def first_error(exc: ValueError) -> str:
    """One line for a settings error: a pydantic error's first problem as ``field.path: message``."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    first = errors()[0]
    where = ".".join(str(x) for x in first.get("loc", ()))
    msg = str(first.get("msg")).removeprefix("Value error, ")
    return f"{where}: {msg}" if where else msg


def load_serve_file(path: str) -> ServeSettings:
    """Read and validate a config file (``ServeSettings``); ``ConfigError`` with one line if it is
    unreadable, not JSON/TOML, or holds a bad or unknown setting."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror or exc}") from None
    toml = file.suffix.lower() == ".toml"  # anything else is read as JSON
    if toml and sys.version_info < (3, 11):
        raise ConfigError(f"config file {path}: TOML needs Python 3.11 or later; use JSON")
    try:
        if toml:
            import tomllib

            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except ValueError as exc:  # json.JSONDecodeError and tomllib.TOMLDecodeError
        raise ConfigError(f"config file {path}: not valid {'TOML' if toml else 'JSON'}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a table of settings, got {type(data).__name__}")
    try:
        return ServeSettings.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"config file {path}: {first_error(exc)}") from None
