"""LangChain RAG with cachedrag: an LCEL chain whose chat model reuses chunk KV caches.

Builds a small index of a few stdlib modules' docs (or uses --index DIR from
`cachedrag index build`) and runs the classic LCEL RAG chain with invoke, stream, batch and
ainvoke. Repeated questions reuse the retrieved chunks' KV caches.

Run: .venv/bin/python examples/langchain_rag.py [--index DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough

from cachedrag.integrations.langchain import CachedRAGRetriever, ChatCachedRAG


def small_index(out: Path) -> Path:
    from cachedrag.corpus import stdlib_corpus
    from cachedrag.model.loader import load_default_tokenizer
    from cachedrag.retrieval import Embedder, build_index

    docs = stdlib_corpus(("json", "heapq", "bisect", "hashlib", "uuid", "textwrap"), max_chars_per_doc=6000)
    build_index(docs, load_default_tokenizer(), Embedder(), out=out, progress=False)
    return out


def format_docs(docs) -> str:
    return "\n\n".join(d.page_content for d in docs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index", help="an index directory from `cachedrag index build`")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        index_dir = args.index or small_index(Path(tmp) / "index")
        retriever = CachedRAGRetriever(index_dir=str(index_dir), k=3)
        model = ChatCachedRAG(max_tokens=48)  # the embedded SmolLM2-135M-Instruct; no network
        prompt = ChatPromptTemplate.from_messages([
            ("system", "Answer the question from the Python documentation excerpts. Be brief."),
            ("human", "Excerpts:\n{context}\n\nQuestion: {question}"),
        ])
        rag = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | model
        chain = rag | StrOutputParser()

        question = "How do I pretty-print a JSON document with indentation?"
        print("invoke:", chain.invoke(question).strip()[:160])
        message = rag.invoke(question)  # again: the chunks come from the cache
        cache = message.response_metadata["cache"]
        print(f"usage {message.usage_metadata}; TTFT {cache['ttft_s'] * 1000:.0f} ms, "
              f"{cache['registered_chunks_cached']} of {cache['registered_chunks']} retrieved chunks from the cache")
        print("stream: ", end="")
        for delta in chain.stream("What does heapq.heappush do?"):
            print(delta, end="", flush=True)
        print()
        for answer in chain.batch(["How do I generate a random UUID?", "How do I wrap text to a width?"]):
            print("batch:", answer.strip()[:120])
        print("ainvoke:", asyncio.run(chain.ainvoke("How do I compute a SHA-256 hash?")).strip()[:120])


if __name__ == "__main__":
    main()
