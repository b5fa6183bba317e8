"""Recompute planner: what of a request comes from the tree, from chunk variants, or fresh.

Owns: ``Planner`` (plan -> release), the request/plan value types (``Segment``,
``PlanRequest``, ``SegmentPlan``, ``Plan``), the comparison modes, and
the micro-benchmark of planning is ``cachedrag_bench.planning`` (``cachedrag bench ttft`` reports it).

Does not own: tensors, loading, attention, or storing what the request computed (the engine
does that after the prefill: ``tree.insert`` for the exact prefix, ``index.add`` for variants).

A request is the system prefix segment(s), the retrieved chunks in prompt order, and the
question. Planning, per mode:

  full       everything computed fresh; nothing is read.
  prefix     the longest knowledge-tree path equal to the leading segments is taken exactly
             (RAGCache); the rest is fresh.
  naive      tree prefix, then every remaining chunk with a variant is reused with no
             recompute (the variant with the lowest CFO).
  random     as cachedrag, but the recompute tokens are drawn at random (seeded by
             ``config.seed``, the chunk key and its position): same count, other tokens.
  cachedrag  tree prefix, then for each remaining chunk the variant with the lowest CFO
             (ties: higher f_r, then more recent); recompute ceil(CFO x len) tokens chosen by
             ``config.token_choice``; a chunk whose best CFO >= ``config.reuse_cfo_limit`` is
             fresh. With ``config.recompute_ratio`` set, every reused chunk recomputes
             ceil(ratio x len) tokens instead (fixed global ratio; same token choice).

Token choice: ``inter`` (top ``token_inter``) and ``leading`` (first tokens) are decided here
and listed in ``SegmentPlan.recompute``. ``deviation`` and the question choices need tensors
(CacheBlend: the K/V deviation of every reused token at ``config.check_layer``; ProphetKV-like:
the question's attention to each reused token), so the plan only fixes how many
(``SegmentPlan.deferred``) and the engine picks which while it runs. ``cached_order`` finds a knowledge-tree path that holds the retrieved
chunks as a set (order-aware exact reuse).

The planner reads the tree and the index without changing their policy state; ``plan`` pins
what it hands out (so nothing it references is evicted while the engine loads it) and
``release(plan, used=True)`` records the hits (tree touches, f_r += 1/CFO) and unpins.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from cachedrag.kvcache.config import CacheConfig
from cachedrag.kvcache.index import Variant, VariantIndex
from cachedrag.kvcache.tree import KnowledgeTree, TreeNode
from cachedrag.kvcache.variants import (
    ReuseScore,
    recompute_count,
    score,
    select_leading_tokens,
    select_random_tokens,
    select_tokens,
)


class Mode(str, Enum):
    """Comparison modes of the engine (``cachedrag bench ttft``)."""

    FULL = "full"
    PREFIX = "prefix"
    NAIVE = "naive"
    RANDOM = "random"
    CACHEDRAG = "cachedrag"


MODES: tuple[str, ...] = tuple(m.value for m in Mode)


class Action(str, Enum):
    TREE = "tree"  # exact KV from the knowledge tree; nothing to compute
    REUSE = "reuse"  # a chunk variant, re-rotated to its new position, ``recompute`` tokens recomputed
    FRESH = "fresh"  # computed from scratch


@dataclass(frozen=True)
class Segment:
    """A run of prompt tokens with a content key (``keys.chunk_key``)."""

    key: str
    n_tokens: int
    glue: bool = False  # template text between chunks (a separator), not a retrieved chunk

    def __post_init__(self) -> None:
        if self.n_tokens < 1:
            raise ValueError(f"Segment {self.key[:12]!r}: n_tokens must be >= 1, got {self.n_tokens}")


@dataclass(frozen=True)
class PlanRequest:
    """system: shared prefix segment(s), first in the prompt. chunks: retrieved chunks in prompt
    order. question_tokens: tokens after the chunks (question + template tail), always computed."""

    system: tuple[Segment, ...]
    chunks: tuple[Segment, ...]
    question_tokens: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "system", tuple(self.system))
        object.__setattr__(self, "chunks", tuple(self.chunks))
        if self.question_tokens < 0:
            raise ValueError(f"PlanRequest.question_tokens must be >= 0, got {self.question_tokens}")


@dataclass(frozen=True)
class SegmentPlan:
    """The decision for one segment.

    role: "system" or "chunk"; index: position within its role's list.
    start: absolute position of its first token in the new prompt (``new_positions`` of a
        reused variant are ``start + i``).
    action: TREE (``node``, ``handle`` = node.handle), REUSE (``variant``, ``handle`` =
        variant.handle, ``recompute`` = sorted token indices within the segment, ``deferred`` =
        how many more the engine picks at run time by K/V deviation), FRESH.
    score: the CFO terms of the chosen (or best rejected) variant, when there was one.
    reason: why this action (for logs and reports).
    """

    role: str
    index: int
    key: str
    n_tokens: int
    start: int
    action: Action
    handle: Any = None
    node: TreeNode | None = None
    variant: Variant | None = None
    score: ReuseScore | None = None
    recompute: tuple[int, ...] = ()
    deferred: int = 0
    reason: str = ""

    @property
    def end(self) -> int:
        return self.start + self.n_tokens

    @property
    def cfo(self) -> float | None:
        return None if self.score is None else self.score.cfo

    @property
    def compute_tokens(self) -> int:
        """Tokens whose KV this request computes for the segment."""
        if self.action is Action.FRESH:
            return self.n_tokens
        if self.action is Action.REUSE:
            return len(self.recompute) + self.deferred
        return 0

    def recompute_positions(self) -> list[int]:
        """Absolute positions of the recompute tokens."""
        return [self.start + i for i in self.recompute]


@dataclass
class Plan:
    """The plan of one request; segments are system segments then chunks, in prompt order."""

    mode: Mode
    segments: tuple[SegmentPlan, ...]
    question_start: int
    question_tokens: int
    prefix_hit_segments: int
    prefix_hit_tokens: int
    notes: tuple[str, ...] = ()
    repeat: int = 0  # times this chunk sequence has been served from reuse, this plan included (set by
    #                  ``ChunkCacheManager.plan`` with ``CacheConfig.exact.repeats``; 0: no reused variant, or off)
    _nodes: tuple[TreeNode, ...] = field(default=(), repr=False)
    _pinned_nodes: bool = field(default=False, repr=False)
    _pinned_variants: tuple[Variant, ...] = field(default=(), repr=False)
    _released: bool = field(default=False, repr=False)

    @property
    def system(self) -> tuple[SegmentPlan, ...]:
        return tuple(s for s in self.segments if s.role == "system")

    @property
    def chunks(self) -> tuple[SegmentPlan, ...]:
        return tuple(s for s in self.segments if s.role == "chunk")

    @property
    def total_tokens(self) -> int:
        return self.question_start + self.question_tokens

    @property
    def compute_tokens(self) -> int:
        """Fresh + recompute + question tokens."""
        return sum(s.compute_tokens for s in self.segments) + self.question_tokens

    @property
    def reused_tokens(self) -> int:
        """Tokens of reused variants (recomputed ones included)."""
        return sum(s.n_tokens for s in self.segments if s.action is Action.REUSE)

    @property
    def compute_fraction(self) -> float:
        return self.compute_tokens / self.total_tokens if self.total_tokens else 0.0

    @property
    def exact_prefix_segments(self) -> int:
        """Leading segments whose KV will equal full prefill after this request: the tree hits,
        then fresh segments up to the first reused one. Only these may go into the tree."""
        n = 0
        for s in self.segments:
            if s.action is Action.REUSE:
                break
            n += 1
        return n

    def summary(self) -> dict[str, Any]:
        """Plain numbers for logs and benchmark JSON."""
        return {
            "mode": self.mode.value,
            "total_tokens": self.total_tokens,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "reused_tokens": self.reused_tokens,
            "compute_tokens": self.compute_tokens,
            "compute_fraction": round(self.compute_fraction, 4),
            "actions": [s.action.value for s in self.segments],
            "cfo": [None if s.cfo is None else round(s.cfo, 4) for s in self.segments],
            "notes": list(self.notes),
        }


class Planner:
    """Plans requests against a ``KnowledgeTree`` and a ``VariantIndex``.

    >>> tree, index = KnowledgeTree("pgdsf"), VariantIndex()
    >>> planner = Planner(tree, index)
    >>> req = PlanRequest((Segment("sys", 8),), (Segment("a", 4), Segment("b", 4)), question_tokens=3)
    >>> plan = planner.plan(req)
    >>> [s.action.value for s in plan.segments], plan.compute_tokens
    (['fresh', 'fresh', 'fresh'], 19)
    >>> planner.release(plan)
    """

    def __init__(self, tree: KnowledgeTree, index: VariantIndex, config: CacheConfig | None = None) -> None:
        self.tree = tree
        self.index = index
        self.config = config if config is not None else CacheConfig()

    def plan(self, request: PlanRequest, mode: str | Mode = Mode.CACHEDRAG, *, pin: bool = True) -> Plan:
        """Decide every segment of ``request``; see the module docstring. Pair with ``release``."""
        try:
            mode = Mode(mode)
        except ValueError:
            raise ValueError(f"unknown planning mode {mode!r}; choose one of {list(MODES)}") from None
        segments = request.system + request.chunks
        n_system = len(request.system)
        notes: list[str] = []
        nodes: list[TreeNode] = []
        if mode is not Mode.FULL:
            nodes = self.tree.match_prefix([s.key for s in segments], pin=pin)
            for i, node in enumerate(nodes):
                if node.n_tokens != segments[i].n_tokens:
                    notes.append(
                        f"segment {i}: tree node has {node.n_tokens} tokens, request says "
                        f"{segments[i].n_tokens}; tree prefix cut there"
                    )
                    if pin:
                        self.tree.unpin(nodes[i:])
                    nodes = nodes[:i]
                    break
        n_hit = len(nodes)
        pinned: list[Variant] = []
        try:
            out = self._plan_segments(request, segments, n_system, nodes, mode, pin, pinned, notes)
        except BaseException:
            if pin:
                self.tree.unpin(nodes)
                for v in pinned:
                    self.index.unpin(v)
            raise
        return Plan(
            mode=mode,
            segments=tuple(out),
            question_start=sum(s.n_tokens for s in segments),
            question_tokens=request.question_tokens,
            prefix_hit_segments=n_hit,
            prefix_hit_tokens=sum(n.n_tokens for n in nodes),
            notes=tuple(notes),
            _nodes=tuple(nodes),
            _pinned_nodes=pin,
            _pinned_variants=tuple(pinned),
        )

    def _plan_segments(
        self,
        request: PlanRequest,
        segments: tuple[Segment, ...],
        n_system: int,
        nodes: list[TreeNode],
        mode: Mode,
        pin: bool,
        pinned: list[Variant],
        notes: list[str],
    ) -> list[SegmentPlan]:
        n_hit = len(nodes)
        chunk_keys = [c.key for c in request.chunks]
        out: list[SegmentPlan] = []
        start = 0
        for i, seg in enumerate(segments):
            role = "system" if i < n_system else "chunk"
            idx = i if role == "system" else i - n_system
            if i < n_hit:
                node = nodes[i]
                out.append(SegmentPlan(role, idx, seg.key, seg.n_tokens, start, Action.TREE, node.handle, node=node, reason="tree prefix"))
            elif role == "system" or mode in (Mode.FULL, Mode.PREFIX):
                reason = "system prefix not in tree" if role == "system" else f"mode {mode.value}"
                out.append(SegmentPlan(role, idx, seg.key, seg.n_tokens, start, Action.FRESH, reason=reason))
            else:
                out.append(self._plan_chunk(seg, idx, start, chunk_keys[:idx], mode, pin, pinned, notes))
            start += seg.n_tokens
        return out

    def release(self, plan: Plan, *, used: bool = True) -> None:
        """Record the plan's hits (if ``used``) and unpin what it pinned. Idempotent."""
        if plan._released:
            return
        plan._released = True
        if used and plan._nodes:
            self.tree.touch(plan._nodes)
        if used:
            for s in plan.segments:
                if s.action is Action.REUSE and s.variant is not None and s.score is not None:
                    self.index.record_reuse(s.variant, s.score.cfo)
        if plan._pinned_nodes and plan._nodes:
            self.tree.unpin(plan._nodes)
        for v in plan._pinned_variants:
            self.index.unpin(v)

    @contextmanager
    def planned(self, request: PlanRequest, mode: str | Mode = Mode.CACHEDRAG) -> Iterator[Plan]:
        """``with planner.planned(req) as plan:`` releases as used on success, unused on error."""
        plan = self.plan(request, mode)
        try:
            yield plan
        except BaseException:
            self.release(plan, used=False)
            raise
        self.release(plan, used=True)

    # -- private -----------------------------------------------------------------------------

    def _plan_chunk(
        self,
        seg: Segment,
        idx: int,
        start: int,
        new_prefix: Sequence[str],
        mode: Mode,
        pin: bool,
        pinned: list[Variant],
        notes: list[str],
    ) -> SegmentPlan:
        cfg = self.config
        if seg.glue and seg.n_tokens < cfg.min_reuse_tokens:  # a separator between chunks: computing it costs nothing
            return SegmentPlan("chunk", idx, seg.key, seg.n_tokens, start, Action.FRESH,
                               reason=f"{seg.n_tokens} tokens < min_reuse_tokens {cfg.min_reuse_tokens}")
        candidates = self.index.variants(seg.key)
        if not candidates:
            return SegmentPlan("chunk", idx, seg.key, seg.n_tokens, start, Action.FRESH, reason="no cached variant")
        best: tuple[tuple[float, float, int], Variant, ReuseScore] | None = None
        for v in candidates:
            if v.n_tokens != seg.n_tokens:
                notes.append(
                    f"chunk {idx}: variant {v.variant_id} has {v.n_tokens} tokens, request says {seg.n_tokens}; skipped"
                )
                continue
            sc = score(
                v.meta,
                new_prefix,
                alpha=cfg.alpha,
                cold_cci=cfg.cold_cci,
            )
            rank = (sc.cfo, -v.reuse_score, -v.last_used)
            if best is None or rank < best[0]:
                best = (rank, v, sc)
        if best is None:
            return SegmentPlan("chunk", idx, seg.key, seg.n_tokens, start, Action.FRESH, reason="no usable variant")
        _, variant, sc = best
        ratio = cfg.recompute_ratio
        if mode is Mode.NAIVE:
            count = 0
        elif ratio is not None:
            count = recompute_count(ratio, seg.n_tokens)
        else:
            if sc.cfo >= cfg.reuse_cfo_limit:
                return SegmentPlan(
                    "chunk", idx, seg.key, seg.n_tokens, start, Action.FRESH, score=sc,
                    reason=f"best CFO {sc.cfo:.3f} >= reuse_cfo_limit {cfg.reuse_cfo_limit}",
                )
            count = recompute_count(sc.cfo, seg.n_tokens)
        deferred = 0
        if mode is Mode.RANDOM:
            rng = random.Random(f"{cfg.seed}:{seg.key}:{start}")
            tokens = select_random_tokens(seg.n_tokens, count, rng)
        elif cfg.token_choice == "inter":
            tokens = select_tokens(variant.meta, count)
        elif cfg.token_choice == "leading" or count >= seg.n_tokens:
            tokens = select_leading_tokens(seg.n_tokens, count)
        else:  # deviation: the engine picks ``count`` tokens while it runs
            tokens, deferred = (), count
        if pin:
            if not self.index.pin(variant):
                notes.append(f"chunk {idx}: variant {variant.variant_id} evicted while planning; computed fresh")
                return SegmentPlan("chunk", idx, seg.key, seg.n_tokens, start, Action.FRESH, reason="variant evicted")
            pinned.append(variant)
        return SegmentPlan(
            "chunk", idx, seg.key, seg.n_tokens, start, Action.REUSE, variant.handle,
            variant=variant, score=sc, recompute=tokens, deferred=deferred, reason=f"variant {variant.variant_id}",
        )


def cached_order(tree: KnowledgeTree, system_keys: Sequence[str], chunk_keys: Sequence[str]) -> list[int] | None:
    """Order-aware exact reuse: a permutation of ``chunk_keys`` (indices) whose leading part is
    the longest knowledge-tree path below the system segments made only of these chunks (as a
    set), followed by the other chunks in their given order; None when no such path is longer
    than the exact prefix of the given order (nothing to gain). Read-only; pure Python.

    Greedy walk: at each node, the child that is one of the remaining chunks and has the
    longest continuation among them wins (ties: earlier in the retrieved order).
    """
    node = tree.root
    for key in system_keys:
        node = node.children.get(key)
        if node is None:
            return None
    start = node
    remaining = {k: i for i, k in reversed(list(enumerate(chunk_keys)))}

    def depth(n, left: frozenset) -> int:
        best = 0
        for key, child in n.children.items():
            if key in left:
                best = max(best, 1 + depth(child, left - {key}))
        return best

    order: list[int] = []
    left = frozenset(remaining)
    while True:
        options = [(depth(child, left - {key}), -remaining[key], key, child)
                   for key, child in node.children.items() if key in left]
        if not options:
            break
        _, _, key, node = max(options, key=lambda o: (o[0], o[1]))
        order.append(remaining[key])
        left = left - {key}
    given, walk = 0, start
    for k in chunk_keys:
        walk = walk.children.get(k)
        if walk is None:
            break
        given += 1
    if len(order) <= given:
        return None
    return order + [i for i in range(len(chunk_keys)) if i not in set(order)]

