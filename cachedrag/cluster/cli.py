"""``cachedrag serve --replicas N --backend ray``: the server as a Ray Serve deployment.

Owns: the cluster-only arguments (``add_arguments``, added to ``cachedrag serve``'s parser),
turning the parsed arguments into a ``ClusterConfig`` (``cluster_config``) and ``run``: start
(or join, ``--ray-address``) a Ray cluster, start a private Redis server for the shared tier
when no ``--redis-url`` is given (``--no-shared-cache``: none), deploy
``cachedrag.cluster.deployment.build_app`` on ``--host``/``--port`` and wait for SIGTERM /
SIGINT, then shut Serve, Ray (when we started it) and Redis down.

Does not own: the deployment (``deployment``), the single-process server (``cachedrag.server.cli``, which
adds these arguments to its parser and hands ``run`` the parsed ones) or the settings models and the
mapping of arguments to them (``cachedrag.server.config``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading

from cachedrag.errors import ConfigError

log = logging.getLogger("cachedrag.cluster")

APP_NAME = "cachedrag"


def add_arguments(parser: argparse.ArgumentParser, advanced=None) -> None:
    """The cluster's options: ``--replicas`` and ``--backend`` in their own group, the rest in
    ``advanced`` (a group of the caller's; default: the same group)."""
    group = parser.add_argument_group("scale-out (Ray Serve)")
    group.add_argument("--replicas", type=int, default=1, help="engine replicas (more than 1 needs --backend ray)")
    group.add_argument("--backend", default="local", choices=("local", "ray"),
                       help="local: one process; ray: replicas as a Ray Serve deployment")
    group = advanced if advanced is not None else group
    group.add_argument("--router", default="affinity", choices=("affinity", "round_robin"),
                       help="ray backend: chunk-affinity request router, or round-robin")
    group.add_argument("--ray-address", default=None, help="join this Ray cluster (e.g. 'auto'); default: start one here")
    group.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs reserved per replica")
    group.add_argument("--retries", type=int, default=2, help="re-sends of a request whose replica died before answering")
    group.add_argument("--no-shared-cache", action="store_true",
                       help="ray backend: no shared Redis tier (each replica keeps its own cache)")


def cluster_config(args: argparse.Namespace, redis_url: str | None):
    """A validated ``ClusterConfig`` from ``cachedrag serve``'s arguments (``ConfigError`` if bad):
    every replica gets one server's engine settings (with ``redis_url``, the shared tier) and
    server settings (scheduler, passages, default max_tokens, API key)."""
    from pydantic import ValidationError

    from cachedrag.cluster.deployment import ClusterConfig
    from cachedrag.cluster.replica import ReplicaSettings
    from cachedrag.server.config import engine_settings, first_error, server_config

    try:
        engine = engine_settings(args, redis_url=redis_url)
        replica = ReplicaSettings(engine=engine, server=server_config(args, engine))
        return ClusterConfig(replicas=args.replicas, router=args.router, retries=args.retries,
                             replica_cpus=args.replica_cpus, graceful_s=args.graceful_s, replica=replica)
    except ValidationError as exc:
        raise ConfigError(f"bad cluster setting: {first_error(exc)}") from None


def check_arguments(args: argparse.Namespace) -> None:
    if args.replicas < 1:
        raise ConfigError(f"--replicas must be >= 1, got {args.replicas}")
    if args.replicas > 1 and args.backend != "ray":
        raise ConfigError("--replicas > 1 needs --backend ray (pip install 'cachedrag[cluster]')")
    if args.backend == "ray":
        try:
            import ray  # noqa: F401
            from ray import serve  # noqa: F401
        except ImportError:
            raise ConfigError("--backend ray needs Ray Serve: pip install 'cachedrag[cluster]'") from None


def _port(host: str, port: int) -> int:
    if port:
        return port
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    import ray
    from ray import serve

    from cachedrag.cluster.deployment import build_app

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    redis_server = None
    redis_url = args.redis_url
    if redis_url is None and not args.no_shared_cache:
        from cachedrag.store.redis_server import start_redis_server

        redis_server = start_redis_server()
        redis_url = redis_server.url
        log.info("shared chunk-cache tier: private redis-server at %s", redis_url)
    config = cluster_config(args, redis_url)
    started_ray = False
    try:
        if not ray.is_initialized():
            ray.init(address=args.ray_address, include_dashboard=False)
            started_ray = args.ray_address is None
        port = _port(args.host, args.port)
        serve.start(http_options={"host": args.host, "port": port})
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        # printed whatever the log level, like the single-process server: scripts read the address
        print(f"cachedrag serve: listening on http://{args.host}:{port} ({config.replicas} replicas on Ray Serve, "
              f"router {config.router}, shared tier {redis_url or 'none'})", file=sys.stderr, flush=True)
        _wait_for_signal()
        log.info("cachedrag serve: stopping")
        serve.shutdown()
    finally:
        if started_ray:
            ray.shutdown()
        if redis_server is not None:
            redis_server.stop()
    print("cachedrag serve: stopped", file=sys.stderr, flush=True)
    return 0


def _wait_for_signal() -> None:
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stop.wait(0.5):
            pass
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
