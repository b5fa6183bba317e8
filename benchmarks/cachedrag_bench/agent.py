"""``cachedrag bench agent``: an agent's retrieval steps per reuse mode (full, prefix, the default level).

Owns: the agent benchmark. Each question of a stream is answered by an agent loop over a chat
model with one tool, ``search_docs`` (top-``chunks`` passages of an index per call): K steps that
each call the tool, then a final answer with ``tool_choice="none"``. Two policies:

    scripted  every step a forced call (``tool_choice`` = the tool), whose result is the search
              of a fixed sub-query of the question (the model's arguments are recorded, not used),
              so every mode sees the same passages and caching is measured apart from planning
    auto      ``tool_choice="auto"`` until the model stops calling or K calls were made; the
              model's own query is searched

Modes, one engine each over one model (each with its own cache), run per question in rotated
order: ``full`` (no reuse), ``prefix`` (exact prefix caching: earlier steps are exact tree hits)
and ``default`` (the engine's default fidelity level: earlier steps as prefix hits, the new tool
result's passages reused as chunks). In-process through ``ChatCachedRAG`` (LangChain), whose
agent steps store their prompt and answer as a conversation path (``engine/continuation.py``);
with ``--serve``, through ``ChatOpenAI`` against one ``cachedrag serve --mode M`` process per mode
(computed = prompt - cached tokens of the usage; TTFT is the server's, arrival to first token, read
from its ``cachedrag_time_to_first_token_seconds`` histogram around each request, as in process the
engine's: the client sees a forced call's first chunk only once its name is decoded, a dozen
tokens later, which ``client_ttft_s`` records).

Reported per K, policy and mode: per step (step 1 = the first call, step K+1 = the answer) TTFT
p50/p95 and median prompt / computed / cached tokens; per question the summed TTFT; against full
prefill the share of tool calls (name and arguments) and of final answers that are identical;
the share of each step's passages that earlier questions retrieved; and the median TTFT ratios
prefix/default and full/default from step 2 on. ``--json OUT`` writes it all.

Does not own: the chat model or the engine (``cachedrag.integrations``, ``cachedrag.engine``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from cachedrag_bench import write_json
from cachedrag_bench.metrics import percentile

MODES = {"full": "full", "prefix": "prefix", "default": "cachedrag"}
TOOL = {"type": "function", "function": {
    "name": "search_docs", "description": "Search the Python documentation. Returns the most relevant passages.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "search query"}},
                   "required": ["query"]}}}
SYSTEM = ("You answer questions about the Python standard library. Call search_docs to find passages, then answer "
          "from them in two sentences.")
SUBQUERIES = ("{q}", "{q} Give an example.", "Which functions and parameters are involved: {q}",
              "{q} What are common mistakes?", "Documentation of the module for: {q}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--questions", type=int, default=8, help="questions of the Zipf stream over the stdlib topics")
    parser.add_argument("--steps", default="3,5", help="retrieval steps per question (K), comma-separated")
    parser.add_argument("--chunks", type=int, default=4, help="passages per tool call")
    parser.add_argument("--policies", default="scripted,auto", help="scripted and/or auto")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    parser.add_argument("--max-tokens", type=int, default=48, help="cap of every step's generation")
    parser.add_argument("--chunk-tokens", type=int, default=128, help="LLM tokens per chunk of the index built")
    parser.add_argument("--doc-chars", type=int, default=8000, help="characters of each stdlib module's docs indexed")
    parser.add_argument("--index", help="use this built index directory instead")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the question stream")
    parser.add_argument("--seed", type=int, default=0, help="seed of the question stream")
    parser.add_argument("--cache-gb", type=float, default=2.0, help="chunk-cache budget of each engine")
    parser.add_argument("--serve", action="store_true",
                        help="through `cachedrag serve` (one server process per mode, ChatOpenAI as the client)")
    parser.add_argument("--json", dest="json_out", help="write the results as JSON here")
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def run(args: argparse.Namespace) -> int:
    from cachedrag.errors import ConfigError
    from cachedrag.model.loader import load_model
    from cachedrag.model.runner import ModelRunner

    steps = [int(k) for k in args.steps.split(",") if k.strip()]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not steps or min(steps) < 1 or set(policies) - {"scripted", "auto"} or set(modes) - set(MODES):
        raise ConfigError("--steps needs K >= 1, --policies scripted/auto, --modes " + ",".join(MODES))
    started = time.perf_counter()
    runner = ModelRunner(*load_model(None))
    with tempfile.TemporaryDirectory(prefix="cachedrag-bench-agent-") as tmp:
        index_dir, build = _index(args, runner.tokenizer, Path(tmp) / "index")
        questions = _questions(args)
        results = {"config": {**{k: v for k, v in vars(args).items() if k != "func"}, "index": build,
                              "n_questions": len(questions),
                              "repeated_questions": len(questions) - len(set(questions))}, "runs": {}}
        for k in steps:
            for policy in policies:
                servers: dict = {}
                records = measure(runner, index_dir, questions, k, policy, modes, args, servers)
                results["runs"][f"K={k} {policy}"] = summarize(records, modes, k)
                if servers:
                    results["runs"][f"K={k} {policy}"]["servers"] = servers
    results["wall_s"] = round(time.perf_counter() - started, 1)
    results["command"] = "cachedrag " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    print_table(results)
    if args.json_out:
        write_json(results, args.json_out)
    return 0


def measure(runner, index_dir, questions: list[str], k: int, policy: str, modes: list[str], args,
            server_stats: dict | None = None) -> list[dict]:
    """One record per question and mode: per step stats, tool calls, the answer, passage ids.
    Fresh engines (and caches) for each K and policy; modes rotate per question. With ``--serve``,
    ``server_stats`` (when given) gets each mode's server counters at the end (``_Served.counters``)."""
    from cachedrag.config import EngineConfig
    from cachedrag.engine import CachedEngine
    from cachedrag.integrations.langchain import ChatCachedRAG
    from cachedrag.integrations.search import IndexSearcher
    from cachedrag.prompt.registry import ChunkRegistry

    registry = ChunkRegistry()
    searcher = IndexSearcher(index_dir, registry)
    chats, servers = {}, []
    for m in modes:
        if getattr(args, "serve", False):
            servers.append(_Served(m, args, index_dir))
            chats[m] = servers[-1].chat
            continue
        engine = CachedEngine(runner, config=EngineConfig(mode=MODES[m], cache_bytes=int(args.cache_gb * 2**30)))
        chats[m] = ChatCachedRAG(engine=engine, chunk_registry=registry, max_tokens=args.max_tokens,
                                 reuse_mode=MODES[m], share_engine=False)
    seen: set[str] = set()
    records = []
    try:
        for i, question in enumerate(questions):
            rotation = modes[i % len(modes):] + modes[:i % len(modes)]
            first = {}
            for m in rotation:
                first[m] = _episode(chats[m], searcher, question, k, policy, args.chunks)
                first[m].update(question=i, mode=m, seen_before=_seen(first[m]["passages"], seen))
            for m in modes:
                records.append(first[m])
            seen |= {p for m in modes for step in first[m]["passages"] for p in step}
            if not args.quiet:
                line = " ".join(f"{m}={sum(s['ttft_s'] for s in first[m]['steps']):.2f}s" for m in modes)
                print(f"[K={k} {policy} {i + 1}/{len(questions)}] {line}", file=sys.stderr)
    finally:
        searcher.close()
        for server in servers:
            if server_stats is not None:
                try:
                    server_stats[server.mode] = server.counters()
                except Exception as exc:  # the figures stand without them
                    server_stats[server.mode] = {"error": repr(exc)}
            server.close()
    return records


def _episode(chat, searcher, question: str, k: int, policy: str, n_chunks: int) -> dict:
    """The agent loop of one question on one chat model: K calls (fewer when ``auto`` stops), then the answer."""
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage

    messages = [SystemMessage(SYSTEM), HumanMessage(question)]
    steps, calls, passages = [], [], []
    for j in range(k):
        choice = "search_docs" if policy == "scripted" else "auto"
        ai, stats = _invoke(chat.bind_tools([TOOL], tool_choice=choice, parallel_tool_calls=False), messages)
        steps.append(stats)
        if not ai.tool_calls:  # (auto) the model answered: that is the answer
            return {"steps": steps, "calls": calls, "passages": passages, "answer": ai.content}
        call = ai.tool_calls[0]
        calls.append(json.dumps({"name": call["name"], "args": call["args"]}, sort_keys=True))
        query = SUBQUERIES[j % len(SUBQUERIES)].format(q=question) if policy == "scripted" else (
            str(call["args"].get("query") or question))
        hits = searcher.search(query, n_chunks)
        passages.append([h.chunk_id for h in hits])
        messages += [ai, ToolMessage("\n\n".join(h.text for h in hits), tool_call_id=call["id"])]
    final, stats = _invoke(chat.bind_tools([TOOL], tool_choice="none"), messages)
    steps.append(stats)
    return {"steps": steps, "calls": calls, "passages": passages, "answer": final.content}


def _invoke(model, messages):
    """The answer and its step stats: the engine's (in-process) or, from a server, TTFT as the client
    saw the stream's first token and the usage's token counts."""
    if _served(model):
        base = model.bound.openai_api_base
        before = _server_ttft_sum(base)
        start, first, message = time.perf_counter(), None, None
        for chunk in model.stream(messages):
            if first is None and (chunk.content or chunk.tool_call_chunks):
                first = time.perf_counter() - start
            message = chunk if message is None else message + chunk
        usage = message.usage_metadata or {}
        prompt, cached = usage.get("input_tokens", 0), (usage.get("input_token_details") or {}).get("cache_read", 0)
        return message, {"ttft_s": _server_ttft_sum(base) - before,
                         "client_ttft_s": first if first is not None else time.perf_counter() - start,
                         "prompt_tokens": prompt, "computed_tokens": prompt - cached, "cached_tokens": cached,
                         "prefix_hit_tokens": None, "chunks_hit": None, "approximations": []}
    message = model.invoke(messages)
    return message, _step(message)


def _server_ttft_sum(base_url: str) -> float:
    """The server's summed time to first token so far (its Prometheus histogram's ``_sum``): the
    difference around one request (the bench sends one at a time) is that request's TTFT."""
    import httpx

    text = httpx.get(base_url.removesuffix("/v1") + "/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith("cachedrag_time_to_first_token_seconds_sum"):
            return float(line.split()[-1])
    raise RuntimeError("the server's /metrics has no cachedrag_time_to_first_token_seconds_sum")


def _served(model) -> bool:
    return type(getattr(model, "bound", model)).__name__ == "ChatOpenAI"


class _Served:
    """One ``cachedrag serve --mode M --port 0 --index DIR`` process (the index the agent's tool
    searches: its chunks are the server's known passages) and a ``ChatOpenAI`` client of it."""

    def __init__(self, mode: str, args, index_dir):
        import os
        import subprocess

        from langchain_openai import ChatOpenAI

        from cachedrag.testing import listening_url

        self.mode = mode
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cachedrag.cli", "serve", "--port", "0", "--mode", MODES[mode], "--cache-gb",
             str(args.cache_gb), "--max-tokens", str(args.max_tokens), "--index", str(index_dir)],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        url, _ = listening_url(self.proc, 300)
        if url is None:
            self.close()
            raise RuntimeError(f"cachedrag serve --mode {MODES[mode]} did not start")
        self.chat = ChatOpenAI(base_url=url + "/v1", api_key="unused", model="SmolLM2-135M-Instruct",
                               max_tokens=args.max_tokens, temperature=0.0, stream_usage=True)

    def counters(self) -> dict:
        """The server's engine-loop counters of interest: conversation steps stored (tokens, seconds),
        decode steps and their seconds (``/metrics``)."""
        import httpx

        names = {"cachedrag_conversation_stored_tokens_total": "conversation_stored_tokens",
                 "cachedrag_conversation_store_seconds_total": "conversation_store_s",
                 "cachedrag_time_per_output_token_seconds_sum": "decode_token_s_sum",
                 "cachedrag_time_per_output_token_seconds_count": "decode_tokens"}
        text = httpx.get(self.chat.openai_api_base.removesuffix("/v1") + "/metrics", timeout=30).text
        return {names[line.split()[0]]: float(line.split()[-1]) for line in text.splitlines()
                if line.split() and line.split()[0] in names}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)


def _step(message) -> dict:
    s = message.response_metadata["cache"]
    return {"ttft_s": s["ttft_s"], "prompt_tokens": s["prompt_tokens"], "computed_tokens": s["computed_tokens"],
            "cached_tokens": s["cached_tokens"], "prefix_hit_tokens": s["prefix_hit_tokens"],
            "chunks_hit": s["chunks_hit"], "approximations": s.get("approximations", [])}


def _seen(passages: list[list[str]], seen: set[str]) -> float | None:
    flat = [p for step in passages for p in step]
    return sum(p in seen for p in flat) / len(flat) if flat else None


def summarize(records: list[dict], modes: list[str], k: int) -> dict:
    """Per mode: step-level and question-level figures, agreement with full; ratios from step 2 on."""
    by = {m: sorted((r for r in records if r["mode"] == m), key=lambda r: r["question"]) for m in modes}
    out: dict = {"modes": {}}
    for m in modes:
        rs = by[m]
        per_step = {}
        for j in range(k + 1):
            rows = [r["steps"][j] for r in rs if len(r["steps"]) > j]
            if rows:
                per_step[str(j + 1)] = _figures(rows)
        later = [s for r in rs for s in r["steps"][1:]]
        entry = {"steps": per_step, "from_step_2": _figures(later) if later else None,
                 "question_ttft_s_median": statistics.median(sum(s["ttft_s"] for s in r["steps"]) for r in rs),
                 "calls_median": statistics.median(len(r["calls"]) for r in rs)}
        if "full" in by and m != "full":
            entry.update(_agreement(rs, by["full"]))
        out["modes"][m] = entry
    seen = [r["seen_before"] for r in by[modes[0]] if r["seen_before"] is not None]
    out["passages_seen_before"] = round(statistics.mean(seen), 3) if seen else None
    med = {m: (out["modes"][m]["from_step_2"] or {}).get("ttft_s_p50") for m in modes}
    if med.get("default"):
        out["prefix_over_default"] = _ratio(med.get("prefix"), med["default"])
        out["full_over_default"] = _ratio(med.get("full"), med["default"])
    return out


def _figures(rows: list[dict]) -> dict:
    ttft = [s["ttft_s"] for s in rows]
    return {"n": len(rows), "ttft_s_p50": round(percentile(ttft, 50), 4), "ttft_s_p95": round(percentile(ttft, 95), 4),
            **{f"{key}_median": statistics.median(s[key] for s in rows)
               for key in ("prompt_tokens", "computed_tokens", "cached_tokens")}}


def _agreement(rs: list[dict], full: list[dict]) -> dict:
    pairs = [(c, f) for r, g in zip(rs, full) for c, f in zip(r["calls"], g["calls"])]
    return {"calls_equal_full": _ratio(sum(c == f for c, f in pairs), len(pairs)),
            "answers_equal_full": _ratio(sum(r["answer"] == g["answer"] for r, g in zip(rs, full)), len(rs))}


def _ratio(num, den):
    return round(num / den, 3) if num is not None and den else None


def _questions(args) -> list[str]:
    from cachedrag.corpus import STDLIB_TOPICS, zipf_stream

    return zipf_stream(list(STDLIB_TOPICS), args.questions, args.zipf, args.seed)


def _index(args, tokenizer, out: Path):
    from cachedrag.corpus import stdlib_corpus
    from cachedrag.retrieval.config import ChunkConfig, RetrievalConfig
    from cachedrag.retrieval.embedder import Embedder
    from cachedrag.retrieval.index import build_index

    if args.index:
        return args.index, {"source": "loaded", "path": str(args.index)}
    t0 = time.perf_counter()
    config = RetrievalConfig(chunk=ChunkConfig(chunk_tokens=args.chunk_tokens, overlap=16))
    index = build_index(stdlib_corpus(max_chars_per_doc=args.doc_chars), tokenizer, Embedder(), config, out=out,
                        progress=not args.quiet)
    return out, {"source": "built", "n_chunks": index.manifest.n_chunks, "chunk_tokens": args.chunk_tokens,
                 "doc_chars": args.doc_chars, "build_s": round(time.perf_counter() - t0, 1)}


def print_table(results: dict) -> None:
    cfg = results["config"]
    print(f"\nagent bench: {cfg['n_questions']} questions, {cfg['chunks']} passages per call, "
          f"index {cfg['index']}")
    for name, run in results["runs"].items():
        print(f"\n{name}: passages seen by earlier questions {run['passages_seen_before']}; median TTFT from step 2: "
              f"prefix/default {run.get('prefix_over_default')}x, full/default {run.get('full_over_default')}x")
        print(f"  {'mode':<8} {'step':>4} {'TTFT p50':>9} {'p95':>7} {'prompt':>7} {'computed':>8} {'cached':>7}")
        for m, entry in run["modes"].items():
            for j, f in entry["steps"].items():
                print(f"  {m:<8} {j:>4} {f['ttft_s_p50']:>9.3f} {f['ttft_s_p95']:>7.3f} "
                      f"{f['prompt_tokens_median']:>7.0f} {f['computed_tokens_median']:>8.0f} "
                      f"{f['cached_tokens_median']:>7.0f}")
            agree = "" if "calls_equal_full" not in entry else (
                f", tool calls = full {entry['calls_equal_full']}, answers = full {entry['answers_equal_full']}")
            print(f"  {m:<8} question TTFT median {entry['question_ttft_s_median']:.3f}s, calls "
                  f"{entry['calls_median']}{agree}")
