"""``cachedrag bench cluster``: replicas on Ray Serve, routing x shared cache, side by side.

Starts a local Ray cluster, a private Redis server and, one after the other, three deployments
of ``--replicas`` replicas (``cachedrag.cluster.deployment``) behind the OpenAI API, and replays
the same Zipf RAG stream (retrieval as ``bench ttft`` does; explicit ``cachedrag.chunks``) at
``--concurrency`` through each:

  a  round-robin routing, no shared tier (each replica its own cache)
  b  round-robin routing + the shared Redis tier
  c  chunk-affinity routing + the shared Redis tier

  one  ONE replica with all the replicas' CPU-tier budget, all their CPUs and torch threads, and
       the same shared Redis tier, same stream, same concurrency, same serving path: the
       reference of the issue's hit-rate target (one replica with the same total cache)
  frontier  c again with a larger affinity ``slack`` (``--frontier``): locality traded for balance

Per config: chunk hit rate (hits / (hits + misses), summed over the replicas' counters), TTFT
p50/p95 (client side: request sent -> first content token of the SSE stream), requests/s, and
where the TTFT went (``parts``, ``cachedrag.cluster.timeline``: server-side wait for a prefill
slot, loading cached chunks (CPU tier or Redis), computing; and how unbalanced the replicas
were: the share of time a replica had a request waiting while another one idled). Then, in
this process: ``redis_reuse`` — the cost of serving a chunk another engine computed from
Redis, vs recomputing it and vs the local CPU tier; and ``estimate`` — the simulator's paper
estimate over replicas x corpus size (``cachedrag.cluster.estimate``), its cost shares taken
from ``redis_reuse``.

JSON (``--json OUT``): ``configs: {"a"|"b"|"c": {"hit_rate", "ttft_p50_s", "requests_per_s", ...}}``
plus ``one``, ``frontier``, ``redis_reuse``, ``estimate`` and ``setup``. The defaults fit one
``cpu-exclusive`` run of about 10 minutes with SmolLM2-135M on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from cachedrag_bench import write_json
from cachedrag_bench.metrics import percentile

CONFIGS = {"a": ("round_robin", False), "b": ("round_robin", True), "c": ("affinity", True)}
APP = "cachedrag-bench"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tiny", action="store_true", help="tiny random model (smoke run) instead of SmolLM2-135M")
    parser.add_argument("--replicas", type=int, default=2, help="engine replicas (default 2)")
    parser.add_argument("--requests", type=int, default=60, help="requests of the stream per config")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    parser.add_argument("--top-k", type=int, default=3, help="chunks per request")
    parser.add_argument("--chunk-tokens", type=int, default=128, help="tokens per corpus chunk")
    parser.add_argument("--max-tokens", type=int, default=8, help="generated tokens per request")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the question stream")
    parser.add_argument("--cache-mb", type=float, default=40.0, help="each replica's CPU-tier budget (MB)")
    parser.add_argument("--configs", default="a,b,c", help="comma list of a, b, c")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-one", action="store_true", help="skip the one-replica reference")
    parser.add_argument("--slack", type=int, default=None, help="affinity slack of config c (default: the router's)")
    parser.add_argument("--frontier", default="2", help="comma list of further affinity slacks to run c with ('' = none)")
    parser.add_argument("--skip-reuse", action="store_true", help="skip the Redis load-vs-recompute measurement")
    parser.add_argument("--json", dest="json_out", help="write results as JSON to this path")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _payload(model: str, chunks: list[str], question: str, max_tokens: int) -> dict:
    content = "Answer from the documents.\n\n" + "\n\n".join(chunks) + f"\n\nQuestion: {question}"
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "cachedrag": {"chunks": chunks}}


def _one_request(client, payload: dict) -> dict:
    t0 = time.perf_counter()
    ttft = None
    with client.stream("POST", "/v1/chat/completions", json=payload) as r:
        if r.status_code != 200:
            r.read()
            return {"ok": False, "status": r.status_code, "error": r.text[:200]}
        replica = r.headers.get("x-cachedrag-replica")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return {"ok": False, "status": 200, "error": str(event["error"])[:200]}
            delta = (event.get("choices") or [{}])[0].get("delta", {})
            if ttft is None and delta.get("content"):
                ttft = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return {"ok": True, "ttft_s": ttft if ttft is not None else total, "total_s": total, "replica": replica}


def _counters(client, records: bool = False) -> dict:
    stats = client.get("/cluster/stats", params={"records": records}).json()["replicas"]
    out = {"hits": 0.0, "misses": 0.0, "prompt": 0.0, "cached": 0.0, "redis_hits": 0.0, "records": [],
           "replicas": sorted(stats)}
    for v in stats.values():
        if "error" in v:
            continue
        out["hits"] += v["chunk_hits"]
        out["misses"] += v["chunk_misses"]
        out["prompt"] += v["prompt_tokens"]
        out["cached"] += v["cached_prompt_tokens"]
        out["redis_hits"] += v.get("tiers", {}).get("redis", {}).get("hits", 0)
        out["records"] += v.get("records", [])
    return out


def _run_config(name: str, args, stream, redis_url: str | None, port: int, model_name: str,
                slack: int | None = None) -> dict:
    """One deployment, the stream through it. ``name``: a, b, c, or ``one`` (a single replica
    with all the replicas' cache, CPUs and threads, and the shared tier)."""
    import httpx
    from ray import serve

    from cachedrag.cluster.deployment import ClusterConfig, build_app
    from cachedrag.cluster.replica import ReplicaSettings
    from cachedrag.cluster.timeline import RequestRecord, summarize
    from cachedrag.server.config import EngineSettings, ServerConfig

    single = name == "one"
    router, shared = ("round_robin", True) if single else CONFIGS[name]
    n = 1 if single else args.replicas
    scale = args.replicas if single else 1  # the one replica gets every replica's budget, CPUs and threads
    engine = EngineSettings(tiny=args.tiny, cache_gb=scale * args.cache_mb / 1024,
                            redis_url=redis_url if shared else None, redis_gb=2.0, threads=scale)
    settings = ReplicaSettings(engine=engine, server=ServerConfig(model_name=model_name,
                                                                  default_max_tokens=args.max_tokens),
                               redis_prefix=f"bench{name}{uuid.uuid4().hex[:6]}",
                               refresh_s=0.5)  # scheduler: one server's defaults
    extra = {} if slack is None else {"slack": slack}
    t_deploy = time.perf_counter()
    serve.run(build_app(ClusterConfig(replicas=n, router=router, replica_cpus=float(scale), replica=settings,
                                      **extra)),
              name=APP, route_prefix="/")
    deploy_s = time.perf_counter() - t_deploy
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        before = _counters(client)
        payloads = [_payload(model_name, chunks, q, args.max_tokens) for q, chunks in stream]
        t0, t0_wall = time.perf_counter(), time.time()
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(lambda p: _one_request(client, p), payloads))
        wall = time.perf_counter() - t0
        after = _counters(client, records=True)
    serve.delete(APP)
    ok = [r for r in results if r["ok"]]
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    ttfts = [r["ttft_s"] for r in ok]
    replicas = {}
    for r in ok:
        replicas[r["replica"]] = replicas.get(r["replica"], 0) + 1
    records = [RequestRecord.from_dict(d) for d in after["records"] if d["arrival"] >= t0_wall - 1.0]
    parts = summarize(records, after["replicas"])
    client_p50 = percentile(ttfts, 50) if ttfts else None
    if client_p50 is not None and parts["server_ttft_p50_s"] is not None:
        parts["overhead_p50_s"] = round(client_p50 - parts["server_ttft_p50_s"], 4)  # ingress, routing, HTTP
    return {
        "router": router, "shared_redis": shared, "replicas": n,
        **({"slack": slack if slack is not None else ClusterConfig().slack} if router == "affinity" else {}),
        "hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
        "ttft_p50_s": round(percentile(ttfts, 50), 4) if ttfts else None,
        "ttft_p95_s": round(percentile(ttfts, 95), 4) if ttfts else None,
        "requests_per_s": round(len(ok) / wall, 4),
        "cached_token_share": round((after["cached"] - before["cached"]) / max(1.0, after["prompt"] - before["prompt"]), 4),
        "redis_hit_share": round((after["redis_hits"] - before["redis_hits"]) / hits, 4) if hits else None,
        "requests": len(results), "errors": len(results) - len(ok), "per_replica": sorted(replicas.values()),
        "deploy_s": round(deploy_s, 1), "wall_s": round(wall, 2), "parts": parts,
        "records": [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.to_dict().items()} for r in records],
    }


def _redis_reuse(args, runner, redis_url: str, stream) -> dict:
    """Engine A computes a request's chunks; engine B (cold CPU tier) serves them from Redis."""
    from cachedrag.cluster.replica import ReplicaSettings, SharedCacheSync, build_replica_engine
    from cachedrag.server.config import EngineSettings

    engine = EngineSettings(tiny=args.tiny, cache_gb=args.cache_mb / 1024, redis_url=redis_url, redis_gb=2.0)
    settings = ReplicaSettings(engine=engine, redis_prefix=f"benchreuse{uuid.uuid4().hex[:6]}")
    a = build_replica_engine(settings, runner=runner)
    b = build_replica_engine(settings, runner=runner)
    sync = SharedCacheSync(b.manager, 0)
    seen, rows = set(), []
    for q, chunks in stream:
        key = tuple(chunks)
        if key in seen:
            continue
        seen.add(key)
        a.generate(chunks, q, max_new_tokens=1)  # A computes and writes through to Redis
        sync.refresh_now()
        from_redis = b.generate(chunks, q, max_new_tokens=1)
        local = b.generate(chunks, q, max_new_tokens=1)  # now in B's CPU tier
        full = b.generate(chunks, q, max_new_tokens=1, mode="full")
        if from_redis.chunks_hit == 0:
            continue
        rows.append({"full": full.ttft_s, "redis": from_redis.ttft_s, "redis_load": from_redis.load_s,
                     "cpu": local.ttft_s, "cpu_load": local.load_s, "same_answer": from_redis.token_ids == local.token_ids})
        if len(rows) >= 5:
            break
    if not rows:
        return {"error": "no request was served from Redis"}
    med = {k: statistics.median(r[k] for r in rows) for k in ("full", "redis", "redis_load", "cpu", "cpu_load")}
    return {"samples": len(rows), "full_ttft_s": round(med["full"], 4), "redis_ttft_s": round(med["redis"], 4),
            "cpu_ttft_s": round(med["cpu"], 4), "redis_load_s": round(med["redis_load"], 4),
            "cpu_load_s": round(med["cpu_load"], 4), "redis_vs_full": round(med["redis"] / med["full"], 4),
            "cpu_vs_full": round(med["cpu"] / med["full"], 4),
            "same_answer_as_cpu_tier": all(r["same_answer"] for r in rows)}


def run(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from cachedrag_bench.workload import build_workload
    from cachedrag.cluster.estimate import format_estimate, scale_estimate
    from cachedrag.errors import ConfigError
    from cachedrag.store.redis_server import start_redis_server

    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in names if c not in CONFIGS]
    if bad or args.replicas < 1 or args.requests < 1 or args.concurrency < 1:
        raise ConfigError(f"bad arguments: configs must be among a, b, c (got {bad}); replicas, requests, concurrency >= 1")
    try:
        slacks = [int(x) for x in args.frontier.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"bad --frontier {args.frontier!r}: a comma list of integer slacks") from None
    if any(x < 0 for x in slacks) or (args.slack is not None and args.slack < 0):
        raise ConfigError("affinity slacks must be >= 0")
    if args.tiny:
        from cachedrag.testing import tiny_runner

        runner = tiny_runner()
        model_name = "tiny-random"
    else:
        from cachedrag.model.loader import load_model
        from cachedrag.model.runner import ModelRunner

        runner = ModelRunner(*load_model(None))
        model_name = "SmolLM2-135M-Instruct"
    wl = build_workload(runner.tokenizer, top_k=args.top_k, chunk_tokens=args.chunk_tokens,
                        n_requests=args.requests, zipf_s=args.zipf, seed=args.seed)
    stream = list(zip(wl.questions, wl.retrieved))
    unique_chunks = len({c for _, cs in stream for c in cs})
    results: dict = {"setup": {"model": model_name, "replicas": args.replicas, "requests": args.requests,
                               "concurrency": args.concurrency, "top_k": args.top_k, "chunk_tokens": args.chunk_tokens,
                               "max_tokens": args.max_tokens, "cache_mb_per_replica": args.cache_mb,
                               "unique_chunks": unique_chunks, "stream": wl.question_source},
                     "configs": {}, "frontier": []}
    redis = start_redis_server()
    try:
        ray.init(num_cpus=max(2, args.replicas), include_dashboard=False, log_to_driver=False)
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for name in names:
            print(f"config {name}: {CONFIGS[name][0]}{' + redis' if CONFIGS[name][1] else ''} ...", flush=True)
            results["configs"][name] = _run_config(name, args, stream, redis.url, port, model_name,
                                                   slack=args.slack if name == "c" else None)
            _progress(results["configs"][name])
        if not args.skip_one:
            print("one replica, same total CPU tier, CPUs and Redis ...", flush=True)
            results["one"] = _run_config("one", args, stream, redis.url, port, model_name)
            _progress(results["one"])
        for slack in slacks:
            print(f"frontier: c with slack {slack} ...", flush=True)
            results["frontier"].append(_run_config("c", args, stream, redis.url, port, model_name, slack=slack))
            _progress(results["frontier"][-1])
        serve.shutdown()
        ray.shutdown()
        if not args.skip_reuse:
            results["redis_reuse"] = _redis_reuse(args, runner, redis.url, stream)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        redis.stop()
    reuse = results.get("redis_reuse", {})
    hit_cost = reuse.get("cpu_vs_full", 0.35)
    load_cost = max(0.0, reuse.get("redis_vs_full", hit_cost + 0.1) - hit_cost)
    rows = scale_estimate(hit_cost=hit_cost, load_cost=load_cost, n_requests=2000)
    results["estimate"] = {"hit_cost": hit_cost, "load_cost": load_cost, "rows": rows}
    _print(results)
    print(format_estimate(rows))
    if args.json_out:
        write_json(results, args.json_out)
    return 0


def _progress(result: dict) -> None:
    print(f"  {({k: v for k, v in result.items() if k != 'records'})}", flush=True)


def _rows(results: dict) -> list[tuple[str, dict]]:
    labels = {"a": "a round-robin", "b": "b round-robin + redis", "c": "c affinity + redis"}
    rows = [(labels[n] + (f" (slack {r['slack']})" if "slack" in r else ""), r) for n, r in results["configs"].items()]
    if "one" in results:
        rows.append(("one replica, same total cache", results["one"]))
    rows += [(f"c affinity + redis (slack {r['slack']})", r) for r in results.get("frontier", [])]
    return rows


def _print(results: dict) -> None:
    print(f"\ncachedrag bench cluster ({results['setup']['model']}, {results['setup']['replicas']} replicas, "
          f"{results['setup']['requests']} requests at concurrency {results['setup']['concurrency']})")
    print(f"{'config':<36} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p95':>9} {'req/s':>7} {'errors':>6} "
          f"{'wait':>6} {'load':>6} {'compute':>7} {'store':>6} {'other':>6} {'stranded':>8} {'spread':>6} {'longer':>6}")
    for label, r in _rows(results):
        p = r.get("parts", {})
        f = lambda k: f"{p[k]:.3f}" if p.get(k) is not None else "-"  # noqa: E731
        print(f"{label:<36} {r['hit_rate'] or 0:>8.3f} {r['ttft_p50_s'] or 0:>9.3f} {r['ttft_p95_s'] or 0:>9.3f} "
              f"{r['requests_per_s']:>7.3f} {r['errors']:>6} {f('wait_p50_s'):>6} {f('load_p50_s'):>6} "
              f"{f('compute_p50_s'):>7} {f('store_p50_s'):>6} {f('overhead_p50_s'):>6} {f('stranded_share'):>8} {f('spread_mean'):>6} "
              f"{f('joined_longer_share'):>6}")
    print("(wait / load / compute / store: medians of the server-side TTFT parts (store: planning and storing new "
          "chunk caches); other: client TTFT p50 minus server "
          "TTFT p50; stranded: share of time a replica had a request waiting while another idled; spread: mean "
          "most - fewest requests in flight; longer: share of requests that joined a longer queue)")
    a, b, c = (results["configs"].get(k) for k in "abc")
    if c and a and a["ttft_p50_s"] and c["ttft_p50_s"]:
        print(f"TTFT p50 c/a = {c['ttft_p50_s'] / a['ttft_p50_s']:.3f}" +
              (f"   c/b = {c['ttft_p50_s'] / b['ttft_p50_s']:.3f}" if b and b["ttft_p50_s"] else ""))
    if c and "one" in results and results["one"]["hit_rate"]:
        print(f"hit rate c/one = {(c['hit_rate'] or 0) / results['one']['hit_rate']:.3f}")
    if "redis_reuse" in results:
        print(f"redis reuse: {results['redis_reuse']}")
