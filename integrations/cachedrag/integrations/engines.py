"""The process-wide engine registry: one ``CachedEngine`` (and so one chunk cache) per model.

Owns: ``shared_engine(model)``, which loads a model once per process and hands the same
engine to every LlamaIndex and LangChain class that names it, ``register_engine`` (make an
engine you built the shared one for a name, e.g. with a custom store or config), and
``engine_name`` (the name an engine is known by). Names are canonical: ``None``,
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


def load_engine(model: str, share: bool) -> "CachedEngine":
    """The engine an integration class uses: the process-wide one of ``model`` when ``share``,
    else a private engine of its own."""
    if share:
        return shared_engine(model)
    from cachedrag.engine import CachedEngine

    return CachedEngine(model=None if model == DEFAULT_MODEL else model)


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
