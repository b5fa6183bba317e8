"""Where a cluster's TTFT goes: queueing, load imbalance, cache fetch, compute.

Owns: ``RequestRecord`` (one finished request as a replica saw it: when it arrived, how long
it waited for its prefill, how long loading its cached chunks and computing took) and
``summarize`` (a set of records from all replicas of one run -> medians of each part, and two
imbalance figures from the replicas' timelines). Pure Python, no torch, no Ray: the replicas
record (``cachedrag.cluster.deployment``), ``cachedrag bench cluster`` summarizes.

Does not own: measuring (the engine's prefill stats and the server loop's TTFT are the source).

The parts of one request's server-side TTFT (arrival at the replica -> first token):
``wait`` (queued behind other prefills and decode steps of its replica), ``load`` (reading its
cached chunks from the CPU tier or Redis), ``compute`` (the partial prefill) and ``store``
(the rest of the engine's prefill call: planning, and storing the new chunk caches, written
through to Redis when the replica shares a tier). The imbalance
figures, from each replica's in-flight intervals ``[arrival, arrival + total]`` and waiting
intervals ``[arrival, prefill start]``:

- ``stranded_share``: the share of the run's time during which some replica had a request
  waiting for its prefill while another replica had nothing at all to do (work that a perfect
  balancer would have started at once: with one core per replica, that is idle CPU);
- ``spread_mean``: the time-weighted mean of (most - fewest requests in flight) over replicas;
- ``joined_longer_share``: the share of requests that arrived at a replica holding more
  requests in flight than another replica held at that moment (what affinity chose over
  balance, or what a stale queue length misled the router into).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class RequestRecord:
    """One finished request on one replica (times in seconds; ``arrival`` is wall-clock)."""

    replica: str
    arrival: float
    ttft_s: float
    total_s: float
    load_s: float = 0.0
    prefill_s: float = 0.0
    chunks_hit: int = 0
    chunks_missed: int = 0
    call_s: float = 0.0  # the whole engine prefill call (0 = not measured: load + prefill stand in)

    @property
    def service_s(self) -> float:
        return max(self.call_s, self.prefill_s + self.load_s)

    @property
    def wait_s(self) -> float:
        """Time before its prefill call started."""
        return max(0.0, self.ttft_s - self.service_s)

    @property
    def store_s(self) -> float:
        """Planning and storing new chunk caches: the prefill call beyond loading and computing."""
        return max(0.0, self.call_s - self.prefill_s - self.load_s)

    @property
    def end(self) -> float:
        return self.arrival + self.total_s

    @property
    def prefill_start(self) -> float:
        return self.arrival + self.wait_s

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RequestRecord:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def _median(values: Sequence[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def _occupancy(records: Sequence[RequestRecord], replicas: Sequence[str]):
    """Elementary intervals of the run with, per replica, (in flight, waiting) counts."""
    points = sorted({t for r in records for t in (r.arrival, r.prefill_start, r.end)})
    for t0, t1 in zip(points, points[1:]):
        mid = (t0 + t1) / 2
        busy = dict.fromkeys(replicas, 0)
        waiting = dict.fromkeys(replicas, 0)
        for r in records:
            if r.arrival <= mid < r.end:
                busy[r.replica] += 1
                if mid < r.prefill_start:
                    waiting[r.replica] += 1
        yield t1 - t0, busy, waiting


def _joined_longer(records: Sequence[RequestRecord], replicas: Sequence[str]) -> int:
    n = 0
    order = sorted(records, key=lambda r: r.arrival)  # equal arrivals: the earlier listed came first
    for i, r in enumerate(order):
        inflight = dict.fromkeys(replicas, 0)
        for o in order[:i]:
            if r.arrival < o.end:
                inflight[o.replica] += 1
        n += inflight[r.replica] > min(inflight.values())
    return n


def summarize(records: Iterable[RequestRecord], replicas: Sequence[str] | None = None) -> dict:
    """Medians of TTFT's parts and the imbalance figures (see the module docstring).

    ``replicas``: all replica ids of the run (one that served nothing counts as idle
    throughout); default, those seen in ``records``."""
    recs = list(records)
    names = sorted(set(replicas or ()) | {r.replica for r in recs})
    out: dict = {
        "requests": len(recs),
        "server_ttft_p50_s": _median([r.ttft_s for r in recs]),
        "wait_p50_s": _median([r.wait_s for r in recs]),
        "wait_mean_s": round(statistics.fmean(r.wait_s for r in recs), 4) if recs else None,
        "load_p50_s": _median([r.load_s for r in recs]),
        "compute_p50_s": _median([r.prefill_s for r in recs]),
        "store_p50_s": _median([r.store_s for r in recs]),
        "store_mean_s": round(statistics.fmean(r.store_s for r in recs), 4) if recs else None,
        "per_replica": {n: sum(1 for r in recs if r.replica == n) for n in names},
    }
    span = stranded = spread = 0.0
    for dt, busy, waiting in _occupancy(recs, names):
        span += dt
        if any(waiting.values()) and len(names) > 1:
            idle = [n for n in names if busy[n] == 0]
            if any(waiting[n] for n in names if n not in idle) and idle:
                stranded += dt
        spread += dt * (max(busy.values()) - min(busy.values()))
    out["stranded_share"] = round(stranded / span, 4) if span else None
    out["joined_longer_share"] = round(_joined_longer(recs, names) / len(recs), 4) if recs and len(names) > 1 else None
    out["spread_mean"] = round(spread / span, 4) if span else None
    return out
