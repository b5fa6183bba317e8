"""PromptBuilder.text_segments: per-part tokenisation (the reference) and whole-text tokenisation
cut at the parts' boundaries (what a server computes for the same text), on the default model's
byte-level BPE tokenizer, whose tokens cross a chunk's boundary (" member" after "\\n\\n")."""

from types import SimpleNamespace

import pytest

from cachedrag.errors import EmptyInputError
from cachedrag.kvcache.keys import Namespace
from cachedrag.prompt.segments import PromptBuilder

NS = Namespace("model@1", "float32", "tok@1")


def _ids(segments):
    return [t for s in segments for t in s.ids]


def test_whole_tokenization_cuts_the_texts_own_ids_at_the_parts(tokenizer):
    # a chunk cut from a corpus by tokens starts with a space; the tokenizer joins it to the first word
    parts = [("text", "Context:\n\n "), ("chunk", "member is the value, start=1,"), ("text", "\n\n"),
             ("chunk", "Help on module json:"), ("text", "\n\nQuestion: what is it?")]
    whole_text = "".join(t for _, t in parts)
    prompts = PromptBuilder(tokenizer, NS)
    whole = prompts.text_segments(parts, tokenization="whole")
    apart = prompts.text_segments(parts, tokenization="parts")
    want = tokenizer.encode(whole_text, add_special_tokens=False)
    assert _ids(whole) == want
    assert _ids(apart) != want  # per part, "\n\n " and "member" are other tokens than "\n\n" and " member"
    assert [s.kind for s in whole] == [k for k, _ in parts]
    first = whole[1]
    assert first.text == " member is the value, start=1," and first.ids[0] == tokenizer.encode(" member", add_special_tokens=False)[0]
    assert "".join(s.text for s in whole) == whole_text
    assert whole[3].ids == apart[3].ids  # a chunk after a blank line: the same ids either way


def test_a_chunk_keeps_its_key_wherever_blank_lines_surround_it(tokenizer):
    prompts = PromptBuilder(tokenizer, NS)
    chunk = " The heapq module provides an implementation of the heap queue algorithm."
    keys = set()
    for before in ("Context:\n\n", "Context:\n\nThe bisect module.\n\n", "Docs:\n-----\n"):
        segs = prompts.text_segments([("text", before), ("chunk", chunk), ("text", "\n\nQuestion: heaps?")],
                                     tokenization="whole")
        keys.add(next(s.key for s in segs if s.kind == "chunk"))
    assert len(keys) == 1
    glued = prompts.text_segments([("text", "Context:"), ("chunk", chunk.strip()), ("text", "?")],
                                  tokenization="whole")  # no whitespace before it: another first token
    assert next(s.key for s in glued if s.kind == "chunk") not in keys


def test_a_part_left_without_tokens_is_dropped_and_bad_settings_refused(tokenizer):
    prompts = PromptBuilder(tokenizer, NS)
    segs = prompts.text_segments([("text", "Context:\n\n"), ("text", " "), ("chunk", "member is")], "whole")
    assert _ids(segs) == tokenizer.encode("Context:\n\n member is", add_special_tokens=False)
    assert all(len(s) for s in segs)
    with pytest.raises(ValueError, match="tokenization"):
        prompts.text_segments([("text", "x")], tokenization="bytes")
    with pytest.raises(EmptyInputError):
        prompts.text_segments([("text", "")], tokenization="whole")


def test_a_tokenizer_without_offsets_falls_back_to_parts(tokenizer):
    slow = SimpleNamespace(is_fast=False, encode=tokenizer.encode)
    parts = [("text", "Context:\n\n "), ("chunk", "member is")]
    assert _ids(PromptBuilder(slow, NS).text_segments(parts, "whole")) == \
        _ids(PromptBuilder(tokenizer, NS).text_segments(parts, "parts"))


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_the_engines_chat_layout_has_the_chat_templates_ids(tokenizer, system):
    """Each chunk is tokenised alone (its key does not depend on its neighbours), yet the layout's
    ids are the chat template's over the layout's text: chunks stripped (a token window of a
    corpus starts with its first word's space, "\n" or indentation), and a chunk's trailing
    "\n\n" two "\n" tokens before the next word, as in the whole text, not the one "\n\n" token
    it is alone."""
    prompts = PromptBuilder(tokenizer, NS)
    chunks = [" member is the value, start=1,", "The json module encodes objects.", "Use json.dumps(obj).\n",
              "\n\ndef f():\n    return 1", "    indented()  ", "uuid4() gives a random UUID"]
    question = "How do I pretty-print JSON?"
    segments = prompts.chat(chunks, question, system)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": "".join(c.strip() + "\n\n" for c in chunks) + "Question: " + question}]
    want = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
    assert _ids(segments) == list(want["input_ids"])
    alone = tokenizer.encode(chunks[1] + "\n\n", add_special_tokens=False)
    assert segments[2].ids == tuple(alone[:-1]) + (198, 198) and alone[-1] != 198  # "\n\n" -> "\n", "\n"
    moved = prompts.chat([chunks[3], chunks[1]], question, system)
    assert moved[2].key == segments[2].key == prompts.chunk_segment(chunks[1]).key  # one key in any position
    assert prompts.chunk_segment(" " + chunks[1] + "\n").key == segments[2].key  # surrounding whitespace aside


def test_running_ids_keep_the_texts_own_ids_where_the_next_word_would_take_a_character(tokenizer):
    prompts = PromptBuilder(tokenizer, NS)
    own = tuple(tokenizer.encode("abc. ", add_special_tokens=False))
    assert prompts.running_ids("abc. ") == own  # the space would join the next word: nothing to cut
    assert prompts.running_ids("abc.") == tuple(tokenizer.encode("abc.", add_special_tokens=False))
    slow = PromptBuilder(SimpleNamespace(encode=lambda text, add_special_tokens: [7, 8], is_fast=False), NS)
    assert slow.running_ids("x\n\n") == (7, 8)  # no offsets: the text's own ids


def test_the_pipelines_layout_has_the_whole_texts_ids(tokenizer):
    """The pipelines' layout (EngineGenerator's segments, TransformersGenerator's 'segments'
    baseline) tokenises to the ids of its whole text, the 'chat_template' baseline's."""
    from cachedrag.pipelines.generators import layout
    from cachedrag.prompt.segments import running_ids

    prompts = PromptBuilder(tokenizer, NS)
    before, after = prompts.template_split("Answer briefly.")
    parts = layout(before, (" member is the value,", "\nHelp on module json:\n", "heapq."), "Question: why?", after,
                   "Answer:")
    whole = tokenizer.encode("".join(text for _, text in parts), add_special_tokens=False)
    assert _ids(prompts.text_segments(parts)) == whole
    assert [t for _, text in parts for t in running_ids(tokenizer, text)] == whole
