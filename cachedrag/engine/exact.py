"""Exact fallbacks during decoding: the decode tie guard (``DecodeTieGuard``,
``CacheConfig.exact.tie_guard_decode``): an answer decoding on approximate KV that meets a near tie goes
on from an exact prefill of the prompt and the answer so far; and the top-2 logit gap that the
first-token and decode guards read (``top2``, ``top2_gap``). The near-tie rule itself is
``cachedrag.kvcache.tie``'s."""

from __future__ import annotations

import logging

import time
from collections.abc import Callable, Sequence

import torch

from cachedrag.kvcache.planner import Mode
from cachedrag.kvcache.tie import near_tie
from cachedrag.model.generation import Rewind, rewind_allowed
from cachedrag.prompt import Segment
from cachedrag.engine.result import EngineResult, Prefilled

log = logging.getLogger(__name__)


class DecodeTieGuard:
    """The tie guard during decoding (``CacheConfig.exact.tie_guard_decode``) for one answer.

    While the answer decodes on an approximate prefill's KV, ``due`` says whether the logits about
    to choose the next token are a near tie (top-2 gap below the threshold); ``switch`` then
    prefills the prompt and the answer so far exactly (``CachedEngine.prefill_exact_continuation``),
    once per answer, and decoding goes on from its KV. ``generate`` hands the guard to the decode
    loop as its ``switch`` hook (``__call__``); the server's engine loop calls ``due`` after a
    batched step and ``switch`` in its next scheduling step. ``stats`` are the
    ``EngineResult.tie_guard_switch*`` / ``tie_guard_agreed`` / ``tie_guard_rewound`` fields.

    ``rewind`` (a whole greedy answer nobody has seen yet: ``generate`` without ``stream``, a server's
    non-streaming request): when the exact prefill would not have chosen every token so far, the answer
    goes back to the ones it agrees with and continues from there (``Rewind``), so it is full
    prefill's answer even where the approximate first token was not (one the first-token guard missed).
    """

    def __init__(self, engine: "CachedEngine", segments: list[Segment], threshold: float, max_new_tokens: int,
                 rewind: bool = False):
        self.engine, self.segments, self.threshold, self.max_new_tokens = engine, segments, threshold, max_new_tokens
        self.rewind = rewind
        self.rewound: int | None = None  # answer tokens dropped by a rewind (None: none)
        self.replaced_first: int | None = None  # the first answer token, when a rewind went back past it
        self.token: int | None = None  # the answer token chosen from the exact prefill's logits
        self.gap: float | None = None
        self.seconds: float | None = None
        self.agreed: int | None = None
        self.failure: str | None = None  # why the exact prefill failed (the answer went on approximately)
        self._pending: Callable[[], None] | None = None  # the exact prefill's store hand-off, after the next token

    @classmethod
    def for_request(cls, engine: "CachedEngine", segments: list[Segment] | None, info: dict, mode: str,
                    max_new_tokens: int, rewind: bool = False) -> "DecodeTieGuard | None":
        """The guard for an answer after a prefill with stats ``info``, or None: the setting is off,
        the mode is not ``cachedrag``, or the prefill was exact (a reordered exact prefix is exact KV).
        ``rewind``: the caller shows no token before the answer is whole and decodes greedily with no
        history (``generation.rewind_allowed``)."""
        threshold = engine.config.cache.exact.tie_guard_decode
        approximate = [a for a in info.get("approximations", ()) if a != "reordered"]
        if threshold <= 0 or mode != Mode.CACHEDRAG.value or not approximate or segments is None or max_new_tokens < 2:
            return None
        return cls(engine, list(segments), threshold, max_new_tokens, rewind)

    def due(self, logits: torch.Tensor, n_tokens: int) -> bool:
        """Whether the answer, ``n_tokens`` (>= 1) tokens long, should move onto exact KV before its
        next token (chosen from ``logits`` ``[V]``); records the gap when it should."""
        if self.token is not None or self.failure is not None or not 0 < n_tokens < self.max_new_tokens:
            return False
        tied, gap = self.engine.near_tie(logits, self.threshold)
        if not tied:
            return False
        self.gap = gap
        return True

    def switch(self, answer: Sequence[int], between_layers: Callable[[int, int], None] | None = None) -> "Prefilled":
        """The exact prefill of the prompt and ``answer``; the caller decodes on from its KV and runs
        its ``hand_off`` once the next token is out."""
        t0 = time.perf_counter()
        exact = self.engine.prefill_exact_continuation(self.segments, answer, self.max_new_tokens, between_layers,
                                                       stop_at_disagreement=self.rewind)
        self.token, self.agreed = len(answer), exact.info["answer_agreed"]
        if exact.info["answer_kept"] < len(answer):
            self.rewound = len(answer) - exact.info["answer_kept"]
            if exact.info["answer_kept"] == 0:
                self.replaced_first = answer[0]
        self.seconds = time.perf_counter() - t0
        return exact

    def __call__(self, logits: torch.Tensor, answer: list[int]):
        """``decode_loop``'s ``switch`` hook. If the exact prefill fails, the answer goes on from the
        approximate logits (logged; ``failure`` says why)."""
        self.close()  # the previous switch's token is out: store its exact path now
        if not self.due(logits, len(answer)):
            return None
        try:
            exact = self.switch(answer)
        except Exception as exc:
            self.fail(exc)
            return None
        self._pending = exact.hand_off
        if self.rewound is not None:
            raise Rewind(exact.kv, exact.logits, exact.info["answer_kept"])
        return exact.kv, exact.logits

    def fail(self, exc: BaseException) -> None:
        """The exact prefill failed: log it and record why; the answer goes on approximately and the
        guard watches no more."""
        log.exception("the tie guard's exact prefill during decoding failed")
        self.failure = f"tie guard during decoding: exact prefill failed: {exc!r}"

    def close(self) -> None:
        """Run a pending store hand-off (a failure costs only the caching)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending()
            except Exception:
                log.exception("store hand-off of the tie guard's exact prefill during decoding failed")

    def stats(self) -> dict:
        return {"tie_guard_switch": self.token, "tie_guard_switch_gap": self.gap,
                "tie_guard_switch_s": self.seconds, "tie_guard_agreed": self.agreed, "tie_guard_rewound": self.rewound}


def top2(logits: torch.Tensor) -> tuple[float, float]:
    """The top logit of ``logits`` ``[V]`` and how far it leads the second (nats of log-probability)."""
    first, second = logits.float().topk(2).values.tolist()  # one read of the device
    return first, first - second


def top2_gap(logits: torch.Tensor) -> float:
    """How far the top logit of ``logits`` ``[V]`` leads the second (nats of log-probability)."""
    return top2(logits)[1]
