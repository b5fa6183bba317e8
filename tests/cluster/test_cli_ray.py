"""``cachedrag serve --replicas 2 --backend ray`` end to end: a real process starts Ray, a private
Redis and the deployment, answers on the printed address and stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from cachedrag.testing import listening_url

pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.slow]


def test_serve_with_ray_replicas_answers_and_stops_on_sigterm():
    from cachedrag.store.redis_server import find_redis_server

    if find_redis_server() is None:
        pytest.skip("no redis-server binary")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "-m", "cachedrag.cli", "serve", "--tiny", "--replicas", "2",
                             "--backend", "ray", "--replica-cpus", "0.5", "--port", "0", "--max-tokens", "4"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        url, lines = listening_url(proc, 240)
        assert url, "".join(lines[-30:])
        assert "2 replicas on Ray Serve" in lines[-1] and "redis://127.0.0.1" in lines[-1]
        chunk = "Passage: " + "cobalt " * 30
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny-random", "max_tokens": 3, "temperature": 0, "cachedrag": {"chunks": [chunk]},
            "messages": [{"role": "user", "content": chunk + "\n\nWhat color?"}]})
        assert r.status_code == 200, r.text
        assert r.headers["x-cachedrag-replica"] and r.json()["usage"]["completion_tokens"] >= 1
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        assert "cachedrag serve: stopped" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
