"""The Ray Serve application: N engine replicas behind the same OpenAI-compatible API.

Owns: the two deployments and how they are bound together.

- ``EngineReplica`` — one ``cachedrag serve`` app (``cachedrag.server.app.create_app``: engine
  loop, batching, cache-aware order, metrics) per replica, over an engine whose chunk cache is
  the replica's own CPU tier plus the cluster's shared Redis tier
  (``cachedrag.cluster.replica``). Requests reach the app in-process (``asgi.call_app``) and
  stream back chunk by chunk. Its ``check_health`` fails when the engine loop died, so Serve
  replaces the replica.
- ``Ingress`` — a FastAPI front (``@serve.ingress``) that takes every request, fingerprints its
  chunks (``fingerprints``) and forwards it to ``EngineReplica`` through a deployment handle
  whose request router is ``ChunkAffinityRouter`` (or ``RoundRobinRouter``). Failure handling:
  a replica that dies before any byte of its response reached the client is retried on
  another replica (``retries`` times; generation has no side effects besides the cache); one
  that dies mid-stream ends the stream with an OpenAI-shaped ``replica_failed`` error event,
  never with a truncated answer presented as complete; a non-streaming answer is only sent
  once complete. ``GET /cluster/stats`` returns each live replica's counters.
- ``build_app(ClusterConfig)`` / ``app_builder(args)`` — the ``serve.run`` / ``serve.yaml``
  entry points (``import_path: cachedrag.cluster.deployment:app_builder``).

Does not own: the HTTP routes of the API itself (the server's app), the routing rule
(``affinity``), Ray cluster lifetime (``cachedrag.cluster.cli`` or the user's KubeRay).
"""

import asyncio
import json
import logging
import time
import uuid
from collections import deque
from typing import Literal

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig

from cachedrag.cluster.affinity import AffinityConfig
from cachedrag.cluster.asgi import ForwardedRequest, ResponseStart, call_app
from cachedrag.cluster import board  # board.BOARD at call time: Ray pickles these classes by value, which
#                                     would copy a global imported by name (and split the router's board from ours)
from cachedrag.cluster.fingerprints import Fingerprints, request_fingerprints
from cachedrag.cluster.replica import ReplicaSettings, SharedCacheSync, build_replica_engine
from cachedrag.cluster.timeline import RequestRecord

log = logging.getLogger("cachedrag.cluster")

ROUTERS = {
    "affinity": "cachedrag.cluster.router:ChunkAffinityRouter",
    "round_robin": "cachedrag.cluster.router:RoundRobinRouter",
}
REPLICA_DEPLOYMENT = "EngineReplica"
_REPLICA_ERRORS = (RayActorError, ActorDiedError, ActorUnavailableError)
_HOP_HEADERS = {b"content-length", b"transfer-encoding", b"connection"}


class ClusterConfig(BaseModel):
    """A cluster deployment: how many replicas, how requests reach them, what each runs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    replicas: int = Field(2, ge=1, description="engine replicas")
    router: Literal["affinity", "round_robin"] = Field("affinity", description="request router of the replicas")
    slack: int = Field(AffinityConfig.model_fields["slack"].default, ge=0,
                       description="affinity: queued requests beyond the least-loaded replica still routed by affinity")
    load_factor: float = Field(AffinityConfig.model_fields["load_factor"].default, ge=1.0,
                               description="affinity: bounded-load factor over the mean queue length after placing")
    prefill_slack: int = Field(AffinityConfig.model_fields["prefill_slack"].default, ge=0,
                               description="affinity: requests before their first token a replica may hold beyond "
                                           "the replica with the fewest and still be a candidate")
    retries: int = Field(2, ge=0, description="re-sends of a request whose replica died before answering")
    replica_cpus: float = Field(1.0, gt=0, description="Ray CPUs reserved per replica")
    max_ongoing_requests: int = Field(32, ge=1, description="requests Serve sends one replica at once")
    graceful_s: float = Field(5.0, ge=0, description="seconds a stopping replica's in-flight requests get to finish")
    replica: ReplicaSettings = Field(default_factory=ReplicaSettings)


def _error(status: int, message: str, type_: str, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def _short(exc: BaseException | None) -> str:
    text = repr(exc) if exc is not None else "unknown error"
    return text.splitlines()[0][:200]


def _replica_ids(app_name: str | None = None) -> list[str]:
    """Unique ids of the live ``EngineReplica`` replicas (their actor names carry them)."""
    prefix = "SERVE_REPLICA::"
    out = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"] if isinstance(actor, dict) else actor
        if not name.startswith(prefix):
            continue
        parts = name[len(prefix):].split("#")
        if len(parts) >= 2 and parts[-2] == REPLICA_DEPLOYMENT and (app_name is None or parts[0] == app_name):
            out.append(parts[-1])
    return sorted(out)


class _Recorder:
    """The engine loop's observer: forwards to the server's metrics and keeps a bounded log of
    finished requests (``RequestRecord``: arrival, TTFT, load and compute time) for
    ``cachedrag.cluster.timeline``."""

    def __init__(self, metrics, replica: str, keep: int = 10_000):
        self.metrics = metrics
        self.replica = replica
        self.records: deque[RequestRecord] = deque(maxlen=keep)

    def on_step(self, batch_size: int, waiting: int) -> None:
        self.metrics.on_step(batch_size, waiting)

    def on_first_token(self, seconds: float) -> None:
        self.metrics.on_first_token(seconds)

    def on_token(self, seconds: float) -> None:
        self.metrics.on_token(seconds)

    def on_finished(self, done) -> None:
        self.metrics.on_finished(done)
        s = done.stats
        self.records.append(RequestRecord(
            replica=self.replica, arrival=time.time() - done.total_s, ttft_s=done.ttft_s, total_s=done.total_s,
            load_s=float(s.get("load_s", 0.0)), prefill_s=float(s.get("prefill_s", 0.0)),
            chunks_hit=int(s.get("chunks_hit", 0)), chunks_missed=int(s.get("chunks_missed", 0)),
            call_s=float(s.get(_CALL_S, 0.0))))


_CALL_S = "replica_prefill_call_s"


class _TimedEngine:
    """The replica's engine as the server's app sees it: the same object, except that each
    ``prefill`` call's whole duration (plan, load, compute, storing new caches) is added to its
    stats (``replica_prefill_call_s``), so a request's TTFT splits into wait and service."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def prefill(self, *args, **kwargs):
        t0 = time.perf_counter()
        pre = self._engine.prefill(*args, **kwargs)
        pre.info[_CALL_S] = time.perf_counter() - t0
        return pre


@serve.deployment(name=REPLICA_DEPLOYMENT, health_check_period_s=2, health_check_timeout_s=30)
class EngineReplica:
    """One engine + the server's app; requests arrive as ``ForwardedRequest``s."""

    async def __init__(self, settings: ReplicaSettings):
        from cachedrag.server.app import create_app

        self.settings = settings
        self.engine = build_replica_engine(settings)
        self.sync = SharedCacheSync(self.engine.manager, settings.refresh_s)
        self.app = create_app(_TimedEngine(self.engine), settings.server_config)
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()  # starts the engine loop
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # constructed outside Serve (tests of the class itself)
            self.replica_id = "local"
        self._header = [(b"x-cachedrag-replica", self.replica_id.encode())]
        self.recorder = _Recorder(self.app.state.metrics, self.replica_id)
        self.app.state.loop.observer = self.recorder
        self.served = 0

    async def handle(self, request: ForwardedRequest, route: Fingerprints | None = None, replica: str | None = None,
                     ticket: str | None = None):
        """Stream the app's response: ``ResponseStart``, then body chunks."""
        self.sync.poke()  # adopt what other replicas wrote meanwhile (background, rate-limited)
        self.served += 1
        async for item in call_app(self.app, request, self._header):
            yield item

    def check_health(self) -> None:
        thread = self.app.state.loop._thread
        if thread is None or not thread.is_alive():
            raise RuntimeError("the engine loop is not running")

    def stats(self, replica: str | None = None, records: bool = False) -> dict:
        """This replica's counters: requests, chunk hits/misses, shared-tier refreshes, tiers;
        ``records``: also its finished requests' ``RequestRecord`` dicts."""
        manager = self.engine.manager
        registry = self.app.state.metrics.registry  # the server's Prometheus counters
        counts = {name: registry.get_sample_value(f"cachedrag_{name}_total") or 0.0
                  for name in ("chunk_hits", "chunk_misses", "prompt_tokens", "cached_prompt_tokens")}
        out = {"replica": self.replica_id, "requests": self.served, **counts, "manager": manager.stats(),
               "sync": self.sync.stats()}
        store = manager.store
        tiers = getattr(store, "tiers", None)
        if tiers is not None:
            out["tiers"] = {t.name: {"used_bytes": t.used_bytes, "hits": t.stats.hits, "misses": t.stats.misses}
                            for t in tiers}
        if records:
            out["records"] = [r.to_dict() for r in list(self.recorder.records)]
        return out

    async def __del__(self):
        try:
            await self._lifespan.__aexit__(None, None, None)
        except Exception:
            pass


ingress_app = FastAPI(title="cachedrag cluster")


@serve.deployment(name="Ingress", ray_actor_options={"num_cpus": 0})
@serve.ingress(ingress_app)
class Ingress:
    """OpenAI-compatible front: fingerprints chunks, forwards to a replica, retries on replica death."""

    def __init__(self, engines, retries: int = 2, passage_chars: int = 200):
        self.engines = engines
        self.retries = retries
        self.passage_chars = passage_chars
        self.counters = {"requests": 0, "retried": 0, "failed_mid_stream": 0, "failed": 0}

    @ingress_app.get("/cluster/stats")
    async def cluster_stats(self, records: bool = False):
        """Counters of every live replica (and the ingress's own); ``?records=true``: also each
        replica's finished requests (``cachedrag.cluster.timeline.RequestRecord``)."""
        out = {}
        for r in _replica_ids():  # one at a time: Serve matches concurrent sub-requests of one request by its id
            try:
                out[r] = await asyncio.wait_for(self.engines.stats.remote(replica=r, records=records), timeout=5)
            except (asyncio.TimeoutError, *_REPLICA_ERRORS) as exc:
                out[r] = {"error": _short(exc)}
        return {"ingress": {**self.counters, "before_first_token": len(board.BOARD)}, "replicas": out}

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(self, path: str, request: Request):
        body = await request.body()
        fwd = ForwardedRequest(request.method, "/" + path, body,
                               [(k, v) for k, v in request.headers.raw if k.lower() not in _HOP_HEADERS],
                               request.url.query.encode())
        route = Fingerprints()
        if request.method == "POST" and body:
            try:
                route = request_fingerprints(json.loads(body), min_chars=self.passage_chars)
            except (ValueError, UnicodeDecodeError):
                pass  # not JSON: the replica's app answers with its 400
        self.counters["requests"] += 1
        ticket = uuid.uuid4().hex  # this request on the prefill board (cachedrag.cluster.board)
        streaming = False
        try:
            last: BaseException | None = None
            for attempt in range(self.retries + 1):
                if attempt:
                    self.counters["retried"] += 1
                stream = self.engines.options(stream=True).handle.remote(fwd, route=route, ticket=ticket)
                try:
                    start = await stream.__anext__()
                except _REPLICA_ERRORS as exc:
                    last = exc
                    continue
                assert isinstance(start, ResponseStart)
                answering = start.header("x-cachedrag-replica")
                if answering:
                    board.BOARD.routed(ticket, answering)
                headers = {k.decode(): v.decode() for k, v in start.headers if k.lower() not in _HOP_HEADERS}
                if (start.header("content-type") or "").startswith("text/event-stream"):
                    streaming = True  # the relay clears the ticket at the first content event
                    return StreamingResponse(self._relay(stream, ticket), status_code=start.status, headers=headers)
                try:
                    chunks = [c async for c in stream]
                except _REPLICA_ERRORS as exc:  # nothing was sent to the client yet: retry
                    last = exc
                    continue
                return Response(b"".join(chunks), status_code=start.status, headers=headers)
        finally:
            if not streaming:
                board.BOARD.started(ticket)
        self.counters["failed"] += 1
        message = f"no replica could serve the request after {self.retries + 1} attempts: {_short(last)}"
        return JSONResponse(_error(503, message, "service_unavailable", "replica_failed"), status_code=503)

    async def _relay(self, stream, ticket: str):
        try:
            async for chunk in stream:
                if b'"role"' not in chunk:  # past the chat role event: the first token (or the end) arrived
                    board.BOARD.started(ticket)
                yield chunk
        except _REPLICA_ERRORS as exc:
            self.counters["failed_mid_stream"] += 1
            message = f"the replica serving this stream failed mid-answer ({_short(exc)}); the answer is incomplete, retry the request"
            yield f"data: {json.dumps(_error(503, message, 'service_unavailable', 'replica_failed'))}\n\n".encode()
            yield b"data: [DONE]\n\n"
        finally:
            board.BOARD.started(ticket)


def build_app(config: ClusterConfig):
    """The Serve application (``serve.run(build_app(config))``)."""
    router = RequestRouterConfig(
        request_router_class=ROUTERS[config.router],
        request_router_kwargs={"slack": config.slack, "load_factor": config.load_factor,
                               "prefill_slack": config.prefill_slack}
        if config.router == "affinity" else {},
    )
    engines = EngineReplica.options(
        num_replicas=config.replicas, request_router_config=router, max_ongoing_requests=config.max_ongoing_requests,
        graceful_shutdown_timeout_s=config.graceful_s,
        ray_actor_options={"num_cpus": config.replica_cpus},
    ).bind(config.replica)
    return Ingress.bind(engines, retries=config.retries, passage_chars=config.replica.server.passages.min_chars)


def app_builder(args: dict):
    """``serve.yaml`` entry point: ``args`` are ``ClusterConfig`` fields (``replica:`` nested)."""
    return build_app(ClusterConfig.model_validate(args or {}))
