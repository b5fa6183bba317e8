"""Shared pieces of the fault-injection suite: the tiny engine, requests, reference answers.

Every fault test compares answers with a full recompute on the same tiny random model
(``mode="full"``: no cache involved), in ``prefix`` mode, where exact-prefix reuse must equal
full prefill bit for bit up to float noise; so any wrong use of a damaged or crafted cache
entry shows up as different tokens.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from cachedrag.config import EngineConfig
from cachedrag.engine import CachedEngine
from cachedrag.fingerprint import namespace_for
from cachedrag.store.config import StoreConfig
from cachedrag.store.tiered import TieredStore

SYSTEM = "You answer from the documents."
_rng = random.Random(11)
DOCS = [f"Doc {i}: " + " ".join(_rng.choice(["red", "blue", "green", "cyan", "gold", "pink"]) for _ in range(7))
        for i in range(6)]
REQUESTS = [([DOCS[0], DOCS[1]], "Which colors?"), ([DOCS[2], DOCS[3]], "Any gold?"),
            ([DOCS[4], DOCS[5], DOCS[0]], "Count them.")]
MAX_NEW = 3


def config(mode: str = "prefix", **kw) -> EngineConfig:
    # a cached entry is always worth waiting for (the tiny model recomputes faster than it loads)
    return EngineConfig(mode=mode, break_even_factor=1e6, **kw)


def namespace(runner) -> str:
    return namespace_for(runner.model, runner.tokenizer, None).digest


def engine_on(runner, store_kwargs: dict, mode: str = "prefix", **kw) -> tuple[CachedEngine, TieredStore]:
    store = TieredStore.from_config(StoreConfig(namespace=namespace(runner), **store_kwargs))
    return CachedEngine(runner, config=config(mode, **kw), store=store), store


def ask(engine: CachedEngine, request):
    chunks, question = request
    return engine.generate(chunks, question, SYSTEM, max_new_tokens=MAX_NEW)


def reference(runner) -> list[list[int]]:
    """Token ids of a full recompute of every request (no cache)."""
    full = CachedEngine(runner, config=config("full"))
    return [ask(full, r).token_ids for r in REQUESTS]


def tree(directory: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``directory`` (not following symlinks) -> (mode, size)."""
    out = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            p = os.path.join(root, name)
            st = os.lstat(p)
            out[os.path.relpath(p, directory)] = (st.st_mode, st.st_size)
    return out
