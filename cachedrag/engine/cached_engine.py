"""``CachedEngine``: the chunk-cache engine's facade, plan -> load -> partial prefill -> decode -> store.

Owns the public API (``generate``, ``generate_segments``, ``score``, ``prefill`` and its task form
``prefill_task``, the exact continuation, ``preload_chunks``) and the request path's order of stages,
each in the module named for its technique:

    layout      segments -> system / chunks / question, order-aware reuse, the plan request
    (plan)      ``ChunkCacheManager.plan`` (``cachedrag.kvcache``)
    exact       exact repeats, the first-token and decode tie guards, promotion, exact continuation
    prefill     the plan executed layer by layer (a generator the caller advances: ``PrefillTask``)
      load        cached KV into the buffer, re-rotation, layer-wise loaders, the cost model
      selection   token scorers (question, inter, deviation, leading) and their fusion
      question    the question pre-pass
      precision   which rows run on the bfloat16 copies
      handoff     what was computed fresh, to the cache manager
    result      stats and result types
    decoding    the decode tail of ``generate`` (sampling in ``cachedrag.model``)

Does not own: decisions (``cachedrag.kvcache.planner`` via ``ChunkCacheManager``), storage tiers
(``cachedrag.store``), prompt layout (``cachedrag.prompt``), or sampling (``cachedrag.model.generation``).
The request path keeps all state in locals, so concurrent ``generate`` calls from several threads are
safe (shared state is behind the manager's locks).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence

import torch

from cachedrag.config import EngineConfig
from cachedrag.errors import ConfigError
from cachedrag.fingerprint import namespace_for
from cachedrag.kvcache.manager import ChunkCacheManager
from cachedrag.kvcache.planner import MODES, Mode
from cachedrag.model.generation import SamplingParams, eos_token_ids
from cachedrag.model.runner import KVBuffer, ModelRunner
from cachedrag.model.textgen import check_context
from cachedrag.prompt import PromptBuilder, Segment
from cachedrag.engine import exact, handoff, precision, question
from cachedrag.engine.decoding import run_request
from cachedrag.engine.layout import lay_out
from cachedrag.engine.load import LoadCosts
from cachedrag.engine.prefill import PrefillTask, Steps, drive, execute_plan
from cachedrag.engine.result import GenerationStream, Prefilled, _Holder
from cachedrag.engine.state import _HandOff, _Lead, _Prefill
from cachedrag.engine.continuation import follow as follow_conversation

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
        self.costs = LoadCosts()  # measured costs: preload depth and the recompute-vs-wait break-even point
        # the prefill takes over the question pre-pass's leading fresh rows (``_Lead``); False: it
        # recomputes them (the reference path of the equivalence tests)
        self.share_lead_rows = True
        # the request's KV buffer is left uninitialised (every prompt row is loaded or computed before
        # any layer reads it, decode rows are written before they are read); a number fills it first
        # (0.0: the reference path of the equivalence tests; NaN there proves no unwritten row is read)
        self.buffer_fill: float | None = None
        # the question pre-pass: "eager" op by op in ``_question_scores`` (the default, and the reference);
        # "cuda-graph" replays it from graphs captured per buffer and row bucket (model/question_graph.py;
        # opt-in on CUDA until a GPU run proves it equal, docs/notes/gpu.md); "static" runs that padded pass
        # eagerly (its CPU check)
        self.question_pass = "eager"
        self.question_graphs = None  # QuestionPassGraphs once a padded pass ran (its captures, passes, failure)
        n = runner.n_layers
        k = min(self.config.metadata_layers, n)
        self.metadata_layers = sorted({round(1 + j * (n - 2) / max(1, k - 1)) if n > 2 else j for j in range(k)})
        self._prepare_question_pass()

    def _prepare_question_pass(self) -> None:
        """The bfloat16 weight copies this engine's default will use, built now (``precision.prepare``)."""
        precision.prepare(self)

    def _question_layers(self) -> list[int]:
        """The layers whose question attention ranks reused tokens (``question.question_layers``)."""
        return question.question_layers(self)

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
                          stream: bool = False, start: float | None = None, teacher: Sequence[int] | None = None,
                          conversation: bool = False):
        """Generate after an arbitrary segment layout (see ``PromptBuilder.text_segments``).

        ``conversation`` (a chat's or an agent's step, whose next step extends this prompt and
        answer): the prompt as served and the answer are stored as one tree path after decoding,
        so the next step is a prefix hit up to its new messages (``continuation``).

        ``teacher``: token ids of a reference answer (at most ``max_new_tokens``); after
        generating, the same prefilled KV scores it teacher-forced and ``result.teacher_logits``
        holds the logits ``[A, V]`` predicting each of its tokens (fidelity measurements).
        """
        start = time.perf_counter() if start is None else start
        mode = self._mode(mode)
        if teacher is not None and (stream or not 0 < len(teacher) <= params.max_new_tokens):
            raise ConfigError("teacher needs stream=False and 1..max_new_tokens token ids")
        holder = _Holder()
        deltas = self._run(list(segments), params, mode, start, holder, teacher, rewind=not stream,
                           conversation=conversation)
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
        ``EngineResult`` fields of the prefill); the caller decodes (``ModelRunner.decode_batch``).
        ``between_layers(layer, tokens)`` is called after each layer of the partial prefill
        (``tokens``: positions that layer computed; ``prefill_task`` hands the same boundaries to a
        caller that advances the prefill itself, as the serving loop does). It must not touch this
        request's buffer; its time is left out of ``prefill_s`` and the engine's cost model.
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
        return _prefilled(pre)

    def prefill_task(self, segments: Sequence[Segment], max_new_tokens: int, mode: str | None = None,
                     defer_store: bool = False, exact: bool = False, conversation: bool = False) -> PrefillTask:
        """``prefill`` as a task the caller advances layer by layer (``PrefillTask``: ``advance()``
        returns after each layer but the last; its ``result`` is the ``Prefilled``): the serving loop
        runs other work between layers instead of being called back from inside the prefill.
        ``conversation``: as in ``generate_segments`` (the leading segments follow the conversation's
        stored paths, approximate ones included); the caller stores the answer
        (``continuation.remember`` with ``Prefilled.segments`` and ``exact_segments``)."""
        steps = self._prefill_steps(list(segments), self._mode(mode), max_new_tokens, defer_store=defer_store,
                                    exact_plan=exact, conversation=conversation)
        return PrefillTask(_as_prefilled(steps))

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
        task = self.exact_continuation_task(segments, answer, max_new_tokens, stop_at_disagreement)
        return task.run(between_layers)

    def exact_continuation_task(self, segments: Sequence[Segment], answer: Sequence[int], max_new_tokens: int,
                                stop_at_disagreement: bool = False) -> PrefillTask:
        """``prefill_exact_continuation`` as a task the caller advances (its ``result``: the ``Prefilled``)."""
        answer = list(answer)
        if not 0 < len(answer) < max_new_tokens:
            raise ConfigError("an exact continuation needs 1..max_new_tokens-1 answer tokens")
        steps = exact.exact_continuation(self, list(segments), answer, max_new_tokens, answer_rows="decode",
                                         stop_at_disagreement=stop_at_disagreement)
        return PrefillTask(_continued(steps, answer))

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
             teacher: Sequence[int] | None = None, rewind: bool = False, conversation: bool = False):
        """The request path of ``generate_segments``: prefill, decode (yielding text deltas), result
        (``decoding.run_request``). ``rewind``: nobody sees the deltas (not streamed). ``conversation``:
        the prompt and answer are stored as a tree path at the end (``continuation``)."""
        pre = self._prefill(segments, mode, params.max_new_tokens, defer_store=True, conversation=conversation)
        yield from run_request(self, pre, segments, params, mode, start, holder, teacher, rewind, conversation)

    def _teacher_forced(self, pre: _Prefill, start: int, teacher: list[int]) -> torch.Tensor:
        """Logits ``[A, V]`` predicting ``teacher[j]`` after the prefilled prompt and
        ``teacher[:j]``: one pass over ``teacher[:-1]`` on the request's buffer (decoding wrote
        only rows >= ``start``; this pass overwrites them in causal order)."""
        with torch.inference_mode():
            rows = [pre.logits[None].float()]  # [1, V]
            if len(teacher) > 1:
                ids = torch.tensor(teacher[:-1], device=self.runner.device)
                pos = torch.arange(start, start + len(teacher) - 1, device=self.runner.device)
                rows.append(self.runner.prefill(ids, pos, kv=pre.kv, kv_len=start + len(teacher) - 1,
                                                all_logits=True))
            return torch.cat(rows, 0)  # [A, V]

    def _prefill(self, segments: list[Segment], mode: Mode, max_new_tokens: int, all_logits: bool = False,
                 between_layers: Callable[[int, int], None] | None = None, defer_store: bool = False,
                 exact_plan: bool = False, tail_logits: int = 1, conversation: bool = False) -> _Prefill:
        """``_prefill_steps`` run to the end, ``between_layers(layer, tokens)`` after each layer but the last."""
        return drive(self._prefill_steps(segments, mode, max_new_tokens, all_logits, defer_store, exact_plan,
                                         tail_logits, conversation), between_layers)

    @torch.inference_mode()
    def _prefill_steps(self, segments: list[Segment], mode: Mode, max_new_tokens: int, all_logits: bool = False,
                       defer_store: bool = False, exact_plan: bool = False, tail_logits: int = 1,
                       conversation: bool = False) -> Steps:
        """Lay out, plan, load and prefill, yielding between layers (``prefill.PrefillTask``). What the
        request computed fresh is handed to the cache manager before returning, or with ``defer_store``
        left in ``pre.hand_off`` for the caller to run once the first token is out: the KV rows and
        queries it reads stay untouched until then. Exact repeats and the first-token guard
        (``exact``) may plan the request exactly instead; ``pre.promote`` computes a recurring
        sequence's exact path later. ``exact_plan``: plan as prefix caching, in the given order (a
        promotion, the tie guard during decoding). ``tail_logits`` > 1: ``pre.logits`` holds the last
        that many positions' logits ``[tail_logits, V]``. The leading segments are first re-cut along
        the longest tree path that is a token prefix of the prompt (``continuation.follow``: a
        conversation's earlier steps; their approximate paths too with ``conversation``)."""
        segments, followed_approximate = follow_conversation(self, segments, mode, conversation and not exact_plan)
        layout = lay_out(segments, mode, exact_plan, self.config.order_aware, self.manager)
        check_context(self.runner, layout.total, max_new_tokens)
        plan = self.manager.plan(layout.request, Mode.PREFIX if exact_plan and mode is not Mode.FULL else mode)
        plan, repeat = exact.exact_repeat(self.manager, self.config.cache, plan, layout.request, exact_plan)
        t_first = time.perf_counter()

        def run(p) -> Steps:
            return execute_plan(self, p, layout.segments, layout.context, mode, max_new_tokens, all_logits,
                                tail_logits)

        pre, hand_offs = yield from run(plan)
        plan, pre, hand_offs, guard = yield from exact.first_token_guard(self, mode, exact_plan, layout.request,
                                                                         plan, pre, hand_offs, t_first, run)
        if guard["tie_guard"] is not None:
            repeat = None  # the exact prefill stored the exact path: nothing left to promote
        if hand_offs:
            call = functools.partial(_call_each, hand_offs)
            if defer_store:
                pre.hand_off = call
            else:
                call()
        if self._layerwise:
            self.manager.prefetch(plan)  # promote what this request reused (background; layer loads do not promote)
        pre.info["chunk_order"] = layout.chunk_order
        pre.info["exact_repeat"] = repeat
        pre.info.update(guard)
        pre.segments = layout.segments
        if repeat == "promote":
            pre.promote = exact.Promotion(self, layout.segments, mode)
        if layout.chunk_order is not None:
            pre.info["approximations"].insert(0, "reordered")
        if followed_approximate:
            pre.info["approximations"].insert(0, "conversation_prefix")
        return pre

    def near_tie(self, logits: torch.Tensor, threshold: float) -> tuple[bool, float]:
        """Whether the top-2 logits of ``logits`` ``[V]`` are a near tie at ``threshold`` nats, allowing
        for one rounding unit of the runner's dtype (``exact.near_tie``), and the gap as read."""
        return exact.near_tie(self, logits, threshold)

    def _question_scores(self, ids: torch.Tensor, kv: KVBuffer, total: int, fresh_pos: list[int],
                         question_pos: list[int], plan, deferred: dict[int, int], load_layer,
                         lead: _Lead | None = None, hidden: Sequence[int] = ()) -> torch.Tensor:
        """The question's attention to every prompt position ``[T]`` (``question.question_scores``).
        The one override point of the token choice's measurements (the fidelity benchmark's oracle)."""
        return question.question_scores(self, ids, kv, total, fresh_pos, question_pos, plan, deferred, load_layer,
                                        lead=lead, hidden=hidden)

    def _can_hide_rows(self) -> bool:
        return question.can_hide_rows(self)

    def _hand_off(self, plan, keys: list[str], h: _HandOff) -> None:
        """Store what the request computed fresh (``handoff.hand_off``); off the first token's path when deferred."""
        handoff.hand_off(self, plan, keys, h)

    @property
    def _store_dtype(self) -> torch.dtype:
        """dtype of chunk caches handed to the store (the runner's ``kv_store_dtype``)."""
        numerics = getattr(self.runner, "numerics", None)
        return numerics.store_dtype if numerics is not None else self.runner.dtype

    @property
    def _layerwise(self) -> bool:
        return self.config.layerwise_loading and hasattr(self.manager.store, "open_layers")


def _prefilled(pre: _Prefill) -> Prefilled:
    return Prefilled(kv=pre.kv, logits=pre.logits, info=pre.info, hand_off=pre.hand_off, promote=pre.promote,
                     segments=pre.segments, exact_segments=pre.exact_segments)


def _as_prefilled(steps: Steps) -> Steps:
    return _prefilled((yield from steps))


def _continued(steps: Steps, answer: list[int]) -> Steps:
    return exact.continuation_prefilled((yield from steps), answer)


def _call_each(calls: list[Callable[[], None]]) -> None:
    for call in calls:
        call()
