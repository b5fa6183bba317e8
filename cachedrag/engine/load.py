"""Loading a plan's cached KV into a request's working buffer: tree and variant entries read whole
or through layer-wise loaders that read ahead while layers compute, raw K re-rotated to the new
positions (``ModelRunner.write_rotated*``), and the load-vs-recompute cost model (``LoadCosts``:
measured per-layer prefill and load times, the preload depth, the break-even wait).

Contract: an entry that is missing, damaged, of the wrong shape, or not ready before recomputing
it would be faster is a miss: its segment is computed fresh and a note says why. A wrong-shaped
entry is invalidated in the cache. A committed layer-wise load that fails mid-prefill raises
``_LoadFailed`` (the engine restarts the prefill with that segment fresh)."""

from __future__ import annotations

import time

import torch

from cachedrag.kvcache.planner import Action
from cachedrag.model.runner import KVBuffer
from cachedrag.engine.state import _LoadFailed


class LoadCosts:
    """Measured costs (exponential moving averages): one token through one layer, one layer of a
    prefill, one layer of a layer-wise load. They set the preload depth and the break-even time
    after which waiting for a load is slower than recomputing its segment."""

    def __init__(self):
        self.t_token_layer: float | None = None
        self.t_prefill_layer: float | None = None
        self.t_load_layer: float | None = None

    def preload_depth(self, n_layers: int) -> int | None:
        from cachedrag.store.preload import preload_depth

        if self.t_prefill_layer is None or self.t_load_layer is None:
            return None
        return preload_depth(n_layers, self.t_prefill_layer, self.t_load_layer)

    def break_even_s(self, n_tokens: int, n_layers: int, factor: float) -> float:
        """Estimated time to recompute ``n_tokens`` through every layer (measured throughput)."""
        per = self.t_token_layer if self.t_token_layer is not None else 1e-3
        return factor * per * n_tokens * n_layers

    def observe_prefill(self, seconds: float, token_layers: int, n_layers: int) -> None:
        if token_layers <= 0:
            return
        per, layer = seconds / token_layers, seconds / n_layers
        self.t_token_layer = per if self.t_token_layer is None else 0.8 * self.t_token_layer + 0.2 * per
        self.t_prefill_layer = layer if self.t_prefill_layer is None else 0.8 * self.t_prefill_layer + 0.2 * layer

    def observe_load(self, loader) -> None:
        t = loader.mean_layer_seconds
        if t is not None:
            self.t_load_layer = t if self.t_load_layer is None else 0.8 * self.t_load_layer + 0.2 * t


class PlanLoads:
    """The planned entries of one request in its buffer: ``actions`` as executed, the layer-wise
    ``loaders`` by segment, and ``__call__(layer)``, which makes each layer's loaded rows final
    before a layer reads them (idempotent; blocks on a loader; ``_LoadFailed`` if one fails)."""

    def __init__(self, runner, plan, kv: KVBuffer, actions: list[Action], loaders: dict, load_s: float):
        self.runner, self.plan, self.kv = runner, plan, kv
        self.actions, self.loaders, self.load_s = actions, loaders, load_s
        self.wait_s = 0.0  # blocked on loaders
        self._loaded: set[int] = set()
        self._rows: torch.Tensor | None = None  # the loaded segments' buffer rows, built once

    def __call__(self, layer: int) -> None:
        if layer in self._loaded:
            return
        self._loaded.add(layer)
        parts = []
        for idx, loader in self.loaders.items():
            t_wait = time.perf_counter()
            got = loader.layer(layer)  # committed: blocks until loaded (or failed)
            self.wait_s += time.perf_counter() - t_wait
            if got is None:
                raise _LoadFailed(idx, loader.error)
            parts.append((got[0], got[1], self.plan.segments[idx].start))
        self._rows = self.runner.write_rotated_segments(self.kv, layer, parts, self._rows)

    def before_layer(self, state, layer: int) -> None:
        """The layer loop's hook: this layer's loaded rows are final before the layer reads them."""
        self(layer)

    def observe(self, costs: LoadCosts) -> None:
        for loader in self.loaders.values():
            costs.observe_load(loader)

    def close(self) -> None:
        for loader in self.loaders.values():
            loader.close()


def load_plan(engine, plan, kv: KVBuffer, force_fresh: frozenset[int], notes: list[str]) -> PlanLoads:
    """Each planned tree / variant segment into ``kv`` (whole entries now, or a layer-wise loader
    that reads ahead while layers compute); a segment whose entry is missing, damaged, of the
    wrong shape or failed before is computed fresh instead (said in ``notes``)."""
    t_load = time.perf_counter()
    actions: list[Action] = []
    loaders: dict[int, object] = {}
    for idx, sp in enumerate(plan.segments):
        action = sp.action
        if action in (Action.TREE, Action.REUSE) and idx in force_fresh:
            notes.append(f"segment {sp.role}[{sp.index}]: cached entry failed while loading; computed fresh")
            action = Action.FRESH
        elif action in (Action.TREE, Action.REUSE) and engine._layerwise:
            loader = open_loader(engine, sp, notes)
            if loader is None:
                action = Action.FRESH
            else:
                loaders[idx] = loader
        elif action in (Action.TREE, Action.REUSE) and not load_whole(engine, sp, kv, notes):
            action = Action.FRESH
        actions.append(action)
    return PlanLoads(engine.runner, plan, kv, actions, loaders, time.perf_counter() - t_load)


def open_loader(engine, sp, notes: list[str]):
    """A layer loader for a planned segment, or None (miss, damaged, or not ready before the
    break-even time of recomputing it: then computing is faster than waiting)."""
    runner = engine.runner
    loader = engine.manager.open_layers(sp.handle, runner.device, engine.costs.preload_depth(runner.n_layers))
    if loader is None:
        notes.append(f"segment {sp.role}[{sp.index}]: cached entry missing; computed fresh")
        return None
    wrong = wrong_shape(runner, loader.kv_shape, loader.kv_dtype, sp.n_tokens)
    if wrong is None and loader.meta.get("n_tokens") not in (None, str(sp.n_tokens)):
        wrong = f"n_tokens {loader.meta.get('n_tokens')!r} in its meta, not {sp.n_tokens}"
    if wrong is not None:
        loader.close()
        engine.manager.invalidate(sp.handle)
        notes.append(f"segment {sp.role}[{sp.index}]: cached entry has {wrong}; computed fresh")
        return None
    wait = engine.costs.break_even_s(sp.n_tokens, runner.n_layers, engine.config.break_even_factor)
    if loader.layer(0, timeout=wait) is None:
        error = loader.error
        loader.close()
        why = f"damaged ({error})" if error is not None else "not ready before its break-even time"
        notes.append(f"segment {sp.role}[{sp.index}]: cached entry {why}; computed fresh")
        return None
    return loader


def wrong_shape(runner, shape, dtype, n_tokens: int) -> str | None:
    """Why a stored K/V of ``shape`` ``[L, H_kv, T, D]`` and ``dtype`` cannot fill a segment of
    ``n_tokens`` tokens in this model (a valid checksum proves integrity, not fit), or None."""
    want = (runner.n_layers, runner.n_kv_heads, n_tokens, runner.head_dim)
    if tuple(shape) != want:
        return f"shape {list(shape)}, not [L, H_kv, T, D] = {list(want)}"
    if dtype != runner.dtype:
        return f"dtype {dtype}, not {runner.dtype}"
    return None


def load_whole(engine, sp, kv: KVBuffer, notes: list[str]) -> bool:
    """One planned entry read whole into its rows of ``kv``; False (and a note) when it is
    missing, damaged or of the wrong shape (a wrong one is invalidated in the cache)."""
    entry = engine.manager.load(sp.handle)
    wrong = None if entry is None else wrong_shape(engine.runner, entry.k.shape, entry.k.dtype, sp.n_tokens)
    if wrong is not None:
        engine.manager.invalidate(sp.handle)
        notes.append(f"segment {sp.role}[{sp.index}]: cached entry has {wrong}; computed fresh")
        return False
    if entry is None:
        notes.append(f"segment {sp.role}[{sp.index}]: cached entry missing or damaged; computed fresh")
        return False
    runner = engine.runner
    k = entry.tensors["k"].to(runner.device, non_blocking=True)  # [L, H_kv, T, D] raw
    v = entry.tensors["v"].to(runner.device, non_blocking=True)  # [L, H_kv, T, D]
    runner.write_rotated(kv, k, v, sp.start)
    return True
