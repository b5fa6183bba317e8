"""Conversations as exact prefix hits: an agent's or a chat's next step computes only what is new.

Owns: ``follow`` (before planning: the request's leading segments re-cut at the boundaries of
the longest knowledge-tree path that is a token prefix of its prompt, so the previous step's
prompt and answer, stored as one path, are tree hits however the new prompt's text was cut) and
``remember`` (after decoding: the prompt as served and the answer's decoded rows stored as that
path). A step's prompt is the previous prompt, the answer (a tool call), and the new messages (a
tool result): after ``follow`` only the new messages' tokens are computed, and only the chunks
among them (the new tool result's passages) are planned for chunk reuse; the earlier steps'
passages are part of the tree path.

Exactness. A stored segment's KV is full prefill's when the prompt up to it was computed
exactly (tree hits and fresh rows before the first reused chunk, ``_Prefill.exact_segments``);
such segments keep their content key and are ordinary tree nodes (prefix caching serves them).
From the first reused chunk on, the rows are the request's approximation (reused chunks with
their recomputed tokens): stored only for a conversation (``remember(conversation=True)``), under
the content key plus ``APPROXIMATE``, so no exact lookup (mode ``prefix``, a faithful server,
the tie guard's exact plan on an ordinary request) ever meets them; ``follow`` takes them only
for a conversation planned with chunk reuse, where that step's answer was decoded over the very
same rows, and only on an engine without tie guards (``CacheConfig.exact.tie_guard`` and
``tie_guard_decode`` 0: the levels ``balanced`` and ``fast``), whose exact prefills would otherwise
plan the same segments and read the approximate path. The answer's rows are decode steps' rows (as
vLLM's and SGLang's prefix caches keep them), equal to a prefill's up to the dtype's rounding.

Does not own: the tree (``kvcache.tree``: ``match_tokens``), admission (``ChunkCacheManager.admit``,
given a plan whose leading segments are tree hits and the rest fresh), payloads (``handoff``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cachedrag.kvcache.keys import chunk_key, path_key
from cachedrag.kvcache.manager import NewEntry
from cachedrag.kvcache.planner import Action, Mode, Plan, SegmentPlan
from cachedrag.prompt import Segment
from cachedrag.engine.handoff import entry_payload

APPROXIMATE = "~approx"  # suffix of the key of a stored segment whose KV is a reuse approximation
REUSE_MODES = (Mode.NAIVE, Mode.RANDOM, Mode.CACHEDRAG)


def is_approximate(key: str) -> bool:
    return key.endswith(APPROXIMATE)


def approximate_paths(engine, mode: Mode, conversation: bool) -> bool:
    """Whether a conversation's approximate paths are stored and followed: a conversation in a reuse
    mode, on an engine without tie guards (their exact prefills must not meet approximate KV)."""
    cache = engine.config.cache
    return conversation and mode in REUSE_MODES and not cache.exact.tie_guard and not cache.exact.tie_guard_decode


def follow(engine, segments: list[Segment], mode: Mode, conversation: bool = False) -> tuple[list[Segment], bool]:
    """``segments`` with their leading part re-cut along the longest tree path whose tokens are a
    prefix of the prompt's (``KnowledgeTree.match_tokens``); whether that path holds approximate
    segments (``approximate_paths``). The path stops before the last
    segment's last token (the question is computed) and never cuts through a chunk. Segments it
    covers become text segments with the path's keys (tree hits for the planner); the one it
    ends in keeps its tail as a text segment. Unchanged when the path ends on the segments' own
    boundaries (the ordinary case)."""
    if mode is Mode.FULL or len(segments) < 2:
        return segments, False
    ids = [t for s in segments for t in s.ids]
    bounds = [0]
    for s in segments:
        bounds.append(bounds[-1] + len(s))
    namespace = engine.namespace
    alternates = (lambda key: (key + APPROXIMATE,)) if approximate_paths(engine, mode, conversation) else None
    nodes = engine.manager.tree.match_tokens(len(ids), lambda a, b: chunk_key(ids[a:b], namespace),
                                             alternates=alternates)
    inside_chunk = {p for s, a, b in zip(segments, bounds, bounds[1:]) if s.kind == "chunk" for p in range(a + 1, b)}
    ends = []
    for node in nodes:
        ends.append((ends[-1] if ends else 0) + node.n_tokens)
    while nodes and (ends[-1] > len(ids) - 1 or ends[-1] in inside_chunk):
        nodes, ends = nodes[:-1], ends[:-1]
    if not nodes or set(ends) <= set(bounds) and all(
            n.key == segments[bounds.index(e) - 1].key for n, e in zip(nodes, ends)):
        return segments, False
    cut = ends[-1]
    out = [Segment("text", tuple(ids[a:b]), node.key) for node, a, b in zip(nodes, [0, *ends], ends)]
    for s, a, b in zip(segments, bounds, bounds[1:]):
        if a >= cut:
            out.append(s)
        elif b > cut:  # the segment the path ends in: its tail is computed (never a chunk: see above)
            tail = tuple(ids[cut:b])
            out.append(Segment("text", tail, chunk_key(tail, namespace)))
    return out, any(is_approximate(n.key) for n in nodes)


def question_from(segments: Sequence[Segment]) -> int:
    """Index of the first question segment, as the engine's ``_prefill`` cuts a request: after
    the last chunk, and at least the last segment."""
    last_chunk = max((i for i, s in enumerate(segments) if s.kind == "chunk"), default=None)
    return len(segments) - 1 if last_chunk is None else max(last_chunk + 1, len(segments) - 1)


@torch.inference_mode()
def remember(engine, segments: Sequence[Segment], kv, answer: Sequence[int], *, exact_segments: int,
             mode: Mode, conversation: bool) -> int:
    """Store ``segments`` (the prompt as served) and ``answer[:-1]`` (decoded tokens whose rows are
    in ``kv``: every one but the last was fed back) as one tree path, what is not on the tree yet
    taken from the buffer's rows (raw K recovered by rotating back). ``exact_segments``: leading
    segments of the context (all but the question segments) whose KV equals full prefill; when
    that is all of them, the question and answer are exact too. Segments past the exact part are
    stored only where ``approximate_paths`` allows, under approximate keys. Returns the
    tokens stored."""
    if mode is Mode.FULL or len(answer) < 2:
        return 0
    parts = [(s.key, tuple(s.ids)) for s in segments] + [(None, tuple(answer[:-1]))]
    n_context = question_from(segments)
    exact = len(parts) if exact_segments >= n_context else exact_segments
    exact = next((i for i, (key, _) in enumerate(parts[:exact]) if key and is_approximate(key)), exact)
    if exact < len(parts) and not approximate_paths(engine, mode, conversation):
        parts = parts[:exact]
    if not parts:
        return 0
    keys = []
    for i, (key, ids) in enumerate(parts):
        key = key or chunk_key(ids, engine.namespace)
        keys.append(key if i < exact or is_approximate(key) else key + APPROXIMATE)
    on_tree = engine.manager.tree.match_prefix(keys)
    starts = [0]
    for _, ids in parts:
        starts.append(starts[-1] + len(ids))
    seg_plans, new = [], []
    for i, (key, (_, ids)) in enumerate(zip(keys, parts)):
        if i < len(on_tree):
            seg_plans.append(SegmentPlan("system", i, key, len(ids), starts[i], Action.TREE, on_tree[i].handle))
            continue
        seg_plans.append(SegmentPlan("system", i, key, len(ids), starts[i], Action.FRESH))
        new.append(_entry(engine, kv, keys[:i + 1], i, starts[i], starts[i + 1]))
    if not new:
        return 0
    plan = Plan(mode=Mode.PREFIX, segments=tuple(seg_plans), question_start=starts[-1], question_tokens=0,
                prefix_hit_segments=len(on_tree), prefix_hit_tokens=starts[len(on_tree)])
    engine.manager.admit(plan, keys, new)
    return starts[-1] - starts[len(on_tree)]


def _entry(engine, kv, path: list[str], i: int, start: int, end: int) -> NewEntry:
    """The buffer rows ``start..end`` as a stored entry: raw K (the rotated rows turned back by
    their positions, in float32) and V in the store dtype."""
    from cachedrag.store.entry import KVEntry

    runner = engine.runner
    positions = torch.arange(start, end, device=runner.device)  # [T]
    rotated = kv.k[:, :, start:end].float()  # [L, H_kv, T, D]
    raw = torch.stack([runner.rotary.for_layer(layer).apply(rotated[layer], -positions)  # [H_kv, T, D] each
                       for layer in range(rotated.shape[0])])  # each layer's own RoPE (Gemma 3's differ)
    raw = raw.to(engine._store_dtype).contiguous()  # [L, H_kv, T, D]
    v = kv.v[:, :, start:end].to(engine._store_dtype, copy=True)  # [L, H_kv, T, D]
    entry = KVEntry(*entry_payload(engine.model_namespace.digest, path, "system", True, raw, v, None))
    return NewEntry(segment=i, handle=path_key(path), entry=entry, nbytes=entry.nbytes, meta=None)
