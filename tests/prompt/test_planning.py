"""The server's prompt planning: explicit and automatically detected chunks, the question cut
from the context, separators, and the ids of the chat template in every chunk mode."""

from __future__ import annotations

from types import SimpleNamespace

from cachedrag.kvcache.keys import Namespace
from cachedrag.prompt.passages import last_paragraph
from cachedrag.prompt.planning import PassageConfig, PromptPlanner, attach_separators, question_apart
from cachedrag.prompt.segments import PromptBuilder
from cachedrag.prompt.template import Message
from cachedrag.testing import TINY_DOCS

NS = Namespace("model@1", "float32", "tok@1")


def _ids(segments):
    return [t for s in segments for t in s.ids]


def _messages(chunks, question="What does it do?"):
    context = "\n\n".join(chunks)
    return [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": f"Context:\n\n{context}\n\nQuestion: {question}"}]


def test_server_prompts_are_the_ids_of_the_chat_template_in_every_chunk_mode(tokenizer):
    """Explicit chunks, automatic detection and no chunks give one token sequence for the same
    messages (so their answers compare with each other and with any other server's), the one
    the chat template itself tokenises to."""
    engine = SimpleNamespace(prompts=PromptBuilder(tokenizer, NS), runner=SimpleNamespace(tokenizer=tokenizer))
    chunks = [" member is the value of the enumeration, and start is where counting begins when no value is "
              "given to the first member of the functional API call." * 2,
              "Help on module json: the json module encodes and decodes JSON text, with dumps and loads as "
              "the two functions most programs call; both take options for indentation and separators." * 2]
    msgs = [Message("system", "Answer from the context."),
            Message("user", "Context:\n\n" + "\n\n".join(chunks) + "\n\nQuestion: what does start do?")]
    want = tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in msgs], tokenize=True,
                                         add_generation_prompt=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    planner = PromptPlanner(engine)
    assert planner.config.tokenization == "whole"  # the default
    explicit = planner.chat(msgs, chunks=chunks)
    auto_first, auto_again = planner.chat(msgs), planner.chat(msgs)
    assert (explicit.chunk_source, auto_again.chunk_source) == ("explicit", "auto")
    for planned in (explicit, auto_first, auto_again):
        assert _ids(planned.segments) == want
    apart = PromptPlanner(engine, PassageConfig(tokenization="parts")).chat(msgs, chunks=chunks)
    assert _ids(apart.segments) != want


def test_prompt_planner_detects_passages_seen_before():
    from cachedrag.engine import CachedEngine
    from cachedrag.testing import tiny_runner

    planner = PromptPlanner(CachedEngine(tiny_runner()), PassageConfig(min_chars=100))
    docs = [TINY_DOCS[i].text for i in (1, 2)]
    msgs = [Message(m["role"], m["content"]) for m in _messages(docs)]
    planned = planner.chat(msgs)
    chunks = [s.text for s in planned.segments if s.kind == "chunk"]
    assert chunks == docs and planned.chunk_source == "auto"
    # seen before: found verbatim inside another prompt even without paragraph breaks around it
    inline = planner.completion("Notes: " + docs[1] + " That is all. What is it?")
    assert [s.text for s in inline.segments if s.kind == "chunk"] == [docs[1]]
    explicit = planner.chat(msgs, chunks=[docs[0]])
    assert [s.text for s in explicit.segments if s.kind == "chunk"] == [docs[0]]
    assert explicit.chunk_source == "explicit"


def test_separators_join_their_chunk_so_a_cold_request_runs_no_reuse_pass():
    """attach_separators: the whitespace after each chunk joins it (one key wherever the chunk sits): no separator
    segment between chunks is planned as a reusable chunk, so an all-miss request recomputes
    nothing and a repeat of the same chunks in another order reuses all of them."""
    from cachedrag.engine import CachedEngine
    from cachedrag.testing import tiny_runner

    parts = [("text", "Context:\n\n"), ("chunk", "A"), ("text", "\n\n"), ("chunk", "B"), ("text", "\n\nQ?")]
    assert attach_separators(parts) == [("text", "Context:\n\n"), ("chunk", "A\n\n"), ("chunk", "B\n\n"),
                                        ("text", "Q?")]

    engine = CachedEngine(tiny_runner())
    planner = PromptPlanner(engine, PassageConfig(attach_separators=True))
    assert not PromptPlanner(engine).config.attach_separators  # off by default
    docs = [TINY_DOCS[i].text[:150] for i in (1, 2, 3)]

    def ask(order):
        chunks = [docs[i] for i in order]
        msgs = [Message("user", "Context:\n\n" + "\n\n".join(chunks) + "\n\nQuestion: what?")]
        planned = planner.chat(msgs, chunks=chunks)
        assert all(s.kind == "chunk" for s in planned.segments[2:-1])  # nothing between the chunks
        pre = engine.prefill(planned.segments, 4, defer_store=True)
        pre.hand_off and pre.hand_off()
        return pre.info

    cold = ask([0, 1, 2])
    assert cold["chunks_missed"] == 3 and cold["recomputed_tokens"] == 0
    warm = ask([2, 0, 1])  # another order: every chunk reused at a new position (the last one too)
    assert warm["chunks_hit"] == 3 and warm["chunks_missed"] == 0


def test_the_question_is_cut_from_the_context_after_the_last_passage():
    text = "Context:\n\nP1\n\nrest of the last chunk\n\nQuestion: why?<end>"
    parts = [("text", "Context:\n\n"), ("chunk", "P1"), ("text", "\n\nrest of the last chunk\n\nQuestion: why?<end>")]
    question = last_paragraph("Context:\n\nP1\n\nrest of the last chunk\n\nQuestion: why?")
    assert question == "Question: why?"
    assert question_apart(parts, text, question) == parts[:2] + [("text", "\n\nrest of the last chunk\n\n"),
                                                                 ("text", "Question: why?<end>")]
    bare = parts[:2] + [("text", "Question: why?<end>")]  # nothing between the last chunk and the question
    assert question_apart(bare, "Context:\n\nP1Question: why?<end>", question) == bare
    assert question_apart(parts, text, "not in the prompt") == parts
    assert question_apart(parts, text, None) == parts


def test_automatic_detection_keeps_the_context_after_the_last_passage_cached():
    """With automatic detection, what follows the last known passage up to the question (the rest
    of a retrieved text that is no passage of its own) is context: stored with the passages, so the
    same retrieved context with another question computes only the question, exactly (the prefill
    equals full prefill of the same segments)."""
    import torch

    from cachedrag.engine import CachedEngine
    from cachedrag.kvcache.config import CacheConfig
    from cachedrag.config import EngineConfig
    from cachedrag.testing import tiny_runner

    engine = CachedEngine(tiny_runner(), config=EngineConfig(cache=CacheConfig(exact={"repeats": 0})))
    planner = PromptPlanner(engine, PassageConfig(min_chars=100))
    passage, rest = TINY_DOCS[1].text, TINY_DOCS[2].text[:60]  # 60 characters: below min_chars, no passage

    def ask(question):
        msgs = [Message("user", f"Context:\n\n{passage}\n\n{rest}\n\nQuestion: {question}")]
        planned = planner.chat(msgs)
        pre = engine.prefill(planned.segments, 2, defer_store=True)
        pre.hand_off and pre.hand_off()
        return planned, pre

    first, _ = ask("what is it?")
    assert [s.kind for s in first.segments][-3:] == ["chunk", "text", "text"]
    assert rest in first.segments[-2].text and "what is it?" in first.segments[-1].text
    second, pre = ask("how is it used?")
    question = len(second.segments[-1])
    assert pre.info["computed_tokens"] == question  # the context, the rest of it included, came from cache
    full = engine.prefill(second.segments, 2, mode="full")
    assert torch.equal(pre.logits.argmax(-1), full.logits.argmax(-1))
    torch.testing.assert_close(pre.logits, full.logits, rtol=1e-4, atol=1e-4)
