"""Worker-thread helpers: results, errors, early close, and an event loop that keeps running."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from cachedrag.integrations.worker import run_in_worker, stream_in_worker

from .conftest import LoopTicker


async def test_run_in_worker_runs_off_the_loop():
    loop_thread = threading.get_ident()
    assert await run_in_worker(threading.get_ident) != loop_thread


async def test_stream_yields_items_in_order_from_another_thread():
    threads = set()

    def items():
        for i in range(5):
            threads.add(threading.get_ident())
            yield i

    assert [x async for x in stream_in_worker(items)] == [0, 1, 2, 3, 4]
    assert threading.get_ident() not in threads


async def test_stream_reraises_worker_errors():
    def items():
        yield 1
        raise KeyError("boom")

    got = []
    with pytest.raises(KeyError):
        async for x in stream_in_worker(items):
            got.append(x)
    assert got == [1]


async def test_early_close_stops_and_closes_the_iterator():
    closed = threading.Event()
    produced = []

    def items():
        try:
            for i in range(1000):
                produced.append(i)
                time.sleep(0.005)
                yield i
        finally:
            closed.set()

    agen = stream_in_worker(items)
    async for x in agen:
        if x == 2:
            break
    await agen.aclose()
    assert await asyncio.to_thread(closed.wait, 5)
    assert len(produced) < 100


async def test_loop_is_not_blocked_while_the_worker_works():
    async with LoopTicker(period=0.01) as loop:
        await run_in_worker(time.sleep, 0.3)
    assert loop.ticks >= 5


async def test_idle_openmp_teams_are_released_on_the_loop_and_on_the_worker(monkeypatch):
    import cachedrag.integrations.worker as worker

    calls: list[int] = []
    monkeypatch.setattr(worker, "release_openmp_threads", lambda: calls.append(threading.get_ident()) or True)
    loop_thread = threading.get_ident()
    worker_thread = await run_in_worker(threading.get_ident)
    assert calls == [loop_thread, worker_thread]  # the loop's team before the job, the worker's after it
    calls.clear()
    assert [x async for x in stream_in_worker(lambda: iter([1, 2]))] == [1, 2]
    assert calls == [loop_thread]  # the stream's own thread exits (its team goes with it)
