"""The Ray Serve deployment on a local Ray cluster: 2 tiny-model replicas sharing a real Redis.

One cluster for the whole module (Ray + Serve startup is most of the cost on 2 cores):
``ray.init(num_cpus=2)``, the app of ``cachedrag.cluster.deployment.build_app`` with the
chunk-affinity router. Checks: answers equal the single-process server's (greedy), requests with
the same chunks stay on one replica, a chunk computed on one replica is served to the other from
Redis, and a replica killed mid-run is replaced while its requests are retried or end with a
clear error (never a wrong or silently truncated answer).
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")
pytest.importorskip("cachedrag.server.app")

from cachedrag.cluster.asgi import ForwardedRequest, ResponseStart  # noqa: E402
from cachedrag.cluster.deployment import REPLICA_DEPLOYMENT, ClusterConfig, build_app  # noqa: E402
from cachedrag.cluster.replica import ReplicaSettings, build_replica_engine  # noqa: E402
from cachedrag.server.config import EngineSettings, ServerConfig  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.redis]

APP = "cachedrag"
DOCS = [f"Doc {i}: " + " ".join(f"w{(i * 7 + j) % 23}" for j in range(30)) for i in range(30)]


def body(chunks, question="What is listed?", max_tokens=6, stream=False, **extra):
    content = "\n\n".join(chunks) + "\n\n" + question
    return {"model": "tiny-random", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream, "cachedrag": {"chunks": list(chunks)}, **extra}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def settings(redis_server):
    engine = EngineSettings(tiny=True, cache_gb=0.05, redis_url=redis_server.url, redis_gb=0.2, threads=1)
    return ReplicaSettings(engine=engine, server=ServerConfig(default_max_tokens=8),
                           redis_prefix=f"cdray{uuid.uuid4().hex[:8]}", refresh_s=0)


@pytest.fixture(scope="module")
def cluster(settings, redis_server):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(ClusterConfig(replicas=2, replica_cpus=0.5, retries=2, replica=settings)),
                  name=APP, route_prefix="/")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            yield client
    finally:
        serve.shutdown()
        ray.shutdown()
        rc = redis_server.client()
        keys = list(rc.scan_iter(match=f"{settings.redis_prefix}:*"))
        if keys:
            rc.delete(*keys)
        rc.close()


@pytest.fixture(scope="module")
def reference(settings):
    """The single-process server over the same tiny model (no Redis): what the cluster must answer."""
    from fastapi.testclient import TestClient

    from cachedrag.server.app import create_app
    from cachedrag.server.config import ServerConfig

    engine = build_replica_engine(settings.model_copy(update={"engine": settings.engine.model_copy(
        update={"redis_url": None})}))
    with TestClient(create_app(engine, ServerConfig(model_name="tiny-random", default_max_tokens=8))) as client:
        yield client


def answer(response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def stream_text(client, payload, first_event: threading.Event | None = None) -> tuple[str, list[dict], str | None]:
    """Text, events and serving replica of a streamed chat completion; ``first_event`` is set
    when the first event arrives (the request is then in flight on its replica)."""
    texts, events = [], []
    with client.stream("POST", "/v1/chat/completions", json=payload) as r:
        assert r.status_code == 200
        replica = r.headers.get("x-cachedrag-replica")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                events.append(event)
                if first_event is not None:
                    first_event.set()
                if "choices" in event and event["choices"]:
                    texts.append(event["choices"][0]["delta"].get("content") or "")
    return "".join(texts), events, replica


def stats(client) -> dict:
    r = client.get("/cluster/stats")
    assert r.status_code == 200, r.text
    return r.json()


def test_answers_equal_the_single_process_server(cluster, reference):
    payload = body(DOCS[:2])
    expected = answer(reference.post("/v1/chat/completions", json=payload))
    assert answer(cluster.post("/v1/chat/completions", json=payload)) == expected
    assert answer(cluster.post("/v1/chat/completions", json=payload)) == expected  # now from the chunk cache
    text, events, _ = stream_text(cluster, {**payload, "stream": True})
    assert text == expected and events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    bad = cluster.post("/v1/chat/completions", json={**payload, "model": "nope"})
    assert bad.status_code == 404 and bad.json()["error"]["code"] == "model_not_found"  # the server's own errors
    assert cluster.get("/v1/models").json()["data"][0]["id"] == "tiny-random"


def test_same_chunks_stay_on_one_replica_and_chunk_sets_spread(cluster):
    seen = {}
    for i in range(12):
        chunks = DOCS[2 + 2 * i: 4 + 2 * i]
        first = cluster.post("/v1/chat/completions", json=body(chunks, max_tokens=2))
        again = cluster.post("/v1/chat/completions", json=body(chunks[::-1], "Other question?", max_tokens=2))
        assert first.status_code == again.status_code == 200
        assert first.headers["x-cachedrag-replica"] == again.headers["x-cachedrag-replica"]
        seen[i] = first.headers["x-cachedrag-replica"]
    assert len(set(seen.values())) == 2  # 12 chunk sets all on one replica: p = 2^-11


def test_chunks_computed_on_one_replica_are_served_to_the_other_from_redis(cluster, reference):
    chunks = DOCS[26:28]
    payload = body(chunks)
    expected = answer(reference.post("/v1/chat/completions", json=payload))
    first = cluster.post("/v1/chat/completions", json=payload)
    assert answer(first) == expected
    owner = first.headers["x-cachedrag-replica"]
    other = next(r for r in stats(cluster)["replicas"] if r != owner)
    handle = serve.get_deployment_handle(REPLICA_DEPLOYMENT, APP)
    fwd = ForwardedRequest("POST", "/v1/chat/completions", json.dumps(payload).encode(),
                           [(b"content-type", b"application/json")])

    def ask_other(request=fwd) -> tuple[int, bytes]:
        parts = list(handle.options(stream=True).handle.remote(request, replica=other))
        assert isinstance(parts[0], ResponseStart) and parts[0].header("x-cachedrag-replica") == other
        return parts[0].status, b"".join(parts[1:])

    # Let the other replica adopt the new entries first (a request triggers its background refresh):
    # asked before that, it would compute the chunks itself and then keep hitting its own CPU tier.
    unrelated = ForwardedRequest("POST", "/v1/chat/completions", json.dumps(body(["A passage no other test sends."], max_tokens=1)).encode(),
                                 [(b"content-type", b"application/json")])
    adopted = stats(cluster)["replicas"][other]["sync"]["adopted"]
    for _ in range(20):
        assert ask_other(unrelated)[0] == 200
        if stats(cluster)["replicas"][other]["sync"]["adopted"] > adopted:
            break
        time.sleep(0.2)
    before = stats(cluster)["replicas"][other]["tiers"]["redis"]["hits"]
    for _ in range(20):  # the other replica adopts the new entries in the background (refresh_s=0)
        status, raw = ask_other()
        assert status == 200
        hits = stats(cluster)["replicas"][other]["tiers"]["redis"]["hits"]
        if hits > before:
            break
        time.sleep(0.2)
    assert hits > before, "the other replica never loaded the chunks from Redis"
    assert json.loads(raw)["choices"][0]["message"]["content"] == expected
    assert json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_replicas_record_where_each_requests_ttft_went(cluster):
    from cachedrag.cluster.timeline import RequestRecord, summarize

    for i in range(3):
        assert cluster.post("/v1/chat/completions", json=body(DOCS[10 + i:12 + i], max_tokens=2)).status_code == 200
    assert all("records" not in v for v in stats(cluster)["replicas"].values())
    replicas = cluster.get("/cluster/stats", params={"records": True}).json()["replicas"]
    records = [RequestRecord.from_dict(d) for v in replicas.values() for d in v["records"]]
    assert len(records) >= 3 and {r.replica for r in records} <= set(replicas)
    for r in records:
        assert 0 < r.ttft_s <= r.total_s and r.prefill_s > 0 and r.arrival > 1e9  # wall-clock seconds
    summary = summarize(records, list(replicas))
    assert summary["requests"] == len(records) and 0.0 <= summary["stranded_share"] <= 1.0
    text, _, _ = stream_text(cluster, body(DOCS[14:16], max_tokens=2, stream=True))
    assert text
    assert stats(cluster)["ingress"]["before_first_token"] == 0  # every ticket left the prefill board


@pytest.mark.slow
def test_a_killed_replica_is_replaced_and_nothing_wrong_is_served(cluster, reference):
    chunks = DOCS[28:30]
    payload = body(chunks, max_tokens=200)
    expected = answer(reference.post("/v1/chat/completions", json=payload))
    owner = cluster.post("/v1/chat/completions", json=body(chunks, max_tokens=1)).headers["x-cachedrag-replica"]
    results: dict[str, object] = {}

    def non_stream():
        results["plain"] = cluster.post("/v1/chat/completions", json=payload)

    streaming = threading.Event()

    def streamed():
        results["stream"] = stream_text(cluster, {**payload, "stream": True}, streaming)

    threads = [threading.Thread(target=non_stream), threading.Thread(target=streamed)]
    for t in threads:
        t.start()
    assert streaming.wait(60)  # the stream is in flight on the owner (same chunks), the other request beside it
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#{REPLICA_DEPLOYMENT}#{owner}", namespace="serve"), no_restart=True)
    for t in threads:
        t.join(180)
    # the non-streaming request either finished before the kill or was retried on the survivor:
    # a complete, correct answer either way
    assert answer(results["plain"]) == expected
    text, events, _ = results["stream"]
    errors = [e for e in events if "error" in e]
    if errors:  # cut mid-stream: a clear error, and no finish_reason pretending it completed
        assert errors[-1]["error"]["code"] == "replica_failed"
        assert not any(e.get("choices") and e["choices"][0].get("finish_reason") for e in events)
        assert expected.startswith(text)
    else:
        assert text == expected
    deadline = time.monotonic() + 120  # Serve replaces the replica
    while time.monotonic() < deadline:
        live = stats(cluster)["replicas"]
        if len(live) == 2 and owner not in live and all("error" not in v for v in live.values()):
            break
        time.sleep(1)
    assert len(live) == 2 and owner not in live, live
    assert answer(cluster.post("/v1/chat/completions", json=body(chunks))) == answer(
        reference.post("/v1/chat/completions", json=body(chunks)))
    ingress = stats(cluster)["ingress"]
    if ingress["retried"] + ingress["failed_mid_stream"] == 0:
        # the tiny model can finish both answers in the moment between the first streamed event and
        # the kill; replacement and correct answers were still checked above
        pytest.skip("both requests completed before the kill landed: the failover path was not exercised")
