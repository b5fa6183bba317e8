"""The ``cachedrag`` command line.

Owns: argument parsing and dispatch to subcommands, ``--version``, and the error contract:
a user mistake (a ``CachedRAGError``, a missing or unreadable file) ends with one line on
stderr and exit code 2, never a traceback. Each subcommand lives in its own module exposing
``add_arguments(parser)`` and ``run(args) -> int``; this file only wires them, and imports
only the module of the command being run (``cachedrag --help`` imports none), so the
command line answers at once:

    cachedrag demo                 answer questions over the stdlib docs corpus
    cachedrag serve                OpenAI-compatible server (continuous batching, chunk reuse)
    cachedrag bench <suite>        the benchmark suites of BENCH_SUITES below (docs/cli.md lists all)
    cachedrag index build|search   build or query an IVF index directory

The bench suites are a distribution of their own, ``cachedrag-bench`` (``benchmarks/`` in a
checkout, import name ``cachedrag_bench``): ``BENCH_SUITES`` names their modules, imported only
when a suite runs; where it is not installed ``cachedrag bench ...`` says so in one line (exit 2).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("cachedrag.demo", "answer questions over the Python stdlib docs with the default model"),
    "serve": ("cachedrag.server.cli", "OpenAI-compatible server with continuous batching over the chunk cache"),
}

BENCH_SUITES: dict[str, tuple[str, str]] = {
    "ttft": ("cachedrag_bench.ttft", "time to first token per reuse mode (full, prefix, naive, random, cachedrag)"),
    "fidelity": ("cachedrag_bench.fidelity", "answers vs full prefill per token choice and recompute ratio (frontier)"),
    "retrieval": ("cachedrag_bench.retrieval", "IVF recall, cluster overlap and lookahead search latency"),
    "lookahead": ("cachedrag_bench.lookahead",
                  "GPU lookahead retrieval on a synthetic 1-5M-vector IVF index vs Faiss CPU (TeleRAG's nprobe 3-12%)"),
    "kernels": ("cachedrag_bench.kernels", "Triton kernels vs torch references (GPU; CPU runs references)"),
    "tiers": ("cachedrag_bench.tiers", "chunk-cache load time per tier vs recompute, restart reuse"),
    "pipelines": ("cachedrag_bench.pipelines", "HyDE, SubQuestion, Iter-RetGen, FLARE end to end"),
    "cluster": ("cachedrag_bench.cluster", "replicas on Ray Serve: round-robin vs chunk-affinity routing, shared Redis tier"),
    "serve": ("cachedrag_bench.serve", "OpenAI server under load: batching, cache-aware order, chunk modes (a..e)"),
    "integrations": ("cachedrag_bench.integrations", "LlamaIndex RetrieverQueryEngine: CachedRAGLLM vs plain transformers"),
    "shapes": ("cachedrag_bench.shapes", "end to end at Llama-3.1-8B / Qwen2.5-7B shapes (random weights; GPU)"),
    "agent": ("cachedrag_bench.agent", "agent steps (K retrieval calls, then the answer) per mode: full, prefix, default"),
    "speed": ("cachedrag_bench.speed", "prefill/decode speed per dtype vs transformers and llama.cpp; first-request "
              "and miss cost; --shape: 0.5B-3B shapes vs llama.cpp GGUFs of the same weights"),
}

#: the import name of the distribution that holds the suites, and what to say where it is missing
BENCH_PACKAGE = "cachedrag_bench"
BENCH_MISSING = ("cachedrag bench needs the cachedrag-bench distribution: pip install -e benchmarks/ "
                 "(in a cachedrag checkout; `make install-dev` does it)")

INDEX_COMMANDS: dict[str, tuple[str, str]] = {
    "build": ("cachedrag.retrieval.cli", "build an IVF index directory from a corpus"),
    "search": ("cachedrag.retrieval.cli", "search an index directory"),
}


def _available(table: dict[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
    """Entries whose module is installed (suites land issue by issue)."""
    found = {}
    for name, (module, help_text) in table.items():
        if importlib.util.find_spec(module) is not None:
            found[name] = (module, help_text)
    return found


def _bench_installed() -> bool:
    """Whether ``cachedrag_bench`` can be imported (an import that fails counts as not installed)."""
    try:
        return importlib.util.find_spec(BENCH_PACKAGE) is not None
    except ImportError:
        return False


def _selected(argv: list[str]) -> list[str]:
    """The leading positional words of ``argv`` (command, then suite/action): what to import."""
    words = []
    for token in argv:
        if token == "--":
            break
        if token.startswith("-"):
            continue
        words.append(token)
        if len(words) == 2:
            break
    return words


def _add(sub, name: str, module: str, help_text: str, selected: bool, adder: str = "add_arguments",
         runner: str = "run") -> None:
    # argparse %-formats a help string (not a description): "3-12%" would break the parent's --help
    p = sub.add_parser(name, help=help_text.replace("%", "%%"), description=help_text)
    if selected:  # only the command being run pays for its imports
        mod = importlib.import_module(module)
        getattr(mod, adder)(p)
        p.set_defaults(_run=getattr(mod, runner))


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser. With ``argv`` (what ``main`` passes), only the subcommand it names gets its
    module imported (``--help`` stays fast); with ``argv=None`` every subcommand is registered
    with its arguments (for callers that parse several command lines with one parser)."""
    from cachedrag import __version__

    words = _selected(list(argv or []))
    command = words[0] if words else None
    second = words[1] if len(words) > 1 else None
    every = argv is None
    parser = argparse.ArgumentParser(
        prog="cachedrag",
        description="cachedrag: reuse chunk KV caches to make RAG fast.",
    )
    parser.add_argument("--version", action="version", version=f"cachedrag {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in _available(COMMANDS).items():
        _add(sub, name, module, help_text, every or command == name)

    bench = sub.add_parser("bench", help="run a benchmark suite (the cachedrag-bench distribution)",
                           description="Benchmark suites (the cachedrag-bench distribution).")
    bench_sub = bench.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for name, (module, help_text) in (_available(BENCH_SUITES) if _bench_installed() else {}).items():
        _add(bench_sub, name, module, help_text, every or (command == "bench" and second == name))

    index_cmds = _available(INDEX_COMMANDS)
    if index_cmds:
        index = sub.add_parser("index", help="build or search an IVF index", description="IVF index tools.")
        index_sub = index.add_subparsers(dest="index_command", required=True, metavar="ACTION")
        for name, (module, help_text) in index_cmds.items():
            _add(index_sub, name, module, help_text, every or (command == "index" and second == name),
                 adder=f"add_{name}_arguments", runner=f"run_{name}")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if _selected(argv)[:1] == ["bench"] and not _bench_installed():
        return _fail(BENCH_MISSING)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    from cachedrag.errors import CachedRAGError

    try:
        return int(args._run(args) or 0)
    except CachedRAGError as exc:
        return _fail(exc)
    except OSError as exc:
        if exc.filename is None:  # not about a path the user gave: a real failure, keep the traceback
            raise
        return _fail(f"{exc.filename}: {exc.strerror or exc}")
    except KeyboardInterrupt:
        print("cachedrag: interrupted", file=sys.stderr)
        return 130


def _fail(problem) -> int:
    text = " ".join(str(problem).split())  # one line
    print(f"cachedrag: error: {text}", file=sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
