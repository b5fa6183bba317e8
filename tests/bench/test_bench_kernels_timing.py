"""`cachedrag bench kernels`' timer: CUDA-graph kernel time vs eager call time, and the fallback.

The CUDA path's control flow runs here without a GPU against a fake ``torch.cuda`` (events on a
fake device clock, a graph that records calls made while capturing); the real thing runs in the
GPU test at the end (``-m gpu``).
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from cachedrag_bench import kernels as bench


class FakeCuda:
    """Just what ``bench._Timer`` uses of ``torch.cuda``. Device time: an eager call costs
    ``launch + kernel`` ms, a replayed captured call ``kernel`` ms."""

    def __init__(self, launch: float = 0.05, kernel: float = 0.01) -> None:
        self.clock = 0.0
        self.launch, self.kernel = launch, kernel
        self.capturing: FakeCuda.Graph | None = None
        self.streams = ["default"]

        fake = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.t = None

            def record(self) -> None:
                self.t = fake.clock

            def elapsed_time(self, end: "Event") -> float:
                return end.t - self.t

        class Stream:
            def wait_stream(self, other) -> None:
                pass

        class Graph:
            def __init__(self) -> None:
                self.calls = 0
                self.ended = False

            def capture_begin(self) -> None:
                fake.capturing = self

            def capture_end(self) -> None:
                fake.capturing = None
                self.ended = True

            def replay(self) -> None:
                assert self.ended
                fake.clock += self.calls * fake.kernel

        @contextlib.contextmanager
        def stream(s):
            fake.streams.append(s)
            try:
                yield
            finally:
                fake.streams.pop()

        self.Event, self.Stream, self.CUDAGraph, self.Graph, self.stream = Event, Stream, Graph, Graph, stream

    def synchronize(self) -> None:
        pass

    def current_stream(self):
        return self.Stream()

    def empty_cache(self) -> None:
        pass

    def call(self, syncs: bool = False) -> None:
        """What a timed callable does on the fake device."""
        if self.capturing is not None:
            if syncs:
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
            self.capturing.calls += 1
        else:
            self.clock += self.launch + self.kernel


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda()
    for name in ("Event", "Stream", "CUDAGraph", "stream", "synchronize", "current_stream", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    return fake


def test_cuda_timer_times_the_kernel_from_a_graph_and_the_call_eagerly(fake_cuda):
    timer = bench._Timer(torch.device("cuda"), warmup=2, repeats=5)
    t = timer(fake_cuda.call, multiple_of=7)
    assert t.method == "cuda-graph" and t.note is None
    assert t.seconds * 1e3 == pytest.approx(0.01)  # replay time / K: the kernel alone
    assert t.call_seconds * 1e3 == pytest.approx(0.06)  # one eager call: launch overhead included
    assert t.calls % 7 == 0 and t.calls >= 3
    assert fake_cuda.streams == ["default"] and fake_cuda.capturing is None
    fields = t.fields()
    assert fields["timing"] == "cuda-graph" and fields["call_ms"] == pytest.approx(0.06)
    assert fields["calls_per_sample"] == t.calls and "timing_note" not in fields


def test_cuda_timer_falls_back_to_back_to_back_calls_when_capture_fails(fake_cuda):
    timer = bench._Timer(torch.device("cuda"), warmup=0, repeats=3)
    t = timer(lambda: fake_cuda.call(syncs=True))
    assert t.method == "back-to-back"
    assert "capture failed" in t.note and "stream is capturing" in t.note
    assert t.seconds * 1e3 == pytest.approx(0.06)  # K eager calls between two events
    assert fake_cuda.streams == ["default"] and fake_cuda.capturing is None  # stream restored
    assert t.fields()["timing_note"] == t.note


def test_cpu_timer_is_wall_time():
    t = bench._Timer(torch.device("cpu"), warmup=0, repeats=2)(lambda: None)
    assert t.method == "wall" and t.seconds == t.call_seconds and t.calls == 1


def test_rotating_sets_only_on_cuda():
    assert bench._rotating_sets(torch.device("cpu"), 10**6) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_kernels_cuda_reports_kernel_and_call_times(tmp_path, capsys):
    from cachedrag.cli import main

    out = tmp_path / "kernels.json"
    rc = main(["bench", "kernels", "--device", "cuda", "--context", "2048", "--repeats", "3", "--warmup", "1",
               "--copy-mib", "256", "--json", str(out)])
    assert rc == 0
    assert "call ms" in capsys.readouterr().out
    res = json.loads(out.read_text())
    rr, at = res["rerotate"], res["selective_attention"]
    assert rr["copy_timing"] == "cuda-graph" and rr["buffer_sets"] >= 1
    for r in [*rr["results"].values(), *at["results"].values()]:
        assert r["timing"] in ("cuda-graph", "back-to-back") and r["ms"] > 0 and r["call_ms"] > 0
        assert (r["timing"] == "back-to-back") == ("timing_note" in r)
    if "triton" in rr["results"]:
        assert rr["results"]["triton"]["timing"] == "cuda-graph"
        assert rr["results"]["triton"]["ms"] < rr["results"]["triton"]["call_ms"]
        assert rr["max_abs_err"] < 0.1
