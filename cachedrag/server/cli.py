"""``cachedrag serve``: parse arguments, build the engine and store, run uvicorn.

Owns: the command's arguments, ``build_engine`` (model -> runner -> chunk-cache store ->
``CachedEngine``), binding the listening socket (so the logged address is the real one, also
with ``--port 0``) and running uvicorn, which stops cleanly on SIGTERM / SIGINT (in-flight
requests get ``--graceful-s`` seconds, then the engine loop stops and the process exits 0).

Does not own: the app (``app``) or the loop.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import socket
import sys

from cachedrag.errors import ConfigError
from cachedrag.kvcache.config import EXACT_REPEAT_TIMINGS
from cachedrag.server.config import FIDELITY_LEVELS, SERVER_EXACT_REPEATS_WHEN
from cachedrag.server.policy import MAX_DELAY_S, PREEMPT_RATIO

log = logging.getLogger("cachedrag.server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (0 = any free port; default 8000)")
    parser.add_argument("--model", default=None, help="HF model id or path (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", default=None, help="the id clients send as `model` (default: the model's name)")
    parser.add_argument("--tiny", action="store_true", help="serve a tiny random-weight model (tests, smoke checks)")
    parser.add_argument("--mode", default=None, choices=("cachedrag", "prefix", "full"),
                        help="chunk reuse mode (default cachedrag, or the --fidelity level's)")
    parser.add_argument("--fidelity", default=None, choices=FIDELITY_LEVELS,
                        help="a fidelity level (docs/fidelity.md): exact (prefix reuse only), faithful (every "
                             "answer full prefill's, TTFT of guarded; answers take longer), guarded, balanced (the "
                             "engine's defaults), fast; sets the mode and recompute policy; --tie-guard* flags given "
                             "beside it win over its values")
    parser.add_argument("--device", default="auto",
                        help="auto (default: CUDA where present), cpu, cuda or cuda:N; --tiny runs on the CPU")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                        help="activations, working KV and dense weights (default float32; bfloat16 with "
                             "--weights int8/int4; docs/speed.md)")
    parser.add_argument("--weights", default="dense", choices=("dense", "int8", "int8-dynamic", "int4"),
                        help="weight format: dense (in --dtype), int8 or int4 weight-only, or int8-dynamic "
                             "(int8 weights and per-token int8 decode activations; needs VNNI) (default dense)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: the cores this process may use)")
    parser.add_argument("--prefill-pairs", default="scores", choices=("scores", "scores+values", "none"),
                        help="bf16 prefill attention on AVX512-BF16 CPUs: bf16 pairs for the scores (default; the "
                             "float32 path's accuracy), for the value products too (probabilities rounded to bf16, "
                             "~3%% faster prefills), or none (docs/speed.md, prefill attention round 13)")
    parser.add_argument("--max-batch", type=int, default=8, help="most requests decoding together (1 = no batching)")
    parser.add_argument("--max-waiting", type=int, default=256, help="waiting-queue limit; beyond it requests get 503")
    parser.add_argument("--order", default="cache_aware", choices=("cache_aware", "fifo"), help="prefill admission order")
    parser.add_argument("--starvation-s", type=float, default=10.0, help="cache-aware order: max wait before a request goes first")
    parser.add_argument("--max-delay-s", type=float, default=MAX_DELAY_S,
                        help="cache-aware order: a younger request goes ahead only while every waiting request is "
                             "forecast to be admitted at most this much later than in arrival order "
                             f"(default {MAX_DELAY_S:g}; inf = no bound)")
    parser.add_argument("--preempt-ratio", type=float, default=PREEMPT_RATIO,
                        help="cache-aware order: between the layers of a running prefill, the next waiting request "
                             "(when no older one waits) is prefilled first if its whole prefill is forecast to take "
                             "at most this fraction of what the running one has left; once per prefill "
                             f"(default {PREEMPT_RATIO:g}; 0 = off)")
    parser.add_argument("--max-overtakes", type=int, default=None,
                        help="cache-aware order: a request passed by this many younger ones goes first "
                             "(default: no cap; 0 = arrival order)")
    parser.add_argument("--hold-waiting", action=argparse.BooleanOptionalAction, default=True,
                        help="the chunk cache evicts the chunks of waiting requests last, so a request finds what was "
                             "cached when it arrived (matters below the working set; default on)")
    parser.add_argument("--prefills-per-step", type=int, default=1, help="prefills admitted between decode steps")
    parser.add_argument("--prefill-chunk-tokens", type=int, default=256,
                        help="chunked prefill: running requests decode after every this many prompt tokens of "
                             "prefill compute (0 = off)")
    parser.add_argument("--kv-pool-tokens", type=int, default=0,
                        help="pooled KV for requests up to this many positions: one attention call per layer for the "
                             "batch over whole 512-key blocks (batch-invariant; step time +8%%/-1%%/-5%% at batch "
                             "1/4/8, bf16), rounding apart from the runner's own step (0 = off, default)")
    parser.add_argument("--trim-heap-idle-s", type=float, default=1.0,
                        help="after this many idle seconds, return freed heap memory (finished requests' KV "
                             "buffers) to the OS, so RSS falls back after a burst (default 1; inf = never)")
    parser.add_argument("--no-auto-chunks", action="store_true", help="no automatic passage detection (explicit chunks only)")
    parser.add_argument("--passage-chars", type=int, default=200, help="shortest paragraph treated as a passage (auto mode)")
    parser.add_argument("--attach-separators", action="store_true",
                        help="the whitespace after each chunk joins the chunk's segment: cold prefills ~1.15x a full "
                             "prefill instead of up to 1.9x and repeated chunk sequences exact tree hits, but lower "
                             "answer fidelity in the one run measured (docs/serving.md)")
    parser.add_argument("--tokenization", choices=("whole", "parts"), default="whole",
                        help="whole (default): tokenise the rendered prompt as one text, the ids any server computes "
                             "for these messages, cut at chunk boundaries; parts: each chunk and text part alone")
    parser.add_argument("--max-tokens", type=int, default=256, help="max_tokens when a request gives none")
    parser.add_argument("--exact-repeats", type=int, default=None,
                        help="reuse-served sightings of a chunk sequence before its exact tree path is computed "
                             "(CacheConfig.exact_repeats; 0 = never; default the engine's)")
    parser.add_argument("--exact-repeats-when", default=None, choices=EXACT_REPEAT_TIMINGS,
                        help="when a recurring chunk sequence gets its exact tree path (CacheConfig.exact_repeats_when; "
                             f"default {SERVER_EXACT_REPEATS_WHEN}: in idle time, else inline at its next sighting)")
    parser.add_argument("--tie-guard", type=float, default=None,
                        help="prefill a request again exactly when its approximate prefill's first token is a near "
                             "tie: top-2 logits closer than this many nats (CacheConfig.tie_guard; default 0 = off; "
                             "docs/fidelity.md, lever 4)")
    parser.add_argument("--tie-guard-trend", type=float, default=None,
                        help="with --tie-guard: prefill a near tie again only when the trend check predicts the "
                             "approximation flips it (CacheConfig.tie_guard_trend; e.g. 0.5; default 0 = every near "
                             "tie)")
    parser.add_argument("--tie-guard-floor", type=float, default=None,
                        help="with --tie-guard-trend: prefill a near tie again when its predicted margin falls below "
                             "this many nats instead of 0 (CacheConfig.tie_guard_floor; e.g. 0.1; default 0)")
    parser.add_argument("--tie-guard-decode", type=float, default=None,
                        help="while an answer decodes on approximate KV, a token whose top-2 logits are closer than "
                             "this many nats moves it onto an exact prefill of the prompt and the answer so far "
                             "(CacheConfig.tie_guard_decode; default 0 = off; docs/fidelity.md)")
    parser.add_argument("--exact-when-waiting", type=int, default=1,
                        help="with --tie-guard-decode inf (--fidelity faithful): admit a request with an exact "
                             "(prefix caching) prefill while at least this many requests wait behind it, since its "
                             "answer moves onto exact KV before its second token anyway (0 = never; default 1)")
    parser.add_argument("--exact-whole-answers", action=argparse.BooleanOptionalAction, default=True,
                        help="with --tie-guard-decode inf (--fidelity faithful): admit a non-streaming request with "
                             "an exact (prefix caching) prefill, since nobody sees its first token early and its "
                             "answer moves onto exact KV before its second token anyway (default on)")
    parser.add_argument("--cache-gb", type=float, default=2.0, help="in-memory chunk-cache budget (GB)")
    parser.add_argument("--disk-dir", default=None, help="add a disk tier in this directory (persists across restarts)")
    parser.add_argument("--disk-gb", type=float, default=10.0, help="disk tier budget (GB) with --disk-dir")
    parser.add_argument("--redis-url", default=None, help="add a shared Redis tier (redis://host:port/db)")
    parser.add_argument("--redis-gb", type=float, default=4.0, help="Redis tier budget (GB) with --redis-url")
    parser.add_argument("--graceful-s", type=float, default=5.0, help="seconds in-flight requests get on shutdown")
    parser.add_argument("--api-key", default=os.environ.get("CACHEDRAG_API_KEY") or None,
                        help="require 'Authorization: Bearer <key>' on every /v1 route (default: $CACHEDRAG_API_KEY; "
                             "none: open); /health and /metrics stay open")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    from cachedrag.cluster.cli import add_arguments as add_cluster_arguments  # --replicas N --backend ray

    add_cluster_arguments(parser)


def _bound(seconds: float) -> float | None:
    return None if seconds == float("inf") else seconds


#: flags only one server process honours, with their defaults: replicas load the model's float32
#: dense weights on the CPU and share the Redis tier, so these are refused with --replicas
SINGLE_PROCESS_ONLY = {"device": "auto", "dtype": None, "weights": "dense", "prefill_pairs": "scores",
                       "disk_dir": None}


def scheduler_config(args: argparse.Namespace):
    """The ``SchedulerConfig`` of ``cachedrag serve``'s arguments (one server or every replica)."""
    from cachedrag.server.config import SchedulerConfig

    return SchedulerConfig(max_batch=args.max_batch, max_waiting=args.max_waiting, order=args.order,
                           starvation_s=args.starvation_s, max_overtakes=args.max_overtakes,
                           max_delay_s=_bound(args.max_delay_s), preempt_ratio=args.preempt_ratio,
                           hold_waiting=args.hold_waiting,
                           prefills_per_step=args.prefills_per_step,
                           prefill_chunk_tokens=args.prefill_chunk_tokens, kv_pool_tokens=args.kv_pool_tokens,
                           exact_when_waiting=args.exact_when_waiting, exact_whole_answers=args.exact_whole_answers,
                           trim_heap_idle_s=_bound(args.trim_heap_idle_s))


def passage_config(args: argparse.Namespace):
    """The ``PassageConfig`` of ``cachedrag serve``'s arguments (one server or every replica)."""
    from cachedrag.server.config import PassageConfig

    return PassageConfig(enabled=not args.no_auto_chunks, min_chars=args.passage_chars,
                         attach_separators=args.attach_separators, tokenization=args.tokenization)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "backend", "local") == "ray" or getattr(args, "replicas", 1) != 1:
        given = ["--" + dest.replace("_", "-") for dest, default in SINGLE_PROCESS_ONLY.items()
                 if getattr(args, dest) != default]
        if given:
            raise ConfigError(f"{', '.join(given)}: only one server process honours this; replicas (--replicas / "
                              "--backend ray) run the model's float32 dense weights on the CPU and share the "
                              "Redis tier")
        from cachedrag.cluster.cli import run as run_cluster  # replicas on Ray Serve (docs/scale-out.md)

        return run_cluster(args)
    import uvicorn

    class _Server(uvicorn.Server):
        """Shuts down gracefully on SIGTERM/SIGINT and then returns (exit 0) instead of re-raising the signal."""

        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                log.info("cachedrag serve: %s received, shutting down", signal.Signals(sig).name)
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

    from cachedrag.server.app import create_app
    from cachedrag.server.config import ServerConfig, server_mode

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        scheduler, passages = scheduler_config(args), passage_config(args)
        name = args.served_model_name or ("tiny-random" if args.tiny else (args.model or "SmolLM2-135M-Instruct"))
        mode = server_mode(args.fidelity, args.mode)
        config = ServerConfig(host=args.host, port=args.port, model_name=name, mode=mode, scheduler=scheduler,
                              passages=passages, default_max_tokens=args.max_tokens, api_key=args.api_key)
    except ValueError as exc:  # before the model loads
        raise ConfigError(f"bad server setting: {_first_error(exc)}") from None
    engine = build_engine(args)
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
        sock.listen(2048)  # connections queue from the moment the address is logged (uvicorn accepts them)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    host, port = sock.getsockname()[:2]
    app = create_app(engine, config)
    server = _Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=args.graceful_s,
                                           access_log=args.log_level == "debug"))
    freeze_startup_objects()
    # printed whatever the log level: scripts (bench serve, tests) read the address from this line
    print(f"cachedrag serve: listening on http://{host}:{port} (model {name}, mode {mode}"
          f"{f', fidelity {args.fidelity}' if args.fidelity else ''}, "
          f"max batch {args.max_batch}, order {args.order}{', API key required' if args.api_key else ''})",
          file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    print("cachedrag serve: stopped", file=sys.stderr, flush=True)
    return 0


def freeze_startup_objects() -> int:
    """Move every object alive after startup (model, tokenizer, engine, app: ~430k for the default
    model) out of the garbage collector's scans (``gc.freeze``), after one collection; returns how
    many. They live as long as the process, and a full collection over them paused the whole
    server for 240-280 ms (measured on the default model, bf16); after the freeze one takes ~0 ms,
    so the collections that long uptime brings no longer stall running requests. Only the
    ``cachedrag serve`` process does this (``create_app`` leaves an embedding process's collector alone)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def build_engine(args: argparse.Namespace):
    """The ``CachedEngine`` the server runs: model, then its chunk-cache store."""
    from cachedrag.engine import CachedEngine
    from cachedrag.fingerprint import namespace_for
    from cachedrag.model.runner import ModelRunner, resolve_device
    from cachedrag.server.config import server_engine_config, tie_guard_settings

    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"bad server setting: --threads must be >= 1, got {args.threads}")
    resolve_device(args.device)  # a bad or absent device is refused before any model loads (also with --tiny)
    numerics = dict(dtype=args.dtype, weights=args.weights, threads=args.threads, prefill_pairs=args.prefill_pairs)
    if args.tiny:
        from cachedrag.testing import tiny_runner

        runner = tiny_runner(**numerics)
    else:
        runner = ModelRunner.from_pretrained(args.model, device=args.device, **numerics)  # warmed up here
    gb = 1 << 30
    config = server_engine_config(args.fidelity, args.mode, int(args.cache_gb * gb), args.exact_repeats,
                                  args.exact_repeats_when, tie_guard_settings(args))
    store = None
    if args.disk_dir or args.redis_url:
        from cachedrag.store.config import StoreConfig
        from cachedrag.store.tiered import TieredStore

        try:
            store_config = StoreConfig(
                namespace=namespace_for(runner.model, runner.tokenizer).digest, cpu_bytes=int(args.cache_gb * gb),
                disk_dir=args.disk_dir, disk_bytes=int(args.disk_gb * gb) if args.disk_dir else 0,
                redis_url=args.redis_url, redis_bytes=int(args.redis_gb * gb) if args.redis_url else 0)
        except ValueError as exc:
            raise ConfigError(f"bad store setting: {_first_error(exc)}") from None
        store = TieredStore.from_config(store_config)
    return CachedEngine(runner, config=config, store=store)


def _first_error(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        return f"{'.'.join(str(x) for x in first.get('loc', ()))}: {first.get('msg')}"
    return str(exc)
