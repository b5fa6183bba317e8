"""Benchmark workloads: a corpus, its chunks, exact top-k retrieval and a question stream.

Owns: what the engine-level suites (ttft, tiers, pipelines) feed their engines, built the
same way for each so their figures compare: corpus (a user path, or the stdlib docs),
token chunks in the LLM's tokenizer, MiniLM embeddings, exact inner-product top-k, and a
deterministic Zipf-skewed question stream when no question file is given.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from cachedrag.corpus import STDLIB_TOPICS, load_corpus, load_questions, stdlib_corpus


@dataclass
class Workload:
    chunks: list[str]
    questions: list[str]  # the request stream, in order
    retrieved: list[list[str]]  # top-k chunk texts per request
    corpus_name: str
    question_source: str


def zipf_stream(pool, n: int, s: float = 1.1, seed: int = 0) -> list[str]:
    """``n`` requests with Zipf(s) popularity over a shuffled rank order of ``pool``.

    ``pool`` items are questions, or topics (tuples of phrasings of one question): a topic is
    drawn by popularity, then one of its phrasings uniformly, as users word the same need
    differently.
    """
    rng = random.Random(seed)
    ranked = list(pool)
    rng.shuffle(ranked)
    weights = [1.0 / (r + 1) ** s for r in range(len(ranked))]
    picks = rng.choices(ranked, weights=weights, k=n)
    return [rng.choice(p) if isinstance(p, tuple) else p for p in picks]


def build_workload(tokenizer, corpus: str | None = None, questions: str | None = None, *, top_k: int = 5,
                   chunk_tokens: int = 256, n_requests: int = 40, zipf_s: float = 1.1, seed: int = 0) -> Workload:
    from cachedrag.retrieval.chunker import chunk_documents
    from cachedrag.retrieval.config import ChunkConfig
    from cachedrag.retrieval.embedder import Embedder

    docs = load_corpus(corpus) if corpus else stdlib_corpus()
    chunk_objs = chunk_documents(docs, tokenizer, ChunkConfig(chunk_tokens=chunk_tokens, overlap=0), progress=False)
    texts = [c.text for c in chunk_objs]
    if questions:
        stream = load_questions(questions)
        source = str(questions)
    else:
        stream = zipf_stream(list(STDLIB_TOPICS), n_requests, zipf_s, seed)
        source = (f"zipf(s={zipf_s}) stream of {n_requests} over {len(STDLIB_TOPICS)} stdlib topics "
                  f"x {len(STDLIB_TOPICS[0])} phrasings")
    embedder = Embedder()
    chunk_vecs = embedder.encode(texts)  # [N, d]
    unique = sorted(set(stream))
    qvecs = embedder.encode(unique)  # [Q, d]
    top = np.argsort(-(qvecs @ chunk_vecs.T), axis=1)[:, :top_k]  # [Q, k]
    by_question = {q: [texts[i] for i in row] for q, row in zip(unique, top)}
    return Workload(texts, stream, [by_question[q] for q in stream], corpus or "stdlib docs", source)
