"""Settings of the chunk-cache policy layer, validated once.

Owns: ``CacheConfig``, the one place every threshold of the policy layer lives (Cache-Craft's
alpha, variant caps N x M, the f_r guard, the fixed recompute ratio, token choice, the tree's
replacement policy, the seed of the ``random`` mode), with one validated group per mechanism:
``RowPrecision`` (``precision``: which rows run on bfloat16 copies), ``ExactFallback``
(``exact``: every "run the exact prefix plan instead" rule) and ``FocusConfig`` (``focus``:
focused-chunk early termination). A former flat name (``MOVED``) is refused with one line that
names its new place.
Does not own: byte budgets of the tiers (the store's config), model or retrieval settings.

Every field is checked in ``__post_init__``; a bad value raises ``ConfigError`` naming the
field, the value and the allowed range. ``dataclasses.replace(cfg, alpha=2.0)`` re-validates;
``cfg.replace(exact={"tie_guard": 0.25})`` updates only the named fields of a group.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from cachedrag.errors import ConfigError
from cachedrag.kvcache.policy import POLICY_NAMES, canonical_policy_name


TOKEN_CHOICES = ("deviation", "inter", "leading", "question", "question+deviation", "question+inter")
#: token choices that rank reused tokens by the question's attention (a pre-pass of the question)
QUESTION_CHOICES = ("question", "question+deviation", "question+inter")
#: precisions a row group's projections may run in (``RowPrecision``)
ROW_DTYPES = ("float32", "bfloat16")
#: which fresh rows the question pre-pass computes (``CacheConfig.question_pass_fresh``)
QUESTION_PASS_FRESH = ("leading", "all")
#: when a recurring chunk sequence gets its exact tree path (``ExactFallback.repeats_when``)
EXACT_REPEAT_TIMINGS = ("after_response", "inline", "after_response_else_inline")


def _check_number(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"CacheConfig.{name} must be a finite number, got {value!r}")
    lo_ok = value > lo if lo_open else value >= lo
    hi_ok = value < hi if hi_open else value <= hi
    if not (lo_ok and hi_ok):
        left = "(" if lo_open else "["
        right = ")" if hi_open else "]"
        raise ConfigError(f"CacheConfig.{name} must be in {left}{lo}, {hi}{right}, got {value!r}")


def _check_int(name: str, value: Any, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"CacheConfig.{name} must be an integer, got {value!r}")
    if value < lo:
        raise ConfigError(f"CacheConfig.{name} must be >= {lo}, got {value!r}")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"CacheConfig.{name} must be one of {list(choices)}, got {value!r}")


def _group_from_dict(cls, group: str, data: Any):
    """A settings group from a mapping; unknown keys are an error naming the group."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"CacheConfig.{group} must be a {cls.__name__} or a mapping, got {data!r}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"CacheConfig.{group}: unknown setting(s) {unknown}; known: {sorted(known)}")
    return cls(**data)


@dataclass(frozen=True)
class RowPrecision:
    """Which rows of a reuse prefill run their projections (q/k/v, output, MLP) on bfloat16 copies
    of the weights (``model/scoring.py``; fp32 accumulation; the residual stream, norms, RoPE and
    attention stay in the runner's precision). Each field is ``"bfloat16"`` or ``"float32"`` (the
    runner's own weights: the reference path). bfloat16 applies to a float32 runner with fused fast
    layers only; any other runner computes in its own precision. System and question rows always
    keep the runner's precision. Measured trade-offs: docs/notes/fidelity.md.

      question: the question pre-pass that ranks reused tokens (question token choices). It only
        ranks; a request whose fresh chunks lead every reused one runs it in the runner's precision,
        because the prefill takes those rows over and they must be exact.
      recompute: the rows recomputed (and probed) for reused chunks: they only repair approximate
        cached K/V.
      fresh: fresh rows after the first reused chunk: they attend to approximate K/V already.
        Reported as the approximation ``fresh_bfloat16``.
      leading_fresh: fresh chunk rows before the first reused chunk, in the question pre-pass and
        the prefill. In float32 they are exact and stored as a tree path (the tie guard's exact
        prefill takes them over); in bfloat16 they are approximate, stored as chunk variants, and an
        exact prefill computes them again. Applies only where every fresh segment before the first
        reused one is a chunk. Reported as ``fresh_bfloat16``.
    """

    question: str = "bfloat16"
    recompute: str = "bfloat16"
    fresh: str = "bfloat16"
    leading_fresh: str = "float32"

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_choice(f"precision.{f.name}", getattr(self, f.name), ROW_DTYPES)


@dataclass(frozen=True)
class ExactFallback:
    """When a request runs the exact prefix plan (tree prefix, the rest fresh, its path stored, as
    prefix caching does) instead of an approximate one. All apply to the ``cachedrag`` mode.

      tie_guard: 0 = off. > 0: an approximate prefill whose first token's top-2 logits are closer
        than this many nats is prefilled again exactly, so the answer is full prefill's; that
        request's TTFT pays both prefills. Missed chunks computed before the first reused one are
        exact already: they are stored first and the exact prefill takes them from the tree.
      tie_guard_decode: 0 = off. > 0: while an answer decodes on an approximate prefill's KV, the
        first later token whose top-2 logits are closer than this many nats is not chosen from
        them: the prompt and the answer so far are prefilled exactly and decoding goes on from
        that KV (once per answer; ``EngineResult.tie_guard_switch`` says at which token).
        ``math.inf``: every approximate answer switches before its second token. Independent of
        ``tie_guard``.
      repeats: 0 = off. n >= 1: the n-th time one chunk sequence (system + chunk segments, in
        prompt order) is served from reuse, its exact tree path is computed and stored, so later
        sightings are exact prefix hits (``repeats.py``).
      repeats_when: ``EXACT_REPEAT_TIMINGS``. "after_response": the n-th sighting is still served
        from reuse and the path is computed once its answer is out (``generate`` runs it before
        returning; ``prefill`` hands it over as ``Prefilled.promote``). "inline": the n-th sighting
        itself is prefilled exactly. "after_response_else_inline" (``cachedrag serve``'s default):
        as "after_response", and a later sighting whose promotion never ran is prefilled exactly
        inline.
      repeat_memory: chunk-sequence fingerprints remembered (least recently seen forgotten
        first). >= 1.
    """

    tie_guard: float = 0.0
    tie_guard_decode: float = 0.0
    repeats: int = 2
    repeats_when: str = "after_response"
    repeat_memory: int = 10_000

    def __post_init__(self) -> None:
        _check_number("exact.tie_guard", self.tie_guard, 0.0, math.inf, hi_open=True)
        if self.tie_guard_decode != math.inf:  # inf: every approximate answer switches before its second token
            _check_number("exact.tie_guard_decode", self.tie_guard_decode, 0.0, math.inf, hi_open=True)
        _check_int("exact.repeats", self.repeats, 0)
        _check_choice("exact.repeats_when", self.repeats_when, EXACT_REPEAT_TIMINGS)
        _check_int("exact.repeat_memory", self.repeat_memory, 1)


@dataclass(frozen=True)
class FocusConfig:
    """Focused-chunk early termination (``focus.py``, Cache-Craft Algorithm 1).

      window (w): the focused set must stay the same for w consecutive layer updates. >= 1.
      min_layers: never decide before this many layers have been fed. >= 1.
      mass_threshold: the focused set is the smallest set of chunks, by cumulative question
        attention, holding at least this share of the total. In (0, 1].
    """

    window: int = 3
    min_layers: int = 4
    mass_threshold: float = 0.8

    def __post_init__(self) -> None:
        _check_int("focus.window", self.window, 1)
        _check_int("focus.min_layers", self.min_layers, 1)
        _check_number("focus.mass_threshold", self.mass_threshold, 0.0, 1.0, lo_open=True)


#: the settings groups of ``CacheConfig``: field name -> group class
GROUPS = {"precision": RowPrecision, "exact": ExactFallback, "focus": FocusConfig}
#: former flat ``CacheConfig`` fields -> where they live now (a config naming one gets one clear line)
MOVED = {"question_dtype": "precision.question", "recompute_dtype": "precision.recompute",
         "fresh_dtype": "precision.fresh", "leading_fresh_dtype": "precision.leading_fresh",
         "tie_guard": "exact.tie_guard", "tie_guard_decode": "exact.tie_guard_decode",
         "exact_repeats": "exact.repeats", "exact_repeats_when": "exact.repeats_when",
         "repeat_memory": "exact.repeat_memory", "focus_window": "focus.window",
         "focus_min_layers": "focus.min_layers", "focus_mass_threshold": "focus.mass_threshold"}


def moved_setting(name: str, prefix: str = "CacheConfig.") -> str:
    """The one-line error for a former flat setting ``name`` (a key of ``MOVED``)."""
    group, field_name = MOVED[name].split(".")
    return (f"{prefix}{name} is now {prefix}{MOVED[name]} (nested: "
            f"{{\"{group}\": {{\"{field_name}\": ...}}}})")


@dataclass(frozen=True)
class CacheConfig:
    """Thresholds of the chunk-cache policy layer.

    Cache-Craft reuse (see ``variants.py`` for the formulas):
      alpha: scale of CFO = alpha x CCI x (1 - beta'); CFO is clipped to [0, 1]. >= 0.
      cold_cci: CCI assumed for a variant computed with no prior chunk (right after the system
        prefix) when it is reused behind other chunks: its metadata cannot say how much context
        it would have absorbed. 0.15 follows the prototype, where recomputing ~15% of each
        non-first chunk cut KL(full || reuse) from 0.082 to 0.025. In [0, 1].
      reuse_cfo_limit: a chunk whose best CFO is >= this is computed fresh instead of reused
        (loading a cache and recomputing all of it is slower than computing it). In (0, 1].
      min_reuse_tokens: template text between chunks (a text segment among the chunks, e.g. the
        ``"\n\n"`` separators that server prompts leave as segments of their own) shorter than this
        is computed fresh, never reused: reusing it saves nothing, but each reused one made the
        request a reuse request (question pre-pass, approximated boundary tokens, no exact tree path
        past it). Computed, an all-miss request is a plain prefill that stores its exact path.
        Retrieved chunks are reused at any length. 0 = off (the reference behaviour). >= 0.
      recompute_ratio: None = per-chunk ceil(CFO x len) recompute (Cache-Craft); a number = fixed
        global ratio, ceil(ratio x len) tokens of every reused chunk (token choice unchanged).
        [0, 1]. Default 0.27: the measured frontier's pick (docs/notes/fidelity.md): the first ratio past
        teacher-forced top-1 0.98 and ROUGE-L 0.90 vs full prefill on ``bench ttft``, at x_prefix 2.07
        in that run (0.3: 1.86; 0.2, the previous default: 2.40 at ROUGE-L 0.86).
      token_choice: which tokens of a reused chunk are recomputed (the count is always
        ceil(CFO x len), or the fixed ratio):
          "deviation"  CacheBlend's selection: the engine computes the layers below
                       ``check_layer`` for every reused token, measures how far each token's
                       fresh K/V at ``check_layer`` is from the cached K/V, and recomputes the
                       tokens that deviate most through the remaining layers. Costs
                       ``check_layer`` / L of a full pass over the reused tokens.
          "inter"      Cache-Craft's selection: the top ``token_inter`` of the variant (the
                       tokens that attended most to prior chunks when it was computed); free.
          "leading"    the chunk's first tokens (where the context change hits first); free.
          "question"   ProphetKV / QCFuse idea: the tokens the *question* attends to most. Before
                       the prefill, the question tokens (and fresh segments) run through layers
                       ``0..max(question_layers)`` against the loaded, re-rotated cache; their
                       attention probability to each reused token, summed over question tokens
                       and the ``question_layers``, ranks the tokens. Costs a few layers of the
                       question only; no probe of the reused tokens.
          "question+deviation"  both rankings fused: weighted rank
                       ``question_weight x rank(question) + (1 - question_weight) x rank(deviation)``
                       (costs the deviation probe plus the question pre-pass).
          "question+inter"  weighted rank of the question ranking and the variant's
                       ``token_inter`` (free: no probe), ``question_weight`` as above.
        Default ``question+inter``: the lowest teacher-forced KL of every real choice at 20-50%
        recompute on the measured frontier (SmolLM2-135M, stdlib + GNU info, 2 seeds,
        docs/notes/fidelity.md).
      check_layer: the layer whose K/V deviation picks the tokens (``token_choice="deviation"``),
        >= 1; a model with no more layers than this recomputes by ``leading`` instead.
      deviation_on: what the deviation measures: "v" (default), "k" (rotated K, as CacheBlend)
        or "kv" (both). On SmolLM2-135M V ranked best (KL 0.087 at 15% vs 0.102 for K and K+V).
      question_layers: layers whose question attention ranks reused tokens (question choices),
        each >= 0; summed after normalising each layer's mass over the reused tokens.
      precision: which rows run their projections on bfloat16 copies of the weights
        (``RowPrecision``).
      question_pass_fresh: which fresh (missed) rows the question pre-pass computes besides the
        question: "leading" (default) only those before every reused chunk (the prefill takes them
        over, ``engine._Lead``: computed once); fresh chunks after a reused one are left out of
        the pass, the question's attention there skips their rows, and the prefill computes them
        once. "all" (the reference behaviour) computes those too, against the uncorrected cache,
        so the ranking sees them, and the prefill computes them again (their rows cannot be taken
        over: in the prefill they see the recomputed rows before them). Only the ranking differs:
        on ``bench ttft``'s stream (docs/notes/fidelity.md, round 8) mean TTFT -4%, teacher-forced top-1 and
        KL unchanged (0.985 / 0.003), ROUGE-L vs full 0.924 -> 0.919 (one near tie flipped).
        A Triton or sliding-window runner computes them ("all"; noted in the result).
      question_weight: weight of the question ranking in ``question+deviation`` and
        ``question+inter``. In [0, 1].

    Exact fallbacks (``ExactFallback``): when a request runs the exact prefix plan instead of an
    approximate one (the first-token and decode tie guards, exact repeats).

    Variant registry (``index.py``):
      max_chunks (N), max_variants_per_chunk (M): at most M variants per chunk and N x M in all.
      cfo_floor: each reuse adds 1 / max(CFO, cfo_floor) to the variant's f_r (CFO may be 0).

    Focused-chunk early termination (``FocusConfig``, ``focus.py``).

    Knowledge tree (``tree.py``): policy, one of ``policy.POLICY_NAMES``.
    seed: seeds the ``random`` planning mode and the simulator's defaults.
    """

    alpha: float = 1.0
    cold_cci: float = 0.15
    reuse_cfo_limit: float = 1.0
    min_reuse_tokens: int = 8
    recompute_ratio: float | None = 0.27
    token_choice: str = "question+inter"
    check_layer: int = 1
    deviation_on: str = "v"
    question_layers: tuple[int, ...] = (4, 8, 12, 16)
    question_pass_fresh: str = "leading"
    question_weight: float = 0.5
    precision: RowPrecision = field(default_factory=RowPrecision)
    exact: ExactFallback = field(default_factory=ExactFallback)
    max_chunks: int = 10_000
    max_variants_per_chunk: int = 4
    cfo_floor: float = 0.05
    focus: FocusConfig = field(default_factory=FocusConfig)
    policy: str = "pgdsf"
    seed: int = 0

    def __post_init__(self) -> None:
        _check_number("alpha", self.alpha, 0.0, math.inf, hi_open=True)
        _check_number("cold_cci", self.cold_cci, 0.0, 1.0)
        _check_number("reuse_cfo_limit", self.reuse_cfo_limit, 0.0, 1.0, lo_open=True)
        _check_int("min_reuse_tokens", self.min_reuse_tokens, 0)
        if self.recompute_ratio is not None:
            _check_number("recompute_ratio", self.recompute_ratio, 0.0, 1.0)
        if self.token_choice not in TOKEN_CHOICES:
            raise ConfigError(f"CacheConfig.token_choice must be one of {list(TOKEN_CHOICES)}, got {self.token_choice!r}")
        _check_int("check_layer", self.check_layer, 1)
        if self.deviation_on not in ("v", "k", "kv"):
            raise ConfigError(f"CacheConfig.deviation_on must be 'v', 'k' or 'kv', got {self.deviation_on!r}")
        layers = self.question_layers
        if isinstance(layers, list):
            layers = tuple(layers)
            object.__setattr__(self, "question_layers", layers)
        if not isinstance(layers, tuple) or not layers:
            raise ConfigError(f"CacheConfig.question_layers must be a non-empty tuple of layer indices, got {layers!r}")
        for layer in layers:
            _check_int("question_layers", layer, 0)
        object.__setattr__(self, "question_layers", tuple(sorted(set(layers))))
        if self.question_pass_fresh not in QUESTION_PASS_FRESH:
            raise ConfigError(f"CacheConfig.question_pass_fresh must be one of {list(QUESTION_PASS_FRESH)}, "
                              f"got {self.question_pass_fresh!r}")
        _check_number("question_weight", self.question_weight, 0.0, 1.0)
        for name, cls in GROUPS.items():
            object.__setattr__(self, name, _group_from_dict(cls, name, getattr(self, name)))
        _check_int("max_chunks", self.max_chunks, 1)
        _check_int("max_variants_per_chunk", self.max_variants_per_chunk, 1)
        _check_number("cfo_floor", self.cfo_floor, 0.0, 1.0, lo_open=True)
        if not isinstance(self.policy, str):
            raise ConfigError(f"CacheConfig.policy must be a string, got {self.policy!r}")
        try:
            object.__setattr__(self, "policy", canonical_policy_name(self.policy))
        except KeyError:
            raise ConfigError(
                f"CacheConfig.policy must be one of {sorted(POLICY_NAMES)}, got {self.policy!r}"
            ) from None
        _check_int("seed", self.seed, 0)

    @property
    def max_variants(self) -> int:
        """Total variant cap N x M."""
        return self.max_chunks * self.max_variants_per_chunk

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CacheConfig:
        """Build from a mapping, groups nested (``{"exact": {"tie_guard": 0.25}}``); unknown keys
        are an error (a typo must not be ignored), a former flat name one naming its new place."""
        return cls().replace(**data)

    def replace(self, **changes: Any) -> CacheConfig:
        """A copy with ``changes``; a mapping given for a group (``precision``, ``exact``, ``focus``)
        updates only the fields it names: ``cfg.replace(exact={"tie_guard": 0.25})``."""
        known = {f.name for f in fields(self)}
        for name in changes:
            if name in MOVED:
                raise ConfigError(moved_setting(name))
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ConfigError(f"CacheConfig: unknown setting(s) {unknown}; known: {sorted(known)}")
        for name, cls in GROUPS.items():
            if isinstance(changes.get(name), dict):
                changes[name] = _group_from_dict(cls, name, {**asdict(getattr(self, name)), **changes[name]})
        return replace(self, **changes)
