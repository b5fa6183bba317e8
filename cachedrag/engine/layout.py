"""Prompt layout on the request path: which segments are the cacheable prefix (``system``), the
retrieved chunks with any text between them (``middle``: glue, stored with the chunks and part of
their tree path) and the question (the last segment, with any text after the last chunk that the
server's passage detection left there); order-aware reuse (a cached tree path holding the same
chunks serves its order, exactly); and the plan request handed to the cache manager.

Does not own: building segments from text (``cachedrag.prompt``) or planning (``kvcache.planner``)."""

from __future__ import annotations

from dataclasses import dataclass

from cachedrag.errors import ConfigError
from cachedrag.kvcache.planner import Mode, PlanRequest
from cachedrag.kvcache.planner import Segment as PlanSegment
from cachedrag.prompt import Segment


@dataclass
class Layout:
    segments: list[Segment]  # the prompt as served (order-aware reuse may reorder the chunks)
    system: list[Segment]
    middle: list[Segment]
    question: list[Segment]
    chunk_order: list[int] | None  # retrieved indices in the order served (None: as given)
    request: PlanRequest

    @property
    def context(self) -> list[Segment]:
        """Every segment before the question: what a hand-off stores."""
        return self.system + self.middle

    @property
    def total(self) -> int:
        return sum(len(s) for s in self.segments)


def lay_out(segments: list[Segment], mode: Mode, exact_plan: bool, order_aware: bool, manager) -> Layout:
    """Split ``segments`` (the question last) and apply order-aware reuse where it may: not for
    ``full``, an exact plan (it keeps the given order), or a middle that is not all chunks."""
    first_chunk = next((i for i, s in enumerate(segments) if s.kind == "chunk"), None)
    last_chunk = max((i for i, s in enumerate(segments) if s.kind == "chunk"), default=None)
    if first_chunk is None:  # no chunks: everything but the last segment is a cacheable prefix
        system, middle, question = segments[:-1], [], segments[len(segments) - 1:]
    else:
        n_question_from = max(last_chunk + 1, len(segments) - 1)
        system, middle = segments[:first_chunk], segments[first_chunk:n_question_from]
        question = segments[n_question_from:]
    if not question:
        raise ConfigError("a request must end with a text segment (the question)")
    chunk_order = None
    if (order_aware and mode is not Mode.FULL and len(middle) > 1 and not exact_plan
            and all(s.kind == "chunk" for s in middle)):
        chunk_order = manager.cached_order([s.key for s in system], [s.key for s in middle])
        if chunk_order is not None:  # a cached tree path holds these chunks: serve its order exactly
            middle = [middle[i] for i in chunk_order]
            segments = system + middle + question
    request = PlanRequest(
        system=tuple(PlanSegment(s.key, len(s)) for s in system),
        chunks=tuple(PlanSegment(s.key, len(s), glue=s.kind != "chunk") for s in middle),
        question_tokens=sum(len(s) for s in question),
    )
    return Layout(segments, system, middle, question, chunk_order, request)
