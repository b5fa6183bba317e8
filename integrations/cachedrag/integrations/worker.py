"""Running blocking generation off the event loop.

Owns: ``run_in_worker`` (await a blocking call on a worker thread) and ``stream_in_worker``
(drive a blocking iterator on a worker thread and consume it as an async iterator through an
``asyncio.Queue``), so the async methods of the LLM classes never block the event loop. An
async consumer that stops early (``aclose``, cancellation) makes the worker stop after the
item it is producing and close the iterator (so the engine releases its plan). Errors raised
on the worker are re-raised in the consumer.

Both free the idle OpenMP team of the thread they leave (``release_openmp_threads``): the
event loop's before the worker computes, the worker's after its job. An idle team on another
thread halves CPU decode speed (measured: 38 ms per decode step on the worker with the
releases, 75-90 ms without; ``cachedrag/executor.py``).

Does not own: what runs (the generator classes hand it callables).
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

from cachedrag.executor import release_openmp_threads

T = TypeVar("T")

_DONE = object()


async def run_in_worker(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``await fn(*args, **kwargs)`` on a worker thread (context variables propagate)."""
    release_openmp_threads()
    return await asyncio.to_thread(_released_after, fn, *args, **kwargs)


def _released_after(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    try:
        return fn(*args, **kwargs)
    finally:
        release_openmp_threads()


async def stream_in_worker(make_iterator: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """Items of ``make_iterator()`` produced on a worker thread, yielded on the event loop."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    stop = threading.Event()

    def produce() -> None:
        try:
            iterator = make_iterator()
            try:
                for item in iterator:
                    loop.call_soon_threadsafe(queue.put_nowait, (True, item))
                    if stop.is_set():
                        break
            finally:
                close = getattr(iterator, "close", None)
                if close is not None:
                    close()
            loop.call_soon_threadsafe(queue.put_nowait, (True, _DONE))
        except BaseException as exc:  # handed to the consumer, which re-raises it
            if not loop.is_closed():
                loop.call_soon_threadsafe(queue.put_nowait, (False, exc))

    release_openmp_threads()  # the worker's thread exits at the end, freeing its own team
    context = contextvars.copy_context()  # callbacks and tracing spans see the caller's context
    thread = threading.Thread(target=context.run, args=(produce,), name="cachedrag-stream", daemon=True)
    thread.start()
    try:
        while True:
            ok, item = await queue.get()
            if not ok:
                raise item
            if item is _DONE:
                return
            yield item
    finally:
        stop.set()
