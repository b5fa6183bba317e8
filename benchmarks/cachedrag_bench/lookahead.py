"""``cachedrag bench lookahead``: GPU lookahead retrieval on a synthetic IVF index (TeleRAG's setting).

Owns: the GPU lookahead benchmark of issue 18 — a synthetic 1-5M-vector IVF-Flat index built in
the run (no embedder, no corpus), searched at nprobe = 3-12% of the clusters, with the fast tier
on the GPU, measured side by side (variants interleaved per query, rotated order) and reported
as median/p95 ms per query and recall@10 against exact search:

- ``faiss_cpu``: Faiss ``IndexIVFFlat`` on the CPU over the same centroids and inverted lists
  (built from the same assignments), all cores, a query's lists split over the threads
  (``parallel_mode=1``; the fastest mode for one query);
- ``faiss_cpu_1thread``: the same index in Faiss's default mode (``parallel_mode=0``: one thread
  per query, so one thread for a single query);
- ``resident``: our search (``ivf.search_blocks``) with every cluster in GPU memory (the upper
  bound of any tiering);
- ``on_demand``: clusters in pinned host memory, the probed ones copied to the GPU when the
  query arrives (no prefetch);
- ``lookahead``: during a simulated query-rewrite window (``--window-ms``; a sleep or a busy GPU
  op on its own stream standing for the LLM), ``LookaheadRetriever.prefetch`` copies the
  *original* query's nearest clusters to the GPU tier (side stream); then the *rewrite* is
  searched on the GPU, its clusters that were not prefetched copied on demand;
- ``lookahead_split``: the same prefetch, then ``LookaheadRetriever.search`` as shipped
  (TeleRAG's split: prefetched clusters searched on the GPU, missed ones on the CPU, concurrently).

Every variant searches the rewrite; the recall reference is exact (brute-force) search of the
rewrite over all vectors (``IVFIndex.exact_search``, on the GPU when there is one). Also
reported: the pinned host -> GPU bandwidth (one bulk copy, and per cluster as the prefetcher
moves them: ``lookahead.measure_bandwidth``), the cluster coverage (the fraction of the
rewrite's probed clusters that the original query also probes, TeleRAG's overlap), the
prefetch hit fraction (probed clusters resident when the search starts) and the build times.

The synthetic data (``SyntheticConfig``): a Gaussian mixture in a ``latent_dim``-dimensional
subspace (``modes`` centres, default 2 x nlist) plus isotropic noise, unit-normalised, inner
product; queries are data points perturbed to cosine ``query_cos``, rewrites the queries
perturbed to cosine ``rewrite_cos`` (a random direction orthogonal to the query). With the
defaults IVF recall@10 is about 0.90 / 0.94 / 0.97 at 3 / 6 / 12% of the clusters and the
coverage 0.82-0.88 (measured on CPU at 500k vectors, nlist 1024; TeleRAG reports 65-93%).

On a machine without CUDA (``--device cpu``) the "GPU" tiers are plain host memory: the run
checks the code paths and recalls (the tests run it at tiny sizes), and the output says that its
resident/on_demand/lookahead rows are not GPU figures. Does not own: any retrieval logic
(``cachedrag.retrieval``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cachedrag_bench import write_json
from cachedrag_bench.metrics import percentile
from cachedrag.errors import ConfigError, describe_validation_error
from cachedrag.model.runner import resolve_device

VARIANTS = ("faiss_cpu", "faiss_cpu_1thread", "resident", "on_demand", "lookahead", "lookahead_split")
GPU_VARIANTS = ("resident", "on_demand", "lookahead", "lookahead_split")
DEFAULT_FRACTIONS = "0.03,0.06,0.12"
_GEN_ROWS = 262_144  # rows generated per step
_ASSIGN_ROWS = 65_536  # rows assigned per matmul ([rows, nlist] scores)
_EXACT_QUERIES = 8  # queries per exact-search step ([8, N] scores)
_BULK_MIB = 256  # size of the bulk H2D copy
_BANDWIDTH_CLUSTERS = 64  # clusters of the per-cluster bandwidth measurement
_WINDOW_MATMUL = 8192  # side of the bf16 matmul that keeps the GPU busy during the window


class SyntheticConfig(BaseModel):
    """How the synthetic vectors and queries are drawn (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    modes: int | None = Field(None, ge=1, description="mixture centres (default: 2 x nlist)")
    latent_dim: int = Field(48, ge=1, description="dimension of the subspace the mixture lives in")
    spread: float = Field(1.0, ge=0.0, description="std of a point around its centre (latent, per unit-norm centre)")
    noise: float = Field(0.5, ge=0.0, description="norm of the isotropic noise added in the full space")
    query_cos: float = Field(0.95, gt=0.0, le=1.0, description="cosine of a query to the data point it perturbs")
    rewrite_cos: float = Field(0.9, gt=0.0, le=1.0, description="cosine of the rewrite to the original query")


class LookaheadBenchConfig(BaseModel):
    """Every setting of one ``bench lookahead`` run, validated once."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    vectors: int = Field(2_000_000, ge=1, description="rows of the synthetic index")
    dim: int = Field(384, ge=2, description="vector dimension (384: MiniLM's)")
    nlist: int | None = Field(None, ge=1, description="IVF clusters (default: auto_nlist(vectors))")
    train_size: int | None = Field(None, ge=1, description="k-means sample (default: max(100k, 32 x nlist), <= vectors)")
    kmeans_iters: int = Field(10, ge=1)
    queries: int = Field(64, ge=1)
    k: int = Field(10, ge=1, description="results per query (recall@k)")
    nprobe_fractions: tuple[float, ...] = Field((0.03, 0.06, 0.12), min_length=1)
    window_ms: float = Field(30.0, ge=0.0, description="simulated query-rewrite time (the prefetch window)")
    window_kind: Literal["auto", "sleep", "gpu"] = "auto"
    budget: Literal["profiled", "probe"] = Field(
        "profiled", description="prefetch budget: per-cluster bandwidth x window (TeleRAG's b_p), or the "
                                "original query's nprobe clusters")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int | None = Field(None, ge=1, description="Faiss threads (default: the cores this process may use)")
    warmup: int = Field(3, ge=0, description="untimed queries per nprobe before the timed ones")
    seed: int = 0
    synthetic: SyntheticConfig = Field(default_factory=SyntheticConfig)

    @model_validator(mode="after")
    def _consistent(self) -> "LookaheadBenchConfig":
        bad = [f for f in self.nprobe_fractions if not 0.0 < f <= 1.0]
        if bad:
            raise ConfigError(f"--nprobe-fractions must be in (0, 1], got {bad}")
        nlist = self.resolved_nlist
        if nlist > self.vectors:
            raise ConfigError(f"--nlist ({nlist}) must not exceed --vectors ({self.vectors})")
        if self.k > self.vectors:
            raise ConfigError(f"-k ({self.k}) must not exceed --vectors ({self.vectors})")
        if self.train_size is not None and not nlist <= self.train_size <= self.vectors:
            raise ConfigError(f"--train-size ({self.train_size}) must be between --nlist ({nlist}) and --vectors "
                              f"({self.vectors})")
        if self.synthetic.latent_dim > self.dim:
            raise ConfigError(f"--latent-dim ({self.synthetic.latent_dim}) must not exceed --dim ({self.dim})")
        return self

    @property
    def resolved_nlist(self) -> int:
        return self.nlist if self.nlist is not None else min(auto_nlist(self.vectors), self.vectors)

    @property
    def resolved_train_size(self) -> int:
        if self.train_size is not None:
            return self.train_size
        return min(self.vectors, max(100_000, 32 * self.resolved_nlist))

    @property
    def resolved_modes(self) -> int:
        return self.synthetic.modes or 2 * self.resolved_nlist

    def nprobes(self) -> list[tuple[float, int]]:
        """``(fraction, nprobe)`` per requested fraction, nprobe = round(fraction x nlist) >= 1, deduplicated."""
        out, seen = [], set()
        for f in self.nprobe_fractions:
            n = max(1, round(f * self.resolved_nlist))
            if n not in seen:
                seen.add(n)
                out.append((f, n))
        return out


def auto_nlist(vectors: int) -> int:
    """The power of two nearest 4 sqrt(N) (4096 for 1-2M vectors, 8192 for 5M), at least 1."""
    return 2 ** max(0, round(math.log2(4 * math.sqrt(max(1, vectors)))))


# ----------------------------------------------------------------------------------------------
# command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vectors", type=int, default=2_000_000, help="rows of the synthetic index (default 2,000,000)")
    parser.add_argument("--dim", type=int, default=384, help="vector dimension (default 384, MiniLM's)")
    parser.add_argument("--nlist", type=int, help="IVF clusters (default: power of two nearest 4 sqrt(N); 4096 at 2M)")
    parser.add_argument("--train-size", type=int, help="k-means sample (default max(100k, 32 x nlist))")
    parser.add_argument("--kmeans-iters", type=int, default=10, help="Faiss k-means iterations (default 10)")
    parser.add_argument("--queries", type=int, default=64, help="timed queries per nprobe (default 64)")
    parser.add_argument("-k", type=int, default=10, help="results per query (recall@k; default 10)")
    parser.add_argument("--nprobe-fractions", default=DEFAULT_FRACTIONS,
                        help=f"nprobe as fractions of nlist, comma list (default {DEFAULT_FRACTIONS}: TeleRAG's 3-12%%)")
    parser.add_argument("--window-ms", type=float, default=30.0, help="simulated query-rewrite window (default 30)")
    parser.add_argument("--window-kind", choices=("auto", "sleep", "gpu"), default="auto",
                        help="what fills the window: a sleep, or a busy bf16 matmul on its own CUDA stream "
                             "(auto: gpu on cuda, sleep on cpu)")
    parser.add_argument("--budget", choices=("profiled", "probe"), default="profiled",
                        help="prefetch budget: per-cluster bandwidth x window (profiled, TeleRAG's b_p) or the "
                             "original query's nprobe clusters (probe)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where the fast tier lives (auto: cuda when available)")
    parser.add_argument("--threads", type=int, help="Faiss threads (default: all cores of this process)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed queries per nprobe (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    group = parser.add_argument_group("synthetic data")
    group.add_argument("--modes", type=int, help="mixture centres (default 2 x nlist)")
    group.add_argument("--latent-dim", type=int, default=48, help="dimension of the mixture's subspace (default 48)")
    group.add_argument("--spread", type=float, default=1.0, help="spread of a point around its centre (default 1.0)")
    group.add_argument("--noise", type=float, default=0.5, help="isotropic noise norm (default 0.5)")
    group.add_argument("--query-cos", type=float, default=0.95, help="cosine of a query to its data point (default 0.95)")
    group.add_argument("--rewrite-cos", type=float, default=0.9, help="cosine of the rewrite to the query (default 0.9)")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT")


def config_from_args(args: argparse.Namespace) -> LookaheadBenchConfig:
    """The validated config of a command line; a bad value -> ``ConfigError`` (one line)."""
    try:
        fractions = tuple(float(x) for x in str(args.nprobe_fractions).split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"bad --nprobe-fractions {args.nprobe_fractions!r}: a comma list of numbers in (0, 1]") from None
    try:
        return LookaheadBenchConfig(
            vectors=args.vectors, dim=args.dim, nlist=args.nlist, train_size=args.train_size,
            kmeans_iters=args.kmeans_iters, queries=args.queries, k=args.k, nprobe_fractions=fractions,
            window_ms=args.window_ms, window_kind=args.window_kind, budget=args.budget, device=args.device,
            threads=args.threads, warmup=args.warmup, seed=args.seed,
            synthetic=SyntheticConfig(modes=args.modes, latent_dim=args.latent_dim, spread=args.spread,
                                      noise=args.noise, query_cos=args.query_cos, rewrite_cos=args.rewrite_cos),
        )
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from exc


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    results = measure(config, json_out=args.json)
    print(format_table(results))
    if args.json:
        write_json(results, args.json)
    return 0


# ----------------------------------------------------------------------------------------------
# the synthetic index


def _log(msg: str) -> None:
    print(f"[bench lookahead] {msg}", file=sys.stderr, flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _unit(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(x, dim=1)


def perturb(q: torch.Tensor, cos: float, gen: torch.Generator) -> torch.Tensor:
    """Unit vectors at cosine ``cos`` to the unit rows of ``q [B, d]``, in random orthogonal directions."""
    u = torch.randn(q.shape, generator=gen, device=q.device)  # [B, d]
    u = _unit(u - (u * q).sum(1, keepdim=True) * q)  # [B, d] orthogonal to q
    return cos * q + math.sqrt(max(0.0, 1.0 - cos * cos)) * u  # [B, d]


def generate_vectors(config: LookaheadBenchConfig, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """The synthetic data ``[N, d]`` float32, unit rows, on ``device`` (see the module docstring)."""
    syn, n, d, r = config.synthetic, config.vectors, config.dim, config.synthetic.latent_dim
    small = torch.Generator().manual_seed(config.seed)  # the small parameters on the CPU: same on every device
    basis = torch.linalg.qr(torch.randn(d, r, generator=small))[0].to(device)  # [d, r] orthonormal columns
    centres = _unit(torch.randn(config.resolved_modes, r, generator=small)).to(device)  # [M, r]
    out = torch.empty((n, d), dtype=torch.float32, device=device)  # [N, d]
    for start in range(0, n, _GEN_ROWS):
        b = min(_GEN_ROWS, n - start)
        mode = torch.randint(centres.shape[0], (b,), generator=gen, device=device)  # [b]
        latent = centres[mode] + syn.spread / math.sqrt(r) * torch.randn(b, r, generator=gen, device=device)  # [b, r]
        noise = syn.noise / math.sqrt(d) * torch.randn(b, d, generator=gen, device=device)  # [b, d]
        out[start:start + b] = _unit(latent @ basis.T + noise)  # [b, d]
    return out


def train_centroids(sample, nlist: int, iters: int, seed: int):
    """Faiss spherical k-means on ``sample [n, d]`` (numpy float32) -> centroids ``[nlist, d]`` (numpy)."""
    import faiss

    n, d = sample.shape
    kmeans = faiss.Kmeans(d, nlist, niter=iters, seed=seed, spherical=True, verbose=False,
                          min_points_per_centroid=1, max_points_per_centroid=max(256, -(-n // nlist) + 1))
    kmeans.train(sample)
    return kmeans.centroids


def build_index(config: LookaheadBenchConfig, device: torch.device):
    """The synthetic IVF index and its queries.

    Returns ``(ivf_dev, ivf_host, q_orig, q_rw, build)``: ``ivf_dev`` has every tensor but the
    offsets on ``device`` (the resident tier and the exact reference), ``ivf_host`` the same
    lists in host memory (pinned on CUDA: the slow tier and Faiss's source; on CPU the same
    tensors as ``ivf_dev``); queries ``[Q, d]`` on ``device``; ``build`` the timings (s).
    """
    from cachedrag.retrieval.ivf import IVFIndex

    build: dict[str, Any] = {}
    gen = torch.Generator(device=device).manual_seed(config.seed)
    nlist, n = config.resolved_nlist, config.vectors

    t = time.perf_counter()
    x = generate_vectors(config, device, gen)  # [N, d]
    rows = torch.randperm(n, generator=gen, device=device)[: config.queries] if config.queries <= n else \
        torch.randint(n, (config.queries,), generator=gen, device=device)  # [Q]
    q_orig = perturb(x[rows], config.synthetic.query_cos, gen)  # [Q, d]
    q_rw = perturb(q_orig, config.synthetic.rewrite_cos, gen)  # [Q, d]
    _sync(device)
    build["generate_s"] = time.perf_counter() - t
    _log(f"generated {n:,} x {config.dim} on {device} in {build['generate_s']:.1f} s")

    t = time.perf_counter()
    train = config.resolved_train_size
    sample_rows = torch.randperm(n, generator=gen, device=device)[:train]  # [T]
    sample = x[sample_rows].cpu().numpy()  # [T, d]
    centroids = torch.from_numpy(train_centroids(sample, nlist, config.kmeans_iters, config.seed))  # [nlist, d]
    del sample
    build["kmeans_s"] = time.perf_counter() - t
    _log(f"k-means: {nlist} centroids on {train:,} vectors, {config.kmeans_iters} iterations, {build['kmeans_s']:.1f} s")

    t = time.perf_counter()
    c_dev = centroids.to(device)  # [nlist, d]
    assign = torch.empty(n, dtype=torch.int64, device=device)  # [N]
    for start in range(0, n, _ASSIGN_ROWS):
        stop = min(n, start + _ASSIGN_ROWS)
        assign[start:stop] = (x[start:stop] @ c_dev.T).argmax(dim=1)  # [b] nearest centroid (first on ties)
    _sync(device)
    build["assign_s"] = time.perf_counter() - t

    t = time.perf_counter()
    order = torch.argsort(assign, stable=True)  # [N] rows grouped by cluster, row order within
    vectors = x[order]  # [N, d] cluster-contiguous
    del x
    counts = torch.bincount(assign, minlength=nlist).cpu()  # [nlist]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])  # [nlist + 1]
    ivf_dev = IVFIndex(c_dev, vectors, order, offsets, "ip")
    _sync(device)
    build["layout_s"] = time.perf_counter() - t

    t = time.perf_counter()
    if device.type == "cuda":  # pinned host copy: the slow tier (and the source of Faiss's lists)
        host_vectors = torch.empty(vectors.shape, dtype=torch.float32, pin_memory=True)  # [N, d]
        host_vectors.copy_(vectors)
        host_ids = torch.empty(order.shape, dtype=torch.int64, pin_memory=True)  # [N]
        host_ids.copy_(order)
        ivf_host = IVFIndex(centroids, host_vectors, host_ids, offsets, "ip")
    else:
        ivf_host = ivf_dev
    build["host_copy_s"] = time.perf_counter() - t
    sizes = counts.tolist()
    build["rows_per_list"] = {"min": min(sizes), "mean": n / nlist, "max": max(sizes), "empty": sizes.count(0)}
    _log(f"assigned and laid out in {build['assign_s'] + build['layout_s']:.1f} s; host copy {build['host_copy_s']:.1f} s")
    return ivf_dev, ivf_host, q_orig, q_rw, build


def exact_ids(ivf, q: torch.Tensor, k: int) -> torch.Tensor:
    """Brute-force top-k ids of ``q [Q, d]`` over every vector of ``ivf`` -> ``[Q, k]`` on the CPU."""
    parts = [ivf.exact_search(q[i:i + _EXACT_QUERIES], k)[1].cpu() for i in range(0, q.shape[0], _EXACT_QUERIES)]
    return torch.cat(parts)  # [Q, k]


def recall(found: Sequence[Sequence[int]], exact: torch.Tensor) -> float:
    """Mean fraction of each exact top-k found (padding ids ignored)."""
    values = []
    for f, e in zip(found, exact.tolist()):
        want = {i for i in e if i >= 0}
        values.append(len(want & set(f)) / max(1, len(want)))
    return statistics.fmean(values)


# ----------------------------------------------------------------------------------------------
# bandwidth and the rewrite window


def bulk_h2d(host: torch.Tensor, device: torch.device, repeats: int = 5) -> dict[str, float]:
    """Bandwidth of one ``_BULK_MIB`` copy from ``host`` (pinned on CUDA) to ``device`` (a memcpy on CPU)."""
    rows = max(1, min(host.shape[0], _BULK_MIB * 2**20 // (host.shape[1] * host.element_size())))
    src = host[:rows]  # [rows, d]
    dst = torch.empty(src.shape, dtype=src.dtype, device=device)  # [rows, d]
    nbytes = src.numel() * src.element_size()
    dst.copy_(src, non_blocking=True)
    _sync(device)
    samples = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        _sync(device)
        samples.append(time.perf_counter() - t)
    del dst
    return {"gb_per_s": nbytes / statistics.median(samples) / 1e9, "bytes": nbytes}


class RewriteWindow:
    """The simulated LLM rewrite: ``window_ms`` of sleep, or of bf16 matmuls on a dedicated CUDA stream."""

    def __init__(self, kind: str, window_ms: float, device: torch.device):
        self.kind, self.target_ms, self.device = kind, window_ms, device
        self.reps = 0
        self.rep_ms = None
        if kind == "gpu" and window_ms > 0:
            n = _WINDOW_MATMUL
            self.stream = torch.cuda.Stream(device)
            with torch.cuda.stream(self.stream):
                self.a = torch.randn(n, n, device=device, dtype=torch.bfloat16)  # [n, n]
                self.b = torch.randn(n, n, device=device, dtype=torch.bfloat16)  # [n, n]
                self.c = torch.empty(n, n, device=device, dtype=torch.bfloat16)  # [n, n]
            self.stream.synchronize()
            self.reps = 2
            self()  # warm-up (cuBLAS handle, kernel choice)
            self.reps = 5
            self.rep_ms = self() / 5
            self.reps = max(1, round(window_ms / self.rep_ms))

    def __call__(self) -> float:
        """Run one window; its measured duration (ms)."""
        if self.kind != "gpu" or self.target_ms <= 0:
            t = time.perf_counter()
            if self.target_ms > 0:
                time.sleep(self.target_ms / 1e3)
            return (time.perf_counter() - t) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record()
            for _ in range(self.reps):
                torch.mm(self.a, self.b, out=self.c)
            end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def info(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "target_ms": self.target_ms}
        if self.kind == "gpu" and self.target_ms > 0:
            out.update(matmul=f"{_WINDOW_MATMUL}x{_WINDOW_MATMUL} bf16", reps=self.reps, rep_ms=self.rep_ms)
        return out


# ----------------------------------------------------------------------------------------------
# the variants


class _Bench:
    """The tiers, the Faiss index and one timed search per variant."""

    def __init__(self, config: LookaheadBenchConfig, device: torch.device, ivf_dev, ivf_host, faiss_index,
                 window: RewriteWindow):
        from cachedrag.retrieval.cluster_store import MemoryClusterStore, make_tiers
        from cachedrag.retrieval.config import LookaheadConfig, SearchConfig
        from cachedrag.retrieval.lookahead import LookaheadRetriever

        self.config, self.device, self.k = config, device, config.k
        self.ivf_dev, self.ivf_host, self.faiss = ivf_dev, ivf_host, faiss_index
        self.quantizer = ivf_dev.quantizer  # centroids on the device
        self.window = window
        self.resident = MemoryClusterStore.from_index(ivf_dev, device)  # every cluster, no copy
        if device.type == "cuda":
            self.slow, self.fast = make_tiers(ivf_host, None, device)  # pinned RAM (views: already pinned), GPU
        else:
            self.slow, self.fast = MemoryClusterStore.from_index(ivf_host, "cpu"), MemoryClusterStore("cpu")
        self.cluster_nbytes = ivf_host.cluster_nbytes()
        self.retriever = LookaheadRetriever(
            self.quantizer, self.slow, self.fast, self.cluster_nbytes,
            config=LookaheadConfig(budget_bytes=0, candidate_chunks=0),
            search_config=SearchConfig(k=config.k, nprobe=1),
        )

    def close(self) -> None:
        self.retriever.close()

    # -- building blocks -----------------------------------------------------------------------

    def _copy_in(self, blocks: dict) -> dict:
        """Blocks copied to the fast device on the current stream (non-blocking from pinned memory;
        later kernels on this stream see them). On CPU a real memcpy, so on_demand still copies."""
        from cachedrag.retrieval.ivf import ClusterBlock

        dev = self.device
        return {c: ClusterBlock(b.vectors.to(dev, non_blocking=True, copy=True), b.ids.to(dev, non_blocking=True, copy=True))
                for c, b in blocks.items()}

    def _search(self, q_host: torch.Tensor, nprobe: int, get_blocks: Callable[[list[int]], dict]) -> list[int]:
        """Assign on the device, fetch blocks, ``search_blocks``; top-k ids on the CPU (a sync)."""
        from cachedrag.retrieval.ivf import search_blocks

        q = q_host.to(self.device, non_blocking=True)  # [1, d]
        probe = self.quantizer.assign(q, nprobe)  # [1, nprobe]
        blocks = get_blocks(probe[0].tolist())
        _, ids = search_blocks(q, probe, blocks, self.k, self.quantizer.metric)  # [1, k]
        return ids[0].cpu().tolist()

    def set_budget(self, budget_bytes: int) -> None:
        self.retriever.config = self.retriever.config.model_copy(update={"budget_bytes": int(budget_bytes)})

    # -- one query of each variant: (ids, ms, extra) --------------------------------------------

    def faiss_search(self, q_np, nprobe: int, parallel_mode: int):
        self.faiss.nprobe = nprobe
        self.faiss.parallel_mode = parallel_mode
        t = time.perf_counter()
        _, ids = self.faiss.search(q_np, self.k)  # [1, k]
        return ids[0].tolist(), (time.perf_counter() - t) * 1e3, {}

    def resident_search(self, q_rw, nprobe: int):
        _sync(self.device)
        t = time.perf_counter()
        ids = self._search(q_rw, nprobe, self.resident.get)
        _sync(self.device)
        return ids, (time.perf_counter() - t) * 1e3, {}

    def on_demand_search(self, q_rw, nprobe: int):
        _sync(self.device)
        t = time.perf_counter()
        ids = self._search(q_rw, nprobe, lambda wanted: self._copy_in(self.slow.get(wanted)))
        _sync(self.device)
        return ids, (time.perf_counter() - t) * 1e3, {}

    def _prefetch_during_window(self, q_orig, budget_bytes: int):
        self.retriever.clear_fast_tier()
        self.set_budget(budget_bytes)
        _sync(self.device)
        handle = self.retriever.prefetch(q_orig)  # returns at once; copies on the prefetch thread (side stream)
        window_ms = self.window()
        _sync(self.device)
        return handle, window_ms

    def lookahead_search(self, q_orig, q_rw, nprobe: int, budget_bytes: int):
        handle, window_ms = self._prefetch_during_window(q_orig, budget_bytes)
        hit = {}

        def get_blocks(wanted: list[int]) -> dict:
            blocks = self.fast.get(wanted)  # prefetched
            hit["fraction"] = len(blocks) / max(1, len(wanted))
            blocks.update(self._copy_in(self.slow.get([c for c in wanted if c not in blocks])))
            return blocks

        t = time.perf_counter()
        handle.cancel()  # the rewrite is ready: stop after the cluster being copied
        report = handle.wait()
        ids = self._search(q_rw, nprobe, get_blocks)
        _sync(self.device)
        ms = (time.perf_counter() - t) * 1e3
        extra = {"hit_fraction": hit["fraction"], "window_ms": window_ms, "copied_clusters": len(report.copied),
                 "planned_clusters": len(report.clusters), "copied_bytes": report.copied_bytes,
                 "complete": len(report.copied) == len(report.clusters), "prefetch_ms": report.elapsed_ms}
        return ids, ms, extra

    def lookahead_split_search(self, q_orig, q_rw, nprobe: int, budget_bytes: int):
        handle, window_ms = self._prefetch_during_window(q_orig, budget_bytes)
        t = time.perf_counter()
        result = self.retriever.search(q_rw, k=self.k, nprobe=nprobe)  # cancels the prefetch; misses on the CPU
        _sync(self.device)
        ms = (time.perf_counter() - t) * 1e3
        handle.join()
        if result.prefetch_error:
            raise RuntimeError(f"prefetch failed: {result.prefetch_error}")
        extra = {"hit_fraction": result.hit_rate, "window_ms": window_ms, "fast_ms": result.fast_ms,
                 "slow_ms": result.slow_ms}
        return result.ids[0].tolist(), ms, extra


# ----------------------------------------------------------------------------------------------
# measurement


def measure(config: LookaheadBenchConfig, json_out: str | None = None) -> dict[str, Any]:
    """Build the index, run every variant at every nprobe; the JSON-ready results.

    With ``json_out``, the results so far are written there after each nprobe (``complete``
    false until the end), so a run cut short still leaves its finished nprobe values.
    """
    import faiss

    from cachedrag.retrieval.lookahead import measure_bandwidth
    from cachedrag.retrieval.policy import prefetch_budget

    t_start = time.perf_counter()
    device = resolve_device(config.device)
    on_cuda = device.type == "cuda"
    kind = config.window_kind if config.window_kind != "auto" else ("gpu" if on_cuda else "sleep")
    if kind == "gpu" and not on_cuda:
        raise ConfigError("--window-kind gpu needs --device cuda")
    threads = config.threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()) or 1
    faiss.omp_set_num_threads(threads)
    device_name = torch.cuda.get_device_name(device) if on_cuda else "cpu"
    nlist = config.resolved_nlist
    note = (f"cuda ({device_name}): fast tier in GPU memory, slow tier in pinned host memory" if on_cuda else
            "cpu: no GPU in this run; the 'GPU' tiers are plain host memory, so the resident, on_demand, lookahead "
            "and lookahead_split rows are not GPU figures (they check the code paths and recalls)")
    _log(f"device {device_name}; {config.vectors:,} vectors x {config.dim}, nlist {nlist}, Faiss threads {threads}")

    ivf_dev, ivf_host, q_orig, q_rw, build = build_index(config, device)
    t = time.perf_counter()
    faiss_index = ivf_host.to_faiss()  # same centroids, same lists, same order
    build["faiss_lists_s"] = time.perf_counter() - t
    t = time.perf_counter()
    exact_rw = exact_ids(ivf_dev, q_rw, config.k)  # [Q, k]
    exact_orig = exact_ids(ivf_dev, q_orig, config.k)  # [Q, k]
    build["exact_s"] = time.perf_counter() - t
    _log(f"Faiss lists {build['faiss_lists_s']:.1f} s, exact search {build['exact_s']:.1f} s")
    q_orig_host = q_orig.cpu().contiguous()  # [Q, d]
    q_rw_host = q_rw.cpu().contiguous()  # [Q, d]
    if on_cuda:
        q_orig_host, q_rw_host = q_orig_host.pin_memory(), q_rw_host.pin_memory()
    q_rw_np = q_rw_host.numpy()  # [Q, d] for Faiss

    window = RewriteWindow(kind, config.window_ms, device)
    bench = _Bench(config, device, ivf_dev, ivf_host, faiss_index, window)
    bulk = bulk_h2d(ivf_host.vectors, device)
    per_cluster = measure_bandwidth(bench.slow, device, _BANDWIDTH_CLUSTERS, cold=False)
    window_alone = statistics.median(window() for _ in range(3))
    rate = per_cluster.bytes_per_s if math.isfinite(per_cluster.bytes_per_s) else bulk["gb_per_s"] * 1e9
    profiled = prefetch_budget(rate, [config.window_ms / 1e3])
    build["total_s"] = time.perf_counter() - t_start
    _log(f"H2D {bulk['gb_per_s']:.1f} GB/s bulk, {per_cluster.bytes_per_s / 1e9:.1f} GB/s per cluster; "
         f"window {kind} {window_alone:.1f} ms; setup {build['total_s']:.1f} s")

    results: dict[str, Any] = {
        "device": device_name,
        "note": note,
        "complete": False,
        "config": {
            **config.model_dump(exclude={"synthetic"}), "nlist": nlist, "train_size": config.resolved_train_size,
            "synthetic": {**config.synthetic.model_dump(), "modes": config.resolved_modes},
            "device": device.type, "device_name": device_name, "torch": torch.__version__,
            "cuda": torch.version.cuda if on_cuda else None, "faiss": faiss.__version__, "faiss_threads": threads,
            "torch_threads": torch.get_num_threads(), "window_kind": kind,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "env": {key: os.environ.get(key) for key in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")},
        },
        "build": {key: round(v, 3) if isinstance(v, float) else v for key, v in build.items()},
        "index_bytes": ivf_host.vectors.numel() * 4 + ivf_host.ids.numel() * 8,
        "bandwidth": {"h2d_bulk_gb_per_s": round(bulk["gb_per_s"], 2), "h2d_bulk_bytes": bulk["bytes"],
                      "per_cluster_gb_per_s": round(per_cluster.bytes_per_s / 1e9, 2),
                      "per_cluster_sample_clusters": _BANDWIDTH_CLUSTERS, "pinned": on_cuda},
        "window": {**window.info(), "alone_ms": round(window_alone, 3)},
        "prefetch_budget": {"rule": config.budget, "profiled_bytes": profiled},
        "queries": {"n": config.queries, "rewrite_cos": config.synthetic.rewrite_cos,
                    "exact_topk_overlap_original_rewrite": round(_overlap(exact_orig.tolist(), exact_rw.tolist()), 4)},
        "runs": [],
    }
    if json_out:  # the setup's figures survive a run cut short in its first nprobe
        Path(json_out).write_text(json.dumps(results, indent=2, default=str))
    try:
        for fraction, nprobe in config.nprobes():
            results["runs"].append(_run_nprobe(bench, config, fraction, nprobe, q_orig, q_orig_host, q_rw_host, q_rw_np,
                                               exact_rw, profiled))
            if on_cuda:
                results["gpu_max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
            if json_out:
                Path(json_out).write_text(json.dumps(results, indent=2, default=str))
    finally:
        bench.close()
    results["complete"] = True
    results["total_s"] = round(time.perf_counter() - t_start, 2)
    return results


def _overlap(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> float:
    """Mean over rows of |a_i & b_i| / |b_i|."""
    return statistics.fmean(len(set(x) & set(y)) / max(1, len(set(y))) for x, y in zip(a, b))


def _run_nprobe(bench: _Bench, config: LookaheadBenchConfig, fraction: float, nprobe: int, q_orig, q_orig_host,
                q_rw_host, q_rw_np, exact_rw, profiled_budget: int) -> dict[str, Any]:
    """All variants at one nprobe, interleaved per query (rotated order), after ``warmup`` untimed queries."""
    probe_orig = bench.quantizer.assign(q_orig, nprobe).cpu().tolist()  # [Q][nprobe]
    probe_rw = bench.quantizer.assign(q_rw_host.to(bench.device), nprobe).cpu().tolist()  # [Q][nprobe]
    sizes = bench.cluster_nbytes
    budgets = [profiled_budget if config.budget == "profiled" else sum(sizes[c] for c in probe_orig[i])
               for i in range(config.queries)]

    def once(name: str, i: int):
        qo, qr = q_orig_host[i:i + 1], q_rw_host[i:i + 1]  # [1, d] each
        if name == "faiss_cpu":
            return bench.faiss_search(q_rw_np[i:i + 1], nprobe, parallel_mode=1)
        if name == "faiss_cpu_1thread":
            return bench.faiss_search(q_rw_np[i:i + 1], nprobe, parallel_mode=0)
        if name == "resident":
            return bench.resident_search(qr, nprobe)
        if name == "on_demand":
            return bench.on_demand_search(qr, nprobe)
        if name == "lookahead":
            return bench.lookahead_search(qo, qr, nprobe, budgets[i])
        return bench.lookahead_split_search(qo, qr, nprobe, budgets[i])

    errors: dict[str, str] = {}
    active = list(VARIANTS)

    def attempt(name: str, i: int):
        try:
            return once(name, i)
        except Exception as exc:  # keep the other variants' figures in a one-shot GPU run; reported below
            errors[name] = f"{type(exc).__name__}: {exc} | " + " / ".join(traceback.format_exc().splitlines()[-4:])
            active.remove(name)
            _log(f"nprobe {nprobe}: {name} failed: {errors[name]}")
            return None

    _log(f"nprobe {nprobe} ({fraction:.0%} of {bench.quantizer.nlist}): warm-up")
    for i in range(min(config.warmup, config.queries)):
        for name in list(active):
            attempt(name, i)
    ms: dict[str, list[float]] = {v: [] for v in VARIANTS}
    ids: dict[str, list[list[int]]] = {v: [] for v in VARIANTS}
    extras: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    t0 = time.perf_counter()
    for i in range(config.queries):
        for j in range(len(VARIANTS)):
            name = VARIANTS[(i + j) % len(VARIANTS)]
            if name not in active:
                continue
            got = attempt(name, i)
            if got is not None:
                ids[name].append(got[0])
                ms[name].append(got[1])
                extras[name].append(got[2])
    bench.retriever.clear_fast_tier()
    _log(f"nprobe {nprobe}: {config.queries} queries x {len(VARIANTS)} variants in {time.perf_counter() - t0:.1f} s")

    variants: dict[str, Any] = {}
    for name in VARIANTS:
        if name in errors or len(ms[name]) != config.queries:
            variants[name] = {"error": errors.get(name, "incomplete")}
            continue
        variants[name] = {
            "median_ms": round(statistics.median(ms[name]), 4),
            "p95_ms": round(percentile(ms[name], 95), 4),
            "mean_ms": round(statistics.fmean(ms[name]), 4),
            f"recall_at_{config.k}": round(recall(ids[name], exact_rw), 4),
        }
    for name in ("lookahead", "lookahead_split"):
        if "error" in variants[name]:
            continue
        ex = extras[name]
        variants[name]["hit_fraction"] = round(statistics.fmean(e["hit_fraction"] for e in ex), 4)
        variants[name]["window_ms_median"] = round(statistics.median(e["window_ms"] for e in ex), 3)
        if name == "lookahead":
            variants[name].update(
                prefetch_copied_clusters_mean=round(statistics.fmean(e["copied_clusters"] for e in ex), 1),
                prefetch_planned_clusters_mean=round(statistics.fmean(e["planned_clusters"] for e in ex), 1),
                prefetch_copied_bytes_mean=round(statistics.fmean(e["copied_bytes"] for e in ex)),
                prefetch_complete_fraction=round(statistics.fmean(float(e["complete"]) for e in ex), 4),
                prefetch_ms_median=round(statistics.median(e["prefetch_ms"] for e in ex), 3),
            )
        else:
            variants[name].update(
                fast_ms_median=round(statistics.median(e["fast_ms"] for e in ex), 4),
                slow_ms_median=round(statistics.median(e["slow_ms"] for e in ex), 4),
            )
    if "error" not in variants["faiss_cpu"] and "error" not in variants["resident"]:
        same = [a == b for a, b in zip(ids["faiss_cpu"], ids["resident"])]
        variants["resident"]["ids_equal_to_faiss_fraction"] = round(statistics.fmean(same), 4)

    def ratio(a: str, b: str) -> float | None:
        if "median_ms" not in variants[a] or "median_ms" not in variants[b] or variants[b]["median_ms"] <= 0:
            return None
        return round(variants[a]["median_ms"] / variants[b]["median_ms"], 3)

    return {
        "fraction": fraction,
        "nprobe": nprobe,
        "probed_bytes_mean": round(statistics.fmean(sum(sizes[c] for c in row) for row in probe_rw)),
        "cluster_coverage": round(_overlap(probe_orig, probe_rw), 4),
        "prefetch_budget_bytes_mean": round(statistics.fmean(budgets)),
        "variants": variants,
        "speedups": {  # ratios of medians, > 1: the second is faster
            "faiss_cpu_over_resident": ratio("faiss_cpu", "resident"),
            "faiss_cpu_over_lookahead": ratio("faiss_cpu", "lookahead"),
            "on_demand_over_lookahead": ratio("on_demand", "lookahead"),
            "on_demand_over_resident": ratio("on_demand", "resident"),
            "lookahead_split_over_lookahead": ratio("lookahead_split", "lookahead"),
        },
        "errors": errors,
    }


# ----------------------------------------------------------------------------------------------
# report


def format_table(res: dict[str, Any]) -> str:
    cfg, b, bw, win = res["config"], res["build"], res["bandwidth"], res["window"]
    rows = b["rows_per_list"]
    k = cfg["k"]
    lines = [
        f"cachedrag bench lookahead  device={res['device']}  torch {cfg['torch']}  faiss {cfg['faiss']} "
        f"({cfg['faiss_threads']} threads)",
        f"  {res['note']}",
        f"index: {cfg['vectors']:,} x {cfg['dim']} float32 ({res['index_bytes'] / 2**30:.2f} GiB), nlist {cfg['nlist']} "
        f"(rows per list {rows['min']}/{rows['mean']:.0f}/{rows['max']} min/mean/max, {rows['empty']} empty); "
        f"set up in {b['total_s']:.1f} s (generate {b['generate_s']:.1f}, k-means {b['kmeans_s']:.1f} on "
        f"{cfg['train_size']:,}, assign {b['assign_s']:.1f}, layout {b['layout_s']:.1f}, host copy {b['host_copy_s']:.1f}, "
        f"Faiss lists {b['faiss_lists_s']:.1f}, exact {b['exact_s']:.1f})",
        f"queries: {cfg['queries']}, rewrite at cosine {cfg['synthetic']['rewrite_cos']} to the original; exact top-{k} "
        f"overlap original/rewrite {res['queries']['exact_topk_overlap_original_rewrite']:.2f}",
        f"host -> {'GPU (pinned)' if bw['pinned'] else 'host (memcpy)'}: {bw['h2d_bulk_gb_per_s']:.1f} GB/s bulk, "
        f"{bw['per_cluster_gb_per_s']:.1f} GB/s per cluster; window {win['kind']} {win['target_ms']:.0f} ms "
        f"(alone {win['alone_ms']:.1f} ms); prefetch budget {res['prefetch_budget']['rule']}"
        + (f" ({res['prefetch_budget']['profiled_bytes'] / 2**20:.0f} MiB)" if res["prefetch_budget"]["rule"] == "profiled" else ""),
        "",
        f"  {'nprobe':>6} {'frac':>5}  {'variant':<18}{'median ms':>10}{'p95 ms':>9}{'recall@' + str(k):>11}  notes",
    ]
    for run in res["runs"]:
        head = f"  {run['nprobe']:>6} {run['fraction']:>5.0%}  "
        for j, name in enumerate(VARIANTS):
            v = run["variants"][name]
            prefix = head if j == 0 else " " * len(head)
            if "error" in v:
                lines.append(f"{prefix}{name:<18}{'failed: ' + v['error'][:80]}")
                continue
            notes = ""
            if name == "on_demand":
                notes = f"copies {run['probed_bytes_mean'] / 2**20:.0f} MiB per query"
            elif name == "lookahead":
                notes = (f"hit {v['hit_fraction']:.2f} (coverage {run['cluster_coverage']:.2f}); prefetched "
                         f"{v['prefetch_copied_clusters_mean']:.0f}/{v['prefetch_planned_clusters_mean']:.0f} clusters, "
                         f"complete {v['prefetch_complete_fraction']:.0%}; window {v['window_ms_median']:.1f} ms")
            elif name == "lookahead_split":
                notes = f"hit {v['hit_fraction']:.2f}; fast {v['fast_ms_median']:.1f} ms, slow (CPU) {v['slow_ms_median']:.1f} ms"
            elif name == "resident" and "ids_equal_to_faiss_fraction" in v:
                notes = f"ids equal to Faiss's in {v['ids_equal_to_faiss_fraction']:.0%} of queries"
            lines.append(f"{prefix}{name:<18}{v['median_ms']:>10.2f}{v['p95_ms']:>9.2f}{v[f'recall_at_{k}']:>11.3f}  {notes}")
        s = run["speedups"]
        parts = [f"{key.replace('_over_', ' / ')} {val:.2f}x" for key, val in s.items() if val is not None]
        lines.append(" " * 16 + "medians: " + ", ".join(parts))
    if res.get("total_s") is not None:
        lines.append(f"total {res['total_s']:.1f} s")
    return "\n".join(lines)
