"""The ``cachedrag`` command line.

Owns: argument parsing and dispatch to subcommands. Each subcommand lives in its own module
exposing ``add_arguments(parser)`` and ``run(args) -> int``; this file only wires them:

    cachedrag demo                 answer questions over the stdlib docs corpus
    cachedrag serve                OpenAI-compatible server (continuous batching, chunk reuse)
    cachedrag bench <suite>        benchmark suites (ttft, retrieval, kernels, tiers, pipelines)
    cachedrag index build|search   build or query an IVF index directory
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("cachedrag.demo", "answer questions over the Python stdlib docs with the default model"),
    "serve": ("cachedrag.server.cli", "OpenAI-compatible server with continuous batching over the chunk cache"),
}

BENCH_SUITES: dict[str, tuple[str, str]] = {
    "ttft": ("cachedrag.bench.ttft", "time to first token per reuse mode (full, prefix, naive, random, cachedrag)"),
    "retrieval": ("cachedrag.bench.retrieval", "IVF recall, cluster overlap and lookahead search latency"),
    "kernels": ("cachedrag.bench.kernels", "Triton kernels vs torch references (GPU; CPU runs references)"),
    "tiers": ("cachedrag.bench.tiers", "chunk-cache load time per tier vs recompute, restart reuse"),
    "pipelines": ("cachedrag.bench.pipelines", "HyDE, SubQuestion, Iter-RetGen, FLARE end to end"),
    "serve": ("cachedrag.bench.serve", "OpenAI server under load: batching, cache-aware order, chunk modes (a..e)"),
    "integrations": ("cachedrag.bench.integrations", "LlamaIndex RetrieverQueryEngine: CachedRAGLLM vs plain transformers"),
}

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cachedrag",
        description="cachedrag: reuse chunk KV caches to make RAG fast.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in _available(COMMANDS).items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)

    suites = _available(BENCH_SUITES)
    if suites:
        bench = sub.add_parser("bench", help="run a benchmark suite", description="Benchmark suites.")
        bench_sub = bench.add_subparsers(dest="suite", required=True, metavar="SUITE")
        for name, (module, help_text) in suites.items():
            p = bench_sub.add_parser(name, help=help_text, description=help_text)
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)

    index_cmds = _available(INDEX_COMMANDS)
    if index_cmds:
        index = sub.add_parser("index", help="build or search an IVF index", description="IVF index tools.")
        index_sub = index.add_subparsers(dest="index_command", required=True, metavar="ACTION")
        for name, (module, help_text) in index_cmds.items():
            p = index_sub.add_parser(name, help=help_text, description=help_text)
            mod = importlib.import_module(module)
            getattr(mod, f"add_{name}_arguments")(p)
            p.set_defaults(_run=getattr(mod, f"run_{name}"))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from cachedrag.errors import CachedRAGError

    try:
        return int(args._run(args) or 0)
    except CachedRAGError as exc:
        print(f"cachedrag: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
