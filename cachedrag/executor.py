"""Background threads that do not outlive their work.

Owns: ``TransientThreadExecutor``, the executor every cachedrag background job that may run
torch ops uses (lookahead prefetch, slow-tier search, store promotions). It behaves like
``concurrent.futures.ThreadPoolExecutor(max_workers)``, except that a worker thread exits as
soon as no work is queued. And ``release_openmp_threads()``, which frees the calling thread's
idle OpenMP team (``omp_pause_resource_all``) for threads that must live on: the event-loop
thread and the worker threads of the async integrations.

Why: torch's CPU build parallelises ops with OpenMP (libgomp), and every thread that runs a
parallel op gets an OpenMP team that lives as long as the thread. With more OpenMP threads
alive than cores, libgomp stops spinning between parallel regions and puts its workers to
sleep after each one, so every small op (a decode step is ~200 of them per layer stack) pays
for futex wake-ups. Measured on this project's 2-core machine: a decode step of the default
model takes 43 ms, 80 ms while an idle pool thread that once ran a torch op is alive, and
30-37 ms again once that thread has exited (``docs/retrieval.md``). A persistent pool thread
would keep the main thread's decoding at half speed for the retriever's whole life.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections import deque
from concurrent.futures import Executor, Future

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the thread pool, keep other state


class TransientThreadExecutor(Executor):
    """At most ``max_workers`` threads; each exits when the queue is empty (FIFO order)."""

    def __init__(self, max_workers: int = 1, thread_name_prefix: str = "cachedrag-worker"):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._max_workers = max_workers
        self._prefix = thread_name_prefix
        self._queue: deque = deque()
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._shutdown = False
        self._started = 0

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new work after shutdown")
            self._queue.append((future, fn, args, kwargs))
            if len(self._threads) < self._max_workers:
                self._started += 1
                thread = threading.Thread(target=self._work, name=f"{self._prefix}-{self._started}", daemon=True)
                self._threads.add(thread)
                thread.start()
        return future

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            with self._lock:
                if not self._queue:
                    self._threads.discard(me)
                    return
                future, fn, args, kwargs = self._queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # handed to the caller through the future
                future.set_exception(exc)
            else:
                future.set_result(result)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shutdown = True
            if cancel_futures:
                while self._queue:
                    self._queue.popleft()[0].cancel()
            threads = list(self._threads)
        if wait:
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()

    @property
    def live_threads(self) -> int:
        """Worker threads alive now (0 when idle)."""
        with self._lock:
            return len(self._threads)


@functools.cache
def _omp_pause():
    """``omp_pause_resource_all`` of the OpenMP runtime torch uses, or None."""
    import torch

    torch_gomp = os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")
    for path in ([torch_gomp] if os.path.exists(torch_gomp) else []) + [None]:  # None: symbols already loaded
        try:
            fn = getattr(ctypes.CDLL(path), "omp_pause_resource_all", None)
        except OSError:
            continue
        if fn is not None:
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            return fn
    return None


def release_openmp_threads() -> bool:
    """Free the calling thread's idle OpenMP team (its next parallel op starts a new one).

    Call it on a long-lived thread before other threads take over the compute (the event loop
    before handing generation to a worker), and on a long-lived worker after its job, so that
    no idle team makes libgomp oversubscribe the cores. True if a team was released (or none
    existed); False where the OpenMP runtime offers no pause (then nothing happens).
    """
    pause = _omp_pause()
    return pause is not None and pause(_OMP_PAUSE_SOFT) == 0
