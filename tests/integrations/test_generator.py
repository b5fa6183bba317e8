"""Chunk-aware generation on a tiny engine: cache segments, reuse across templates, stop, timeout."""

from __future__ import annotations

import pytest

from cachedrag.prompt.registry import ChunkRegistry
from cachedrag.integrations.generator import ChunkAwareGenerator, sampling_params
from cachedrag.prompt.template import Message

A = "The heapq module provides an implementation of the heap queue algorithm."
B = "The json module encodes and decodes JSON documents; pass indent to pretty-print."


@pytest.fixture
def gen(tiny_engine):
    reg = ChunkRegistry()
    reg.register([A, B])
    return ChunkAwareGenerator(tiny_engine, reg)


def ask(gen, content, **kw):
    params = sampling_params(kw.pop("max_new_tokens", 6), **kw)
    return gen.generate(gen.render_messages([Message("user", content)]), params)


def test_chunks_are_reused_under_another_template_and_order(gen):
    first = ask(gen, f"Use these:\n{A}\n\n{B}\nQ: one?")
    assert first.split.n_chunks == 2 and first.stats()["registered_chunks"] == 2
    # another template and order, same chunk texts: they come from the cache
    again = ask(gen, f"Question: two?\nDocs:\n* {B}\n* {A}\nAnswer briefly.")
    assert again.split.n_chunks == 2
    assert again.result.chunks_hit >= 2  # text between chunks counts as a (new) middle segment too
    # byte tokenizer: one token per byte; the chunks were loaded, not computed fresh (CFO may recompute a share)
    assert again.result.fresh_tokens <= again.result.prompt_tokens - len(A) - len(B)
    assert again.cached_tokens > 0
    assert again.input_tokens == again.result.prompt_tokens and again.output_tokens == len(again.result.token_ids)


def test_repeat_is_served_from_prefix_tree(gen):
    fresh = "A chunk text seen by no earlier test, so the first request computes it in place."
    gen.registry.register([fresh])
    prompt = f"Context:\n{fresh}\nQ: repeat?"
    first = ask(gen, prompt)
    assert first.result.chunks_missed == 1 and first.chunk_outcomes() == ["fresh"]
    assert first.stats()["registered_chunks_computed"] == 1
    second = ask(gen, prompt)
    assert second.result.prefix_hit_tokens > len(fresh)  # system text + the chunk, as an exact prefix
    assert second.chunk_outcomes() == ["tree"] and second.stats()["registered_chunks_cached"] == 1
    assert second.result.computed_tokens < second.result.prompt_tokens / 2


def test_chunk_outcomes_tell_registered_chunks_from_text_between(gen):
    x = "First passage for the outcome test, new to the cache and long enough."
    y = "Second passage for the outcome test, also new to the cache, long enough."
    gen.registry.register([x, y])
    assert ask(gen, f"Docs:\n{x}\n--\n{y}\nQ?").chunk_outcomes() == ["fresh", "fresh"]
    swapped = ask(gen, f"Other docs:\n{y}\n==\n{x}\nQ2?")  # new text before and between: reused at new positions
    assert swapped.chunk_outcomes() == ["reuse", "reuse"]
    assert swapped.result.chunks_missed >= 1  # the engine also counts the new text between them


def test_stop_string_cuts_the_answer(gen):
    free = ask(gen, "say something", max_new_tokens=12).text
    cut = next((i for i in range(1, len(free)) if free[i].isprintable() and free[i] not in free[:i]), None)
    if cut is None:
        pytest.skip("tiny model output has no usable stop character")
    stopped = ask(gen, "say something", max_new_tokens=12, stop=[free[cut]])
    assert stopped.text == free[:cut]
    assert stopped.finish_reason == "stop"


def test_stream_matches_generate(gen):
    prompt = gen.render_messages([Message("user", f"{B}\nstream?")])
    stream = gen.stream(prompt, sampling_params(8))
    text = "".join(stream)
    assert stream.answer.text == text == gen.generate(prompt, sampling_params(8)).text


def test_timeout_raises(gen):
    prompt = gen.render_messages([Message("user", "long answer please")])
    with pytest.raises(TimeoutError):
        gen.generate(prompt, sampling_params(200), timeout=1e-6)


def test_formatted_completion_is_used_as_is(gen):
    rendered = gen.render_completion("raw prompt text", formatted=True)
    assert rendered.text == "raw prompt text" and rendered.prefix_end is None
    assert gen.render_completion("hi", "sys").text.startswith("<|im_start|>system\nsys")


def test_a_framework_prompt_has_the_ids_a_plain_llm_computes_for_it():
    """On the default model's byte-level BPE (tokens cross chunk boundaries: " member" after a
    blank line), the generator's segments concatenate to the tokenizer's ids of the whole
    formatted prompt, and speculative pipelining's segments of the prompt up to its last chunk
    are the same segments (one key per chunk for both)."""
    from cachedrag.integrations.speculation import PromptShape
    from cachedrag.prompt.splitter import TOKENIZATION, split_prompt
    from cachedrag.kvcache.keys import Namespace
    from cachedrag.model.loader import load_tokenizer
    from cachedrag.prompt import PromptBuilder

    class Captured(Exception):
        pass

    class Engine:  # the generator's view of an engine; generating only records the segments
        def __init__(self, tokenizer):
            self.runner = type("Runner", (), {"tokenizer": tokenizer})()
            self.prompts = PromptBuilder(tokenizer, Namespace("model@1", "float32", "tok@1"))

        def generate_segments(self, segments, params, **kw):
            raise Captured(segments)

    tokenizer = load_tokenizer(None)
    chunks = [" member is the value of the enumeration member", "Help on module json: encoders and decoders"]
    reg = ChunkRegistry()
    reg.register(chunks)
    gen = ChunkAwareGenerator(Engine(tokenizer), reg)
    prompt = gen.render_messages([Message("user", "Context:\n\n" + "\n\n".join(chunks) + "\n\nQuestion: what?")])
    with pytest.raises(Captured) as got:
        gen.stream(prompt, sampling_params(4))
    segments = got.value.args[0]
    assert [t for s in segments for t in s.ids] == tokenizer.encode(prompt.text, add_special_tokens=False)
    assert sum(s.kind == "chunk" for s in segments) == 2
    shape = PromptShape.of(split_prompt(prompt, reg), gen.engine, None)
    ahead = gen.engine.prompts.text_segments(shape.parts([c.strip() for c in chunks]), tokenization=TOKENIZATION)
    assert [s.key for s in ahead if s.kind == "chunk"] == [s.key for s in segments if s.kind == "chunk"]
