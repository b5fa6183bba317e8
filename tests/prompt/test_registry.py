"""Chunk registry: every occurrence found whatever the stride alignment, overlaps, LRU bound."""

from __future__ import annotations

import time

import pytest

from cachedrag.prompt.registry import ChunkRegistry, ChunkRegistryConfig, Match, chunk_registry, register_chunks

A = "The heapq module provides an implementation of the heap queue algorithm."
B = "The json module encodes and decodes JSON documents; pass indent to pretty-print."
C = "The hashlib module implements secure hash and message digest algorithms."


def registry(**kw) -> ChunkRegistry:
    return ChunkRegistry(ChunkRegistryConfig(**kw))


@pytest.mark.parametrize("stride", [1, 3, 4, 8])
@pytest.mark.parametrize("offset", range(0, 9))
def test_found_at_any_alignment(stride, offset):
    reg = registry(stride=stride, anchor_chars=16)
    reg.register([A])
    prompt = "x" * offset + A + "y" * 5
    assert reg.find(prompt) == [Match(offset, offset + len(A), A)]


def test_found_at_the_very_end_and_start():
    reg = registry()
    reg.register([A, B])
    assert reg.find(A) == [Match(0, len(A), A)]
    prompt = "Q?\n" + B
    assert reg.find(prompt) == [Match(3, len(prompt), B)]


def test_several_chunks_in_order_with_template_text_around():
    reg = registry()
    reg.register([A, B, C])
    prompt = f"<|im_start|>user\nContext:\n---\n{C}\n\n{A}\n---\nQuestion: {B[:20]}?<|im_end|>"
    found = reg.find(prompt)
    assert [m.text for m in found] == [C, A]
    for m in found:
        assert prompt[m.start:m.end] == m.text


def test_registered_texts_are_stripped_and_match_inside_whitespace():
    reg = registry()
    assert reg.register(["  \n" + A + "\n\n"]) == 1
    assert A in reg and ("\n" + A) in reg
    assert [m.text for m in reg.find("ctx:" + A + "\n")] == [A]


def test_duplicates_give_two_matches():
    reg = registry()
    reg.register([A])
    found = reg.find(A + "\n\n" + A)
    assert [(m.start, m.end) for m in found] == [(0, len(A)), (len(A) + 2, 2 * len(A) + 2)]


def test_overlaps_leftmost_then_longest():
    reg = registry(anchor_chars=8, stride=2)
    long_ = A + " It has heappush and heappop."
    reg.register([A, long_])
    assert reg.find("> " + long_) == [Match(2, 2 + len(long_), long_)]  # same start: the longer wins
    tail = "module provides an implementation of the heap queue algorithm. And more text here."
    reg.register([tail])
    # A starts first; the overlapping tail is dropped and stays text
    assert [m.text for m in reg.find(A + " And more text here.")] == [A]


def test_short_texts_are_not_registered():
    reg = registry(anchor_chars=32, stride=4)
    assert reg.register(["x" * 34]) == 0
    assert reg.register(["x" * 35]) == 1
    assert len(reg) == 1


def test_register_counts_new_only():
    reg = registry()
    assert reg.register([A, B]) == 2
    assert reg.register([A, C]) == 1
    assert len(reg) == 3


def test_lru_eviction_keeps_recently_used():
    reg = registry(capacity=2)
    reg.register([A, B])
    reg.find("..." + A)  # A becomes most recent
    reg.register([C])  # evicts B
    assert A in reg and C in reg and B not in reg
    assert reg.find(B) == []
    assert [m.text for m in reg.find(A + C)] == [A, C]


def test_anchor_shared_by_chunks_with_a_common_start():
    reg = registry()
    common = "Help on module json:\n\nNAME\n    json - "
    x, y = common + "JSON (JavaScript Object Notation) encoder.", common + "a different ending of the text."
    reg.register([x, y])
    assert [m.text for m in reg.find("a " + y + " b " + x)] == [y, x]
    reg.register(["z" * 100])
    reg.clear()
    assert len(reg) == 0 and reg.find(x) == []


def test_find_is_fast_on_long_prompts():
    reg = registry()
    words = [f"word{i} " * 12 for i in range(2000)]
    reg.register(words)
    prompt = "filler text " * 3000 + words[7] + "more " * 500  # ~40k characters
    t = time.perf_counter()
    found = reg.find(prompt)
    elapsed = time.perf_counter() - t
    assert [m.text for m in found] == [words[7].strip()]
    assert elapsed < 0.5  # O(n / stride) probes; ~10 ms here


def test_process_wide_registry():
    assert chunk_registry() is chunk_registry()
    text = "A process-wide registered chunk text that is long enough to be indexed."
    register_chunks([text])
    assert text in chunk_registry()


def test_config_validation():
    with pytest.raises(ValueError):
        ChunkRegistryConfig(anchor_chars=8, stride=9)
    assert ChunkRegistryConfig(anchor_chars=32, stride=4).min_chars == 35


def test_the_integrations_package_reexports_the_registry_and_the_splitter():
    import cachedrag.integrations as integrations
    from cachedrag.prompt import registry, splitter

    for name in ("ChunkRegistry", "ChunkRegistryConfig", "chunk_registry", "register_chunks"):
        assert getattr(integrations, name) is getattr(registry, name)
    assert integrations.split_prompt is splitter.split_prompt
    assert integrations.chunk_registry() is registry.chunk_registry()
