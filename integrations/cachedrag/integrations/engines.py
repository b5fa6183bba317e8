"""The process-wide engine registry: one ``CachedEngine`` (and so one chunk cache) per model.

Owns: ``shared_engine(model)``, which loads a model once per process and hands the same
engine to every LlamaIndex and LangChain class that names it, ``register_engine`` (make an
engine you built the shared one for a name, e.g. with a custom store or config), and
``engine_name`` (the name an engine is known by), and ``fidelity_engine`` (an engine at a fidelity
level on another engine's weights: the classes' ``fidelity=``). Names are canonical: ``None``,
``"default"`` and the default model's name are one key; an existing local path is keyed by
its absolute path; anything else (a Hugging Face id) by itself.

Does not own: loading weights (``cachedrag.model.loader``) or the engine itself.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

from cachedrag.model.loader import DEFAULT_MODEL

if TYPE_CHECKING:
    from cachedrag.engine import CachedEngine


class EngineRegistry:
    """Thread-safe map of canonical model name -> engine, loading on first use."""

    def __init__(self):
        self._engines: dict[str, CachedEngine] = {}
        # (id of the base engine, fidelity) -> (base, engine at that level): holding the base keeps its id unique
        self._levels: dict[tuple[int, str], tuple[CachedEngine, CachedEngine]] = {}
        self._lock = threading.Lock()

    def get(self, model: str | None = None) -> "CachedEngine":
        """The engine of ``model``, loading it the first time (under the lock: loaded once)."""
        name = canonical_name(model)
        with self._lock:
            engine = self._engines.get(name)
            if engine is None:
                from cachedrag.engine import CachedEngine

                engine = CachedEngine(model=None if name == DEFAULT_MODEL else name)
                self._engines[name] = engine
            return engine

    def at_level(self, engine: "CachedEngine", fidelity: str) -> "CachedEngine":
        """``engine`` itself when configured at ``fidelity``; else one engine per (engine, level) on
        its runner (the weights are not loaded again), configured at that level, with its own cache."""
        if engine.config.fidelity == fidelity:
            return engine
        with self._lock:
            key = (id(engine), fidelity)
            if key not in self._levels:
                from cachedrag.config import EngineConfig
                from cachedrag.engine import CachedEngine

                config = EngineConfig(fidelity=fidelity, cache_bytes=engine.config.cache_bytes)
                self._levels[key] = (engine, CachedEngine(engine.runner, config=config))
            return self._levels[key][1]

    def register(self, name: str, engine: "CachedEngine") -> None:
        """Make ``engine`` the shared engine of ``name`` (replacing any earlier one)."""
        with self._lock:
            self._engines[canonical_name(name)] = engine

    def name_of(self, engine: "CachedEngine") -> str | None:
        with self._lock:
            return next((n for n, e in self._engines.items() if e is engine), None)

    def remove(self, name: str) -> None:
        with self._lock:
            self._engines.pop(canonical_name(name), None)


def canonical_name(model: str | None) -> str:
    if model is None or model.lower() in (DEFAULT_MODEL.lower(), "default"):
        return DEFAULT_MODEL
    if os.path.exists(model):
        return os.path.abspath(model)
    return model


_REGISTRY = EngineRegistry()


def engine_registry() -> EngineRegistry:
    return _REGISTRY


def shared_engine(model: str | None = None) -> "CachedEngine":
    """The process-wide engine of ``model`` (HF id, local path, or None for the embedded default)."""
    return _REGISTRY.get(model)


def load_engine(model: str, share: bool, fidelity: str | None = None) -> "CachedEngine":
    """The engine an integration class uses: the process-wide one of ``model`` when ``share``,
    else a private engine of its own; with ``fidelity``, that engine at the level
    (``fidelity_engine``)."""
    if share:
        engine = shared_engine(model)
        return engine if fidelity is None else _REGISTRY.at_level(engine, fidelity)
    from cachedrag.config import EngineConfig
    from cachedrag.engine import CachedEngine

    config = EngineConfig(fidelity=fidelity) if fidelity is not None else None
    return CachedEngine(model=None if model == DEFAULT_MODEL else model, config=config)


def fidelity_engine(engine: "CachedEngine", fidelity: str) -> "CachedEngine":
    """``engine`` at the fidelity level ``fidelity`` (``FIDELITY_PRESETS``: exact, faithful, guarded,
    balanced, fast): itself when configured so, else an engine on the same runner at that level,
    with a chunk cache of its own, one per (engine, level) in the process."""
    return _REGISTRY.at_level(engine, fidelity)


def register_engine(name: str, engine: "CachedEngine") -> None:
    """Share ``engine`` under ``name``: classes constructed with ``model=name`` use it."""
    _REGISTRY.register(name, engine)


def engine_name(engine: "CachedEngine") -> str:
    """The registry name of ``engine``, else its weights' ``name_or_path``, else ``"custom"``."""
    name = _REGISTRY.name_of(engine)
    if name is not None:
        return name
    config = getattr(engine.runner.model, "config", None)
    return str(getattr(config, "name_or_path", "") or "custom")
