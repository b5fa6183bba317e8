"""TransientThreadExecutor: futures like ThreadPoolExecutor's, and no worker thread outlives its work."""

from __future__ import annotations

import threading
import time

import pytest

from cachedrag.executor import TransientThreadExecutor


def _wait_idle(pool: TransientThreadExecutor, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while pool.live_threads and time.monotonic() < deadline:
        time.sleep(0.005)


def test_results_exceptions_and_order():
    pool = TransientThreadExecutor(1)
    seen: list[int] = []
    gate = threading.Event()
    first = pool.submit(lambda: (gate.wait(5), seen.append(0), 0)[2])
    rest = [pool.submit(lambda i=i: (seen.append(i), i * i)[1]) for i in range(1, 5)]
    failing = pool.submit(lambda: 1 / 0)
    gate.set()
    assert first.result(5) == 0 and [f.result(5) for f in rest] == [1, 4, 9, 16]
    with pytest.raises(ZeroDivisionError):
        failing.result(5)
    assert seen == [0, 1, 2, 3, 4]  # one worker: FIFO
    pool.shutdown()


def test_worker_threads_exit_when_the_queue_is_empty_and_come_back_for_new_work():
    pool = TransientThreadExecutor(2, thread_name_prefix="transient-test")
    gate = threading.Event()
    futures = [pool.submit(gate.wait, 5) for _ in range(3)]
    assert pool.live_threads == 2  # capped at max_workers
    gate.set()
    assert all(f.result(5) for f in futures)
    _wait_idle(pool)
    assert pool.live_threads == 0
    assert not [t for t in threading.enumerate() if t.name.startswith("transient-test")]
    assert pool.submit(lambda: threading.current_thread().name).result(5).startswith("transient-test")
    _wait_idle(pool)
    assert pool.live_threads == 0
    pool.shutdown()


def test_shutdown_cancels_queued_work_and_refuses_new_work():
    pool = TransientThreadExecutor(1)
    gate = threading.Event()
    running = pool.submit(gate.wait, 5)
    deadline = time.monotonic() + 5
    while not running.running() and time.monotonic() < deadline:
        time.sleep(0.001)
    queued = pool.submit(lambda: "never")
    pool.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled()
    gate.set()
    assert running.result(5) is True
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(lambda: None)
    with pytest.raises(ValueError):
        TransientThreadExecutor(0)


def test_release_openmp_threads_frees_the_calling_threads_team_and_torch_still_computes():
    import torch

    from cachedrag.executor import _omp_pause, release_openmp_threads

    if _omp_pause() is None:
        assert release_openmp_threads() is False  # no pause in this OpenMP runtime: a no-op
        return
    x = torch.randn(256, 256)
    expected = x @ x
    assert release_openmp_threads() is True
    assert release_openmp_threads() is True  # nothing left to free is fine too
    torch.testing.assert_close(x @ x, expected)  # the next parallel op starts a new team
