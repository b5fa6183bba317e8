"""One per-sequence decode state (``model.generation.SequenceDecoder``) behind both ``generate`` and the
server's batched loop: the same tokens, text and finish reasons for stop strings, ``max_new_tokens`` and a
grammar constraint (including a grammar that completes on the last allowed token)."""

from __future__ import annotations


from cachedrag.config import EngineConfig
from cachedrag.engine import CachedEngine
from cachedrag.model.constraint import JsonConstraint
from cachedrag.model.generation import SamplingParams, SequenceDecoder
from cachedrag.model.lookup import LookupConfig
from cachedrag.testing import TINY_DOCS, serve_requests, tiny_runner

NO_DRAFTS = EngineConfig(lookup=LookupConfig(max_draft=0))
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def _serve(engine, requests):
    return serve_requests(engine, requests)[0]


def test_server_and_generate_agree_on_tokens_text_and_finish_reason():
    served, reference = CachedEngine(tiny_runner(), config=NO_DRAFTS), CachedEngine(tiny_runner(), config=NO_DRAFTS)
    docs = [d.text for d in TINY_DOCS]

    def prompt(engine, i):
        return engine.prompts.chat(docs[i:i + 1], "What does heapq do?")

    plain = reference.generate_segments(prompt(reference, 0), SamplingParams(max_new_tokens=16))
    stop = plain.text[3:5]
    assert stop and plain.finish_reason == "length"
    grammar = reference.generate_segments(prompt(reference, 1), SamplingParams(
        max_new_tokens=40, constraint=JsonConstraint(SCHEMA, reference.runner.tokenizer, reference.eos_ids)))
    assert grammar.finish_reason == "stop"

    def kinds(engine):  # fresh constraints each time: a constraint follows one generation
        def json_params(n):
            return SamplingParams(max_new_tokens=n, constraint=JsonConstraint(SCHEMA, engine.runner.tokenizer,
                                                                                engine.eos_ids))
        return [(prompt(engine, 0), SamplingParams(max_new_tokens=16, stop=[stop])),
                (prompt(engine, 0), SamplingParams(max_new_tokens=7)),
                (prompt(engine, 1), json_params(40)),
                (prompt(engine, 1), json_params(len(grammar.token_ids))),  # completes on the last token allowed
                (prompt(engine, 1), json_params(3))]  # cut off mid-document

    got = _serve(served, kinds(served))
    want = [reference.generate_segments(segments, params) for segments, params in kinds(reference)]
    assert [(g.token_ids, g.text, g.finish_reason) for g in got] == \
        [(w.token_ids, w.text, w.finish_reason) for w in want]
    assert [g.finish_reason for g in got] == ["stop", "length", "stop", "stop", "length"]
    assert got[0].text == plain.text[:plain.text.index(stop)]
    assert got[3].token_ids == grammar.token_ids


def test_sequence_decoder_tail():
    """``choose`` / ``accept`` / ``finished`` / ``finish_reason`` / ``rewind`` on one sequence."""
    import torch

    runner = tiny_runner()
    decoder = SequenceDecoder.start(runner, SamplingParams(max_new_tokens=2), eos_ids={0})
    a = runner.tokenizer.encode("a")[0]
    logits = torch.zeros(len(runner.tokenizer))  # [V]
    logits[0] = 1.0
    assert decoder.choose(logits) is None and decoder.eos and decoder.finished and decoder.finish_reason == "stop"
    decoder = SequenceDecoder.start(runner, SamplingParams(max_new_tokens=2), eos_ids={0})
    logits[0], logits[a] = 0.0, 5.0
    token = decoder.choose(logits)
    assert token == a and not decoder.finished
    decoder.accept(token)
    decoder.accept(token)
    assert decoder.finished and decoder.finish_reason == "length" and decoder.tokens == [token, token]
    decoder.rewind(1)
    assert decoder.tokens == [token] and decoder.stream.ids == [token] and not decoder.finished
