"""Preloading: moving chunk caches toward the compute device ahead of the compute.

Owns: the preload-depth formula, the layer-wise loader (``LayerLoader``: layer l is handed
to the compute while layers l+1..l+depth load in a background thread / CUDA stream, with a
non-blocking readiness check and timeouts so the engine can recompute instead of waiting; from
page-locked memory to a GPU, queued copies on one copy stream per device instead of a thread)
and the asynchronous prefetcher (``Prefetcher``: background threads promoting whole
entries to the fastest tier). Does not own: which tier an entry lives in (``tiered``) or
how a layer's bytes are read (``source``).

Cache-Craft's preload depth: with per-layer prefill time ``T_p`` and per-layer load time
``T_l``, starting the compute after ``Lp = (L - 1)(1 - T_p / T_l) + 1`` layers are loaded
lets the rest load under the compute without a stall (layer i is ready at ``(i+1) T_l``,
needed at ``Lp T_l + i T_p``). ``preload_depth`` rounds up and clamps to ``[1, L]``.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from cachedrag.executor import TransientThreadExecutor
from cachedrag.store.entry import KVEntry
from cachedrag.store.source import LayerSource, TensorSource


def preload_depth(n_layers: int, t_prefill_per_layer: float, t_load_per_layer: float) -> int:
    """Layers to load before the compute starts: ``ceil((L-1)(1 - T_p/T_l) + 1)`` in ``[1, L]``."""
    if n_layers < 1:
        raise ValueError(f"n_layers must be >= 1, got {n_layers}")
    if t_prefill_per_layer < 0 or t_load_per_layer < 0:
        raise ValueError("per-layer times must be >= 0")
    if t_load_per_layer == 0:
        return 1  # loading is free: nothing to hide
    lp = (n_layers - 1) * (1.0 - t_prefill_per_layer / t_load_per_layer) + 1.0
    return max(1, min(n_layers, math.ceil(round(lp, 9))))


#: layers a queued loader (page-locked source) copies ahead of the last one asked for, and per copy
QUEUED_AHEAD = 4
QUEUED_GROUP = 4


class LayerLoader:
    """Loads one entry to ``device`` layer by layer, ``depth`` layers ahead of the consumer.

    ``layer(l)`` returns ``(k_l, v_l)`` (``[H_kv, T, D]`` each, on ``device``) once loaded,
    or ``None`` on timeout or failure (see ``error``). Before any request, layers
    ``0..depth-1`` load; after ``layer(l)``, loading may run up to ``l + depth``. Tensors
    served straight from a memory tier on ``device`` are views of the stored entry: read-only.
    """

    def __init__(self, source: LayerSource, device: torch.device | str = "cpu", depth: int | None = None) -> None:
        self.source = source
        self.device = torch.device(device)
        self.n_layers = source.n_layers
        self.depth = max(1, min(self.n_layers, depth if depth is not None else self.n_layers))
        self.meta = dict(source.meta)
        self.kv_shape = tuple(source.kv_shape)  # [L, H_kv, T, D] of the stored k and v
        self.kv_dtype = source.kv_dtype
        self.layer_seconds: list[float | None] = [None] * self.n_layers
        self._layers: list[dict[str, torch.Tensor] | None] = [None] * self.n_layers
        self._events: list[object | None] = [None] * self.n_layers
        self._extras: dict[str, torch.Tensor] | None = None
        self._extras_event: object | None = None
        self._requested = -1
        self._error: BaseException | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._cuda = self.device.type == "cuda"
        self._stream = None  # the CUDA stream copies run on: the loader thread's own, or the shared copy stream
        self._thread: threading.Thread | None = None
        self._issued = -1  # queued copies: layers 0.._issued are queued (-1: none, or not queued)
        self._queued = False
        self._blocks: list[dict[str, torch.Tensor] | None] = [None] * self.n_layers  # queued: each layer's group
        self._waited: object | None = None  # queued: the last group event the compute stream waits on
        if isinstance(source, TensorSource) and _same_device(source.device, self.device):
            self._load_all_inline()  # already resident: views, nothing to overlap
        elif self._cuda and isinstance(source, TensorSource) and source.pinned:
            self._queue_copies()  # page-locked memory: the GPU copies while the host moves on
        else:
            self._stream = torch.cuda.Stream(self.device) if self._cuda else None
            self._thread = threading.Thread(target=self._run, name="cachedrag-layer-loader", daemon=True)
            self._thread.start()

    # ---- consumer side -------------------------------------------------------------------
    def layer(self, layer: int, timeout: float | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(k_l, v_l)`` on the device, blocking up to ``timeout`` s; ``None`` if not ready / failed."""
        tensors = self.layer_tensors(layer, timeout)
        return None if tensors is None else (tensors["k"], tensors["v"])  # [H_kv, T, D] each

    def layer_tensors(self, layer: int, timeout: float | None = None) -> dict[str, torch.Tensor] | None:
        """Every layered tensor at ``layer`` (``k``, ``v``, ...), like ``layer``."""
        if not 0 <= layer < self.n_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.n_layers})")
        with self._cond:
            if self._queued:
                self._issue(layer + QUEUED_AHEAD)
            if layer > self._requested:
                self._requested = layer
                self._cond.notify_all()
            self._cond.wait_for(lambda: self._layers[layer] is not None or self._error is not None or self._closed, timeout)
            tensors, event = self._layers[layer], self._events[layer]
        if tensors is None:
            return None
        if self._queued:  # a group of layers per copy: wait for it and mark its blocks once
            if event is not self._waited:
                stream = torch.cuda.current_stream(self.device)
                stream.wait_event(event)
                for t in self._blocks[layer].values():
                    t.record_stream(stream)
                self._waited = event
        elif event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
            for t in tensors.values():
                t.record_stream(torch.cuda.current_stream(self.device))
        return tensors

    def ready(self, layer: int) -> bool:
        """Non-blocking: is layer ``layer`` on the device now?"""
        with self._cond:
            if self._queued:
                self._issue(layer + QUEUED_AHEAD)
            if self._layers[layer] is None:
                return False
            event = self._events[layer]
        return event is None or bool(event.query())

    def extras(self, timeout: float | None = None) -> dict[str, torch.Tensor] | None:
        """Non-layered tensors (e.g. ``token_inter``), on the device; ``None`` if not ready."""
        with self._cond:
            self._cond.wait_for(lambda: self._extras is not None or self._error is not None or self._closed, timeout)
            extras, event = self._extras, self._extras_event
        if extras is not None and event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        return extras

    def wait(self, timeout: float | None = None) -> bool:
        """Request every layer and wait for all of them; ``True`` if all loaded."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for l in range(self.n_layers):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self.layer_tensors(l, left) is None:
                return False
        return True

    def entry(self, timeout: float | None = None) -> KVEntry | None:
        """The whole entry on the device (stacked copies), or ``None``."""
        if not self.wait(timeout):
            return None
        extras = self.extras(0)
        return KVEntry.from_layers([t for t in self._layers if t is not None], extras or {}, self.meta)

    @property
    def error(self) -> BaseException | None:
        """Why loading stopped early (a ``CorruptCacheError`` for a bad blob), else ``None``."""
        return self._error

    @property
    def mean_layer_seconds(self) -> float | None:
        """Measured load time per layer so far (for ``preload_depth``'s ``T_load``)."""
        done = [s for s in self.layer_seconds if s is not None]
        return sum(done) / len(done) if done else None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        if self._thread is None:
            self.source.close()

    def __enter__(self) -> LayerLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- producer side -------------------------------------------------------------------
    def _load_all_inline(self) -> None:
        self._extras = self.source.load_extras()
        for l in range(self.n_layers):
            self._layers[l] = self.source.load_layer(l)  # [H_kv, T, D] views
            self.layer_seconds[l] = 0.0

    def _queue_copies(self) -> None:
        """Page-locked host memory to a GPU: layers are queued as copies on one copy stream per
        device, ``QUEUED_GROUP`` layers per copy (one event each), up to ``QUEUED_AHEAD`` layers past
        the last one asked for, and ``layer(l)`` makes the compute stream wait for its group's event:
        the GPU waits where a layer is late, the host never does (a copy and an event per layer and
        chunk cost the host ~1 ms per layer of a 20-chunk request). Loaders of one request share
        the stream, so their copies run layer by layer across chunks in the order the prefill needs
        them. The copies are DMA the
        host only issues, so no thread: a thread per chunk that waited on each layer's copy before
        handing it over made the host wait too and contend for the GIL (20 chunks at an 8B shape
        on an H100: 466 ms from this tier vs 155 ms from the GPU tier, for ~27 ms of copies;
        commit 3574ef0; this tier's figures since: docs/notes/gpu.md). PyTorch's host allocator keeps a page-locked block alive until the copies
        reading it have run, so an entry evicted meanwhile is still read whole. Their time is not
        observed (``mean_layer_seconds`` stays None): copies of other chunks run between them."""
        self._queued = True
        self._stream = copy_stream(self.device)
        with torch.cuda.stream(self._stream):
            self._extras = {n: t.to(self.device, non_blocking=True) for n, t in self.source.load_extras().items()}
            self._extras_event = torch.cuda.Event()
            self._extras_event.record(self._stream)
        self._issue(QUEUED_AHEAD)

    def _issue(self, upto: int) -> None:
        """Queue the copies of the layer groups up to the one holding layer ``upto`` (queued mode)."""
        upto = min(upto, self.n_layers - 1)
        while self._issued < upto:
            a = self._issued + 1
            b = min(self.n_layers, a + QUEUED_GROUP)
            with torch.cuda.stream(self._stream):
                block = {n: t.to(self.device, non_blocking=True)  # [b - a, H_kv, T, D] each
                         for n, t in self.source.load_layers(a, b).items()}
                event = torch.cuda.Event()
                event.record(self._stream)
            for l in range(a, b):
                self._layers[l] = {n: t[l - a] for n, t in block.items()}  # [H_kv, T, D] views
                self._events[l], self._blocks[l] = event, block
            self._issued = b - 1

    def _run(self) -> None:
        try:
            extras, event = self._to_device(self.source.load_extras())
            with self._cond:
                self._extras, self._extras_event = extras, event
                self._cond.notify_all()
            for l in range(self.n_layers):
                with self._cond:
                    self._cond.wait_for(lambda: self._closed or l <= self._requested + self.depth)
                    if self._closed:
                        return
                t0 = time.perf_counter()
                tensors, event = self._to_device(self.source.load_layer(l))  # [H_kv, T, D] each
                with self._cond:
                    self._layers[l], self._events[l] = tensors, event
                    self.layer_seconds[l] = time.perf_counter() - t0
                    self._cond.notify_all()
        except Exception as exc:  # reported through .error; layer() then returns None
            with self._cond:
                self._error = exc
                self._cond.notify_all()
        finally:
            self.source.close()

    def _to_device(self, host: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], object | None]:
        if not self._cuda:
            return {n: t.to(self.device) for n, t in host.items()}, None  # [H_kv, T, D] each (extras: any)
        with torch.cuda.stream(self._stream):
            pinned = all(t.is_pinned() for t in host.values())
            out = {n: t.to(self.device, non_blocking=pinned) for n, t in host.items()}  # [H_kv, T, D] each
            event = torch.cuda.Event()
            event.record(self._stream)
        if pinned:
            event.synchronize()  # the pinned source must outlive the async copy; we are off the compute path
        return out, event


_COPY_STREAMS: dict[torch.device, object] = {}
_COPY_STREAMS_LOCK = threading.Lock()


def copy_stream(device: torch.device) -> object:
    """The CUDA stream queued host-to-device layer copies run on, one per device (so they run in
    the order they were issued)."""
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    with _COPY_STREAMS_LOCK:
        stream = _COPY_STREAMS.get(device)
        if stream is None:
            stream = _COPY_STREAMS[device] = torch.cuda.Stream(device)
        return stream


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    return a.type == "cpu" or a.index == b.index or a.index is None or b.index is None


class PrefetchHandle:
    """Futures of one ``prefetch`` call: ``done()``, ``wait(timeout)``, ``results()``."""

    def __init__(self, futures: dict[str, Future]) -> None:
        self.futures = futures

    def done(self) -> bool:
        return all(f.done() for f in self.futures.values())

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every key was handled (or ``timeout``); ``True`` if all done."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for f in self.futures.values():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                f.result(left)
            except FutureTimeout:
                return False
        return True

    def results(self) -> dict[str, bool]:
        """Per key: now in the fastest tier that would take it? (waits)."""
        return {k: bool(f.result()) for k, f in self.futures.items()}


class Prefetcher:
    """Background threads running ``fetch(key)`` (promote one key); one in flight per key."""

    def __init__(self, fetch: Callable[[str], bool], workers: int = 1) -> None:
        self._fetch = fetch
        self._workers = workers
        self._pool: TransientThreadExecutor | None = None
        self._inflight: dict[str, Future] = {}
        self._lock = threading.Lock()

    def submit(self, keys: Iterable[str]) -> PrefetchHandle:
        futures: dict[str, Future] = {}
        new: list[tuple[str, Future]] = []
        with self._lock:
            if self._pool is None:
                # workers exit when idle: a live thread that ran torch ops slows CPU decoding (executor.py)
                self._pool = TransientThreadExecutor(self._workers, thread_name_prefix="cachedrag-prefetch")
            for key in keys:
                fut = self._inflight.get(key)
                if fut is None:
                    fut = self._inflight[key] = self._pool.submit(self._fetch, key)
                    new.append((key, fut))
                futures[key] = fut
        for key, fut in new:  # outside the lock: a finished future runs its callback right here
            fut.add_done_callback(lambda f, k=key: self._done(k, f))
        return PrefetchHandle(futures)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every key submitted so far was handled (or ``timeout``); ``True`` if all done."""
        with self._lock:
            pending = dict(self._inflight)
        return PrefetchHandle(pending).wait(timeout)

    def _done(self, key: str, fut: Future) -> None:
        with self._lock:
            if self._inflight.get(key) is fut:
                del self._inflight[key]

    def shutdown(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
