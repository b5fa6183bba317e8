"""Row precision: which rows of a prefill run on the runner's bfloat16 weight copies
(``model/scoring.py``) instead of its own precision.

Owns the rule (``CacheConfig.precision``, a ``RowPrecision``: ``recompute``, the reused chunks' recomputed rows;
``fresh``, fresh rows after the first reused chunk; ``leading_fresh``, fresh chunks
before it, ``leading_low``), the per-layer projections that split the compute set by it
(``LowPrecisionRows.weights``, a ``RowSplitLayer``), and building the copies ahead of the first
request (``prepare``). Only mode ``cachedrag`` with reused chunks lowers any row; a prefill that
lowered rows reports ``recompute_bfloat16`` / ``fresh_bfloat16`` among its approximations."""

from __future__ import annotations

import torch

from cachedrag.kvcache.config import QUESTION_CHOICES
from cachedrag.kvcache.planner import Action, Mode
from cachedrag.model.scoring import RowSplit, RowSplitLayer, scoring_layers
from cachedrag.model.transfer import device_tensor
from cachedrag.engine.selection import _reused_positions
from cachedrag.engine.state import LayerState, RowPlan


def prepare(engine) -> None:
    """Build the bfloat16 weight copies now (~130 ms and 120 MB for the default model; every layer's
    where a row-precision setting is "bfloat16", the question pre-pass's layers where only
    ``precision.question`` is), so the first reuse-served request does not pay them. Only where this
    engine's default mode is ``cachedrag`` (a per-call ``mode="cachedrag"`` builds them on its first
    reuse instead)."""
    cache = engine.config.cache
    if engine.config.mode == "cachedrag" and "bfloat16" in (cache.precision.recompute, cache.precision.fresh,
                                                            cache.precision.leading_fresh):
        scoring_layers(engine.runner, engine.runner.n_layers)
    elif (engine.config.mode == "cachedrag" and cache.token_choice in QUESTION_CHOICES
            and cache.precision.question == "bfloat16"):
        scoring_layers(engine.runner, max(engine._question_layers()) + 1)


def leading_low(engine, mode: Mode, rows: RowPlan, plan) -> tuple[bool, list[int]]:
    """Whether the fresh chunks before the first reused one run on the bfloat16 copies
    (``precision.leading_fresh="bfloat16"``; approximate then: the exact tree path ends before them),
    and those segments. Only where no other fresh segment (the system prompt) leads."""
    lead_segments = [i for i, (sp, a) in enumerate(zip(plan.segments, rows.actions))
                     if a is Action.FRESH and sp.start < rows.first_reuse]
    runner = engine.runner
    low = (mode is Mode.CACHEDRAG and engine.config.cache.precision.leading_fresh == "bfloat16"
           and rows.first_reuse < rows.total and bool(lead_segments)
           and all(plan.segments[i].role == "chunk" for i in lead_segments)
           and scoring_layers(runner, runner.n_layers) is not None)
    return low, lead_segments


class LowPrecisionRows:
    """The rows of one prefill on the bfloat16 copies (``low_t`` ``[Tlow]``, absolute positions) and the
    per-layer projections splitting the compute set by them. ``used``: some layer split rows."""

    def __init__(self, engine, mode: Mode, rows: RowPlan, plan, lead_low: bool, tail_logits: int):
        cfg = engine.config.cache
        runner = engine.runner
        self.runner, self.tail_logits = runner, tail_logits
        self.recompute_low = cfg.precision.recompute == "bfloat16"
        fresh_bf16 = cfg.precision.fresh == "bfloat16"
        first = rows.first_reuse
        fresh_low = [p for p in rows.fresh_pos if (p > first and fresh_bf16) or (p < first and lead_low)]
        self.low_t = None
        if mode is Mode.CACHEDRAG and (self.recompute_low or fresh_low) and Action.REUSE in rows.actions:
            reused = _reused_positions(plan, rows.actions)
            self.low_t = device_tensor(sorted((reused if self.recompute_low else []) + fresh_low),
                                       runner.device)  # [Tlow]
        self.fresh_low = bool(fresh_low) and self.low_t is not None
        self.layers = (scoring_layers(runner, runner.n_layers)
                       if self.low_t is not None and self.low_t.numel() else None)
        self.used = False
        self._of = None  # the positions ``_split`` was built for
        self._split = self._split_last = None  # RowSplit of the low rows of ``_of`` (all of them, and the last rows')

    def weights(self, state: LayerState, layer: int, last: bool) -> RowSplitLayer | None:
        """Layer ``layer``'s projections for the rows of ``state`` (None: the runner's own);
        ``last``: the layer computes only the last ``tail_logits`` rows' output."""
        if self.layers is None:
            return None
        if self._of is not state.positions:
            mask, self._of = torch.isin(state.positions, self.low_t), state.positions  # [Tc] rows on the copies
            self._split, self._split_last = RowSplit(mask), RowSplit(mask[-self.tail_logits:])
        if self._split.low is None:
            return None
        self.used = True
        return RowSplitLayer(self.runner.fast_layers[layer], self.layers[layer], self._split,
                             self._split_last if last else self._split)
