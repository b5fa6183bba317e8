"""Which rows of reused chunks a prefill recomputes when the plan deferred that choice (it fixed how
many tokens per chunk; which ones is measured here).

Owns the token scorers, each behind one interface (``TokenScorer``: per deferred segment, a score
per token, the highest recomputed) and when it scores (``layer``: None before the prefill, else at
that layer inside the layer loop):

    QuestionScorer   the question's attention to the loaded cache, in a pre-pass (``question``)
    InterScorer      the stored variant's per-token inter-attention fraction (free: metadata)
    DeviationScorer  K/V deviation of the probed tokens from the cache at ``check_layer`` (CacheBlend)
    LeadingScorer    each chunk's leading tokens (the fallback when the check layer is too deep)

their fusion (weighted ranks within each chunk: ``fuse_inter``, ``fuse_ranks``), picking the top
tokens (``_pick_each``) and the step that runs them for one request (``choose_before_prefill``;
``DeviationCheck`` is the layer loop's hook at the check layer). A new scorer is a class here with
its name among ``CacheConfig.token_choice``'s choices and a branch in ``scorers_for``.
Pure tensor helpers besides the scorers; the pre-pass itself is ``engine/question.py``."""

from __future__ import annotations

from typing import Protocol

import torch

from cachedrag.kvcache.config import QUESTION_CHOICES
from cachedrag.kvcache.planner import Action
from cachedrag.model.transfer import device_tensor
from cachedrag.engine.state import LayerState, RowPlan, _Lead


class TokenScorer(Protocol):
    """Scores the tokens of the deferred segments of ``rows``: segment -> ``[T_i]`` (higher:
    recompute first). ``layer``: None scores before the prefill; else at that layer, from the layer
    loop's ``state`` (the scorer then probes every token of its segments up to there)."""

    layer: int | None

    def score(self, rows: RowPlan, plan, state: LayerState | None = None) -> dict[int, torch.Tensor]: ...


class QuestionScorer:
    """The question's attention to each token (``engine/question.py``), from a pre-pass over the
    question and the fresh rows (``hidden``: fresh rows left out of it)."""

    layer = None

    def __init__(self, engine, ids: torch.Tensor, kv, loads, lead: _Lead, hidden: list[int]):
        self.engine, self.ids, self.kv, self.loads, self.lead, self.hidden = engine, ids, kv, loads, lead, hidden

    def score(self, rows: RowPlan, plan, state: LayerState | None = None) -> dict[int, torch.Tensor]:
        hidden = set(self.hidden)
        scores = self.engine._question_scores(self.ids, self.kv, rows.total,
                                              [p for p in rows.fresh_pos if p not in hidden], rows.question_pos,
                                              plan, rows.deferred, self.loads, lead=self.lead,
                                              hidden=self.hidden)  # [T]
        return {i: scores[plan.segments[i].start:plan.segments[i].end] for i in rows.deferred}


class InterScorer:
    """The stored variant's per-token inter-attention fractions, where the variant carries them."""

    layer = None

    def __init__(self, device):
        self.device = device

    def score(self, rows: RowPlan, plan, state: LayerState | None = None) -> dict[int, torch.Tensor]:
        out = {}
        for i in rows.deferred:
            variant = plan.segments[i].variant
            values = list(variant.meta.token_inter) if variant is not None and variant.meta is not None else []
            if len(values) == plan.segments[i].n_tokens:
                out[i] = device_tensor(values, self.device, torch.float32)  # [T_i]
        return out


class DeviationScorer:
    """K/V deviation of each probed token's fresh K/V from the loaded cache at ``layer``."""

    def __init__(self, engine, layer: int, kv):
        self.engine, self.layer, self.kv = engine, layer, kv

    def score(self, rows: RowPlan, plan, state: LayerState | None = None) -> dict[int, torch.Tensor]:
        device = self.engine.runner.device
        probe_t = device_tensor(rows.probe_pos, device)  # [Tp], sorted
        at = torch.searchsorted(state.positions, probe_t)  # [Tp] rows of probed tokens in the compute set
        dev = self.engine.runner.kv_deviation(self.layer, state.hidden[at], probe_t, self.kv,
                                              (state.rope[0][at], state.rope[1][at]),
                                              on=self.engine.config.cache.deviation_on)  # [Tp]
        out, offset = {}, 0
        for i in rows.deferred:
            n = plan.segments[i].n_tokens
            out[i] = dev[offset:offset + n]  # [T_i]
            offset += n
        return out


class LeadingScorer:
    """Each chunk's leading tokens first (a position's score falls with its index)."""

    layer = None

    def score(self, rows: RowPlan, plan, state: LayerState | None = None) -> dict[int, torch.Tensor]:
        return {i: -torch.arange(plan.segments[i].n_tokens, dtype=torch.float32) for i in rows.deferred}


def choose_before_prefill(engine, rows: RowPlan, plan, ids, kv, loads, lead: _Lead, notes: list[str]) -> bool:
    """The token choice of ``CacheConfig.token_choice`` that runs before the prefill: the question
    pre-pass (and its fusion with the inter metadata), or the leading-token fallback when the check
    layer lies below the model. Picks into ``rows.recompute_pos`` unless the deviation check follows
    in the layer loop (returns True then; ``rows.probe_pos`` and ``rows.question_scores`` are set)."""
    cfg = engine.config.cache
    choice = cfg.token_choice
    n_layers = engine.runner.n_layers
    by_deviation = choice in ("deviation", "question+deviation")
    if rows.deferred and by_deviation and cfg.check_layer >= n_layers:
        if choice == "deviation":  # too shallow to probe: leading tokens
            notes.append(f"check_layer {cfg.check_layer} >= {n_layers} layers; recomputing leading tokens")
            pick_into(rows, plan, LeadingScorer().score(rows, plan))
        else:
            notes.append(f"check_layer {cfg.check_layer} >= {n_layers} layers; ranking by the question only")
        by_deviation = False
    if rows.deferred and choice in QUESTION_CHOICES:
        scorer = QuestionScorer(engine, ids, kv, loads, lead, _left_out(engine, rows, notes))
        rows.question_scores = scorer.score(rows, plan)
        if choice == "question+inter":  # fused with the variant's own inter-attention fractions (free)
            fuse_inter(rows.question_scores, InterScorer(engine.runner.device).score(rows, plan), cfg.question_weight)
        if not by_deviation:
            pick_into(rows, plan, rows.question_scores)
    rows.probe_pos = [p for i in rows.deferred for p in range(plan.segments[i].start, plan.segments[i].end)]
    return bool(rows.deferred)


def _left_out(engine, rows: RowPlan, notes: list[str]) -> list[int]:
    """Fresh rows after a reused chunk: left out of the pre-pass (computed once, by the prefill) with
    ``question_pass_fresh="leading"``. Where the runner's attention cannot hide rows (Triton,
    sliding-window layers) a note says so, and the rows are still left out, as before the engine was
    split into stages (to be settled: the note says they are computed)."""
    after = [p for p in rows.fresh_pos if p > rows.first_reuse]
    if not (after and engine.config.cache.question_pass_fresh == "leading"):
        return []
    if not engine._can_hide_rows():
        notes.append("question pre-pass computed the fresh chunks after reused ones too "
                     "(Triton or sliding-window attention cannot hide their rows)")
    return sorted(after)


def pick_into(rows: RowPlan, plan, scores: dict[int, torch.Tensor]) -> None:
    """The top-scored tokens of every deferred segment into ``rows.recompute_pos``; nothing stays deferred."""
    tops = _pick_each([scores[i] for i in rows.deferred], list(rows.deferred.values()))
    for i, top in zip(rows.deferred, tops):
        rows.recompute_pos[i] = sorted(plan.segments[i].start + j for j in top)
    rows.deferred = {}


class DeviationCheck:
    """The layer loop's hook at the check layer (CacheBlend's token choice): for each deferred segment,
    the ``deferred[i]`` tokens whose fresh K/V deviate most from the loaded cache (fused by rank with
    the question's scores where there are any) go into ``recompute_pos``; the other probed tokens leave
    the compute set. Segments focused-chunk early termination already ruled out keep none."""

    def __init__(self, engine, rows: RowPlan, plan, kv, focus):
        self.engine, self.rows, self.plan, self.focus = engine, rows, plan, focus
        self.scorer = DeviationScorer(engine, engine.config.cache.check_layer, kv)

    def before_layer(self, state: LayerState, layer: int) -> None:
        if layer != self.scorer.layer:
            return
        rows, plan = self.rows, self.plan
        unfocused = self.focus.unfocused() if self.focus is not None else set()
        dev = self.scorer.score(rows, plan, state)
        chosen: set[int] = set()
        for i, count in rows.deferred.items():
            if i in unfocused:
                rows.recompute_pos[i] = []
                continue
            seg = dev[i]  # [T_i]
            if rows.question_scores:
                seg = fuse_ranks(rows.question_scores[i], seg, self.engine.config.cache.question_weight)
            rows.recompute_pos[i] = sorted(plan.segments[i].start + j for j in _pick(seg, count))
            chosen.update(rows.recompute_pos[i])
        drop = set(rows.probe_pos) - chosen
        keep = torch.tensor([p not in drop for p in state.positions.tolist()], device=state.positions.device)  # [Tc]
        state.narrow(self.engine.runner, keep)


def _reused_positions(plan, actions) -> list[int]:
    """Prompt positions of the chunks a plan serves from reuse, in order."""
    return [p for sp, a in zip(plan.segments, actions) if a is Action.REUSE for p in range(sp.start, sp.end)]


def _rows(positions: torch.Tensor, wanted: torch.Tensor) -> slice | torch.Tensor:
    """Rows of the sorted ``wanted`` positions ``[Tw]`` in the sorted ``positions`` ``[Tc]`` (all present):
    a slice when they are consecutive rows (a miss: the fresh tokens lead the compute set), so
    reading them is a view, not a gather; else the row indices ``[Tw]``."""
    idx = torch.searchsorted(positions, wanted)  # [Tw]
    n = idx.shape[0]
    if n:
        first, last = torch.stack([idx[0], idx[-1]]).tolist()  # one read of the device, not two
        if last - first == n - 1:
            return slice(first, first + n)
    return idx


def _pick(scores: torch.Tensor, count: int) -> list[int]:
    """Indices of the ``count`` tokens to recompute in one chunk: the highest ``scores [T]``."""
    return _pick_each([scores], [count])[0]


def _pick_each(scores: list[torch.Tensor], counts: list[int]) -> list[list[int]]:
    """``_pick`` of every chunk (``scores[c]`` ``[T_c]``, ``counts[c]`` tokens), read back to the host
    in one transfer: one wait for the GPU per request, not one per chunk."""
    parts = [torch.topk(x, min(count, x.shape[0])).indices for x, count in zip(scores, counts)]
    flat = torch.cat(parts).tolist() if parts else []
    out, at = [], 0
    for part in parts:
        out.append(flat[at:at + part.shape[0]])
        at += part.shape[0]
    return out


def fuse_ranks(first: torch.Tensor, second: torch.Tensor, weight: float) -> torch.Tensor:
    """``weight x rank(first) + (1 - weight) x rank(second)`` within one segment ``[T_i]``."""
    return weight * _rank01(first) + (1.0 - weight) * _rank01(second)


def fuse_inter(scores: dict[int, torch.Tensor], inter: dict[int, torch.Tensor], weight: float) -> None:
    """``question+inter``: each segment's question scores ``[T_i]`` become ``weight x rank(question) +
    (1 - weight) x rank(token_inter)`` (ranks within the segment, ``_rank01``) where ``inter`` has the
    segment's per-token inter fractions; every segment's in one ranking pass."""
    segs = [i for i in scores if i in inter]
    if not segs:
        return
    lengths = [inter[i].shape[0] for i in segs]
    inter_t = torch.cat([inter[i] for i in segs])  # [N]
    question = torch.cat([scores[i] for i in segs])  # [N]
    fused = weight * _rank01_segments(question, lengths) + (1.0 - weight) * _rank01_segments(inter_t, lengths)  # [N]
    for i, part in zip(segs, fused.split(lengths)):
        scores[i] = part  # [T_i]


def _rank01_segments(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """``_rank01`` of each consecutive segment of ``x`` ``[N]`` (``lengths`` sum to N), equal to it
    segment by segment, in two sorts for all segments instead of one per segment."""
    n = x.shape[0]
    device = x.device
    lens = device_tensor(lengths, device)  # [S]
    seg = torch.repeat_interleave(torch.arange(len(lengths), device=device), lens, output_size=n)  # [N]
    flipped = torch.argsort(x.flip(0), stable=True)  # [N] ascending; among ties, later positions first
    flipped = flipped[torch.argsort(seg.flip(0)[flipped], stable=True)]  # [N] grouped by segment, order kept
    order = (n - 1) - flipped  # [N] indices into x: by segment, then ascending (ties: later first)
    starts = torch.cumsum(lens, 0) - lens  # [S]
    of = seg[order]  # [N] segment of each sorted entry
    r = torch.empty(n, dtype=torch.float32, device=device)  # [N]
    r[order] = (torch.arange(n, device=device) - starts[of]).float() / (lens[of] - 1).clamp_min(1).float()
    return r


def _rank01(x: torch.Tensor) -> torch.Tensor:
    """Ranks of ``x`` scaled to [0, 1] (0 = smallest), float32 ``[T]``: a scale-free score for fusing rankings.
    Ties rank the earlier position higher (as ``select_tokens`` breaks them: by position)."""
    n = x.shape[0]
    r = torch.empty_like(x, dtype=torch.float32)  # [T]
    order = (n - 1) - torch.argsort(x.flip(0), stable=True)  # [T] ascending; among ties, later positions first
    r[order] = torch.arange(n, dtype=torch.float32, device=x.device)
    return r / max(1, x.shape[0] - 1)
