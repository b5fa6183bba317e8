"""``cachedrag bench serve``: the OpenAI server under load, five configurations side by side.

Owns: the serving suite. For each configuration it starts ``cachedrag serve`` as its own
process on loopback (``--port 0``), warms it with a few requests, then replays a Zipf-skewed
RAG stream (the ``bench ttft`` workload: stdlib-docs chunks, exact top-k retrieval with the
MiniLM embedder) at each concurrency level with Poisson arrivals (``--rate`` requests/s; at
most ``level`` requests in flight), streaming every answer through SSE, and reports per level:
requests/s, output tokens/s, TTFT p50/p95, time per output token p50, chunk hit rate (from the
server's Prometheus counters), the ``cached_tokens`` share of prompt tokens, the admission
counters' shares (contested: the order had a choice; reordered: it overtook an older request;
preempted: it was prefilled between the layers of a running prefill, ahead of it)
and output tokens/s over the level's busy window (all slots in flight, before the level
drains). Configs c and d also replay ``--queue-level`` (default 16, above the batch limit of 8)
on ``--queue-requests`` further requests ("16q"): there requests queue for batch slots, so
the admission order has real choices to make, and FIFO and cache-aware order are compared
where they can differ. Configs d and e replay concurrency 1 once more at the end ("1w", the
passages seen so far: a running service's steady state), beside the cold first level. Then the
configurations' answers are compared with (b) (ROUGE-L, exact match) and, with ``--soak``,
config (d) takes ``--soak-requests`` at ``--soak-concurrency`` with random client disconnects,
``--soak-rounds`` times; the server's RSS is read at rest (after its idle heap trim) before and
after each round.

Configurations (the issue's a..e):
  a  ``--mode full --max-batch 1``          today's one-at-a-time baseline
  b  ``--mode full``, batched, FIFO
  c  ``--mode cachedrag``, batched, FIFO, explicit ``cachedrag.chunks``
  d  ``--mode cachedrag``, batched, cache-aware order, explicit chunks
  e  as (d), but the client sends no extension field (automatic passage detection)
  f  as (d), at a fidelity level (``--fidelity``, default ``faithful``: the tie guards on the first and
     every later token); not in the default set. Its answers are compared with (b)'s like every
     configuration's, so a run of b,d,f shows what the level buys under load and what it costs
     (``f_vs_d_*`` ratios; per level the share of requests the guards prefilled again or switched)
  g  ``--mode prefix``, batched, cache-aware order: prefix caching, the reuse vLLM and SGLang do,
     under the same scheduler (not in the default set; ``d_vs_g_*`` / ``f_vs_g_*`` ratios)

Every configuration runs the same numerics (``--dtype`` / ``--weights`` / ``--threads``, passed
to each ``cachedrag serve``), so the ratios compare scheduling and reuse, not number formats;
``--max-delay-s`` / ``--max-overtakes`` / ``--starvation-s`` (the cache-aware order's bounds) likewise go to every
server, so one run compares FIFO (c) with one setting of the bounds (d); so does ``--cache-gb``
(the chunk-cache budget: below the working set, chunks are evicted, and the order can change
the hit rate, RAGCache's setting). ``--disk-dir`` adds a disk tier below it: each server gets a
new directory there (removed when it stops), so no configuration starts with another's entries,
and each level reports hits per tier.
Every level of one configuration replays the same requests as that level of every other, so
answers compare request by request. Servers run one at a time (the CPU is shared): by default one
configuration after another; with ``--interleave`` all are started first and each level runs on
every one in turn, the order reversed from one replay to the next, so a slow stretch of a shared
machine, or the position of a server in the run, does not fall on one configuration. Outside its
turns a server is stopped (SIGSTOP): it uses no CPU and does no background work (exact-repeat
promotions, heap trims) meanwhile, so it serves the same uninterrupted sequence of levels as
when run alone (idle time between levels would let it finish promotions a loaded service
would not get to, raising its hit rate). ``--rounds N`` replays each
level N times on the stream's next requests and pools the figures (ABBA with ``--interleave``).
``--json OUT`` writes ``{"config", "configs": {name: {level: {...}}}, "answers", "soak"}`` (``soak``: the
first round's figures and ``rounds``, every round's).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from cachedrag_bench import write_json
from cachedrag_bench.metrics import percentile, rouge_l
from cachedrag.errors import ConfigError
from cachedrag.kvcache.config import EXACT_REPEAT_TIMINGS
from cachedrag.server.config import FIDELITY_LEVELS

CONFIGS = {
    "a": ("full, no batching", ["--mode", "full", "--max-batch", "1", "--order", "fifo"], True),
    "b": ("full, batched", ["--mode", "full", "--order", "fifo"], True),
    "c": ("cachedrag, batched, FIFO", ["--mode", "cachedrag", "--order", "fifo"], True),
    "d": ("cachedrag, batched, cache-aware", ["--mode", "cachedrag", "--order", "cache_aware"], True),
    "e": ("cachedrag, cache-aware, automatic chunks", ["--mode", "cachedrag", "--order", "cache_aware"], False),
    # not in the default set: (d) at a fidelity level (--fidelity, default faithful), its answers and speed beside d's
    "f": ("cachedrag, cache-aware, a fidelity level", ["--order", "cache_aware"], True),
    # not in the default set: prefix caching (vLLM's / SGLang's reuse) under the same scheduler, the peer of d and f
    "g": ("prefix caching, batched, cache-aware", ["--mode", "prefix", "--order", "cache_aware"], True),
}
WARM_C1_CONFIGS = ("d", "e")  # the pair whose concurrency-1 comparison depends on what the server has seen
QUEUE_CONFIGS = ("c", "d")  # FIFO vs cache-aware order, side by side on a level where requests queue for slots
SYSTEM_PROMPT = ("You are a helpful assistant. Answer the question using the Python documentation excerpts "
                 "given by the user. Be brief.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF model id or path (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--tiny", action="store_true", help="tiny random model (a smoke run of the suite, seconds)")
    parser.add_argument("--configs", default="a,b,c,d,e", help="comma-separated subset of a,b,c,d,e")
    parser.add_argument("--levels", default="1,2,4,8", help="concurrency levels")
    parser.add_argument("--requests", type=int, default=12, help="requests per level (default 12: fits one 15-min run)")
    parser.add_argument("--warmup", type=int, default=4, help="unmeasured requests per server before the levels")
    parser.add_argument("--warmup-max-tokens", type=int, default=8, help="max_tokens of the warm-up requests")
    parser.add_argument("--rate", type=float, default=8.0, help="Poisson arrival rate (requests/s) of every level")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="answer length cap (64: a short RAG answer; decode, which batching shares, is then "
                             "a real part of each request, as in a service)")
    parser.add_argument("--warm-c1", action=argparse.BooleanOptionalAction, default=True,
                        help="after the levels, configs d and e replay concurrency 1 again on the stream's next "
                             "requests, with the passages seen so far (the steady state of a running service); "
                             "the cold concurrency-1 level stays in the table")
    parser.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=False,
                        help="start every configuration's server first, then run each level on all of them in "
                             "turn, the order reversed from one replay to the next (servers otherwise run one "
                             "after another): a slow stretch of a shared machine, or a position effect, then "
                             "falls on every configuration rather than on whichever ran during it; a server is "
                             "stopped (SIGSTOP) outside its turns, so it does no background work meanwhile")
    parser.add_argument("--rounds", type=int, default=1,
                        help="replay each level this many times, each on the stream's next requests, the level's "
                             "figures pooled over them (with --interleave the configuration order reverses from "
                             "round to round: ABBA)")
    parser.add_argument("--max-batch", type=int, default=8, help="batch size of the batched configurations")
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                        help="stream every answer (SSE; default) or, with --no-stream, ask for it whole: no TTFT "
                             "then (ttft = the whole answer's latency) but the tie guard during decoding may rewind "
                             "a whole answer (--fidelity faithful's answers are then full prefill's even where a "
                             "first token flipped)")
    parser.add_argument("--exact-when-waiting", type=int, default=None,
                        help="`cachedrag serve --exact-when-waiting` of every server (default: the server's, 1; it "
                             "acts only at --fidelity faithful, so config f)")
    parser.add_argument("--fidelity", default="faithful", choices=FIDELITY_LEVELS,
                        help="`cachedrag serve --fidelity` of config f (default faithful)")
    parser.add_argument("--queue-level", type=int, default=16,
                        help="the ordering comparison: configs c (FIFO) and d (cache-aware) also replay this "
                             "concurrency, above --max-batch, so requests queue for slots and the admission order "
                             "has choices to make (0 = skip)")
    parser.add_argument("--queue-requests", type=int, default=24, help="requests of the queue level")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"),
                        help="the model's numerics in EVERY configuration (a..e run the same numerics; passed to "
                             "`cachedrag serve --dtype`; default bfloat16, the numerics a loaded CPU server runs "
                             "best in and the one the targets are measured in: docs/serving.md)")
    parser.add_argument("--weights", default="dense", choices=("dense", "int8", "int8-dynamic", "int4"),
                        help="weight format of every configuration (`cachedrag serve --weights`; default dense; "
                             "int8-dynamic needs VNNI)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of every server (`cachedrag serve --threads`; default: all cores)")
    parser.add_argument("--starvation-s", type=float, default=None,
                        help="`cachedrag serve --starvation-s` of every server (default: the server's)")
    parser.add_argument("--max-overtakes", type=int, default=None,
                        help="`cachedrag serve --max-overtakes` of every server (default: the server's)")
    parser.add_argument("--max-delay-s", type=float, default=None,
                        help="`cachedrag serve --max-delay-s` of every server (default: the server's)")
    parser.add_argument("--preempt-ratio", type=float, default=None,
                        help="`cachedrag serve --preempt-ratio` of every server (default: the server's; it acts only "
                             "where the order is cache-aware, so config c stays plain FIFO)")
    parser.add_argument("--exact-repeats", type=int, default=None,
                        help="`cachedrag serve --exact-repeats` of every server (default: the engine's)")
    parser.add_argument("--exact-repeats-when", default=None, choices=EXACT_REPEAT_TIMINGS,
                        help="`cachedrag serve --exact-repeats-when` of every server (default: the server's)")
    parser.add_argument("--cache-gb", type=float, default=None,
                        help="`cachedrag serve --cache-gb` (chunk-cache budget) of every server (default: the server's, "
                             "2 GB); below the working set, chunks are evicted and the order can change the hit rate")
    parser.add_argument("--disk-dir", default=None,
                        help="add a disk tier below the --cache-gb memory tier of every server, each in a new "
                             "directory under this one (removed when the server stops)")
    parser.add_argument("--disk-gb", type=float, default=None,
                        help="`cachedrag serve --disk-gb` with --disk-dir (default: the server's, 10 GB)")
    parser.add_argument("--exact-whole-answers", action=argparse.BooleanOptionalAction, default=None,
                        help="`cachedrag serve --[no-]exact-whole-answers` of every server (default: the server's, "
                             "on; acts with --fidelity faithful and --no-stream)")
    parser.add_argument("--hold-waiting", action=argparse.BooleanOptionalAction, default=None,
                        help="`cachedrag serve --[no-]hold-waiting` of every server (default: the server's, on)")
    parser.add_argument("--trim-heap-idle-s", type=float, default=None,
                        help="`cachedrag serve --trim-heap-idle-s` of every server (default: the server's; "
                             "inf = never)")
    parser.add_argument("--passage-chars", type=int, default=None,
                        help="`cachedrag serve --passage-chars` (automatic detection's shortest passage) of every "
                             "server (default: the server's)")
    parser.add_argument("--tokenization", choices=("whole", "parts"), default=None,
                        help="`cachedrag serve --tokenization` of every server (default: the server's, whole)")
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--chunk-tokens", type=int, default=192)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--soak", action=argparse.BooleanOptionalAction, default=True,
                        help="run the disconnect soak on config d after the levels")
    parser.add_argument("--soak-requests", type=int, default=200)
    parser.add_argument("--soak-concurrency", type=int, default=16)
    parser.add_argument("--soak-disconnect", type=float, default=0.3, help="share of soak requests that disconnect")
    parser.add_argument("--soak-max-tokens", type=int, default=6)
    parser.add_argument("--soak-rounds", type=int, default=2,
                        help="soak rounds on the same server (default 2: the second tells growth that stops, "
                             "such as newly cached chunks, from growth that goes on)")
    parser.add_argument("--json", dest="json_out", help="write results as JSON to this path")


def numerics_args(args: argparse.Namespace) -> list[str]:
    """The ``cachedrag serve`` flags that give every configuration the same numerics."""
    if args.weights == "int8-dynamic" and args.dtype != "bfloat16":
        raise ConfigError("--weights int8-dynamic runs with --dtype bfloat16 (it prefills in bfloat16)")
    out = ["--dtype", args.dtype]
    if args.weights != "dense":
        out += ["--weights", args.weights]
    if args.threads is not None:
        out += ["--threads", str(args.threads)]
    return out


def scheduler_args(args: argparse.Namespace) -> list[str]:
    """The admission-order bounds given to every server (they act only where the order is cache-aware),
    holding waiting requests' chunks, the exact-repeat timing, the idle heap trim,
    the shortest passage and the tokenisation."""
    out = [] if args.starvation_s is None else ["--starvation-s", str(args.starvation_s)]
    out += [] if args.max_overtakes is None else ["--max-overtakes", str(args.max_overtakes)]
    out += [] if args.hold_waiting is None else ["--hold-waiting" if args.hold_waiting else "--no-hold-waiting"]
    out += [] if args.exact_repeats_when is None else ["--exact-repeats-when", args.exact_repeats_when]
    out += [] if args.exact_repeats is None else ["--exact-repeats", str(args.exact_repeats)]
    out += [] if args.trim_heap_idle_s is None else ["--trim-heap-idle-s", str(args.trim_heap_idle_s)]
    out += [] if args.passage_chars is None else ["--passage-chars", str(args.passage_chars)]
    out += [] if args.tokenization is None else ["--tokenization", args.tokenization]
    out += [] if args.preempt_ratio is None else ["--preempt-ratio", str(args.preempt_ratio)]
    out += [] if args.exact_when_waiting is None else ["--exact-when-waiting", str(args.exact_when_waiting)]
    out += [] if args.exact_whole_answers is None else [
        "--exact-whole-answers" if args.exact_whole_answers else "--no-exact-whole-answers"]
    return out + ([] if args.max_delay_s is None else ["--max-delay-s", str(args.max_delay_s)])


def config_args(name: str, args: argparse.Namespace) -> list[str]:
    """The ``cachedrag serve`` flags that make configuration ``name``: its mode and order, the batch size
    (``--max-batch`` unless the configuration fixes its own) and, for (f), ``--fidelity``."""
    flags = CONFIGS[name][1]
    batch = [] if "--max-batch" in flags else ["--max-batch", str(args.max_batch)]
    return flags + batch + (["--fidelity", args.fidelity] if name == "f" else [])


def cache_args(args: argparse.Namespace) -> list[str]:
    """The chunk-cache budget given to every server (the same for every configuration)."""
    if args.cache_gb is not None and not args.cache_gb > 0:
        raise ConfigError(f"--cache-gb must be > 0, got {args.cache_gb}")
    return [] if args.cache_gb is None else ["--cache-gb", str(args.cache_gb)]


def disk_args(args: argparse.Namespace, directory: str | None) -> list[str]:
    """The disk tier of one server (``directory``: its own, new, under ``--disk-dir``)."""
    if args.disk_gb is not None and not args.disk_gb > 0:
        raise ConfigError(f"--disk-gb must be > 0, got {args.disk_gb}")
    if args.disk_gb is not None and args.disk_dir is None:
        raise ConfigError("--disk-gb needs --disk-dir")
    if directory is None:
        return []
    return ["--disk-dir", directory] + ([] if args.disk_gb is None else ["--disk-gb", str(args.disk_gb)])


def _server_disk_dir(args: argparse.Namespace, name: str) -> str | None:
    """A new directory under ``--disk-dir`` for configuration ``name``'s server (None without one)."""
    if args.disk_dir is None:
        return None
    return tempfile.mkdtemp(prefix=f"bench-serve-{name}-", dir=args.disk_dir)


# ---------------------------------------------------------------------- server processes
class ServerProcess:
    """``cachedrag serve`` on loopback in a child process."""

    def __init__(self, args: list[str]):
        self.proc = subprocess.Popen([sys.executable, "-m", "cachedrag.cli", "serve", "--port", "0",
                                      "--log-level", "warning", *args], stderr=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.url = None
        self.frozen = False
        lines = []
        deadline = time.monotonic() + 300
        while self.url is None:
            if not select.select([self.proc.stderr], [], [], max(0.0, deadline - time.monotonic()))[0]:
                self.proc.kill()
                raise RuntimeError("cachedrag serve did not start within 300 s:\n" + "".join(lines[-20:]))
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError("cachedrag serve exited before listening:\n" + "".join(lines[-20:]))
            lines.append(line)
            m = re.search(r"listening on (http://[\d.]+:\d+)", line)
            self.url = m.group(1) if m else None
        self._wait_healthy(deadline, lines)

    def _wait_healthy(self, deadline: float, lines: list[str]) -> None:
        """Until ``/health`` answers 200 (the engine loop runs); the child's log if it exits first."""
        import httpx

        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("cachedrag serve exited after listening:\n" + "".join(lines[-20:])
                                   + self.proc.stderr.read()[-4000:])
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError("cachedrag serve did not become healthy within 300 s")
            time.sleep(0.2)

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def freeze(self) -> None:
        """Stop the process (SIGSTOP) between its turns of an interleaved run: it uses no CPU and
        does no background work (exact-repeat promotions, heap trims) while another server runs."""
        if self.proc.poll() is None and not self.frozen:
            self.proc.send_signal(signal.SIGSTOP)
            self.frozen = True
            self._await_state(stopped=True)

    def thaw(self) -> None:
        if self.frozen:
            self.proc.send_signal(signal.SIGCONT)
            self.frozen = False
            self._await_state(stopped=False)

    def _await_state(self, stopped: bool, timeout: float = 10.0) -> None:
        """Return once the kernel has delivered SIGSTOP / SIGCONT (signals are asynchronous: right after
        ``send_signal`` the process may still be running, and its turn would overlap another server's).
        Reads ``/proc/PID/stat``; where there is no ``/proc`` it returns at once."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with open(f"/proc/{self.proc.pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                return
            if (state == "T") == stopped:
                return
            time.sleep(0.005)

    def stop(self) -> int:
        self.thaw()  # a stopped process would hold SIGTERM until continued
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def _metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _by_label(before: str, after: str, name: str, label: str) -> dict[str, float]:
    """How much each ``label`` value's sample of metric ``name`` grew between two scrapes."""
    from prometheus_client.parser import text_string_to_metric_families

    def samples(text: str) -> dict[str, float]:
        return {s.labels[label]: s.value for family in text_string_to_metric_families(text)
                for s in family.samples if s.name == name and label in s.labels}

    was = samples(before)
    return {k: v - was.get(k, 0.0) for k, v in samples(after).items()}


# ---------------------------------------------------------------------- clients
def _body(model: str, chunks: list[str], question: str, explicit: bool, max_tokens: int, stream: bool = True) -> dict:
    context = "\n\n".join(chunks)
    body = {"model": model, "stream": stream, "max_tokens": max_tokens,
            "temperature": 0.0,
            "messages": [{"role": "system", "content": SYSTEM_PROMPT},
                         {"role": "user", "content": f"Context:\n\n{context}\n\nQuestion: {question}"}]}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if explicit:
        body["cachedrag"] = {"chunks": chunks}
    return body


async def _one(client, url: str, body: dict, disconnect_after: int | None = None) -> dict:
    """Stream one request; returns timings, text, usage (or what happened). A request with ``"stream": false``
    gets its answer whole: its first text arrives with the last (``ttft_s`` = ``total_s``, no TPOT)."""
    t0 = time.perf_counter()
    out = {"ttft_s": None, "text": "", "usage": None, "status": None, "disconnected": False, "t_start": t0,
           "delta_times": [], "streamed": body.get("stream", False)}
    if not out["streamed"]:
        r = await client.post(url + "/v1/chat/completions", json=body)
        out["status"], now = r.status_code, time.perf_counter()
        if r.status_code != 200:
            out["error"] = r.text[:200]
            return out
        data = r.json()
        out.update(text=data["choices"][0]["message"]["content"] or "", usage=data["usage"],
                   served=data.get("cachedrag"), ttft_s=now - t0, total_s=now - t0, delta_times=[now])
        return out
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            out["error"] = (await r.aread()).decode()[:200]
            return out
        deltas = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out["error"] = event["error"]["message"]
                break
            if event.get("usage"):
                out["usage"] = event["usage"]
            if event.get("cachedrag"):  # how the server served the prompt (approximations, tie guards)
                out["served"] = event["cachedrag"]
            for choice in event.get("choices", ()):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    now = time.perf_counter()
                    out["delta_times"].append(now)
                    if out["ttft_s"] is None:
                        out["ttft_s"] = now - t0
                    out["text"] += piece
                    deltas += 1
            if disconnect_after is not None and deltas >= disconnect_after:
                out["disconnected"] = True
                break  # leaving the block closes the connection mid-stream
    out["total_s"] = time.perf_counter() - t0
    return out


async def _replay(url: str, bodies: list[dict], concurrency: int, rate: float, seed: int) -> tuple[list[dict], float]:
    """Poisson arrivals at ``rate``; at most ``concurrency`` in flight. Returns results and wall time."""
    import httpx

    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in bodies:
        arrivals.append(t)
        t += rng.expovariate(rate)
    slots = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.perf_counter()

        async def go(body, at):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            async with slots:
                return await _one(client, url, body)

        results = await asyncio.gather(*(go(b, a) for b, a in zip(bodies, arrivals)))
        return list(results), time.perf_counter() - start


def _busy_window(results: list[dict], level: int) -> tuple[float, float] | None:
    """Throughput while all ``level`` slots were busy, as (window seconds, output tokens inside it):
    from the start of the ``level``-th request (every slot filled) to the start of the last one
    (a slot is refilled as soon as a request ends while others wait, so in between exactly
    ``level`` are in flight; after it the level drains with fewer). With a dozen requests per
    level the drain is a large part of a high level's wall time, so the whole-level figures
    understate what that concurrency sustains. Tokens are counted by the share of each request's
    streamed deltas inside the window. (A requests/s figure over the same window is biased low:
    the window opens when the level's first requests start together, and none of them ends for
    a whole answer's time.) None when the replay never filled its slots."""
    ok = [r for r in results if r["status"] == 200 and r["usage"]]
    starts = sorted(r["t_start"] for r in results)
    if len(starts) <= level:
        return None
    lo, hi = starts[level - 1], starts[-1]
    if hi - lo <= 0:
        return None
    tokens = 0.0
    for r in ok:
        times = r["delta_times"]
        if times:
            inside = sum(lo <= t < hi for t in times)
            tokens += r["usage"]["completion_tokens"] * inside / len(times)
    return hi - lo, tokens


@dataclasses.dataclass
class Replay:
    """One replay of a level on one server: the clients' results, its wall time and the server's
    /metrics scraped just before and just after it."""

    results: list[dict]
    wall: float
    before: str
    after: str


def _level_stats(replays: list[Replay], level: int = 1) -> dict:
    """One level's figures, pooled over its replays (``--rounds``): requests, tokens and the
    server's counters summed, wall times added, percentiles over every request."""
    results = [r for rep in replays for r in rep.results]
    wall = sum(rep.wall for rep in replays)

    def grew(name: str) -> float:
        return sum(_metric_sum(rep.after, name) - _metric_sum(rep.before, name) for rep in replays)

    def grew_by(name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for rep in replays:
            for k, v in _by_label(rep.before, rep.after, name, label).items():
                out[k] = out.get(k, 0.0) + v
        return out

    windows = [w for w in (_busy_window(rep.results, level) for rep in replays) if w is not None]
    busy_s = sum(w for w, _ in windows)

    hits, misses = grew("cachedrag_chunk_hits_total"), grew("cachedrag_chunk_misses_total")
    admitted = grew("cachedrag_admissions_total")
    steps = grew("cachedrag_decode_batch_size_count")
    prefill_s, prefill_rows = grew("cachedrag_prefill_seconds_sum"), grew("cachedrag_prefill_rows_total")
    ok = [r for r in results if r["status"] == 200 and r["usage"]]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    latency = [r["total_s"] for r in ok]  # whole answers: what a guard that prefills again mid-answer costs
    tpot = [(r["total_s"] - r["ttft_s"]) / (r["usage"]["completion_tokens"] - 1) for r in ok
            if r["ttft_s"] is not None and r["usage"]["completion_tokens"] > 1 and r.get("streamed", True)]
    out_tokens = sum(r["usage"]["completion_tokens"] for r in ok)
    prompt = sum(r["usage"]["prompt_tokens"] for r in ok)
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in ok)
    return {
        "requests": len(results), "completed": len(ok), "wall_s": round(wall, 3),
        "requests_per_s": len(ok) / wall, "output_tokens_per_s": out_tokens / wall,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
        "ttft_mean_s": sum(ttft) / len(ttft) if ttft else None,
        "tpot_p50_s": percentile(tpot, 50) if tpot else None,
        "latency_p50_s": percentile(latency, 50) if latency else None,
        "latency_mean_s": sum(latency) / len(latency) if latency else None,
        "chunk_hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        # the server's own view: time of the decode forward each output token came from, batch size of a step
        "decode_step_s_mean": (grew("cachedrag_time_per_output_token_seconds_sum")
                               / max(1.0, grew("cachedrag_time_per_output_token_seconds_count"))) if steps else None,
        "decode_batch_mean": (grew("cachedrag_decode_batch_size_sum") / steps) if steps else None,
        # prefill compute of the level's finished requests (no batch shares it): its share of the wall,
        # rows per request (whole-depth equivalents) and the rate it computed them at
        "prefill_s_sum": prefill_s,
        "prefill_share": prefill_s / wall,
        "prefill_rows_mean": prefill_rows / len(ok) if ok else 0.0,
        "prefill_rows_per_s": prefill_rows / prefill_s if prefill_s > 0 else None,
        "cached_tokens_share": cached / prompt if prompt else 0.0,
        "completion_tokens_mean": out_tokens / len(ok) if ok else 0.0,
        # how much the admission order could matter: admissions made with a choice, and ahead of an older request
        "contested_share": grew("cachedrag_contested_admissions_total") / admitted if admitted else 0.0,
        "reordered_share": grew("cachedrag_reordered_admissions_total") / admitted if admitted else 0.0,
        "preempted_share": grew("cachedrag_preempted_prefills_total") / admitted if admitted else 0.0,
        # recurring chunk sequences: requests served as an exact tree path, exact paths stored / abandoned
        "exact_hit_share": grew("cachedrag_exact_hit_requests_total") / len(ok) if ok else 0.0,
        "promotions": grew("cachedrag_exact_promotions_total"),
        "promotions_yielded": grew("cachedrag_exact_promotions_yielded_total"),
        # the tie guards (a fidelity level's): requests prefilled again exactly for a near-tied first token, and
        # answers moved onto an exact prefill at a later near-tied token
        "tie_guarded_share": grew("cachedrag_tie_guarded_requests_total") / len(ok) if ok else 0.0,
        "tie_switched_share": grew("cachedrag_tie_guard_switches_total") / len(ok) if ok else 0.0,
        # faithful under a queue: requests prefilled exactly because others waited (SchedulerConfig.exact_when_waiting)
        "exact_admission_share": grew("cachedrag_exact_admissions_total") / len(ok) if ok else 0.0,
        "prompt_tokens_mean": prompt / len(ok) if ok else 0.0,
        # every request's TTFT in the order the level sent them (the shape behind p50 / p95)
        "ttft_s_by_request": [None if r["ttft_s"] is None else round(r["ttft_s"], 3) for r in results],
        # the chunk cache at the level's end (in memory; below a --cache-gb budget, eviction holds it there)
        "cache_mb_after": round(_metric_sum(replays[-1].after, "cachedrag_cache_bytes") / 2**20, 2),
        # which store tier the level's cache reads came from, and the time they took (a tiered store: by tier)
        "tier_hits": grew_by("cachedrag_tier_hits_total", "tier"),
        "tier_load_s": grew_by("cachedrag_tier_load_seconds_total", "tier"),
        "errors": sorted({str(r.get("error"))[:120] for r in results if r.get("error")})[:3],
        "busy_window_s": busy_s if windows else None,
        "busy_output_tokens_per_s": sum(t for _, t in windows) / busy_s if windows and busy_s > 0 else None,
        "rounds": len(replays),
    }


# ---------------------------------------------------------------------- the suite
def run(args: argparse.Namespace) -> int:
    import httpx

    from cachedrag_bench.workload import Workload, build_workload

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        raise ConfigError(f"--configs: unknown or no configurations {unknown or args.configs!r}; choose from "
                          f"{','.join(CONFIGS)}")
    try:
        levels = [int(x) for x in args.levels.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise ConfigError(f"--levels must list concurrency levels (integers >= 1, comma-separated), got {args.levels!r}")
    n_rounds = args.rounds
    if n_rounds < 1:
        raise ConfigError(f"--rounds must be >= 1, got {n_rounds}")
    n_total = args.warmup + n_rounds * (args.requests * (len(levels) + 1) + max(0, args.queue_requests))
    model_args = ["--tiny"] if args.tiny else (["--model", args.model] if args.model else [])
    model_args += numerics_args(args) + scheduler_args(args) + cache_args(args)
    disk_args(args, None)  # a bad --disk-gb is refused before any work
    if args.disk_dir is not None and not os.path.isdir(args.disk_dir):
        raise ConfigError(f"--disk-dir {args.disk_dir!r} is not a directory")
    if args.tiny:
        from cachedrag.testing import TINY_DOCS

        rng = random.Random(args.seed)
        docs = [d.text for d in TINY_DOCS]
        questions = [f"What does item {rng.randrange(6)} do?" for _ in range(n_total)]
        work = Workload(docs, questions, [rng.sample(docs, 1) for _ in questions], "tiny docs", "random")  # 512-token context
        model_name = "tiny-random"
    else:
        from cachedrag.model.loader import load_tokenizer

        work = build_workload(load_tokenizer(args.model), None, None, top_k=args.top_k, chunk_tokens=args.chunk_tokens,
                              n_requests=n_total, zipf_s=args.zipf, seed=args.seed)
        model_name = args.model or "SmolLM2-135M-Instruct"
    from cachedrag.executor import release_openmp_threads

    release_openmp_threads()  # the embedder ran torch ops here; this process only waits on sockets from now on

    def bodies(explicit: bool, lo: int, hi: int, max_tokens: int) -> list[dict]:
        return [_body(model_name, work.retrieved[i], work.questions[i], explicit, max_tokens, args.stream)
                for i in range(lo, hi)]

    results: dict = {"config": {
        "model": model_name, "levels": levels, "requests_per_level": args.requests, "warmup": args.warmup,
        "rate_per_s": args.rate, "max_tokens": args.max_tokens, "max_batch": args.max_batch, "top_k": args.top_k,
        "dtype": args.dtype, "weights": args.weights, "threads": args.threads,
        "starvation_s": args.starvation_s, "max_overtakes": args.max_overtakes, "max_delay_s": args.max_delay_s,
        "preempt_ratio": args.preempt_ratio, "exact_when_waiting": args.exact_when_waiting,
        "exact_whole_answers": args.exact_whole_answers,
        "exact_repeats_when": args.exact_repeats_when, "exact_repeats": args.exact_repeats,
        "queue_level": args.queue_level,
        "cache_gb": args.cache_gb, "disk_tier": args.disk_dir is not None, "disk_gb": args.disk_gb,
        "hold_waiting": args.hold_waiting,
        "trim_heap_idle_s": args.trim_heap_idle_s,
        "passage_chars": args.passage_chars, "tokenization": args.tokenization,
        "queue_requests": args.queue_requests, "interleave": args.interleave, "rounds": n_rounds, "stream": args.stream,
        "chunk_tokens": args.chunk_tokens, "corpus": work.corpus_name, "questions": work.question_source,
        "configs": {c: CONFIGS[c][0] for c in configs},
        "fidelity_f": args.fidelity if "f" in configs else None,
    }, "configs": {}, "answers": {}}
    texts: dict[str, dict[str, list[str]]] = {}
    disks: dict[str, str | None] = {}

    def start(name: str) -> ServerProcess:
        """``name``'s server, started and warmed with the warm-up requests."""
        label, _, explicit = CONFIGS[name]
        print(f"[{name}] {label}: starting server", file=sys.stderr)
        disk = disks[name] = _server_disk_dir(args, name)
        try:
            server = ServerProcess(model_args + config_args(name, args) + disk_args(args, disk))
        except BaseException:
            if disk is not None:
                shutil.rmtree(disk, ignore_errors=True)
            raise
        try:
            asyncio.run(_replay(server.url, bodies(explicit, 0, args.warmup, args.warmup_max_tokens), 1, args.rate, 0))
        except BaseException:
            stop(name, server)
            raise
        results["configs"][name] = {}
        texts[name] = {}
        return server

    def stop(name: str, server: ServerProcess) -> None:
        server.stop()
        if disks.get(name) is not None:
            shutil.rmtree(disks[name], ignore_errors=True)

    def replay(name: str, server: ServerProcess, conc: int, lo: int, count: int) -> Replay:
        before = httpx.get(server.url + "/metrics").text
        res, wall = asyncio.run(_replay(server.url, bodies(CONFIGS[name][2], lo, lo + count, args.max_tokens),
                                        conc, args.rate, args.seed + conc))
        return Replay(res, wall, before, httpx.get(server.url + "/metrics").text)

    def record(name: str, level: str, conc: int, replays: list[Replay]) -> None:
        row = _level_stats(replays, conc)
        results["configs"][name][level] = row
        texts[name][level] = [(r["text"], r.get("served")) for rep in replays for r in rep.results]
        print(f"[{name}] concurrency {level}: {row['requests_per_s']:.2f} req/s, TTFT p50 "
              f"{row['ttft_p50_s']:.2f} s, {row['output_tokens_per_s']:.1f} tok/s", file=sys.stderr)

    def soak(server: ServerProcess) -> None:
        rounds = [_soak(server, args, model_name, work, k) for k in range(max(1, args.soak_rounds))]
        results["soak"] = {**rounds[0], "rounds": rounds}

    def save() -> None:  # partial results survive an interrupted run
        if args.json_out:
            write_json(results, args.json_out)

    # (label, concurrency, each round's first request, requests, configurations): every configuration
    # that runs a level sees the same requests there, in the same order
    requests_at = args.warmup + len(levels) * n_rounds * args.requests
    runs = [(str(lv), lv, [args.warmup + (j * n_rounds + r) * args.requests for r in range(n_rounds)],
             args.requests, configs) for j, lv in enumerate(levels)]
    queue_pair = [c for c in configs if c in QUEUE_CONFIGS]
    if args.queue_level > 0 and queue_pair:
        # before "1w", so c and d come to it with the same history (the same requests served)
        runs.append((f"{args.queue_level}q", args.queue_level,
                     [requests_at + n_rounds * args.requests + r * args.queue_requests for r in range(n_rounds)],
                     args.queue_requests, queue_pair))
    warm_pair = [c for c in configs if c in WARM_C1_CONFIGS]
    if args.warm_c1 and warm_pair and 1 in levels:  # concurrency 1 again, on new requests of the same stream
        runs.append(("1w", 1, [requests_at + r * args.requests for r in range(n_rounds)], args.requests, warm_pair))
    if not args.interleave:  # one server after another
        for name in configs:
            server = start(name)
            try:
                for level, conc, firsts, count, who in runs:
                    if name in who:
                        record(name, level, conc, [replay(name, server, conc, lo, count) for lo in firsts])
                if args.soak and name == "d":
                    soak(server)
            finally:
                stop(name, server)
            save()
    else:  # every server alive; each replay runs on all of them in turn, the order reversed from one to the next
        servers: dict[str, ServerProcess] = {}
        try:
            for name in configs:
                servers[name] = start(name)
                servers[name].freeze()
            turn = 0
            for level, conc, firsts, count, who in runs:
                replays: dict[str, list[Replay]] = {name: [] for name in who}
                for lo in firsts:
                    order = list(who) if turn % 2 == 0 else list(reversed(who))
                    turn += 1
                    for name in order:
                        servers[name].thaw()
                        replays[name].append(replay(name, servers[name], conc, lo, count))
                        servers[name].freeze()
                for name in who:
                    record(name, level, conc, replays[name])
                save()
            if args.soak and "d" in servers:
                servers["d"].thaw()
                soak(servers["d"])
        finally:
            for name, server in servers.items():
                stop(name, server)
    if "b" in texts:
        for name in texts:
            if name == "b":
                continue
            results["answers"][name] = _answers_vs_b(texts[name], texts["b"], levels)
    _ratios(results)
    _print(results)
    if args.json_out:
        write_json(results, args.json_out)
    return 0


def _answers_vs_b(answers: dict[str, list], full: dict[str, list], levels: list[int]) -> dict:
    """One configuration's answers against (b)'s (full prefill) on the same requests: ROUGE-L and exact
    match over all, exact match by how each prompt was served (``exact``: no approximation; ``approximate``;
    ``switched``: the tie guard during decoding moved the answer onto exact KV), and every answer that
    differs with how it was served, so a mismatch can be told apart: an approximation that changed the
    answer, or numerics (an exact prefix, a chunked prefill or another batch rounding apart in bfloat16)."""
    rows = [(lv, i, x, served or {}, y) for lv in map(str, levels)
            for i, ((x, served), (y, _)) in enumerate(zip(answers[lv], full[lv]))]  # same requests, same order
    out = {"rouge_l_vs_b": sum(rouge_l(x, y) for _, _, x, _, y in rows) / len(rows),
           "exact_match_vs_b": sum(x == y for _, _, x, _, y in rows) / len(rows)}
    kinds: dict[str, list[bool]] = {}
    differs = []
    for lv, i, x, served, y in rows:
        kind = ("switched" if served.get("tie_guard_switch") is not None
                else "approximate" if served.get("approximations") else "exact")
        kinds.setdefault(kind, []).append(x == y)
        if x != y:
            differs.append({"level": lv, "request": i, "served": kind, "rouge_l": round(rouge_l(x, y), 3),
                            "approximations": served.get("approximations"),
                            "first_token_gap": served.get("first_token_gap"), "tie_guard": served.get("tie_guard"),
                            "tie_guard_switch": served.get("tie_guard_switch"),
                            "tie_guard_agreed": served.get("tie_guard_agreed"),
                            "tie_guard_rewound": served.get("tie_guard_rewound")})
    out["served"] = {k: {"requests": len(v), "exact_match_vs_b": sum(v) / len(v)} for k, v in sorted(kinds.items())}
    out["differs"] = differs
    out["rewound"] = sum(1 for *_, served, _ in rows if served.get("tie_guard_rewound"))  # whole answers taken back
    return out


def _at_rest(server: ServerProcess, args, timeout_s: float = 120.0) -> None:
    """Wait until the server has nothing to do and has trimmed its heap, for a memory reading:
    no request running or waiting, no exact-repeat promotion pending (idle time computes those
    first, and a soak leaves some), then past its idle heap trim (``--trim-heap-idle-s``, the
    server's 1 s by default; at least 2 s, so the last disconnects are noticed)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(server.url + "/metrics").text
        if not any(_metric_sum(text, name) for name in ("cachedrag_exact_promotions_pending",
                                                       "cachedrag_running_requests", "cachedrag_queue_length")):
            break
        time.sleep(0.25)
    trim_s = args.trim_heap_idle_s if args.trim_heap_idle_s is not None else 1.0
    time.sleep(max(2.0, trim_s + 1.0) if math.isfinite(trim_s) else 2.0)


def _soak(server: ServerProcess, args, model_name: str, work, round_: int = 0) -> dict:
    """``--soak-requests`` at ``--soak-concurrency``, a share of them disconnecting mid-stream
    (``round_``: which soak round on this server; each draws its own requests)."""
    import httpx

    rng = random.Random(args.seed + 99 + 1000 * round_)
    n = len(work.questions)
    plan = [(rng.randrange(n), rng.randint(1, 3) if rng.random() < args.soak_disconnect else None)
            for _ in range(args.soak_requests)]
    _at_rest(server, args)  # both RSS readings at rest: the levels' freed buffers trimmed too
    rss_before = server.rss_bytes()
    before = httpx.get(server.url + "/metrics").text
    cache_before = _metric_sum(before, "cachedrag_cache_bytes")
    released_before = _metric_sum(before, "cachedrag_heap_released_bytes_total")

    async def go():
        slots = asyncio.Semaphore(args.soak_concurrency)
        limits = httpx.Limits(max_connections=args.soak_concurrency + 4)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
            async def one(i, cut):
                async with slots:
                    body = _body(model_name, work.retrieved[i], work.questions[i], True, args.soak_max_tokens)
                    try:
                        return await _one(client, server.url, body, disconnect_after=cut)
                    except httpx.HTTPError as exc:
                        return {"status": None, "error": repr(exc), "disconnected": False, "usage": None}
            return await asyncio.gather(*(one(i, cut) for i, cut in plan))

    t0 = time.perf_counter()
    res = asyncio.run(go())
    wall = time.perf_counter() - t0
    _at_rest(server, args)
    health = httpx.get(server.url + "/health").json()
    metrics = httpx.get(server.url + "/metrics").text
    stayed = [r for r in res if not r["disconnected"]]
    statuses: dict[str, int] = {}
    for r in res:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    return {
        "requests": len(res), "concurrency": args.soak_concurrency, "wall_s": round(wall, 2),
        "disconnected": sum(r["disconnected"] for r in res),
        "stayed": len(stayed), "stayed_completed": sum(1 for r in stayed if r["status"] == 200 and r["usage"]),
        "statuses": statuses, "errors": [r.get("error") for r in res if r.get("error")][:5],
        "server_5xx": sum(1 for r in res if r["status"] and r["status"] >= 500),
        "running_after": health["running"], "waiting_after": health["waiting"],
        "disconnects_counted": _metric_sum(metrics, "cachedrag_client_disconnects_total"),
        "rss_before_mb": round(rss_before / 2**20, 1), "rss_after_mb": round(server.rss_bytes() / 2**20, 1),
        "cache_bytes_growth_mb": round((_metric_sum(metrics, "cachedrag_cache_bytes") - cache_before) / 2**20, 1),
        "heap_released_mb": round(
            (_metric_sum(metrics, "cachedrag_heap_released_bytes_total") - released_before) / 2**20, 1),
    }


def _ratios(results: dict) -> None:
    c = results["configs"]
    out = {}
    if "a" in c and "d" in c and "4" in c["a"] and "4" in c["d"]:
        out["d_vs_a_requests_per_s_c4"] = c["d"]["4"]["requests_per_s"] / c["a"]["4"]["requests_per_s"]
        out["a_vs_d_ttft_p50_c4"] = c["a"]["4"]["ttft_p50_s"] / c["d"]["4"]["ttft_p50_s"]
    for name in ("b", "d"):
        if name in c and "8" in c[name] and "1" in c[name]:
            out[f"{name}_output_tokens_per_s_c8_vs_c1"] = (c[name]["8"]["output_tokens_per_s"]
                                                          / c[name]["1"]["output_tokens_per_s"])
    for name in ("b", "d"):
        if name in c and "8" in c[name] and "1" in c[name] and c[name]["8"].get("busy_output_tokens_per_s"):
            out[f"{name}_busy_output_tokens_per_s_c8_vs_c1"] = (c[name]["8"]["busy_output_tokens_per_s"]
                                                               / c[name]["1"]["busy_output_tokens_per_s"])
    if "d" in c and "8" in c["d"] and "1w" in c["d"]:  # against the warm concurrency-1 level (a stricter base)
        out["d_output_tokens_per_s_c8_vs_c1w"] = c["d"]["8"]["output_tokens_per_s"] / c["d"]["1w"]["output_tokens_per_s"]
    if "c" in c and "d" in c:
        for lv in c["c"]:
            if lv in c["d"]:
                out[f"c_vs_d_ttft_p50_c{lv}"] = c["c"][lv]["ttft_p50_s"] / c["d"][lv]["ttft_p50_s"]
                out[f"c_vs_d_ttft_mean_c{lv}"] = c["c"][lv]["ttft_mean_s"] / c["d"][lv]["ttft_mean_s"]
                out[f"d_p95_le_c_p95_c{lv}"] = c["d"][lv]["ttft_p95_s"] <= c["c"][lv]["ttft_p95_s"]
                out.update({f"d_minus_c_{k}_c{lv}": v for k, v in _paired_ttft(
                    c["c"][lv]["ttft_s_by_request"], c["d"][lv]["ttft_s_by_request"]).items()})
    # a fidelity level's price under load (f vs d), and both against prefix caching (g): the same requests
    for num, den in (("f", "d"), ("d", "g"), ("f", "g")):
        if num not in c or den not in c:
            continue
        for lv in c[num]:
            if lv in c[den]:
                for key in ("requests_per_s", "output_tokens_per_s", "ttft_p50_s", "ttft_mean_s", "latency_p50_s",
                            "latency_mean_s"):
                    if c[den][lv].get(key) and c[num][lv].get(key) is not None:
                        out[f"{num}_vs_{den}_{key}_c{lv}"] = c[num][lv][key] / c[den][lv][key]
    if all(k in c for k in "ade"):
        for lv in c["e"]:
            base = c["a"].get("1" if lv == "1w" else lv)  # full mode has no warm state: c1 is its c1w
            if base is None or lv not in c["d"]:
                continue
            gain_d = base["ttft_p50_s"] - c["d"][lv]["ttft_p50_s"]
            gain_e = base["ttft_p50_s"] - c["e"][lv]["ttft_p50_s"]
            out[f"e_keeps_of_d_ttft_gain_c{lv}"] = gain_e / gain_d if gain_d > 0 else None
    results["ratios"] = out


PAIRED_TIE_S = 0.02  # paired TTFTs closer than this count as neither faster nor slower


def _paired_ttft(base: list, other: list) -> dict:
    """Two servers replayed the same requests in the same order, so their TTFTs pair request by
    request: the mean of ``other - base`` (seconds), how many requests ``other`` served more than
    ``PAIRED_TIE_S`` sooner / later, and the largest gain and loss. Requests without a TTFT on
    either side are left out."""
    diffs = [y - x for x, y in zip(base, other) if x is not None and y is not None]
    if not diffs:
        return {}
    return {"paired_ttft_mean_s": sum(diffs) / len(diffs),
            "paired_sooner": sum(d < -PAIRED_TIE_S for d in diffs),
            "paired_later": sum(d > PAIRED_TIE_S for d in diffs),
            "paired_most_sooner_s": -min(min(diffs), 0.0), "paired_most_later_s": max(max(diffs), 0.0)}


def _print(results: dict) -> None:
    cols = [("requests_per_s", "req/s"), ("output_tokens_per_s", "tok/s"), ("ttft_p50_s", "ttft50"),
            ("ttft_p95_s", "ttft95"), ("ttft_mean_s", "ttftavg"), ("tpot_p50_s", "tpot50"), ("latency_p50_s", "lat50"),
            ("chunk_hit_rate", "hit"),
            ("cached_tokens_share", "cached"), ("completion_tokens_mean", "tok/req"), ("decode_batch_mean", "batch"),
            ("decode_step_s_mean", "step"), ("prefill_share", "prefill"), ("prefill_rows_mean", "rows/req"),
            ("contested_share", "contest"), ("reordered_share", "reorder"), ("preempted_share", "preempt"),
            ("busy_output_tokens_per_s", "busy t/s"), ("tie_switched_share", "switch")]
    cfg = results["config"]
    numerics = cfg["dtype"] + ("" if cfg["weights"] == "dense" else f"+{cfg['weights']}")
    rounds = cfg.get("rounds", 1)
    per_level = f"{cfg['requests_per_level']} requests per level" + (f" x {rounds} rounds" if rounds > 1 else "")
    order = "servers interleaved" if cfg.get("interleave") else "servers one after another"
    print(f"\nserve: {per_level}, max_tokens {cfg['max_tokens']}, {cfg['model']} ({numerics}), {order}")
    print(f"{'config':>8} {'conc':>5} " + " ".join(f"{h:>8}" for _, h in cols))
    for name, levels in results["configs"].items():
        for lv, row in levels.items():
            vals = [row[k] for k, _ in cols]
            print(f"{name:>8} {lv:>5} " + " ".join(f"{v:>8.3f}" if isinstance(v, float) else f"{'-':>8}" for v in vals))
    if cfg.get("disk_tier"):  # where a tiered store's reads came from
        for name, levels in results["configs"].items():
            for lv, row in levels.items():
                print(f"{name} {lv} cache reads by tier: " + ", ".join(
                    f"{t} {n:.0f} ({row['tier_load_s'].get(t, 0.0):.2f} s)" for t, n in row["tier_hits"].items()))
    for name, a in results.get("answers", {}).items():
        print(f"answers {name} vs b: ROUGE-L {a['rouge_l_vs_b']:.3f}, exact {a['exact_match_vs_b']:.2f}"
              + "".join(f"; {k} {v['exact_match_vs_b']:.2f} of {v['requests']}" for k, v in a.get("served", {}).items()))
    for k, v in results.get("ratios", {}).items():
        print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    for k, s in enumerate(results["soak"].get("rounds", [results["soak"]]) if "soak" in results else []):
        print(f"soak round {k + 1}: {s['requests']} requests at concurrency {s['concurrency']}, "
              f"{s['disconnected']} disconnected, "
              f"{s['stayed_completed']}/{s['stayed']} others completed, statuses {s['statuses']}, "
              f"running/waiting after {s['running_after']}/{s['waiting_after']}, "
              f"RSS {s['rss_before_mb']} -> {s['rss_after_mb']} MB (cache +{s['cache_bytes_growth_mb']} MB, "
              f"{s.get('heap_released_mb', 0)} MB of freed heap returned when idle)")
