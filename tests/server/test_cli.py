"""``cachedrag serve`` as a process: logs where it listens, serves, stops cleanly on SIGTERM/SIGINT."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from cachedrag.testing import listening_url

pytest.importorskip("uvicorn")


def _serve(*args):
    return subprocess.Popen([sys.executable, "-m", "cachedrag.cli", "serve", "--tiny", "--port", "0", *args],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_logs_address_and_stops_cleanly(sig):
    proc = _serve("--max-batch", "2")
    try:
        url, lines = listening_url(proc, 120)
        assert url, "".join(lines)
        for _ in range(100):  # uvicorn starts accepting right after the log line
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        r = httpx.post(url + "/v1/completions", json={"model": "tiny-random", "prompt": "hi", "max_tokens": 3, "temperature": 0},
                       timeout=60)  # greedy: sampling may pick end-of-text early
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0
        assert "stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bad_setting_exits_2_with_one_line():
    proc = subprocess.run([sys.executable, "-m", "cachedrag.cli", "serve", "--tiny", "--max-batch", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("cachedrag: error:") and "max_batch" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("args, says", [
    (["--weights", "int8", "--dtype", "float32"], "bfloat16"),  # a quantised format computes in bf16
    (["--threads", "0"], "--threads"),
    (["--max-overtakes", "-1"], "max_overtakes"),
    (["--dtype", "bfloat16", "--replicas", "2"], "--replicas"),  # replicas would silently ignore it
    (["--prefill-pairs", "none", "--replicas", "2"], "--prefill-pairs"),
    (["--device", "cpu", "--replicas", "2"], "--device"),
    (["--device", "tpu7"], "unknown device"),
    (["--port", "99999"], "port"),  # refused before the model loads
    (["--max-tokens", "0"], "default_max_tokens"),
    (["--tie-guard-decode", "-1"], "exact.tie_guard_decode"),
    (["--index", "/nonexistent/index"], "--index"),
])
def test_bad_numerics_exit_2_with_one_line(args, says):
    port = [] if "--port" in args else ["--port", "0"]
    proc = subprocess.run([sys.executable, "-m", "cachedrag.cli", "serve", "--tiny", *port, *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().startswith("cachedrag: error:") and says in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_api_key_comes_from_the_flag_or_the_environment(monkeypatch):
    from cachedrag.cli import build_parser

    monkeypatch.delenv("CACHEDRAG_API_KEY", raising=False)
    assert build_parser().parse_args(["serve"]).api_key is None
    assert build_parser().parse_args(["serve", "--api-key", "k1"]).api_key == "k1"
    monkeypatch.setenv("CACHEDRAG_API_KEY", "k2")
    assert build_parser().parse_args(["serve"]).api_key == "k2"


def test_tokenization_flag_defaults_to_whole_and_refuses_others(capsys):
    from cachedrag.cli import build_parser

    assert build_parser().parse_args(["serve"]).tokenization == "whole"
    assert build_parser().parse_args(["serve", "--tokenization", "parts"]).tokenization == "parts"
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--tokenization", "bytes"])
    assert exc.value.code == 2 and "--tokenization" in capsys.readouterr().err


def test_faithful_admission_flags_reach_the_scheduler():
    from cachedrag.cli import build_parser
    from cachedrag.server.config import scheduler_config

    default = scheduler_config(build_parser().parse_args(["serve"]))
    assert default.exact_whole_answers is True and default.exact_when_waiting == 1
    argv = ["serve", "--no-exact-whole-answers", "--exact-when-waiting", "0"]
    off = scheduler_config(build_parser().parse_args(argv))
    assert off.exact_whole_answers is False and off.exact_when_waiting == 0


def test_build_engine_uses_the_requested_numerics():
    from cachedrag.cli import build_parser
    from cachedrag.server.cli import build_engine

    args = build_parser().parse_args(["serve", "--tiny", "--dtype", "bfloat16", "--weights", "int8", "--threads", "1",
                                      "--prefill-pairs", "scores+values"])
    engine = build_engine(args)
    assert engine.runner.numerics.tag == "bfloat16+int8w" and engine.runner.threads == 1
    assert engine.runner.prefill_pairs == "scores+values"
    assert engine.namespace.dtype == "bfloat16+int8w"  # its caches never serve a float32 engine
    # a loaded server has no idle time for exact-repeat promotions: overdue ones go inline
    assert engine.config.cache.exact.repeats_when == "after_response_else_inline"
    other = build_engine(build_parser().parse_args(["serve", "--tiny", "--exact-repeats-when", "after_response",
                                                    "--exact-repeats", "3"])).config.cache
    assert other.exact.repeats_when == "after_response" and other.exact.repeats == 3
    text = engine.generate(["heapq pushes items onto a heap."], "What does heapq do?", max_new_tokens=3).text
    assert isinstance(text, str)
    guard = build_engine(build_parser().parse_args(["serve", "--tiny", "--tie-guard", "1"])).config.cache
    assert guard.exact.tie_guard == 1.0
    decoding = build_engine(build_parser().parse_args(["serve", "--tiny", "--tie-guard-decode", "0.25"])).config.cache
    assert decoding.exact.tie_guard_decode == 0.25 and decoding.exact.tie_guard == 0.0


def test_a_fidelity_level_sets_the_servers_mode_and_policy(capsys):
    """``--fidelity`` gives the server a level of FIDELITY_PRESETS (its mode and recompute policy); tie-guard
    flags given beside it win over its values; a --mode that contradicts it is one line, exit 2."""
    import math

    from cachedrag.cli import build_parser, main
    from cachedrag.config import FIDELITY_PRESETS
    from cachedrag.server.cli import build_engine
    from cachedrag.server.config import FIDELITY_LEVELS

    assert set(FIDELITY_LEVELS) == set(FIDELITY_PRESETS)
    faithful = build_engine(build_parser().parse_args(["serve", "--tiny", "--fidelity", "faithful"])).config
    assert faithful.fidelity == "faithful" and faithful.mode == "cachedrag"
    assert faithful.cache.exact.tie_guard == 0.25 and math.isinf(faithful.cache.exact.tie_guard_decode)
    assert faithful.cache.recompute_ratio == FIDELITY_PRESETS["faithful"]["cache"]["recompute_ratio"]
    assert faithful.cache.exact.repeats_when == "after_response_else_inline"  # the server's own setting stays
    softer = build_engine(build_parser().parse_args(["serve", "--tiny", "--fidelity", "faithful",
                                                     "--tie-guard-decode", "0.25"])).config.cache
    assert softer.exact.tie_guard_decode == 0.25 and softer.exact.tie_guard == 0.25
    exact = build_engine(build_parser().parse_args(["serve", "--tiny", "--fidelity", "exact"])).config
    assert exact.mode == "prefix" and exact.order_aware is False
    fast = build_engine(build_parser().parse_args(["serve", "--tiny", "--fidelity", "fast"])).config
    assert fast.order_aware is True and fast.cache.recompute_ratio == 0.1
    plain = build_engine(build_parser().parse_args(["serve", "--tiny"])).config
    assert plain.fidelity is None and plain.mode == "cachedrag" and plain.cache.exact.tie_guard_decode == 0
    assert main(["serve", "--tiny", "--fidelity", "exact", "--mode", "cachedrag"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--fidelity exact runs mode prefix" in err and len(err.splitlines()) == 1


def test_startup_objects_leave_the_collectors_scans():
    """``cachedrag serve`` freezes what startup built: a later full collection no longer walks it."""
    import gc

    from cachedrag.server.cli import freeze_startup_objects

    keep = [[i] for i in range(10_000)]  # long-lived objects, as the model and engine are
    try:
        frozen = freeze_startup_objects()
        # frozen objects may still be freed (another thread of the test process dropping its last
        # reference), so the count can only have fallen since the call returned it
        assert frozen >= gc.get_freeze_count() >= len(keep)
        gc.collect()  # unfrozen, a full collection leaves keep[0] in the oldest generation it scans
        assert not any(o is keep[0] for o in gc.get_objects(generation=2))
    finally:
        gc.unfreeze()
