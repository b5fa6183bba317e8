"""Settings of the chunk-cache policy layer, validated once.

Owns: ``CacheConfig``, the one place every threshold of the policy layer lives (Cache-Craft's
alpha, variant caps N x M, the f_r guard, focus window / minimum layers / mass threshold, the
fixed recompute ratio, the tree's replacement policy, the seed of the ``random`` mode).
Does not own: byte budgets of the tiers (the store's config), model or retrieval settings.

Every field is checked in ``__post_init__``; a bad value raises ``ConfigError`` naming the
field, the value and the allowed range. ``dataclasses.replace(cfg, alpha=2.0)`` re-validates.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from cachedrag.errors import ConfigError
from cachedrag.kvcache.policy import POLICY_NAMES, canonical_policy_name


TOKEN_CHOICES = ("deviation", "inter", "leading", "question", "question+deviation", "question+inter")
#: token choices that rank reused tokens by the question's attention (a pre-pass of the question)
QUESTION_CHOICES = ("question", "question+deviation", "question+inter")
#: precision of the question pre-pass's projections (``CacheConfig.question_dtype``)
QUESTION_DTYPES = ("bfloat16", "float32")
#: precision of the projections of recomputed reused tokens and of fresh tokens after a reused chunk
#: (``CacheConfig.recompute_dtype``, ``CacheConfig.fresh_dtype``)
RECOMPUTE_DTYPES = ("float32", "bfloat16")
#: which fresh rows the question pre-pass computes (``CacheConfig.question_pass_fresh``)
QUESTION_PASS_FRESH = ("leading", "all")
#: when a recurring chunk sequence gets its exact tree path (``CacheConfig.exact_repeats_when``)
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
        [0, 1]. Default 0.27: the measured frontier's pick (docs/fidelity.md): the first ratio past
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
        docs/fidelity.md).
      check_layer: the layer whose K/V deviation picks the tokens (``token_choice="deviation"``),
        >= 1; a model with no more layers than this recomputes by ``leading`` instead.
      deviation_on: what the deviation measures: "v" (default), "k" (rotated K, as CacheBlend)
        or "kv" (both). On SmolLM2-135M V ranked best (KL 0.087 at 15% vs 0.102 for K and K+V).
      question_layers: layers whose question attention ranks reused tokens (question choices),
        each >= 0; summed after normalising each layer's mass over the reused tokens.
      question_dtype: precision of the question pre-pass's projections: "bfloat16" (default) runs
        its matmuls on bfloat16 copies of those layers' weights (``model/scoring.py``; a float32
        runner with fused fast layers only, else its own precision), "float32" on the runner's own
        (the reference path). The pass only ranks tokens; on ``bench ttft``'s stream at 27% the two
        chose the same tokens but 1 in 350, and bfloat16 made the pass 52 -> 38 ms. A request whose
        fresh chunks lead every reused one runs the pass in the runner's precision: the prefill
        takes those rows over (``engine._Lead``), so they must be computed exactly.
      recompute_dtype: precision of the projections (q/k/v, output, MLP) of the rows a prefill
        computes for reused chunks (the recomputed tokens; also probed and dense rows):
        "bfloat16" (default: ``model/scoring.py``'s bfloat16 copies of every layer, fp32
        accumulation; the residual stream, norms, RoPE and attention stay in the runner's
        precision; a float32 runner with fused fast layers only, else its own precision) or
        "float32" (the runner's own weights, the reference). Those rows only repair approximate
        cached K/V, so their precision is a fidelity/speed setting like the ratio; question, system
        and fresh rows keep the runner's precision (fresh rows after a reused chunk: ``fresh_dtype``).
        On the frontier (8 requests, 2 seeds) the teacher-forced KL at 27 / 35 / 45% is the
        float32 setting's to 3 decimals, x full 2.95 -> 3.80 at 27%; on ``bench ttft``'s streams
        the same fidelity figures and x prefix 1.99 -> 2.51 (seed 0), 1.80 -> 1.96 (seed 1)
        (docs/fidelity.md, round 10). Costs a bfloat16 copy of every layer (SmolLM2-135M: 212 MB).
      fresh_dtype: precision of the projections of the fresh rows a reuse prefill computes after
        its first reused chunk (missed chunks placed behind a reused one): "bfloat16" (default: the
        bfloat16 copies the recomputed rows run on, fp32 accumulation; a float32 runner with fused
        fast layers only, else its own precision) or "float32" (the runner's own weights, the
        reference). Those rows attend to the reused chunks' approximate K/V, so they are
        approximate already; their precision is a speed setting like ``recompute_dtype``. Fresh
        rows before every reused chunk (exact there), system and question rows keep the runner's
        precision. Reported as the approximation ``fresh_bfloat16``. On ``bench ttft``'s six
        streams (stdlib and info, seeds 0-2): the same fidelity figures (first token equal, KL
        within 2%, top-1 within 0.001), x prefix 2.73 -> 2.89, 1.98 -> 2.40 (stdlib seeds 0-1),
        1.62 -> 2.00, 1.52 -> 1.87 (info seeds 0-1) (docs/fidelity.md, round 20).
      leading_fresh_dtype: precision of the projections of the fresh chunk rows a reuse prefill
        computes before its first reused chunk (missed chunks behind the tree prefix), in the
        question pre-pass and the prefill: "float32" (default: the runner's own weights; those rows
        are then exact, stored as a tree path and taken over by the tie guard's exact prefill) or
        "bfloat16" (``fresh_dtype``'s bfloat16 copies; a float32 runner with fused fast layers
        only, else its own precision). In bfloat16 they are approximate like the rows behind a
        reused chunk: stored as chunk variants, not tree nodes, and an exact prefill computes them
        again. Applies only where every fresh segment before the first reused one is a chunk (a
        fresh system prompt keeps the runner's precision, and so do the chunks after it). Made for
        ``fidelity="faithful"``, whose answers move onto an exact prefill after their (guarded)
        first token anyway, so only that token reads these rows: on ``bench ttft``'s four streams
        the same first tokens and answers, x prefix 1.61 -> 2.09 on info seed 1 (docs/fidelity.md,
        round 26). Reported as ``fresh_bfloat16``.
      question_pass_fresh: which fresh (missed) rows the question pre-pass computes besides the
        question: "leading" (default) only those before every reused chunk (the prefill takes them
        over, ``engine._Lead``: computed once); fresh chunks after a reused one are left out of
        the pass, the question's attention there skips their rows, and the prefill computes them
        once. "all" (the reference behaviour) computes those too, against the uncorrected cache,
        so the ranking sees them, and the prefill computes them again (their rows cannot be taken
        over: in the prefill they see the recomputed rows before them). Only the ranking differs:
        on ``bench ttft``'s stream (docs/fidelity.md, round 8) mean TTFT -4%, teacher-forced top-1 and
        KL unchanged (0.985 / 0.003), ROUGE-L vs full 0.924 -> 0.919 (one near tie flipped).
        A Triton or sliding-window runner computes them ("all"; noted in the result).
      question_weight: weight of the question ranking in ``question+deviation`` and
        ``question+inter``. In [0, 1].

    Exact repeats (``repeats.py``): a request served partly from reused chunk variants stores no
    exact knowledge-tree path (its KV is approximate), so a recurring chunk sequence would be
    approximated again at every sighting.
      exact_repeats: 0 = off (the reference behaviour). n >= 1: the n-th time one chunk sequence
        (system + chunk segments, in prompt order) is served from reuse, its exact tree path is
        computed (a prefill of the part not on the tree, as prefix caching does on a miss) and
        stored, so later sightings are exact prefix hits whose answers equal full prefill. Default 2
        (measured on ``bench ttft``'s stream, docs/fidelity.md: 5 of its 8 exact repeats become exact
        hits, ROUGE-L vs full 0.908 -> 0.924, teacher-forced top-1 0.981 -> 0.985, mean TTFT -7%, x_prefix
        unchanged; 5.5 s of exact prefills after responses over the 36 requests).
      exact_repeats_when: "after_response" (default): the n-th sighting is still served from
        reuse; the exact path is computed once its answer is out (``CachedEngine.generate`` runs
        it before returning; ``prefill`` hands it to the caller as ``Prefilled.promote``, e.g. for
        a server's idle time), so no TTFT pays for it (an in-process caller of ``generate`` waits
        for it). "inline": the n-th sighting itself is prefilled exactly (its answer exact, its TTFT a miss's: x_prefix 2.05 -> 1.62 on that stream).
        "after_response_else_inline" (``cachedrag serve``'s default): as "after_response", and a later
        sighting still served from reuse (the caller never found time to compute the path: a
        server under load has no idle time) is prefilled exactly inline, so a recurring sequence
        is approximated at most once past the n-th sighting.
      repeat_memory: how many chunk-sequence fingerprints are remembered (least recently seen
        forgotten first). >= 1.

    Tie guard (``CachedEngine``): an approximate prefill whose first token is a near tie lets the
    approximation pick the answer's first token, and with it the answer (on ``bench ttft``'s two
    streams 9 of 29 approximate requests had a first-token gap below 0.3 nats; docs/fidelity.md,
    lever 4).
      tie_guard: 0 = off. > 0: when a prefill that reused chunk variants ends with a first token
        whose top-2 logits are closer than this many nats, the request is prefilled again
        exactly (as prefix caching would: tree prefix, the rest fresh, its path stored), so
        its answer is full prefill's; the TTFT of that request pays both prefills. Missed
        chunks the first prefill computed before its first reused one are exact already: they
        are stored before the exact prefill, which takes them from the tree instead of computing
        them again (on ``bench ttft``'s info seed-1 stream the exact prefills of 4 of its 6 guarded
        requests took 0.76-1.34 s instead of 1.66-2.25 s, docs/fidelity.md). Applies
        to the ``cachedrag`` mode (not the ``naive`` / ``random`` ablations).
      tie_guard_decode: 0 = off. > 0: the guard during decoding. While an answer decodes on the KV
        of an approximate prefill (one that reused chunk variants and was not prefilled again
        for its first token), each later answer token whose top-2 logits are closer than this
        many nats is not chosen from them: the prompt and the answer so far are prefilled
        exactly (as prefix caching would: tree prefix, the rest fresh, its path stored) and
        decoding goes on from that KV, so the rest of the answer is full prefill's answer to
        the same prefix. The answer pauses for that prefill (once per answer; its TTFT does not
        change); the result says at which token (``EngineResult.tie_guard_switch``) and whether
        the tokens before it were full prefill's greedy choices too (``tie_guard_agreed``).
        ``math.inf``: every approximate answer switches before its second token, so the whole
        answer is full prefill's whenever its first token is.
        Independent of ``tie_guard`` (which watches the first token). Applies to the
        ``cachedrag`` mode.

    Variant registry (``index.py``):
      max_chunks (N), max_variants_per_chunk (M): at most M variants per chunk and N x M in all.
      cfo_floor: each reuse adds 1 / max(CFO, cfo_floor) to the variant's f_r (CFO may be 0).

    Focused-chunk early termination (``focus.py``):
      focus_window (w): the focused set must stay the same for w consecutive layer updates.
      focus_min_layers: never decide before this many layers have been fed.
      focus_mass_threshold: the focused set is the smallest set of chunks, by cumulative
        question attention, holding at least this share of the total. In (0, 1].

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
    question_dtype: str = "bfloat16"
    question_pass_fresh: str = "leading"
    recompute_dtype: str = "bfloat16"
    fresh_dtype: str = "bfloat16"
    leading_fresh_dtype: str = "float32"
    question_weight: float = 0.5
    exact_repeats: int = 2
    exact_repeats_when: str = "after_response"
    repeat_memory: int = 10_000
    tie_guard: float = 0.0
    tie_guard_decode: float = 0.0
    max_chunks: int = 10_000
    max_variants_per_chunk: int = 4
    cfo_floor: float = 0.05
    focus_window: int = 3
    focus_min_layers: int = 4
    focus_mass_threshold: float = 0.8
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
        if self.question_dtype not in QUESTION_DTYPES:
            raise ConfigError(f"CacheConfig.question_dtype must be one of {list(QUESTION_DTYPES)}, "
                              f"got {self.question_dtype!r}")
        if self.recompute_dtype not in RECOMPUTE_DTYPES:
            raise ConfigError(f"CacheConfig.recompute_dtype must be one of {list(RECOMPUTE_DTYPES)}, "
                              f"got {self.recompute_dtype!r}")
        if self.fresh_dtype not in RECOMPUTE_DTYPES:
            raise ConfigError(f"CacheConfig.fresh_dtype must be one of {list(RECOMPUTE_DTYPES)}, "
                              f"got {self.fresh_dtype!r}")
        if self.leading_fresh_dtype not in RECOMPUTE_DTYPES:
            raise ConfigError(f"CacheConfig.leading_fresh_dtype must be one of {list(RECOMPUTE_DTYPES)}, "
                              f"got {self.leading_fresh_dtype!r}")
        if self.question_pass_fresh not in QUESTION_PASS_FRESH:
            raise ConfigError(f"CacheConfig.question_pass_fresh must be one of {list(QUESTION_PASS_FRESH)}, "
                              f"got {self.question_pass_fresh!r}")
        _check_number("question_weight", self.question_weight, 0.0, 1.0)
        _check_int("exact_repeats", self.exact_repeats, 0)
        if self.exact_repeats_when not in EXACT_REPEAT_TIMINGS:
            raise ConfigError(f"CacheConfig.exact_repeats_when must be one of {list(EXACT_REPEAT_TIMINGS)}, "
                              f"got {self.exact_repeats_when!r}")
        _check_int("repeat_memory", self.repeat_memory, 1)
        _check_number("tie_guard", self.tie_guard, 0.0, math.inf, hi_open=True)
        if self.tie_guard_decode != math.inf:  # inf: every approximate answer switches before its second token
            _check_number("tie_guard_decode", self.tie_guard_decode, 0.0, math.inf, hi_open=True)
        _check_int("max_chunks", self.max_chunks, 1)
        _check_int("max_variants_per_chunk", self.max_variants_per_chunk, 1)
        _check_number("cfo_floor", self.cfo_floor, 0.0, 1.0, lo_open=True)
        _check_int("focus_window", self.focus_window, 1)
        _check_int("focus_min_layers", self.focus_min_layers, 1)
        _check_number("focus_mass_threshold", self.focus_mass_threshold, 0.0, 1.0, lo_open=True)
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
        """Build from a mapping; unknown keys are an error (a typo must not be ignored)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"CacheConfig: unknown setting(s) {unknown}; known: {sorted(known)}")
        return cls(**data)
