"""Benchmark workloads: a corpus, its chunks, exact top-k retrieval and a question stream.

Owns: what the engine-level suites (ttft, tiers, pipelines) feed their engines, built the
same way for each so their figures compare: corpus (a user path, or an embedded one: the stdlib
docs or the GNU info manuals, ``EMBEDDED_CORPORA``, each with the system prompt its questions are
asked under), token chunks in the LLM's tokenizer, MiniLM embeddings, exact inner-product top-k,
and a deterministic Zipf-skewed question stream over the embedded corpus's topics when no
question file is given. Also a workload's file form (``save_workload`` / ``load_workload``: what
a run needs downstream of retrieval, so a machine without the embedder, or with another Python
whose stdlib docs differ, replays the same requests; ``bench ttft --workload-out`` /
``--workload``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cachedrag.corpus import (INFO_TOPICS, STDLIB_TOPICS, Document, info_corpus, load_corpus, load_questions,
                              stdlib_corpus, zipf_stream)
from cachedrag.errors import ConfigError

#: the ``format`` tag and ``version`` of a saved workload file
WORKLOAD_FORMAT = "cachedrag-bench-workload"
WORKLOAD_VERSION = 1


@dataclass(frozen=True)
class EmbeddedCorpus:
    """A corpus shipped with the package (no data files) and how the benchmarks ask it."""

    title: str  # a built workload's ``corpus_name``
    documents: Callable[[], list[Document]]
    topics: tuple[tuple[str, ...], ...]  # the Zipf stream's topics, each a few phrasings of one question
    system_prompt: str  # the system prompt its questions are asked under


EMBEDDED_CORPORA: dict[str, EmbeddedCorpus] = {
    "stdlib": EmbeddedCorpus("stdlib docs", stdlib_corpus, STDLIB_TOPICS,
                             "You are a helpful assistant. Answer the question using the Python documentation "
                             "excerpts given by the user. Be brief."),
    "info": EmbeddedCorpus("GNU info manuals", info_corpus, INFO_TOPICS,
                           "You are a helpful assistant. Answer the question using the GNU manual excerpts given "
                           "by the user. Be brief."),
}


def embedded_corpus_of(work: "Workload") -> EmbeddedCorpus:
    """The embedded corpus a workload was built from (by its ``corpus_name``); the stdlib one for any
    other (a user corpus, a hand-made workload)."""
    return next((c for c in EMBEDDED_CORPORA.values() if c.title == work.corpus_name), EMBEDDED_CORPORA["stdlib"])


@dataclass
class Workload:
    chunks: list[str]
    questions: list[str]  # the request stream, in order
    retrieved: list[list[str]]  # top-k chunk texts per request
    corpus_name: str
    question_source: str
    #: how it was built: top_k, chunk_tokens, overlap, n_requests, zipf_s, seed, embedder (empty when
    #: made by hand)
    params: dict = field(default_factory=dict)


def build_workload(tokenizer, corpus: str | None = None, questions: str | None = None, *, top_k: int = 5,
                   chunk_tokens: int = 256, n_requests: int = 40, zipf_s: float = 1.1, seed: int = 0,
                   embedded: str = "stdlib") -> Workload:
    """``corpus``: a user path; without one, the embedded corpus ``embedded`` (``EMBEDDED_CORPORA``),
    whose topics make the Zipf stream when no ``questions`` file is given."""
    from cachedrag.retrieval.chunker import chunk_documents
    from cachedrag.retrieval.config import ChunkConfig
    from cachedrag.retrieval.embedder import Embedder

    if embedded not in EMBEDDED_CORPORA:
        raise ConfigError(f"unknown embedded corpus {embedded!r}; choose one of {', '.join(EMBEDDED_CORPORA)}")
    topics = EMBEDDED_CORPORA[embedded].topics
    docs = load_corpus(corpus) if corpus else EMBEDDED_CORPORA[embedded].documents()
    chunk_objs = chunk_documents(docs, tokenizer, ChunkConfig(chunk_tokens=chunk_tokens, overlap=0), progress=False)
    texts = [c.text for c in chunk_objs]
    if questions:
        stream = load_questions(questions)
        source = str(questions)
    else:
        stream = zipf_stream(list(topics), n_requests, zipf_s, seed)
        source = (f"zipf(s={zipf_s}) stream of {n_requests} over {len(topics)} {embedded} topics "
                  f"x {len(topics[0])} phrasings")
    embedder = Embedder()
    chunk_vecs = embedder.encode(texts)  # [N, d]
    unique = sorted(set(stream))
    qvecs = embedder.encode(unique)  # [Q, d]
    top = np.argsort(-(qvecs @ chunk_vecs.T), axis=1)[:, :top_k]  # [Q, k]
    by_question = {q: [texts[i] for i in row] for q, row in zip(unique, top)}
    params = {"top_k": top_k, "chunk_tokens": chunk_tokens, "overlap": 0,
              "n_requests": None if questions else n_requests, "zipf_s": None if questions else zipf_s,
              "seed": None if questions else seed, "embedder": embedder.name}
    return Workload(texts, stream, [by_question[q] for q in stream], corpus or EMBEDDED_CORPORA[embedded].title,
                    source, params)


def _chunks_digest(chunks: list[str]) -> str:
    h = hashlib.sha256()
    for text in chunks:
        h.update(text.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


def save_workload(work: Workload, path: str | Path, *, tokenizer: dict | None = None) -> dict:
    """Write ``work`` as JSON to ``path``: every chunk text once, each request's top-k as indices into
    them, the question stream in order, how it was built (``work.params``) and ``tokenizer`` (the
    identity of the LLM tokenizer the chunks were cut in: ``{"model", "fingerprint"}``). Returns
    what was written."""
    index: dict[str, int] = {}
    for i, text in enumerate(work.chunks):
        index.setdefault(text, i)
    missing = [t for ts in work.retrieved for t in ts if t not in index]
    if missing:
        raise ConfigError(f"workload: a retrieved text is not among its chunks: {missing[0][:60]!r}")
    data = {
        "format": WORKLOAD_FORMAT, "version": WORKLOAD_VERSION,
        "corpus": work.corpus_name, "question_source": work.question_source,
        "params": dict(work.params), "tokenizer": dict(tokenizer or {}),
        "n_chunks": len(work.chunks), "chunks_sha256": _chunks_digest(work.chunks),
        "questions": list(work.questions),
        "retrieved": [[index[t] for t in ts] for ts in work.retrieved],
        "chunks": list(work.chunks),
    }
    Path(path).write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return data


def load_workload(path: str | Path) -> tuple[Workload, dict]:
    """Read a file ``save_workload`` wrote: ``(Workload, its tokenizer identity)``. Any problem (no
    such file, not JSON, another format or version, a field missing or of the wrong shape, chunks
    that do not match their digest) is one ``ConfigError`` naming the file."""
    where = f"workload file {path}"
    try:
        raw = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: cannot read it: {exc}") from None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != WORKLOAD_FORMAT:
        raise ConfigError(f"{where}: not a bench workload (no \"format\": \"{WORKLOAD_FORMAT}\")")
    if data.get("version") != WORKLOAD_VERSION:
        raise ConfigError(f"{where}: version {data.get('version')!r}, this cachedrag reads version {WORKLOAD_VERSION}")

    def strings(name: str) -> list[str]:
        value = data.get(name)
        if not isinstance(value, list) or not value or not all(isinstance(x, str) for x in value):
            raise ConfigError(f"{where}: {name!r} must be a non-empty list of strings")
        return value

    chunks, questions = strings("chunks"), strings("questions")
    retrieved = data.get("retrieved")
    if (not isinstance(retrieved, list) or len(retrieved) != len(questions)
            or not all(isinstance(r, list) and r and all(type(i) is int and 0 <= i < len(chunks) for i in r)
                       for r in retrieved)):
        raise ConfigError(f"{where}: 'retrieved' must hold, per question ({len(questions)}), a non-empty list of "
                          f"chunk indices in 0..{len(chunks) - 1}")
    for name in ("corpus", "question_source"):
        if not isinstance(data.get(name), str):
            raise ConfigError(f"{where}: {name!r} must be a string")
    for name in ("params", "tokenizer"):
        if not isinstance(data.get(name, {}), dict):
            raise ConfigError(f"{where}: {name!r} must be an object")
    if data.get("n_chunks") != len(chunks) or data.get("chunks_sha256") != _chunks_digest(chunks):
        raise ConfigError(f"{where}: its chunks do not match their recorded count and digest (edited or truncated?)")
    work = Workload(chunks, questions, [[chunks[i] for i in r] for r in retrieved], data["corpus"],
                    data["question_source"], dict(data.get("params", {})))
    return work, dict(data.get("tokenizer", {}))
