"""Running blocking generation off the event loop.

Owns: ``run_in_worker`` (await a blocking call on a worker thread) and ``stream_in_worker``
(drive a blocking iterator on a worker thread and consume it as an async iterator through an
``asyncio.Queue``), so the async methods of the LLM classes never block the event loop. An
async consumer that stops early (``aclose``, cancellation) makes the worker stop after the
item it is producing and close the iterator (so the engine releases its plan). Errors raised
on the worker are re-raised in the consumer.

Does not own: what runs (the generator classes hand it callables).
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

_DONE = object()


async def run_in_worker(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``await fn(*args, **kwargs)`` on a worker thread (context variables propagate)."""
    return await asyncio.to_thread(fn, *args, **kwargs)


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
