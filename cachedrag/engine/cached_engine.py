"""``CachedEngine``: the chunk-cache engine's facade and request path, plan -> load -> partial
prefill -> decode -> store.

Owns: ``CachedEngine`` (the one generation API with chunk reuse) and the tensor side of a
request: loading planned KV into the working buffer (raw K re-rotated to its new positions),
computing only fresh + recompute + question tokens layer by layer, choosing the recompute tokens
when the plan defers that choice (by measured K/V deviation, CacheBlend; by the question's
attention to the re-rotated cache, ProphetKV-like; or both fused: helpers in ``selection``),
order-aware exact reuse (serving a cached tree path's order), the first-token tie guard
(``CacheConfig.exact.tie_guard``: an approximate prefill whose first token is a near tie is prefilled
again exactly; the decode-time guard is ``exact.DecodeTieGuard``), teacher-forced scoring of a
given answer, focused-chunk early termination, measuring the inter/intra attention metadata of
fresh chunks, and handing their raw K + V to the cache manager (``handoff``).

Does not own: decisions (``cachedrag.kvcache.planner`` via ``ChunkCacheManager``), storage
tiers (``cachedrag.store``), prompt layout (``cachedrag.prompt``), or sampling
(``cachedrag.model.generation``). The request path keeps all state in locals, so concurrent
``generate`` calls from several threads are safe (shared state is behind the manager's locks).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Sequence

import torch

from cachedrag.config import EngineConfig
from cachedrag.errors import ConfigError
from cachedrag.fingerprint import namespace_for
from cachedrag.kvcache.config import QUESTION_CHOICES
from cachedrag.kvcache.focus import FocusTracker
from cachedrag.kvcache.keys import path_key
from cachedrag.kvcache.manager import ChunkCacheManager, NewEntry
from cachedrag.kvcache.planner import MODES, Action, Mode, PlanRequest
from cachedrag.kvcache.planner import Segment as PlanSegment
from cachedrag.kvcache.tie import near_tie
from cachedrag.kvcache.variants import AttentionMetadata
from cachedrag.model.generation import SamplingParams, eos_token_ids, rewind_allowed
from cachedrag.model.lookup import prompt_lookup
from cachedrag.model.runner import KVBuffer, ModelRunner
from cachedrag.model.scoring import RowSplit, RowSplitLayer, scoring_layers
from cachedrag.model.textgen import check_context, stream_tokens
from cachedrag.model.transfer import device_tensor
from cachedrag.prompt import PromptBuilder, Segment
from cachedrag.engine.result import EngineResult, Prefilled, GenerationStream, _Holder
from cachedrag.engine.state import _Prefill, _HandOff, _Lead, _LoadFailed
from cachedrag.engine.exact import DecodeTieGuard, top2
from cachedrag.engine.selection import _reused_positions, _rows, _pick, _pick_each, _fuse_inter, _rank01
from cachedrag.engine.handoff import entry_payload

log = logging.getLogger(__name__)


class CachedEngine:
    """Generate with chunk KV reuse.

    >>> engine = CachedEngine()                                   # embedded default model
    >>> r = engine.generate(chunks=[doc1, doc2], question="...")  # doctest: +SKIP
    >>> r.text, r.ttft_s, r.chunks_hit                             # doctest: +SKIP

    ``mode`` (per engine or per call) chooses the reuse strategy: ``full`` (no reuse),
    ``prefix`` (exact-prefix tree only), ``naive`` (reuse every cached chunk, no recompute),
    ``random`` (cachedrag's recompute counts, random tokens), ``cachedrag`` (the design).
    """

    def __init__(self, runner: ModelRunner | None = None, *, model: str | None = None,
                 config: EngineConfig | None = None, store=None, manager: ChunkCacheManager | None = None):
        if runner is None:
            runner = ModelRunner.from_pretrained(model)  # warmed up: no first-request penalty
        self.runner = runner
        self.config = config or EngineConfig()
        # chunk keys carry the tenant salt (isolation); stored entries carry the model namespace
        # (validity: a cache of one model never serves another), shared by all tenants of a store
        self.namespace = namespace_for(runner.model, runner.tokenizer, self.config.tenant_salt,
                                       getattr(getattr(runner, "numerics", None), "tag", None))
        self.model_namespace = dataclasses.replace(self.namespace, tenant_salt=None)
        self.prompts = PromptBuilder(runner.tokenizer, self.namespace)
        if manager is None:
            # the default in-memory store is capped by cache_bytes; a user's store governs its own budgets
            capacity = self.config.cache_bytes if store is None else None
            if store is None:
                from cachedrag.store.cpu import CPUTier

                store = CPUTier(self.config.cache_bytes, namespace=self.model_namespace.digest)
            manager = ChunkCacheManager(store, self.config.cache, capacity_bytes=capacity)
        self.manager = manager
        self.eos_ids = eos_token_ids(runner.model, runner.tokenizer)
        # measured costs (EMAs) for preload depth and the recompute-vs-wait break-even point
        self._t_token_layer: float | None = None
        self._t_prefill_layer: float | None = None
        self._t_load_layer: float | None = None
        # the prefill takes over the question pre-pass's leading fresh rows (``_Lead``); False: it
        # recomputes them (the reference path of the equivalence tests)
        self.share_lead_rows = True
        # the request's KV buffer is left uninitialised (every prompt row is loaded or computed before
        # any layer reads it, decode rows are written before they are read); a number fills it first
        # (0.0: the reference path of the equivalence tests; NaN there proves no unwritten row is read)
        self.buffer_fill: float | None = None
        # the question pre-pass: "eager" op by op in ``_question_scores`` (the default, and the reference);
        # "cuda-graph" replays it from graphs captured per buffer and row bucket (model/question_graph.py;
        # opt-in on CUDA until a GPU run proves it equal, docs/gpu.md); "static" runs that padded pass
        # eagerly (its CPU check)
        self.question_pass = "eager"
        self.question_graphs = None  # QuestionPassGraphs once a padded pass ran (its captures, passes, failure)
        n = runner.n_layers
        k = min(self.config.metadata_layers, n)
        self.metadata_layers = sorted({round(1 + j * (n - 2) / max(1, k - 1)) if n > 2 else j for j in range(k)})
        self._prepare_question_pass()

    def _prepare_question_pass(self) -> None:
        """Build the question pre-pass's bfloat16 weight copies now (``model/scoring.py``: ~130 ms
        and 120 MB for the default model; every layer's with ``precision.recompute``, ``.fresh`` or
        ``.leading_fresh`` "bfloat16", which its recomputed rows and fresh rows run on), so
        the first reuse-served request does not pay them.
        Only where this engine's default can use them: mode ``cachedrag`` with a question token
        choice and ``precision.question="bfloat16"`` (a per-call ``mode="cachedrag"`` on an engine
        with another default builds them on its first reuse instead)."""
        cache = self.config.cache
        if self.config.mode == "cachedrag" and "bfloat16" in (cache.precision.recompute, cache.precision.fresh,
                                                              cache.precision.leading_fresh):
            scoring_layers(self.runner, self.runner.n_layers)
        elif (self.config.mode == "cachedrag" and cache.token_choice in QUESTION_CHOICES
                and cache.precision.question == "bfloat16"):
            scoring_layers(self.runner, max(self._question_layers()) + 1)

    def _question_layers(self) -> list[int]:
        """The layers whose question attention ranks reused tokens (``CacheConfig.question_layers``
        within the model; its last layer when none is)."""
        n = self.runner.n_layers
        return [x for x in self.config.cache.question_layers if x < n] or [n - 1]

    # ------------------------------------------------------------------ public API
    def generate(self, chunks: Sequence[str] = (), question: str = "", system_prompt: str | None = None, *,
                 max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                 stop: Sequence[str] | str | None = None, seed: int | None = None, mode: str | None = None,
                 stream: bool = False):
        """Answer ``question`` over retrieved ``chunks`` (chat template of the tokenizer).

        Returns an ``EngineResult``, or with ``stream=True`` a ``GenerationStream`` of text
        deltas whose ``.result`` is set when it is exhausted.
        """
        start = time.perf_counter()
        segments = self.prompts.chat(list(chunks), question, system_prompt)
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                stop=stop or (), seed=seed)
        return self.generate_segments(segments, params, mode=mode, stream=stream, start=start)

    def generate_segments(self, segments: Sequence[Segment], params: SamplingParams, *, mode: str | None = None,
                          stream: bool = False, start: float | None = None, teacher: Sequence[int] | None = None):
        """Generate after an arbitrary segment layout (see ``PromptBuilder.text_segments``).

        ``teacher``: token ids of a reference answer (at most ``max_new_tokens``); after
        generating, the same prefilled KV scores it teacher-forced and ``result.teacher_logits``
        holds the logits ``[A, V]`` predicting each of its tokens (fidelity measurements).
        """
        start = time.perf_counter() if start is None else start
        mode = self._mode(mode)
        if teacher is not None and (stream or not 0 < len(teacher) <= params.max_new_tokens):
            raise ConfigError("teacher needs stream=False and 1..max_new_tokens token ids")
        holder = _Holder()
        deltas = self._run(list(segments), params, mode, start, holder, teacher, rewind=not stream)
        if stream:
            return GenerationStream(deltas, holder)
        for _ in deltas:
            pass
        return holder.result

    def score(self, segments: Sequence[Segment], answer: Sequence[int], mode: str | None = None) -> torch.Tensor:
        """Teacher-forced logits ``[A, V]`` of ``answer`` after the prompt, without decoding:
        row j predicts ``answer[j]`` from the prompt and ``answer[:j]`` (the prompt prefilled by
        ``mode``, with this engine's reuse; fidelity measurements compare these with ``full``)."""
        if not answer:
            raise ConfigError("score needs at least one answer token")
        pre = self._prefill(list(segments), self._mode(mode), len(answer))
        return self._teacher_forced(pre, pre.info["prompt_tokens"], list(answer))

    def prefill(self, segments: Sequence[Segment], max_new_tokens: int, mode: str | None = None,
                between_layers: Callable[[int, int], None] | None = None, defer_store: bool = False,
                exact: bool = False) -> "Prefilled":
        """Plan, load and prefill only, without decoding (the serving scheduler's seam).

        Returns the working KV buffer (capacity = prompt + ``max_new_tokens``, rows of the
        prompt valid), the last-position logits ``[V]`` and the request's stats (the
        ``EngineResult`` fields of the prefill); the caller decodes (``cachedrag.server.batch``).
        ``between_layers(layer, tokens)`` is called after each layer of the partial prefill
        (``tokens``: positions that layer computed): the serving loop runs other requests'
        decode steps there (chunked prefill). It must not touch this request's buffer; its time
        is left out of ``prefill_s`` and the engine's cost model.
        ``defer_store``: what the request computed fresh is not handed to the cache manager yet but
        left in ``.hand_off`` (None when there is nothing to store), for the caller to run once
        the first token is out, as ``generate`` does; until then only decode may write the buffer
        (rows past the prompt).
        ``.promote`` (``CacheConfig.exact.repeats``, timing "after_response"): when this request's
        chunk sequence recurred often enough, a callable that computes and stores its exact tree
        path; the caller runs it whenever it likes (after the response, in idle time) or drops it.
        ``exact``: plan as prefix caching (tree prefix, the rest fresh: the prefill equals full
        prefill's) but store as ``mode`` does, so the chunks it computes stay reusable elsewhere as
        variants (a faithful server's exact admissions).
        """
        pre = self._prefill(list(segments), self._mode(mode), max_new_tokens, between_layers=between_layers,
                            defer_store=defer_store, exact_plan=exact)
        return Prefilled(kv=pre.kv, logits=pre.logits, info=pre.info, hand_off=pre.hand_off, promote=pre.promote,
                         segments=pre.segments)

    def prefill_exact_continuation(self, segments: Sequence[Segment], answer: Sequence[int], max_new_tokens: int,
                                   between_layers: Callable[[int, int], None] | None = None,
                                   stop_at_disagreement: bool = False) -> "Prefilled":
        """The tie guard during decoding (``CacheConfig.exact.tie_guard_decode``): prefill exactly, as prefix
        caching would (tree prefix, the rest fresh), ``segments`` as served (``Prefilled.segments``)
        followed by the ``answer`` token ids chosen so far (>= 1).

        Returns a ``Prefilled`` whose buffer holds the prompt and answer rows (capacity prompt +
        ``max_new_tokens``), whose ``logits`` ``[V]`` predict the next answer token, and whose
        ``info`` is the exact prefill's stats plus ``answer_agreed``: how many leading ``answer``
        tokens are its greedy choices too. ``hand_off`` stores its exact path (run it once the next
        token is out). ``between_layers`` as in ``prefill``.

        ``stop_at_disagreement`` (a rewind: the answer is not shown yet): the buffer stops after the agreed
        tokens, and ``logits`` predict the token after them (the exact prefill's choice there replaces
        the answer's); ``info["answer_kept"]`` says how many answer tokens the buffer holds.
        """
        answer = list(answer)
        if not 0 < len(answer) < max_new_tokens:
            raise ConfigError("an exact continuation needs 1..max_new_tokens-1 answer tokens")
        pre = self._exact_continuation(list(segments), answer, max_new_tokens, between_layers, answer_rows="decode",
                                       stop_at_disagreement=stop_at_disagreement)
        rows = pre.logits  # [kept + 1, V]: row j predicts answer token j
        chosen = rows[:-1].argmax(-1).tolist()
        kept = rows.shape[0] - 1
        pre.info["answer_agreed"] = next((j for j, (c, a) in enumerate(zip(chosen, answer)) if c != a), kept)
        pre.info["answer_kept"] = kept
        return Prefilled(kv=pre.kv, logits=rows[-1].float(), info=pre.info, hand_off=pre.hand_off,
                         segments=pre.segments)

    def _exact_continuation(self, segments: list[Segment], answer: list[int], max_new_tokens: int,
                            between_layers=None, answer_rows: str = "prefill",
                            stop_at_disagreement: bool = False) -> _Prefill:
        """Exact prefill of ``segments`` followed by the ``answer`` tokens; ``pre.logits`` holds the rows
        ``[len(answer) + 1, V]`` predicting each answer token and the next one; the store hand-off is left
        in ``pre.hand_off``.

        ``answer_rows``: how the answer tokens' rows are computed. ``"decode"`` (a switch, which goes on
        decoding): one ``decode_step`` each after the prompt's prefill, as a full prefill's answer wrote
        them, so the continuation has that answer's KV bit for bit where the prompt's is (in bfloat16 a
        prefill's rows round apart from decode steps' and near ties flip: ``bench serve`` found 6 of 9
        switched answers parting from full prefill's that way, none in float32). ``"prefill"`` (teacher-
        forced scoring): appended to the question in the one prefill, as ``_teacher_forced`` scores full
        prefill's answer. ``stop_at_disagreement`` (with ``"decode"``): no rows past the first answer token
        the exact rows would not have chosen (greedy).

        Planned as prefix caching (``exact_plan``) but run as ``cachedrag``, so what it computes fresh
        is stored with its attention metadata: an exact entry that replaces the approximate prefill's
        variant of a chunk (same path) stays that chunk's variant, reusable elsewhere."""
        if answer_rows == "prefill":
            question = segments[-1]
            extended = dataclasses.replace(question, ids=tuple(question.ids) + tuple(answer))
            return self._prefill(segments[:-1] + [extended], Mode.CACHEDRAG, max_new_tokens - len(answer),
                                 between_layers=between_layers, defer_store=True, exact_plan=True,
                                 tail_logits=len(answer) + 1)
        pre = self._prefill(segments, Mode.CACHEDRAG, max_new_tokens, between_layers=between_layers,
                            defer_store=True, exact_plan=True)
        start = pre.kv.length
        rows = [pre.logits.reshape(1, -1).float()]  # [1, V]
        for j, token in enumerate(answer):
            if stop_at_disagreement and int(rows[-1].argmax()) != token:
                break
            rows.append(self.runner.decode_step(token, start + j, pre.kv)[None].float())  # [1, V]
        pre.logits = torch.cat(rows)  # [kept + 1, V]: kept = len(answer) unless it stopped at a disagreement
        return pre

    def prefill_logits(self, segments: Sequence[Segment], mode: str | None = None, all_logits: bool = False):
        """Prefill only; returns the last-position logits ``[V]`` (for equivalence tests and FLARE)."""
        pre = self._prefill(list(segments), self._mode(mode), 0, all_logits=all_logits)
        return pre.logits

    def stats(self) -> dict:
        return self.manager.stats()

    def preload_chunks(self, texts: Sequence[str]):
        """Chunk-KV lookahead: start moving the cached KV of these candidate chunks (every variant,
        and tree nodes ending in them) toward the fastest tier, in the background.

        Wire it to retrieval's lookahead hook so chunk caches move while the LLM still rewrites
        the query: with ``text_of = {c.id: c.text for c in index.chunks}``,
        ``LookaheadRetriever.from_index(index, on_candidates=lambda ids: engine.preload_chunks(
        [text_of[i] for i in ids]))``. Returns the store's prefetch handle, or None when
        the store cannot prefetch or nothing is cached.
        """
        prefetch = getattr(self.manager.store, "prefetch", None)
        if prefetch is None:
            return None
        keys = {self.prompts.chunk_segment(t).key for t in texts if t and t.strip()}
        handles = [v.handle for k in keys for v in self.manager.index.variants(k)]
        handles += [n.handle for n in self.manager.tree.nodes() if n.key in keys and n.handle is not None]
        return prefetch(list(dict.fromkeys(handles))) if handles else None

    # ------------------------------------------------------------------ request path
    def _mode(self, mode: str | None) -> Mode:
        name = mode or self.config.mode
        if name not in MODES:
            raise ConfigError(f"unknown mode {name!r}; choose one of {', '.join(MODES)}")
        return Mode(name)

    def _run(self, segments: list[Segment], params: SamplingParams, mode: Mode, start: float, holder: _Holder,
             teacher: Sequence[int] | None = None, rewind: bool = False):
        """The request path of ``generate_segments``: prefill, decode (yielding text deltas), result.
        ``rewind``: nobody sees the deltas (not streamed), so the tie guard during decoding may rewind."""
        pre = self._prefill(segments, mode, params.max_new_tokens, defer_store=True)
        prompt_tokens = pre.info["prompt_tokens"]
        lookup = prompt_lookup(self.config.lookup, [t for s in segments for t in s.ids], params.temperature == 0.0)
        guard = DecodeTieGuard.for_request(self, pre.segments, pre.info, mode.value, params.max_new_tokens,
                                           rewind=rewind and rewind_allowed(params))
        try:
            yield from stream_tokens(self.runner, pre.kv, pre.logits, prompt_tokens, params, self.eos_ids, start,
                                     holder, lookup, after_first=pre.hand_off,  # the hand-off waits for the 1st token
                                     switch=guard)
        finally:
            if guard is not None:
                guard.close()
        g = holder.last_result
        info = dict(pre.info, decoded_first_token=g.token_ids[0] if g.token_ids else None)
        if guard is not None:
            info.update(guard.stats())
            if guard.replaced_first is not None:
                info["decoded_first_token"] = guard.replaced_first
            if guard.failure is not None:
                info["notes"] = [*info["notes"], guard.failure]
        holder.result = EngineResult(
            text=g.text, token_ids=g.token_ids, mode=mode.value, ttft_s=g.ttft_s, total_s=g.total_s,
            prompt_tokens=prompt_tokens, finish_reason=g.finish_reason, token_logprobs=g.token_logprobs,
            draft_passes=lookup.passes if lookup else 0, draft_tokens=lookup.proposed if lookup else 0,
            draft_accepted=lookup.accepted if lookup else 0,
            **{k: v for k, v in info.items() if k != "prompt_tokens"},
        )
        if teacher is not None:
            holder.result.teacher_logits = self._teacher_forced(pre, prompt_tokens, list(teacher))
            if guard is not None:
                self._guard_teacher(holder.result.teacher_logits, pre.segments, list(teacher), guard)
        if guard is not None and guard.token is not None and pre.promote is not None:
            pre.promote = None  # the switch stored this sequence's exact path already: nothing to promote
            holder.result.exact_repeat = None
        if pre.promote is not None:  # the answer is out: now compute the recurring sequence's exact path
            try:
                holder.result.promotion_s = pre.promote()
                holder.result.exact_repeat = "promoted"
            except Exception as exc:  # the answer stands; only the promotion failed (reported, not swallowed)
                holder.result.notes.append(f"exact-repeat promotion failed: {exc!r}")

    def _promote(self, segments: list[Segment], mode: Mode,
                 between_layers: Callable[[int, int], None] | None = None) -> float:
        """Compute and store the exact knowledge-tree path of ``segments``' system and chunks (a
        prefill of the part not on the tree, as prefix caching does on a miss; the question rows
        ride along, nothing is decoded). Returns its seconds. ``between_layers(layer, tokens)``
        runs after each layer; an exception raised there abandons the promotion with nothing
        stored (an idle-time caller yields to a request that arrived)."""
        t0 = time.perf_counter()
        self._prefill(segments, mode, 0, between_layers=between_layers, exact_plan=True)
        return time.perf_counter() - t0

    @torch.inference_mode()
    def _guard_teacher(self, rows: torch.Tensor, segments: list[Segment], teacher: list[int],
                       guard: DecodeTieGuard) -> None:
        """Teacher-forced logits ``rows`` ``[A, V]`` as the tie guard during decoding would give them: from
        the first position >= 1 whose approximate logits are a near tie on, the exact prefill's rows
        (the prompt and ``teacher[:-1]`` prefilled exactly; nothing stored: a measurement must not
        change the cache)."""
        at = next((j for j in range(1, len(teacher)) if self.near_tie(rows[j], guard.threshold)[0]), None)
        if at is None:
            return
        exact = self._exact_continuation(segments, teacher[:-1], guard.max_new_tokens)  # [A, V]
        rows[at:] = exact.logits[at:].float()

    @torch.inference_mode()
    def _teacher_forced(self, pre: _Prefill, start: int, teacher: list[int]) -> torch.Tensor:
        """Logits ``[A, V]`` predicting ``teacher[j]`` after the prefilled prompt and
        ``teacher[:j]``: one pass over ``teacher[:-1]`` on the request's buffer (decoding wrote
        only rows >= ``start``; this pass overwrites them in causal order)."""
        rows = [pre.logits[None].float()]  # [1, V]
        if len(teacher) > 1:
            ids = torch.tensor(teacher[:-1], device=self.runner.device)
            pos = torch.arange(start, start + len(teacher) - 1, device=self.runner.device)
            rows.append(self.runner.prefill(ids, pos, kv=pre.kv, kv_len=start + len(teacher) - 1, all_logits=True))
        return torch.cat(rows, 0)  # [A, V]

    @torch.inference_mode()
    def _prefill(self, segments: list[Segment], mode: Mode, max_new_tokens: int, all_logits: bool = False,
                 between_layers: Callable[[int, int], None] | None = None, defer_store: bool = False,
                 exact_plan: bool = False, tail_logits: int = 1) -> _Prefill:
        """Plan, load and prefill. What the request computed fresh is handed to the cache
        manager (``_HandOff``: metadata, entry copies, store writes) before returning, or with
        ``defer_store`` left in ``pre.hand_off`` for the caller to run once the first token is
        out (``_run``): the KV rows and queries it reads stay untouched until then.
        Exact repeats (``CacheConfig.exact.repeats``): when the plan reuses chunk variants and this
        chunk sequence has now been served from reuse that many times, either the request is
        planned as prefix caching would (timing "inline": tree prefix, the rest fresh, so it is
        exact and stores its whole path) or ``pre.promote`` computes that path later (``_promote``).
        ``exact_plan``: plan as prefix caching, in the given order (a promotion, the tie guard during
        decoding). ``tail_logits`` > 1: ``pre.logits`` holds the last that many positions' logits
        ``[tail_logits, V]`` (the tie guard during decoding reads the answer's rows).
        The question is the last segment; text segments between the last chunk and it are
        context (glue: stored with the chunks and part of their tree path), as the server's
        automatic passage detection cuts what follows the last passage it knows."""
        runner = self.runner
        first_chunk = next((i for i, s in enumerate(segments) if s.kind == "chunk"), None)
        last_chunk = max((i for i, s in enumerate(segments) if s.kind == "chunk"), default=None)
        if first_chunk is None:  # no chunks: everything but the last segment is a cacheable prefix
            first_chunk = last_chunk = len(segments) - 1
            n_question_from = len(segments) - 1
            system, middle = segments[:-1], []
        else:
            n_question_from = max(last_chunk + 1, len(segments) - 1)
            system, middle = segments[:first_chunk], segments[first_chunk:n_question_from]
        question = segments[n_question_from:]
        if not question:
            raise ConfigError("a request must end with a text segment (the question)")
        chunk_order = None
        if (self.config.order_aware and mode is not Mode.FULL and len(middle) > 1 and not exact_plan
                and all(s.kind == "chunk" for s in middle)):
            chunk_order = self.manager.cached_order([s.key for s in system], [s.key for s in middle])
            if chunk_order is not None:  # a cached tree path holds these chunks: serve its order exactly
                middle = [middle[i] for i in chunk_order]
                segments = system + middle + question
        context = system + middle
        request = PlanRequest(
            system=tuple(PlanSegment(s.key, len(s)) for s in system),
            chunks=tuple(PlanSegment(s.key, len(s), glue=s.kind != "chunk") for s in middle),
            question_tokens=sum(len(s) for s in question),
        )
        total = sum(len(s) for s in segments)
        check_context(runner, total, max_new_tokens)
        plan = self.manager.plan(request, Mode.PREFIX if exact_plan and mode is not Mode.FULL else mode)
        repeat = None
        cache = self.config.cache
        if cache.exact.repeats and not exact_plan and plan.repeat >= cache.exact.repeats:
            overdue = plan.repeat > cache.exact.repeats  # an earlier sighting's promotion has not landed
            when = cache.exact.repeats_when
            if when == "inline" or (when == "after_response_else_inline" and overdue):
                # this sighting is computed exactly and stores its path
                self.manager.release(plan, used=False)
                plan = self.manager.plan(request, Mode.PREFIX)
                repeat = "inline"
            else:
                repeat = "promote"
        t_first = time.perf_counter()
        pre, hand_offs = self._execute_plan(plan, segments, context, mode, max_new_tokens, all_logits, between_layers,
                                            tail_logits)
        gap = first_actions = first = None
        tied = False
        if mode is not Mode.FULL and not exact_plan and pre.info["approximations"]:
            logits = pre.logits[-1] if pre.logits.dim() == 2 else pre.logits  # [V]
            # how close the approximate first token was to a rival (reported; the tie guard's reading)
            tied, first = self.near_tie(logits, cache.exact.tie_guard)
        if cache.exact.tie_guard and mode is Mode.CACHEDRAG and first is not None:
            if tied:  # the approximation would pick a near-tied first token: prefill exactly
                if hand_offs and any(sp.action is Action.FRESH for sp in plan.segments[:pre.exact_segments]):
                    # the first prefill computed fresh chunks before its first reused one, exactly: stored
                    # now, they are tree prefix hits for the exact prefill below instead of computed again
                    try:
                        _call_each(hand_offs)
                    except Exception:  # only the caching failed: the exact prefill computes them itself
                        log.exception("store hand-off before the tie guard's exact prefill failed")
                    hand_offs = []
                gap, seconds, first_actions = first, time.perf_counter() - t_first, pre.info["segment_actions"]
                plan = self.manager.plan(request, Mode.PREFIX)
                pre, exact_hand_offs = self._execute_plan(plan, segments, context, mode, max_new_tokens, all_logits,
                                                          between_layers, tail_logits)
                hand_offs += exact_hand_offs  # the first prefill's fresh chunks are stored too
                pre.info["prefill_s"] += seconds
                repeat = None  # this prefill stores the exact path: nothing left to promote
        if hand_offs:
            run = functools.partial(_call_each, hand_offs)
            if defer_store:
                pre.hand_off = run
            else:
                run()
        if self._layerwise:
            self.manager.prefetch(plan)  # promote what this request reused (background; layer loads do not promote)
        pre.info["chunk_order"] = chunk_order
        pre.info["exact_repeat"] = repeat
        pre.info["tie_guard"] = gap
        pre.info["first_token_gap"] = first
        pre.info["tie_guard_actions"] = first_actions
        pre.segments = segments
        if repeat == "promote":
            pre.promote = functools.partial(self._promote, list(segments), mode)
        if chunk_order is not None:
            pre.info["approximations"].insert(0, "reordered")
        return pre

    def near_tie(self, logits: torch.Tensor, threshold: float) -> tuple[bool, float]:
        """Whether the top-2 logits of ``logits`` ``[V]`` are a near tie at ``threshold`` nats, allowing
        for one rounding unit of the runner's dtype at the top logit (``kvcache.tie.near_tie``: in
        bfloat16 a gap read as 0.25 nats may be two 1/8-nat steps), and the gap as read."""
        top, gap = top2(logits)
        bits = round(-math.log2(torch.finfo(self.runner.dtype).eps))  # explicit mantissa bits
        return near_tie(gap, top, threshold, bits), gap

    def _execute_plan(self, plan, segments, context, mode: Mode, max_new_tokens: int, all_logits: bool,
                      between_layers, tail_logits: int = 1) -> tuple[_Prefill, list[Callable[[], None]]]:
        """Execute ``plan`` (releasing it however that ends); returns the prefill and its store
        hand-off, if any, as a list of calls for the caller to run now or after the first token."""
        used = False
        try:
            force_fresh: frozenset[int] = frozenset()
            while True:  # a cached entry that fails mid-load (corrupt, lost) is recomputed: restart once per failure
                try:
                    pre, hand_off = self._execute(plan, segments, context, mode, max_new_tokens, all_logits,
                                                  force_fresh, between_layers, tail_logits)
                    break
                except _LoadFailed as failed:
                    force_fresh = force_fresh | {failed.segment}
            used = True
        finally:
            self.manager.release(plan, used=used)
        if hand_off is None:
            return pre, []
        return pre, [functools.partial(self._hand_off, plan, [s.key for s in context], hand_off)]

    def _execute(self, plan, segments, context, mode: Mode, max_new_tokens: int, all_logits: bool,
                 force_fresh: frozenset[int] = frozenset(), between_layers=None, tail_logits: int = 1):
        runner = self.runner
        device = runner.device
        total = plan.total_tokens
        ids = device_tensor([t for s in segments for t in s.ids], device)  # [T]
        kv = runner.new_kv(total + max_new_tokens, fill=self.buffer_fill)
        notes = list(plan.notes)

        # 1. load: planned tree / variant KV into the buffer, raw K rotated to the new positions.
        #    Layer-wise stores hand out loaders that keep reading ahead while layers compute.
        actions, loaders, load_s = self._load_planned(plan, kv, force_fresh, notes)

        # 2. what to compute: fresh segments, recompute tokens of reused chunks, the question
        fresh_pos: list[int] = []
        recompute_pos: dict[int, list[int]] = {}  # segment index -> absolute positions
        for i, (sp, action) in enumerate(zip(plan.segments, actions)):
            if action is Action.FRESH:
                fresh_pos.extend(range(sp.start, sp.end))
            elif action is Action.REUSE and sp.recompute:
                recompute_pos[i] = sp.recompute_positions()
        question_pos = list(range(plan.question_start, total))
        # token_choice "deviation" (and the question choices): the plan fixed how many tokens of
        # these segments to recompute; which ones is measured here. Deviation: at check_layer, so
        # layers below it run over all their tokens. Question: the question's attention to the
        # loaded cache, in a pre-pass of the question (and fresh tokens) through a few layers.
        cfg = self.config.cache
        choice = cfg.token_choice
        deferred = {i: sp.deferred for i, (sp, a) in enumerate(zip(plan.segments, actions))
                    if a is Action.REUSE and sp.deferred}
        check_layer = cfg.check_layer
        by_deviation = choice in ("deviation", "question+deviation")
        if deferred and by_deviation and check_layer >= runner.n_layers:
            if choice == "deviation":  # too shallow to probe: leading tokens
                notes.append(f"check_layer {check_layer} >= {runner.n_layers} layers; recomputing leading tokens")
                for i, n in deferred.items():
                    recompute_pos[i] = list(range(plan.segments[i].start, plan.segments[i].start + n))
                deferred = {}
            else:
                notes.append(f"check_layer {check_layer} >= {runner.n_layers} layers; ranking by the question only")
            by_deviation = False
        loaded_layers: set[int] = set()
        load_wait = [0.0]
        loaded_rows: list[torch.Tensor | None] = [None]  # the loaded segments' buffer rows, built once

        def load_layer(layer: int) -> None:  # layer-wise loads: each layer once, before it is read
            if layer in loaded_layers:
                return
            loaded_layers.add(layer)
            parts = []
            for idx, loader in loaders.items():
                t_wait = time.perf_counter()
                got = loader.layer(layer)  # committed: blocks until loaded (or failed)
                load_wait[0] += time.perf_counter() - t_wait
                if got is None:
                    raise _LoadFailed(idx, loader.error)
                parts.append((got[0], got[1], plan.segments[idx].start))
            loaded_rows[0] = runner.write_rotated_segments(kv, layer, parts, loaded_rows[0])

        question_scores: dict[int, torch.Tensor] = {}  # segment -> [T_i] question attention to its tokens
        # fresh tokens before every reused chunk see only exact rows (system, tree, each other) in the
        # pre-pass as in the prefill proper: the prefill takes their pre-pass layers over (``_Lead``)
        first_reuse = min((sp.start for sp, a in zip(plan.segments, actions) if a is Action.REUSE), default=total)
        leading = sum(p < first_reuse for p in fresh_pos)
        # leading_fresh_dtype="bfloat16": the fresh chunks before the first reused one on the bfloat16 copies too
        # (approximate then: the tree path ends before them), where no other fresh segment leads
        lead_segments = [i for i, (sp, a) in enumerate(zip(plan.segments, actions))
                         if a is Action.FRESH and sp.start < first_reuse]
        lead_low = (mode is Mode.CACHEDRAG and cfg.precision.leading_fresh == "bfloat16" and first_reuse < total
                    and bool(lead_segments) and all(plan.segments[i].role == "chunk" for i in lead_segments)
                    and scoring_layers(runner, runner.n_layers) is not None)
        exact_segments = min(lead_segments[0], plan.exact_prefix_segments) if lead_low else plan.exact_prefix_segments
        lead = _Lead(rows=leading if self.share_lead_rows else 0, q_layers=frozenset(self.metadata_layers),
                     leading=leading, low=lead_low)
        if deferred and choice in QUESTION_CHOICES:
            # fresh rows after a reused chunk: left out of the pre-pass (computed once, by the prefill)
            # unless question_pass_fresh="all" or the runner's attention cannot hide them
            after = [p for p in fresh_pos if p > first_reuse]
            if after and cfg.question_pass_fresh == "leading" and not self._can_hide_rows():
                notes.append("question pre-pass computed the fresh chunks after reused ones too "
                             "(Triton or sliding-window attention cannot hide their rows)")
            elif after and cfg.question_pass_fresh == "leading":
                after = set(after)
            else:
                after = set()
            try:
                scores = self._question_scores(ids, kv, total, [p for p in fresh_pos if p not in after], question_pos,
                                               plan, deferred, load_layer, lead=lead, hidden=sorted(after))  # [T]
            except BaseException:
                for loader in loaders.values():
                    loader.close()
                raise
            question_scores = {i: scores[plan.segments[i].start:plan.segments[i].end] for i in deferred}
            if choice == "question+inter":  # fused with the variant's own inter-attention fractions (free)
                _fuse_inter(question_scores, plan, cfg.question_weight, device)
            if not by_deviation:
                tops = _pick_each([question_scores[i] for i in deferred], list(deferred.values()))
                for i, top in zip(deferred, tops):
                    recompute_pos[i] = sorted(plan.segments[i].start + j for j in top)
                deferred = {}
        probe_pos = [p for i in deferred for p in range(plan.segments[i].start, plan.segments[i].end)]
        compute = sorted(set(fresh_pos) | {p for ps in recompute_pos.values() for p in ps} | set(question_pos)
                         | set(probe_pos))
        n_lead = lead.rows if lead.hidden is not None else 0  # leading fresh rows the pre-pass computed
        positions = device_tensor(compute[n_lead:], device)  # [Tc] (the lead rows join at lead.layer)
        fresh_t = device_tensor(fresh_pos, device)  # [Tf]
        fresh_main = fresh_t[n_lead:]  # [Tf'] fresh rows this pass computes before the lead rows join
        bounds = [0]
        for s in segments:
            bounds.append(bounds[-1] + len(s))
        n_system = len(plan.system)
        chunk_seg = [i for i, sp in enumerate(plan.segments) if sp.role == "chunk"]

        capture = mode in (Mode.NAIVE, Mode.RANDOM, Mode.CACHEDRAG)  # variants: only modes that reuse them
        store_new = mode is not Mode.FULL
        raw_k = None
        if store_new and fresh_pos:
            raw_k = torch.empty(runner.n_layers, runner.n_kv_heads, len(fresh_pos), runner.head_dim,
                                dtype=self._store_dtype, device=device)  # [L, H_kv, Tf, D]
        meta_q: list[tuple[int, torch.Tensor]] = []  # metadata layers' fresh queries, for the hand-off
        fresh_chunk_rows = capture and any(
            actions[i] is Action.FRESH for i in chunk_seg)
        fresh_rows, rows_of = None, None  # rows of the fresh tokens in the compute set, for ``rows_of``
        tracker = None
        if (mode in (Mode.CACHEDRAG, Mode.RANDOM) and self.config.early_termination and (recompute_pos or deferred)
                and len(chunk_seg) > 1):
            tracker = FocusTracker.from_config(len(chunk_seg), self.config.cache)

        # The rows on bfloat16 copies: with recompute_dtype="bfloat16" the reused rows of the compute set; with
        # fresh_dtype="bfloat16" the fresh rows after the first reused chunk (``low_t``: every such row), and with
        # leading_fresh_dtype="bfloat16" those before it (``lead.low``)
        low_bf16 = cfg.precision.recompute == "bfloat16"
        fresh_bf16 = cfg.precision.fresh == "bfloat16"
        low_t = None
        fresh_low = [p for p in fresh_pos if (p > first_reuse and fresh_bf16) or (p < first_reuse and lead.low)]
        if mode is Mode.CACHEDRAG and (low_bf16 or fresh_low) and Action.REUSE in actions:
            reused = _reused_positions(plan, actions)
            low_t = device_tensor(sorted((reused if low_bf16 else []) + fresh_low), device)  # [Tlow]
        low_fresh = bool(fresh_low) and low_t is not None
        low_layers = scoring_layers(runner, runner.n_layers) if low_t is not None and low_t.numel() else None
        low_rows = False
        low_of = None  # the compute set ``low`` was built for
        low = low_last = None  # RowSplit of the low-precision rows of ``low_of`` (all of them, and the last row's)

        # 3. partial prefill, layer by layer
        t_prefill = time.perf_counter()
        paused = 0.0  # spent in between_layers (other requests' decode steps), not in this prefill
        hidden = runner.embed(ids[positions])  # [Tc, Dm]
        token_layers = 0
        focus_layer = None
        rope = runner.rotary.cos_sin(positions, runner.dtype, device)  # [Tc, D] each, shared by all layers
        blocks = runner.causal_blocks(positions, total)  # the attention's block-causal plan, shared likewise

        def narrow(keep: torch.Tensor) -> None:  # the compute set shrinks: rows, rope and attention plan follow
            nonlocal positions, hidden, rope, blocks
            positions, hidden, rope = positions[keep], hidden[keep], (rope[0][keep], rope[1][keep])
            blocks = runner.causal_blocks(positions, total)

        try:
            for layer in range(runner.n_layers):
                load_layer(layer)
                if n_lead and layer == lead.layer:  # the lead rows join with their pre-pass hidden states
                    positions = torch.cat([device_tensor(compute[:n_lead], device), positions])  # [Tc]
                    hidden = torch.cat([lead.hidden, hidden])  # [Tc, Dm]
                    rope = runner.rotary.cos_sin(positions, runner.dtype, device)
                    blocks = runner.causal_blocks(positions, total)
                    fresh_main = fresh_t
                    token_layers += n_lead * lead.layer
                if deferred and layer == check_layer:
                    unfocused = set() if tracker is None or tracker.decision is None else {
                        i for c, i in enumerate(chunk_seg) if not tracker.decision.is_focused(c)}
                    narrow(self._choose_deviating(layer, hidden, positions, rope, kv, plan, deferred, probe_pos,
                                                  recompute_pos, unfocused, question_scores))
                raw: dict = {}
                last = layer + 1 == runner.n_layers and not all_logits  # only the last row's output is read
                lw = None
                if low_layers is not None and low_of is not positions:
                    low_mask, low_of = torch.isin(positions, low_t), positions  # [Tc] rows on the bfloat16 copies
                    low, low_last = RowSplit(low_mask), RowSplit(low_mask[-tail_logits:])
                if low_layers is not None and low.low is not None:
                    lw = RowSplitLayer(runner.fast_layers[layer], low_layers[layer], low, low_last if last else low)
                    low_rows = True
                hidden = runner.forward_layer(layer, hidden, positions, kv, total, raw_out=raw, rope=rope, blocks=blocks,
                                              out_rows=slice(-tail_logits, None) if last else None, weights=lw)
                token_layers += positions.shape[0]
                if raw_k is not None and rows_of is not positions:  # fresh tokens are never dropped
                    fresh_rows, rows_of = _rows(positions, fresh_main), positions
                early = n_lead and layer < lead.layer  # the lead rows' K and q of this layer are the pre-pass's
                if raw_k is not None:
                    raw_k[layer, :, n_lead if early else 0:] = raw["k"][:, fresh_rows]  # [H_kv, Tf, D]
                    if early:
                        raw_k[layer, :, :n_lead] = lead.k[layer]  # [H_kv, Tl, D]
                if raw_k is not None and fresh_chunk_rows and layer in self.metadata_layers:
                    q_f = raw["q"][:, fresh_rows]  # [H_q, Tf, D] (a view when the rows are a range)
                    meta_q.append((layer, torch.cat([lead.q[layer], q_f], 1) if early else q_f))
                if tracker is not None and tracker.decision is None:
                    q_rows = torch.arange(positions.shape[0] - len(question_pos), positions.shape[0], device=device)
                    qm = runner.segment_attention_mass(layer, raw["q"][:, q_rows], positions[q_rows], kv, total, bounds)
                    per_chunk = qm.sum(0)[chunk_seg].tolist()  # question -> each chunk
                    decision = tracker.update(per_chunk)
                    if decision is not None and layer + 1 < runner.n_layers:
                        focus_layer = layer
                        drop = {p for c, i in enumerate(chunk_seg) if not decision.is_focused(c)
                                for p in recompute_pos.get(i, ())}
                        if drop:
                            narrow(torch.tensor([p not in drop for p in positions.tolist()], device=device))
                if between_layers is not None and layer + 1 < runner.n_layers:  # chunked prefill: others decode
                    t_pause = time.perf_counter()
                    between_layers(layer, int(positions.shape[0]))
                    paused += time.perf_counter() - t_pause
            for loader in loaders.values():
                self._observe_load(loader)
        finally:
            for loader in loaders.values():
                loader.close()
        load_s += load_wait[0]
        if all_logits:
            logits = runner.logits(hidden)  # [Tc, V]
        elif tail_logits > 1:
            logits = runner.logits(hidden[-tail_logits:])  # [tail_logits, V]
        else:
            logits = runner.logits(hidden[-1:])[0]  # [V] (the last layer computed only this row's output)
        kv.length = total
        prefill_s = time.perf_counter() - t_prefill - paused
        self._observe_prefill(prefill_s, token_layers - n_lead * (lead.layer or 0))  # the timed token-layers

        # 4. what to store (raw K + V of fresh segments, metadata for fresh chunks): ``_hand_off``,
        #    run by ``_prefill`` or, for a generation, once its first token is out
        hand_off = None
        if raw_k is not None:
            hand_off = _HandOff(actions, fresh_t, raw_k, kv, total, meta_q, bounds, n_system, chunk_seg,
                                capture, exact_segments)
        # truthful reuse: only tokens that reached the last layer were computed; the rest of the
        # prompt was served from cache (some of it probed at the lower layers: "checked")
        full_depth = set(positions.tolist())
        n_recomputed = len(full_depth - set(fresh_pos) - set(question_pos))
        chunk_actions = [actions[i] for i in chunk_seg]
        reused = [i for i, a in enumerate(actions) if a is Action.REUSE]
        used_choice = (None if not reused else "none" if mode is Mode.NAIVE
                       else "random" if mode is Mode.RANDOM else choice)
        approximations = []  # empty: the prefill equals full prefill of the served order
        if reused:
            approximations.append("chunk_reuse")
            if any(p not in full_depth for i in reused for p in range(plan.segments[i].start, plan.segments[i].end)):
                approximations.append(f"partial_recompute:{used_choice}")
            if focus_layer is not None:
                approximations.append("early_termination")
            if low_rows and low_bf16 and len(compute) > len(fresh_pos) + len(question_pos):  # reused rows computed
                approximations.append("recompute_bfloat16")
            if low_rows and low_fresh:
                approximations.append("fresh_bfloat16")
        info = {
            "prompt_tokens": total,
            "computed_tokens": len(full_depth),
            "cached_tokens": total - len(full_depth),
            "checked_tokens": len(compute) - len(full_depth),
            "computed_fraction": token_layers / (runner.n_layers * total),
            "fresh_tokens": len(fresh_pos),
            "recomputed_tokens": n_recomputed,
            "question_tokens": len(question_pos),
            "prefix_hit_tokens": sum(sp.n_tokens for sp, a in zip(plan.segments, actions) if a is Action.TREE),
            "chunks_hit": sum(a is not Action.FRESH for a in chunk_actions),
            "chunks_missed": sum(a is Action.FRESH for a in chunk_actions),
            "chunk_cfo": [plan.segments[i].cfo if actions[i] is Action.REUSE else None for i in chunk_seg],
            "chunk_recompute": [[p - plan.segments[i].start for p in recompute_pos.get(i, ())] for i in chunk_seg],
            "focus_layer": focus_layer,
            "load_s": load_s,
            "prefill_s": prefill_s,
            "segment_actions": [a.value for a in actions],
            "notes": notes,
            "token_choice": used_choice,
            "approximations": approximations,
        }
        return _Prefill(kv, logits, info, exact_segments=exact_segments), hand_off

    def _load_planned(self, plan, kv: KVBuffer, force_fresh: frozenset[int], notes: list[str]):
        """Each planned tree / variant segment into ``kv`` (whole entries now, or a layer-wise loader
        that reads ahead while layers compute); a segment whose entry is missing, damaged, of the
        wrong shape or failed before is computed fresh instead (said in ``notes``). Returns the
        segments' actions as executed, the loaders by segment index, and the seconds spent."""
        t_load = time.perf_counter()
        actions: list[Action] = []
        loaders: dict[int, object] = {}
        for idx, sp in enumerate(plan.segments):
            action = sp.action
            if action in (Action.TREE, Action.REUSE) and idx in force_fresh:
                notes.append(f"segment {sp.role}[{sp.index}]: cached entry failed while loading; computed fresh")
                action = Action.FRESH
            elif action in (Action.TREE, Action.REUSE) and self._layerwise:
                loader = self._open_loader(sp, notes)
                if loader is None:
                    action = Action.FRESH
                else:
                    loaders[idx] = loader
            elif action in (Action.TREE, Action.REUSE) and not self._load_whole(sp, kv, notes):
                action = Action.FRESH
            actions.append(action)
        return actions, loaders, time.perf_counter() - t_load

    def _load_whole(self, sp, kv: KVBuffer, notes: list[str]) -> bool:
        """One planned entry read whole into its rows of ``kv``; False (and a note) when it is
        missing, damaged or of the wrong shape (a wrong one is invalidated in the cache)."""
        entry = self.manager.load(sp.handle)
        wrong = None if entry is None else self._wrong_shape(entry.k.shape, entry.k.dtype, sp.n_tokens)
        if wrong is not None:
            self.manager.invalidate(sp.handle)
            notes.append(f"segment {sp.role}[{sp.index}]: cached entry has {wrong}; computed fresh")
            return False
        if entry is None:
            notes.append(f"segment {sp.role}[{sp.index}]: cached entry missing or damaged; computed fresh")
            return False
        self._write_entry(kv, entry, sp.start, sp.end)
        return True

    def _choose_deviating(self, layer: int, hidden, positions, rope, kv: KVBuffer, plan, deferred: dict[int, int],
                          probe_pos: list[int], recompute_pos: dict[int, list[int]], unfocused: set[int],
                          question_scores: dict[int, torch.Tensor] | None = None):
        """CacheBlend's token choice at ``layer`` (= check_layer): for each deferred segment, the
        ``deferred[i]`` tokens whose fresh K/V deviate most from the loaded cache go into
        ``recompute_pos``; the other probed tokens leave the compute set. Returns the keep
        mask ``[Tc]`` over ``positions``. Segments already ruled out by focused-chunk early
        termination keep none of their probe tokens. With ``question_scores``
        (``question+deviation``), the ranking is the weighted rank of both."""
        device = self.runner.device
        probe_t = device_tensor(probe_pos, device)  # [Tp], sorted
        rows = torch.searchsorted(positions, probe_t)  # [Tp] rows of probed tokens in the compute set
        dev = self.runner.kv_deviation(layer, hidden[rows], probe_t, kv, (rope[0][rows], rope[1][rows]),
                                       on=self.config.cache.deviation_on)  # [Tp]
        chosen: set[int] = set()
        offset = 0
        for i, count in deferred.items():
            sp = plan.segments[i]
            seg_dev = dev[offset:offset + sp.n_tokens]  # [T_i]
            offset += sp.n_tokens
            if i in unfocused:
                recompute_pos[i] = []
                continue
            if question_scores:
                w = self.config.cache.question_weight
                seg_dev = w * _rank01(question_scores[i]) + (1.0 - w) * _rank01(seg_dev)  # [T_i]
            top = _pick(seg_dev, count)
            recompute_pos[i] = sorted(sp.start + j for j in top)
            chosen.update(recompute_pos[i])
        drop = set(probe_pos) - chosen
        return torch.tensor([p not in drop for p in positions.tolist()], device=device)  # [Tc]

    def _can_hide_rows(self) -> bool:
        """Whether the question pre-pass can leave rows out (``hidden_keys`` of ``causal_blocks`` and
        ``segment_attention_mass``): not on the Triton backend, nor with sliding-window layers
        among the pass's, whose attention ignores block plans."""
        runner = self.runner
        last = max(self._question_layers())
        return runner.kernel_backend != "triton" and all(w is None for w in runner.windows[:last + 1])

    def _question_scores(self, ids: torch.Tensor, kv: KVBuffer, total: int, fresh_pos: list[int],
                         question_pos: list[int], plan, deferred: dict[int, int], load_layer,
                         lead: "_Lead | None" = None, hidden: Sequence[int] = ()) -> torch.Tensor:
        """The question's attention to every prompt position ``[T]`` (float32): the question and
        fresh tokens run through layers ``0..max(question_layers)`` against the loaded cache (the
        reused chunks' K re-rotated to their new positions); at each of ``question_layers`` the
        attention probability of every question token to each position, averaged over heads,
        is summed over question tokens and normalised to sum 1 over the deferred segments' tokens.
        Rows it writes (question and fresh tokens) are written again by the prefill proper, except
        ``lead.rows`` leading fresh rows (before every reused chunk, so computed as the prefill
        would): their raw K, metadata-layer queries and the hidden states entering the last scoring
        layer go into ``lead`` for the prefill to take over.
        Its projections run on bfloat16 copies of the weights (``CacheConfig.precision.question``,
        ``model/scoring.py``) unless fresh rows lead every reused chunk (``lead.leading``): those
        are the prefill's own rows and stay in the runner's precision, or go on the copies with
        every other row of the pass where the prefill computes them there (``lead.low``:
        ``CacheConfig.precision.leading_fresh="bfloat16"``).
        ``hidden``: positions of fresh rows left out of the pass (``CacheConfig.question_pass_fresh``
        "leading": fresh chunks after a reused one): zeroed in the buffer's pass layers and masked
        from every query's attention, as if those rows were absent (attention is position-free
        once K is rotated); the prefill writes them. Their scores are 0.
        The fidelity benchmark's oracle overrides this method."""
        runner = self.runner
        device = runner.device
        layers = self._question_layers()
        weights = None  # None: the runner's own projections
        if (lead is not None and lead.low) or (self.config.cache.precision.question == "bfloat16"
                                               and not (lead is not None and lead.leading)):
            weights = scoring_layers(runner, max(layers) + 1)
        rows = sorted(set(fresh_pos) | set(question_pos))
        last = max(layers)
        n_lead = lead.rows if lead is not None and last > 0 else 0
        graphs = self._question_pass_graphs()
        if graphs is not None and not hidden and not n_lead and all(w is None for w in runner.windows):
            for layer in range(last + 1):  # every layer the pass reads, loaded before the replay
                load_layer(layer)
            scores = graphs.scores(kv, ids, rows, len(question_pos),
                                   [(plan.segments[i].start, plan.segments[i].end) for i in deferred], total,
                                   layers, weights)  # [T] or None (too many rows: the pass below)
            if scores is not None:
                return scores
        pos = device_tensor(rows, device)  # [Tp]
        q_rows = torch.arange(pos.shape[0] - len(question_pos), pos.shape[0], device=device)  # question: the last rows
        inside = torch.zeros(total, dtype=torch.bool, device=device)  # [T]
        for i in deferred:
            inside[plan.segments[i].start:plan.segments[i].end] = True
        every = list(range(total + 1))  # one segment per position
        hidden_keys = hidden_idx = None
        if hidden:
            hidden_idx = device_tensor(list(hidden), device)  # [Th]
            hidden_keys = torch.zeros(total, dtype=torch.bool, device=device)  # [T]
            hidden_keys[hidden_idx] = True
        x = runner.embed(ids[pos])  # [Tp, Dm]
        rope = runner.rotary.cos_sin(pos, runner.dtype, device)  # [Tp, D] each
        blocks = runner.causal_blocks(pos, total, hidden_keys)
        scores = torch.zeros(total, dtype=torch.float32, device=device)  # [T]
        for layer in range(last + 1):
            load_layer(layer)
            if hidden_idx is not None:  # masked rows must be finite: 0 x NaN would still poison the attention
                kv.k[layer].index_fill_(1, hidden_idx, 0.0)  # rows of [H_kv, C, D]
                kv.v[layer].index_fill_(1, hidden_idx, 0.0)
            raw: dict = {}
            lw = weights[layer] if weights is not None else None
            if layer == last:  # the last scoring layer: its queries and K/V, not its output
                runner.write_layer(layer, x, pos, kv, raw_out=raw, rope=rope, weights=lw)
            else:
                x = runner.forward_layer(layer, x, pos, kv, total, raw_out=raw, rope=rope, blocks=blocks, weights=lw)
                if n_lead:
                    lead.k.append(raw["k"][:, :n_lead])  # [H_kv, Tl, D]
                    if layer in lead.q_layers:
                        lead.q[layer] = raw["q"][:, :n_lead]  # [H_q, Tl, D]
            if layer in layers:
                mass = runner.segment_attention_mass(layer, raw["q"][:, q_rows], pos[q_rows], kv, total, every,
                                                     hidden_keys=hidden_keys)  # [Tq, T]
                s = mass.sum(0).float()  # [T]
                scores += s / torch.where(inside, s, 0.0).sum().clamp_min(1e-12)  # (s[inside] waits for the GPU)
        if n_lead:
            lead.hidden, lead.layer = x[:n_lead], last  # [Tl, Dm]: the input of layer ``last``
        return scores  # [T]

    def _question_pass_graphs(self):
        """The padded static pre-pass (``model/question_graph.py``) per ``question_pass``, or None (eager)."""
        if self.question_pass == "eager":
            return None
        if self.question_pass not in ("cuda-graph", "static"):
            raise ConfigError(f"question_pass must be 'cuda-graph', 'static' or 'eager', got {self.question_pass!r}")
        capture = self.question_pass == "cuda-graph"
        if capture and self.runner.device.type != "cuda":
            raise ConfigError("question_pass='cuda-graph' needs a CUDA runner")
        graphs = self.question_graphs
        if graphs is None or graphs.capture != capture:
            from cachedrag.model.question_graph import QuestionPassGraphs

            graphs = self.question_graphs = QuestionPassGraphs(self.runner, capture=capture)
        return graphs

    @property
    def _store_dtype(self) -> torch.dtype:
        """dtype of chunk caches handed to the store (the runner's ``kv_store_dtype``)."""
        numerics = getattr(self.runner, "numerics", None)
        return numerics.store_dtype if numerics is not None else self.runner.dtype

    @property
    def _layerwise(self) -> bool:
        return self.config.layerwise_loading and hasattr(self.manager.store, "open_layers")

    def _open_loader(self, sp, notes: list[str]):
        """A layer loader for a planned segment, or None (miss, damaged, or not ready before the
        break-even time of recomputing it: then computing is faster than waiting)."""
        from cachedrag.store.preload import preload_depth

        runner = self.runner
        depth = None
        if self._t_prefill_layer is not None and self._t_load_layer is not None:
            depth = preload_depth(runner.n_layers, self._t_prefill_layer, self._t_load_layer)
        loader = self.manager.open_layers(sp.handle, runner.device, depth)
        if loader is None:
            notes.append(f"segment {sp.role}[{sp.index}]: cached entry missing; computed fresh")
            return None
        wrong = self._wrong_shape(loader.kv_shape, loader.kv_dtype, sp.n_tokens)
        if wrong is None and loader.meta.get("n_tokens") not in (None, str(sp.n_tokens)):
            wrong = f"n_tokens {loader.meta.get('n_tokens')!r} in its meta, not {sp.n_tokens}"
        if wrong is not None:
            loader.close()
            self.manager.invalidate(sp.handle)
            notes.append(f"segment {sp.role}[{sp.index}]: cached entry has {wrong}; computed fresh")
            return None
        if loader.layer(0, timeout=self._break_even_s(sp.n_tokens)) is None:
            error = loader.error
            loader.close()
            why = f"damaged ({error})" if error is not None else "not ready before its break-even time"
            notes.append(f"segment {sp.role}[{sp.index}]: cached entry {why}; computed fresh")
            return None
        return loader

    def _wrong_shape(self, shape, dtype, n_tokens: int) -> str | None:
        """Why a stored K/V of ``shape`` ``[L, H_kv, T, D]`` and ``dtype`` cannot fill a segment of
        ``n_tokens`` tokens in this model (a valid checksum proves integrity, not fit), or None."""
        r = self.runner
        want = (r.n_layers, r.n_kv_heads, n_tokens, r.head_dim)
        if tuple(shape) != want:
            return f"shape {list(shape)}, not [L, H_kv, T, D] = {list(want)}"
        if dtype != r.dtype:
            return f"dtype {dtype}, not {r.dtype}"
        return None

    def _break_even_s(self, n_tokens: int) -> float:
        """Estimated time to recompute ``n_tokens`` through every layer (measured throughput)."""
        per = self._t_token_layer if self._t_token_layer is not None else 1e-3
        return self.config.break_even_factor * per * n_tokens * self.runner.n_layers

    def _observe_prefill(self, seconds: float, token_layers: int) -> None:
        if token_layers <= 0:
            return
        per, layer = seconds / token_layers, seconds / self.runner.n_layers
        self._t_token_layer = per if self._t_token_layer is None else 0.8 * self._t_token_layer + 0.2 * per
        self._t_prefill_layer = layer if self._t_prefill_layer is None else 0.8 * self._t_prefill_layer + 0.2 * layer

    def _observe_load(self, loader) -> None:
        t = loader.mean_layer_seconds
        if t is not None:
            self._t_load_layer = t if self._t_load_layer is None else 0.8 * self._t_load_layer + 0.2 * t

    def _write_entry(self, kv: KVBuffer, entry, start: int, end: int) -> None:
        k = entry.tensors["k"].to(self.runner.device, non_blocking=True)  # [L, H_kv, T, D] raw
        v = entry.tensors["v"].to(self.runner.device, non_blocking=True)  # [L, H_kv, T, D]
        self.runner.write_rotated(kv, k, v, start)

    def _hand_off(self, plan, keys: list[str], h: _HandOff) -> None:
        """Store what the request computed fresh: the chunks' attention metadata (segment masses of
        the fresh rows' queries at the metadata layers, against the buffer's keys: the same values
        as inside the layer loop, since a layer's K rows are final once it ran), the entries' copies
        and the manager's admission. Off the first token's path when deferred (``_run``)."""
        fresh_mass = None
        for layer, q in h.meta_q:
            m = self.runner.segment_attention_mass(layer, q, h.fresh_t, h.kv, h.total, h.bounds)  # [Tf, S]
            fresh_mass = m if fresh_mass is None else fresh_mass + m
        new_entries = self._new_entries(plan, h.actions, keys, h.raw_k, h.kv, fresh_mass, h.n_system, h.chunk_seg,
                                        h.capture, h.exact)
        if new_entries:
            self.manager.admit(plan, keys, new_entries, exact=h.exact)

    def _new_entries(self, plan, actions, keys, raw_k, kv, fresh_mass, n_system, chunk_seg,
                     capture, exact: int) -> list[NewEntry]:
        from cachedrag.store.entry import KVEntry

        offset = 0
        out = []
        row_of = {}
        for i, (sp, action) in enumerate(zip(plan.segments, actions)):
            if action is not Action.FRESH:
                continue
            row_of[i] = offset
            offset += sp.n_tokens
        for i, r0 in row_of.items():
            sp = plan.segments[i]
            k = raw_k[:, :, r0:r0 + sp.n_tokens].contiguous()  # [L, H_kv, T, D]
            v = kv.v[:, :, sp.start:sp.end].to(self._store_dtype, copy=True)  # [L, H_kv, T, D]
            handle = path_key(keys[: i + 1])
            meta = None
            if capture and sp.role == "chunk" and fresh_mass is not None:
                meta = self._metadata(i, sp, fresh_mass[r0:r0 + sp.n_tokens], keys, n_system, chunk_seg)
            entry = KVEntry(*entry_payload(self.model_namespace.digest, keys[: i + 1], sp.role, i < exact, k, v, meta))
            out.append(NewEntry(segment=i, handle=handle, entry=entry, nbytes=entry.nbytes, meta=meta))
        return out

    def _metadata(self, i: int, sp, mass: torch.Tensor, keys, n_system: int, chunk_seg) -> AttentionMetadata:
        """Inter/intra attention of fresh chunk ``i`` from its tokens' segment masses ``[T, S]``."""
        prior = [j for j in chunk_seg if j < i]
        prior_mass = mass[:, prior] if prior else torch.zeros(mass.shape[0], 1, device=mass.device)  # [T, P]
        intra_t = mass[:, i]  # [T]
        inter_t = prior_mass.sum(-1)  # [T]
        token_inter_t = inter_t / (inter_t + intra_t).clamp_min(1e-12)  # [T]
        means = torch.stack([prior_mass[:, c].mean() for c in range(len(prior))] + [intra_t.mean()])  # [P + 1]
        values = torch.cat([token_inter_t, means.to(token_inter_t.dtype)]).tolist()  # one read of the device
        t = token_inter_t.shape[0]
        inter = {keys[j]: values[t + c] for c, j in enumerate(prior)}
        return AttentionMetadata(
            prefix_keys=tuple(keys[j] for j in prior), inter=inter, intra=values[-1], token_inter=values[:t],
        )


def _call_each(calls: list[Callable[[], None]]) -> None:
    for call in calls:
        call()
