"""Decode speed of the engine: the runner's fast path and prompt-lookup speculative decoding.

Four engines share one model: the reference path (F.linear over the HF modules, one token per
pass), the few-row ``W @ x^T`` layout over the HF modules, the fast path (fused projections,
``docs/speed.md``; the default), and the fast path with prompt-lookup drafts (the engine's
default). Each answers the same questions over the same chunks, interleaved; all should
produce the same tokens (the paths sum in different orders, so a near-tied greedy choice may
differ). Prints decode ms per generated token and how many drafts were kept.

Run: .venv/bin/python scripts/decode_speed.py [--questions 6] [--tokens 48]
"""

import argparse

from cachedrag.config import EngineConfig
from cachedrag.corpus import STDLIB_QUESTIONS, stdlib_corpus
from cachedrag.engine import CachedEngine
from cachedrag.model.loader import load_model
from cachedrag.model.lookup import LookupConfig
from cachedrag.model.runner import ModelRunner

parser = argparse.ArgumentParser()
parser.add_argument("--questions", type=int, default=6)
parser.add_argument("--tokens", type=int, default=48)
args = parser.parse_args()

model, tokenizer = load_model()
engines = {
    "F.linear, no drafts": CachedEngine(ModelRunner(model, tokenizer, fast=False, skinny_linear=False),
                                        config=EngineConfig(lookup=LookupConfig(max_draft=0))),
    "few-row layout, no drafts": CachedEngine(ModelRunner(model, tokenizer, fast=False),
                                              config=EngineConfig(lookup=LookupConfig(max_draft=0))),
    "fast path, no drafts": CachedEngine(ModelRunner(model, tokenizer), config=EngineConfig(lookup=LookupConfig(max_draft=0))),
    "fast path + drafts (default)": CachedEngine(ModelRunner(model, tokenizer)),
}
docs = {d.id: d.text for d in stdlib_corpus(("json", "heapq", "bisect", "functools", "textwrap", "csv"))}
chunks = [tokenizer.decode(tokenizer.encode(t, add_special_tokens=False)[:256]) for t in docs.values()]
totals = {name: [0.0, 0, 0, 0] for name in engines}  # decode s, tokens, draft tokens, accepted
for i, question in enumerate(list(STDLIB_QUESTIONS)[: args.questions]):
    picked = chunks[i % len(chunks):] + chunks[: i % len(chunks)]
    answers = set()
    for name, engine in engines.items():
        engine.generate(picked[:4], question, max_new_tokens=1)  # cache the chunks: time decode, not prefill
        r = engine.generate(picked[:4], question, max_new_tokens=args.tokens)
        t = totals[name]
        t[0] += r.total_s - r.ttft_s
        t[1] += max(0, len(r.token_ids) - 1)
        t[2] += r.draft_tokens
        t[3] += r.draft_accepted
        answers.add(tuple(r.token_ids))
    print(f"{question[:60]!r}: {'same tokens' if len(answers) == 1 else 'DIFFERENT tokens'} from all four")

for name, (seconds, tokens, drafted, accepted) in totals.items():
    kept = f", {accepted}/{drafted} draft tokens accepted" if drafted else ""
    print(f"{name:<36} {seconds / max(tokens, 1) * 1000:6.1f} ms/token{kept}")
