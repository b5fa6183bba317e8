"""The partial prefill: one request's plan executed layer by layer, as a generator the caller advances.

Owns: ``execute`` (buffer -> load -> rows to compute -> token choice -> layer loop -> logits, stats and
the hand-off), the layer loop over a short list of hooks (``layer_loop``; each hook is an object with
``before_layer(state, layer)`` and/or ``after_layer(state, layer, raw)``), the hooks that belong to no
other technique (``LeadJoin``: the question pre-pass's lead rows join; ``Focus``: focused-chunk early
termination), the restart of a plan whose committed load failed (``execute_plan``) and
``PrefillTask``, the handle a caller advances.

The generators yield ``(layer, tokens)`` after every layer but the last (``tokens``: rows that layer
computed) and return their result; a caller runs other work there (the server's decode steps, another
request's prefill) without touching this request's buffer. Time spent suspended is left out of
``prefill_s`` and the cost model. Closing a generator mid-way releases the plan and its loaders and
stores nothing.

Hook order within a layer: loads, lead join, deviation check (``selection.DeviationCheck``), row
precision (``precision.LowPrecisionRows.weights``), the layer's forward, then capture for the hand-off
(``handoff.Capture``) and focus. A new per-layer technique is a hook here or in its own module."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Generator
from typing import Generic, TypeVar

import torch

from cachedrag.kvcache.focus import FocusTracker
from cachedrag.kvcache.planner import Action, Mode
from cachedrag.model.transfer import device_tensor
from cachedrag.engine.handoff import Capture
from cachedrag.engine.load import load_plan
from cachedrag.engine.precision import LowPrecisionRows, leading_low
from cachedrag.engine.result import prefill_info
from cachedrag.engine.selection import DeviationCheck, choose_before_prefill
from cachedrag.engine.state import LayerState, RowPlan, _HandOff, _Lead, _LoadFailed, _Prefill

R = TypeVar("R")
Steps = Generator[tuple[int, int], None, R]  # yields (layer, tokens) between layers, returns R


class PrefillTask(Generic[R]):
    """A prefill the caller advances: ``advance()`` runs it up to the next layer boundary (False once
    it finished: ``result`` is set; an error raises from it). ``layer`` / ``tokens``: the boundary
    reached. ``run(between_layers)`` drives it to the end, calling ``between_layers(layer, tokens)``
    at each boundary. ``close()`` abandons it (nothing stored, the plan released)."""

    def __init__(self, steps: Steps):
        self._steps = steps
        self.layer = -1
        self.tokens = 0
        self.done = False
        self.result: R | None = None

    def advance(self) -> bool:
        try:
            self.layer, self.tokens = next(self._steps)
            return True
        except StopIteration as stop:
            self.done, self.result = True, stop.value
            return False

    def run(self, between_layers: Callable[[int, int], None] | None = None) -> R:
        try:
            while self.advance():
                if between_layers is not None:
                    between_layers(self.layer, self.tokens)
        except BaseException:
            self.close()
            raise
        return self.result

    def close(self) -> None:
        self._steps.close()


def drive(steps: Steps, between_layers: Callable[[int, int], None] | None = None):
    """Run ``steps`` to the end (``between_layers`` at each boundary); returns its result."""
    return PrefillTask(steps).run(between_layers)


def layer_loop(runner, state: LayerState, kv, hooks: list, precision: LowPrecisionRows | None, tail_logits: int,
               all_logits: bool) -> Steps:
    """Every layer over ``state``'s rows with ``hooks`` around each; returns the seconds spent suspended."""
    paused = 0.0
    n = runner.n_layers
    before = [h.before_layer for h in hooks if hasattr(h, "before_layer")]
    after = [h.after_layer for h in hooks if hasattr(h, "after_layer")]
    for layer in range(n):
        for hook in before:
            hook(state, layer)
        raw: dict = {}
        last = layer + 1 == n and not all_logits  # only the last rows' output is read
        lw = precision.weights(state, layer, last) if precision is not None else None
        state.hidden = runner.forward_layer(layer, state.hidden, state.positions, kv, state.total, raw_out=raw,
                                            rope=state.rope, blocks=state.blocks, weights=lw,
                                            out_rows=slice(-tail_logits, None) if last else None)
        state.token_layers += state.positions.shape[0]
        for hook in after:
            hook(state, layer, raw)
        if layer + 1 < n:
            t_pause = time.perf_counter()
            yield layer, int(state.positions.shape[0])
            paused += time.perf_counter() - t_pause
    return paused


class LeadJoin:
    """The lead rows (``_Lead``: computed by the question pre-pass below ``lead.layer``) join the
    compute set at ``lead.layer`` with their pre-pass hidden states."""

    def __init__(self, runner, lead: _Lead, positions: list[int]):
        self.runner, self.lead, self.positions = runner, lead, positions

    def before_layer(self, state: LayerState, layer: int) -> None:
        if layer != self.lead.layer:
            return
        runner = self.runner
        state.positions = torch.cat([device_tensor(self.positions, runner.device), state.positions])  # [Tc]
        state.hidden = torch.cat([self.lead.hidden, state.hidden])  # [Tc, Dm]
        state.rope = runner.rotary.cos_sin(state.positions, runner.dtype, runner.device)
        state.blocks = runner.causal_blocks(state.positions, state.total)
        state.token_layers += len(self.positions) * self.lead.layer


class Focus:
    """Focused-chunk early termination (Cache-Craft Algorithm 1): after each layer the question's
    attention mass per chunk feeds a ``FocusTracker``; once it decides, the recompute rows of the
    unfocused chunks leave the compute set (``state.focus_layer``)."""

    def __init__(self, engine, kv, rows: RowPlan, chunk_seg: list[int], bounds: list[int]):
        self.runner, self.kv, self.rows, self.chunk_seg, self.bounds = engine.runner, kv, rows, chunk_seg, bounds
        self.tracker = FocusTracker.from_config(len(chunk_seg), engine.config.cache)

    def unfocused(self) -> set[int]:
        decision = self.tracker.decision
        return set() if decision is None else {i for c, i in enumerate(self.chunk_seg) if not decision.is_focused(c)}

    def after_layer(self, state: LayerState, layer: int, raw: dict) -> None:
        if self.tracker.decision is not None:
            return
        runner, positions = self.runner, state.positions
        q_rows = torch.arange(positions.shape[0] - len(self.rows.question_pos), positions.shape[0],
                              device=positions.device)
        qm = runner.segment_attention_mass(layer, raw["q"][:, q_rows], positions[q_rows], self.kv, state.total,
                                           self.bounds)  # [Tq, S]
        decision = self.tracker.update(qm.sum(0)[self.chunk_seg].tolist())  # question -> each chunk
        if decision is not None and layer + 1 < runner.n_layers:
            state.focus_layer = layer
            drop = {p for c, i in enumerate(self.chunk_seg) if not decision.is_focused(c)
                    for p in self.rows.recompute_pos.get(i, ())}
            if drop:
                state.narrow(runner, torch.tensor([p not in drop for p in positions.tolist()], device=positions.device))


def plan_rows(plan, actions: list[Action], total: int) -> RowPlan:
    """The rows a plan computes before any token choice: fresh segments, the plan's own recompute
    tokens, the question; the deferred segments' counts."""
    fresh_pos: list[int] = []
    recompute_pos: dict[int, list[int]] = {}
    for i, (sp, action) in enumerate(zip(plan.segments, actions)):
        if action is Action.FRESH:
            fresh_pos.extend(range(sp.start, sp.end))
        elif action is Action.REUSE and sp.recompute:
            recompute_pos[i] = sp.recompute_positions()
    deferred = {i: sp.deferred for i, (sp, a) in enumerate(zip(plan.segments, actions))
                if a is Action.REUSE and sp.deferred}
    first_reuse = min((sp.start for sp, a in zip(plan.segments, actions) if a is Action.REUSE), default=total)
    return RowPlan(total=total, actions=actions, fresh_pos=fresh_pos,
                   question_pos=list(range(plan.question_start, total)), recompute_pos=recompute_pos,
                   deferred=deferred, first_reuse=first_reuse)


def execute(engine, plan, segments, mode: Mode, max_new_tokens: int, all_logits: bool,
            force_fresh: frozenset[int] = frozenset(), tail_logits: int = 1) -> Steps:
    """One plan's prefill: returns ``(_Prefill, _HandOff | None)``."""
    runner = engine.runner
    total = plan.total_tokens
    ids = device_tensor([t for s in segments for t in s.ids], runner.device)  # [T]
    kv = runner.new_kv(total + max_new_tokens, fill=engine.buffer_fill)
    notes = list(plan.notes)
    loads = load_plan(engine, plan, kv, force_fresh, notes)  # planned tree / variant KV, raw K re-rotated
    try:
        rows = plan_rows(plan, loads.actions, total)
        lead_low, lead_segments = leading_low(engine, mode, rows, plan)
        exact_segments = min(lead_segments[0], plan.exact_prefix_segments) if lead_low else plan.exact_prefix_segments
        leading = sum(p < rows.first_reuse for p in rows.fresh_pos)
        lead = _Lead(rows=leading if engine.share_lead_rows else 0, q_layers=frozenset(engine.metadata_layers),
                     leading=leading, low=lead_low)
        checking = choose_before_prefill(engine, rows, plan, ids, kv, loads, lead, notes)
        run = _Run(engine, plan, segments, mode, rows, kv, lead, checking)
        precision = LowPrecisionRows(engine, mode, rows, plan, lead_low, tail_logits)
        t_prefill = time.perf_counter()
        state = run.state(ids)
        paused = yield from layer_loop(runner, state, kv, [loads, *run.hooks], precision, tail_logits, all_logits)
        loads.observe(engine.costs)
    finally:
        loads.close()
    if all_logits:
        logits = runner.logits(state.hidden)  # [Tc, V]
    elif tail_logits > 1:
        logits = runner.logits(state.hidden[-tail_logits:])  # [tail_logits, V]
    else:
        logits = runner.logits(state.hidden[-1:])[0]  # [V] (the last layer computed only this row's output)
    kv.length = total
    prefill_s = time.perf_counter() - t_prefill - paused
    n_lead = lead.shared
    engine.costs.observe_prefill(prefill_s, state.token_layers - n_lead * (lead.layer or 0), runner.n_layers)
    hand_off = run.hand_off(exact_segments)
    info = prefill_info(runner.n_layers, plan, rows, run.compute, state, mode, engine.config.cache.token_choice,
                        run.chunk_seg, precision, loads.load_s + loads.wait_s, prefill_s, notes)
    return _Prefill(kv, logits, info, exact_segments=exact_segments), hand_off


class _Run:
    """The compute set and hooks of one plan's layer loop, after the token choice before the prefill."""

    def __init__(self, engine, plan, segments, mode: Mode, rows: RowPlan, kv, lead: _Lead, checking: bool):
        self.engine, self.rows, self.kv, self.lead, self.mode = engine, rows, kv, lead, mode
        self.compute = rows.compute()
        self.chunk_seg = [i for i, sp in enumerate(plan.segments) if sp.role == "chunk"]
        self.bounds = [0]
        for s in segments:
            self.bounds.append(self.bounds[-1] + len(s))
        self.n_system = len(plan.system)
        device = engine.runner.device
        self.fresh_t = device_tensor(rows.fresh_pos, device)  # [Tf]
        self.capture = mode in (Mode.NAIVE, Mode.RANDOM, Mode.CACHEDRAG)  # variants: only modes that reuse them
        focus = None
        if (mode in (Mode.CACHEDRAG, Mode.RANDOM) and engine.config.early_termination
                and (rows.recompute_pos or rows.deferred) and len(self.chunk_seg) > 1):
            focus = Focus(engine, kv, rows, self.chunk_seg, self.bounds)
        self.hooks: list = []
        if lead.shared:
            self.hooks.append(LeadJoin(engine.runner, lead, self.compute[:lead.shared]))
        if checking:
            self.hooks.append(DeviationCheck(engine, rows, plan, kv, focus))
        self.capturing = None
        if mode is not Mode.FULL and rows.fresh_pos:  # what is computed fresh is stored
            with_meta = self.capture and any(rows.actions[i] is Action.FRESH for i in self.chunk_seg)
            self.capturing = Capture(engine, self.fresh_t, lead, with_meta)
            self.hooks.append(self.capturing)
        if focus is not None:
            self.hooks.append(focus)

    def state(self, ids: torch.Tensor) -> LayerState:
        """The loop's first rows: the compute set less the lead rows (they join at ``lead.layer``)."""
        runner = self.engine.runner
        positions = device_tensor(self.compute[self.lead.shared:], runner.device)  # [Tc]
        return LayerState(positions=positions, hidden=runner.embed(ids[positions]),  # [Tc, Dm]
                          rope=runner.rotary.cos_sin(positions, runner.dtype, runner.device),  # [Tc, D] each
                          blocks=runner.causal_blocks(positions, self.rows.total), total=self.rows.total)

    def hand_off(self, exact_segments: int) -> _HandOff | None:
        """What to store (raw K + V of fresh segments, metadata for fresh chunks), or None."""
        c = self.capturing
        if c is None:
            return None
        return _HandOff(self.rows.actions, self.fresh_t, c.raw_k, self.kv, self.rows.total, c.meta_q, self.bounds,
                        self.n_system, self.chunk_seg, self.capture, exact_segments)


def execute_plan(engine, plan, segments, context, mode: Mode, max_new_tokens: int, all_logits: bool,
                 tail_logits: int = 1) -> Steps:
    """Execute ``plan`` (releasing it however that ends; a cached entry that fails mid-load is
    computed fresh: the prefill restarts once per failure). Returns the prefill and its store
    hand-off, if any, as a list of calls for the caller to run now or after the first token."""
    used = False
    try:
        force_fresh: frozenset[int] = frozenset()
        while True:
            try:
                pre, hand_off = yield from execute(engine, plan, segments, mode, max_new_tokens, all_logits,
                                                   force_fresh, tail_logits)
                break
            except _LoadFailed as failed:
                force_fresh = force_fresh | {failed.segment}
        used = True
    finally:
        engine.manager.release(plan, used=used)
    if hand_off is None:
        return pre, []
    return pre, [functools.partial(engine._hand_off, plan, [s.key for s in context], hand_off)]
