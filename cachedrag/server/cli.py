"""``cachedrag serve``: parse arguments, build the engine and store, run uvicorn.

Owns: the command's arguments (``add_arguments``: the user-facing options in ``--help``, the
tuning ones in an advanced group that ``--help-all`` shows; ``--config FILE`` reads settings
from a file, which flags given on the command line override), ``build_engine`` (model ->
runner -> chunk-cache store -> ``CachedEngine``), binding the listening socket (so the logged
address is the real one, also with ``--port 0``) and running uvicorn, which stops cleanly on
SIGTERM / SIGINT (in-flight requests get ``--graceful-s`` seconds, then the engine loop stops and
the process exits 0).

Does not own: the settings models and the mapping of arguments to them (``config``), the app
(``app``) or the loop, the cluster's own arguments (``cachedrag.cluster.cli``).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import socket
import sys

from cachedrag.cluster.cli import add_arguments as add_cluster_arguments
from cachedrag.errors import ConfigError
from cachedrag.kvcache.config import EXACT_REPEAT_TIMINGS
from cachedrag.server.config import (FIDELITY_LEVELS, SERVER_EXACT_REPEATS_WHEN, SINGLE_PROCESS_ONLY,
                                     engine_settings, first_error, flag_values, load_serve_file, server_config)
from cachedrag.server.policy import MAX_DELAY_S, PREEMPT_RATIO

log = logging.getLogger("cachedrag.server")


class _HelpAll(argparse.Action):
    """``--help-all``: the help with the advanced options too, then exit."""

    def __init__(self, option_strings, dest, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        for action in parser._actions:
            if hasattr(action, "full_help"):
                action.help = action.full_help
        parser.print_help()
        parser.exit()


class ServeParser(argparse.ArgumentParser):
    """``cachedrag serve``'s parser: after parsing, a ``--config`` file's settings fill every option
    not given on the command line (a bad file: one line on stderr, exit 2)."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        path = getattr(namespace, "config", None)
        if path:
            try:
                values = flag_values(load_serve_file(path))
            except ConfigError as exc:
                self.exit(2, f"cachedrag: error: {' '.join(str(exc).split())}\n")
            given = self._given(sys.argv[1:] if args is None else list(args))
            for dest, value in values.items():
                if dest not in given:
                    setattr(namespace, dest, value)
        return namespace, extras

    def _given(self, args: list[str]) -> set[str]:
        """The destinations of the options ``args`` names (parsed again with every default suppressed)."""
        defaults = [(action, action.default) for action in self._actions]
        try:
            for action, _ in defaults:
                action.default = argparse.SUPPRESS
            namespace, _ = super().parse_known_args(args, argparse.Namespace())
        finally:
            for action, default in defaults:
                action.default = default
        return set(vars(namespace))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``cachedrag serve``'s options: user-facing ones in ``--help``, the rest in ``--help-all``."""
    parser.__class__ = ServeParser  # the --config file fills what the command line leaves out
    parser.add_argument("--help-all", action=_HelpAll, dest="help_all", help="show every option, advanced ones too")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="read settings from a JSON or TOML file: {\"server\": {... \"scheduler\": {...}, "
                             "\"passages\": {...}}, \"engine\": {...}} (cachedrag.server.config.ServeSettings); "
                             "flags given here win over it")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (0 = any free port; default 8000)")
    parser.add_argument("--model", default=None, help="HF model id, path or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", default=None, help="the id clients send as `model` (default: the model's name)")
    parser.add_argument("--fidelity", default=None, choices=FIDELITY_LEVELS,
                        help="a fidelity level (docs/fidelity.md): exact (prefix reuse only), faithful (every "
                             "answer full prefill's, TTFT of guarded; answers take longer), guarded, balanced (the "
                             "engine's defaults), fast; sets the mode and recompute policy; --tie-guard* flags given "
                             "beside it win over its values")
    parser.add_argument("--mode", default=None, choices=("cachedrag", "prefix", "full"),
                        help="chunk reuse mode (default cachedrag, or the --fidelity level's)")
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
    parser.add_argument("--max-batch", type=int, default=8, help="most requests decoding together (1 = no batching)")
    parser.add_argument("--max-tokens", type=int, default=256, help="max_tokens when a request gives none")
    parser.add_argument("--index", default=None, metavar="DIR",
                        help="an index directory (`cachedrag index build`): its chunks are known passages (found whole in "
                             "prompts and tool results); /v1/embeddings embeds with its embedder")
    parser.add_argument("--cache-gb", type=float, default=2.0, help="in-memory chunk-cache budget (GB)")
    parser.add_argument("--disk-dir", default=None, help="add a disk tier in this directory (persists across restarts)")
    parser.add_argument("--disk-gb", type=float, default=10.0, help="disk tier budget (GB) with --disk-dir")
    parser.add_argument("--redis-url", default=None, help="add a shared Redis tier (redis://host:port/db)")
    parser.add_argument("--redis-gb", type=float, default=4.0, help="Redis tier budget (GB) with --redis-url")
    parser.add_argument("--api-key", default=os.environ.get("CACHEDRAG_API_KEY") or None,
                        help="require 'Authorization: Bearer <key>' on every /v1 route (default: $CACHEDRAG_API_KEY; "
                             "none: open); /health and /metrics stay open")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    advanced = parser.add_argument_group("advanced (tuning, tests)")
    _add_advanced_arguments(advanced)
    add_cluster_arguments(parser, advanced)
    for action in advanced._group_actions:  # shown by --help-all only
        action.full_help, action.help = action.help, argparse.SUPPRESS


def _add_advanced_arguments(group) -> None:
    group.add_argument("--max-waiting", type=int, default=256, help="waiting-queue limit; beyond it requests get 503")
    group.add_argument("--tiny", action="store_true", help="serve a tiny random-weight model (tests, smoke checks)")
    group.add_argument("--prefill-pairs", default="scores", choices=("scores", "scores+values", "none"),
                       help="bf16 prefill attention on AVX512-BF16 CPUs: bf16 pairs for the scores (default; the "
                            "float32 path's accuracy), for the value products too (probabilities rounded to bf16, "
                            "~3%% faster prefills), or none (docs/speed.md)")
    group.add_argument("--order", default="cache_aware", choices=("cache_aware", "fifo"), help="prefill admission order")
    group.add_argument("--starvation-s", type=float, default=10.0, help="cache-aware order: max wait before a request goes first")
    group.add_argument("--max-delay-s", type=float, default=MAX_DELAY_S,
                       help="cache-aware order: a younger request goes ahead only while every waiting request is "
                            "forecast to be admitted at most this much later than in arrival order "
                            f"(default {MAX_DELAY_S:g}; inf = no bound)")
    group.add_argument("--preempt-ratio", type=float, default=PREEMPT_RATIO,
                       help="cache-aware order: between the layers of a running prefill, the next waiting request "
                            "(when no older one waits) is prefilled first if its whole prefill is forecast to take "
                            "at most this fraction of what the running one has left; once per prefill "
                            f"(default {PREEMPT_RATIO:g}; 0 = off)")
    group.add_argument("--max-overtakes", type=int, default=None,
                       help="cache-aware order: a request passed by this many younger ones goes first "
                            "(default: no cap; 0 = arrival order)")
    group.add_argument("--hold-waiting", action=argparse.BooleanOptionalAction, default=True,
                       help="the chunk cache evicts the chunks of waiting requests last, so a request finds what was "
                            "cached when it arrived (matters below the working set; default on)")
    group.add_argument("--prefills-per-step", type=int, default=1, help="prefills admitted between decode steps")
    group.add_argument("--prefill-chunk-tokens", type=int, default=256,
                       help="chunked prefill: running requests decode after every this many prompt tokens of "
                            "prefill compute (0 = off)")
    group.add_argument("--trim-heap-idle-s", type=float, default=1.0,
                       help="after this many idle seconds, return freed heap memory (finished requests' KV "
                            "buffers) to the OS, so RSS falls back after a burst (default 1; inf = never)")
    group.add_argument("--no-auto-chunks", action="store_true", help="no automatic passage detection (explicit chunks only)")
    group.add_argument("--passage-chars", type=int, default=200, help="shortest paragraph treated as a passage (auto mode)")
    group.add_argument("--passage-capacity", type=int, default=20_000,
                       help="distinct passages remembered for automatic detection (least recently seen leave first)")
    group.add_argument("--attach-separators", action="store_true",
                       help="the whitespace after each chunk joins the chunk's segment: cold prefills ~1.15x a full "
                            "prefill instead of up to 1.9x and repeated chunk sequences exact tree hits, but lower "
                            "answer fidelity in the one run measured (docs/serving.md)")
    group.add_argument("--tokenization", choices=("whole", "parts"), default="whole",
                       help="whole (default): tokenise the rendered prompt as one text, the ids any server computes "
                            "for these messages, cut at chunk boundaries; parts: each chunk and text part alone")
    group.add_argument("--exact-repeats", type=int, default=None,
                       help="reuse-served sightings of a chunk sequence before its exact tree path is computed "
                            "(CacheConfig.exact.repeats; 0 = never; default the engine's)")
    group.add_argument("--exact-repeats-when", default=None, choices=EXACT_REPEAT_TIMINGS,
                       help="when a recurring chunk sequence gets its exact tree path (CacheConfig.exact.repeats_when; "
                            f"default {SERVER_EXACT_REPEATS_WHEN}: in idle time, else inline at its next sighting)")
    group.add_argument("--tie-guard", type=float, default=None,
                       help="prefill a request again exactly when its approximate prefill's first token is a near "
                            "tie: top-2 logits closer than this many nats (CacheConfig.exact.tie_guard; default 0 = off; "
                            "docs/fidelity.md, lever 4)")
    group.add_argument("--tie-guard-decode", type=float, default=None,
                       help="while an answer decodes on approximate KV, a token whose top-2 logits are closer than "
                            "this many nats moves it onto an exact prefill of the prompt and the answer so far "
                            "(CacheConfig.exact.tie_guard_decode; default 0 = off; docs/fidelity.md)")
    group.add_argument("--exact-when-waiting", type=int, default=1,
                       help="with --tie-guard-decode inf (--fidelity faithful): admit a request with an exact "
                            "(prefix caching) prefill while at least this many requests wait behind it, since its "
                            "answer moves onto exact KV before its second token anyway (0 = never; default 1)")
    group.add_argument("--exact-whole-answers", action=argparse.BooleanOptionalAction, default=True,
                       help="with --tie-guard-decode inf (--fidelity faithful): admit a non-streaming request with "
                            "an exact (prefix caching) prefill, since nobody sees its first token early and its "
                            "answer moves onto exact KV before its second token anyway (default on)")
    group.add_argument("--graceful-s", type=float, default=5.0, help="seconds in-flight requests get on shutdown")


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

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    _check_threads(args)
    try:
        config = server_config(args, engine_settings(args))
    except ValueError as exc:  # before the model loads
        raise ConfigError(f"bad server setting: {first_error(exc)}") from None
    name, mode = config.model_name, config.mode
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


def _check_threads(args: argparse.Namespace) -> None:
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"bad server setting: --threads must be >= 1, got {args.threads}")


def build_engine(args: argparse.Namespace):
    """The ``CachedEngine`` the server runs: model, then its chunk-cache store."""
    from cachedrag.engine import CachedEngine
    from cachedrag.fingerprint import namespace_for
    from cachedrag.model.runner import ModelRunner, resolve_device

    _check_threads(args)
    try:
        settings = engine_settings(args)
    except ValueError as exc:
        raise ConfigError(f"bad engine setting: {first_error(exc)}") from None
    resolve_device(settings.device)  # a bad or absent device is refused before any model loads (also with --tiny)
    numerics = dict(dtype=settings.dtype, weights=settings.weights, threads=settings.threads,
                    prefill_pairs=settings.prefill_pairs)
    if settings.tiny:
        from cachedrag.testing import tiny_runner

        runner = tiny_runner(**numerics)
    else:
        runner = ModelRunner.from_pretrained(settings.model, device=settings.device, **numerics)  # warmed up here
    gb = 1 << 30
    config = settings.engine_config()
    store = None
    if settings.disk_dir or settings.redis_url:
        from cachedrag.store.config import StoreConfig
        from cachedrag.store.tiered import TieredStore

        try:
            store_config = StoreConfig(
                namespace=namespace_for(runner.model, runner.tokenizer).digest,
                cpu_bytes=int(settings.cache_gb * gb), disk_dir=settings.disk_dir,
                disk_bytes=int(settings.disk_gb * gb) if settings.disk_dir else 0, redis_url=settings.redis_url,
                redis_bytes=int(settings.redis_gb * gb) if settings.redis_url else 0)
        except ValueError as exc:
            raise ConfigError(f"bad store setting: {first_error(exc)}") from None
        store = TieredStore.from_config(store_config)
    return CachedEngine(runner, config=config, store=store)
