"""Speculative pipelining through the user-facing option ``pipelining=``: LlamaIndex, LangChain, a pipeline.

Each framework path answers the same questions with and without ``pipelining=`` and prints the
answers (equal) and what the speculation did. Uses the stdlib index under the cache home (built
once, ~3.5 min) unless ``--index DIR`` names an index directory (``cachedrag index build``).

    python examples/pipelining_option.py [--index DIR]
"""

from __future__ import annotations

import argparse

from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from llama_index.core.query_engine import RetrieverQueryEngine

from cachedrag.engine import CachedEngine
from cachedrag.integrations import ChunkRegistry
from cachedrag.integrations.engines import shared_engine
from cachedrag.integrations.langchain import CachedRAGRetriever as LCRetriever
from cachedrag.integrations.langchain import ChatCachedRAG
from cachedrag.integrations.llama_index import CachedRAGLLM, CachedRAGRetriever
from cachedrag.pipelines import HyDE
from cachedrag.retrieval import PipeliningConfig, load_index

QUESTIONS = ["How do I pretty-print JSON?", "What does heapq.heappush do?", "How do I get a SHA-256 digest?"]
# speculate on every request: the stdlib index's searches take ~1 ms, below the default min_search_s
ALWAYS = PipeliningConfig(min_search_s=0.0)


def llama_index(index_dir: str, runner, pipelining) -> list[tuple[str, dict | None]]:
    reg = ChunkRegistry()  # a fresh registry and engine per variant: the same cache history for both
    llm = CachedRAGLLM(engine=CachedEngine(runner), chunk_registry=reg, max_new_tokens=32)
    retriever = CachedRAGRetriever(index_dir=index_dir, similarity_top_k=3, chunk_registry=reg, pipelining=pipelining)
    engine = RetrieverQueryEngine.from_args(retriever, llm=llm)
    return [(str(engine.query(q)).strip(), retriever.last_speculation) for q in QUESTIONS]


def langchain(index_dir: str, runner, pipelining) -> list[tuple[str, dict | None]]:
    reg = ChunkRegistry()
    chat = ChatCachedRAG(engine=CachedEngine(runner), chunk_registry=reg, max_tokens=32)
    retriever = LCRetriever(index_dir=index_dir, k=3, chunk_registry=reg, pipelining=pipelining)
    prompt = ChatPromptTemplate.from_messages([("system", "Answer from the context."),
                                               ("human", "Context:\n{context}\n\nQuestion: {question}")])
    chain = ({"context": retriever | (lambda docs: "\n\n".join(d.page_content for d in docs)),
              "question": RunnablePassthrough()} | prompt | chat | StrOutputParser())
    return [(chain.invoke(q).strip(), retriever.last_speculation) for q in QUESTIONS]


def hyde(index_dir: str, runner, pipelining) -> list[tuple[str, dict | None]]:
    pipeline = HyDE(CachedEngine(runner), load_index(index_dir), top_k=3, passage_tokens=24, max_new_tokens=32,
                    pipelining=pipelining)
    out = []
    for q in QUESTIONS:
        run = pipeline.run(q)
        out.append((run.answer, run.steps_of("retrieval")[0].retrieval.get("speculation")))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index", help="index directory (default: the stdlib index under the cache home)")
    args = parser.parse_args()
    if args.index is None:
        from cachedrag.retrieval.scale import stdlib_base_index

        args.index = str(stdlib_base_index().path)
    runner = shared_engine().runner  # one model for every engine
    for name, path in (("LlamaIndex", llama_index), ("LangChain", langchain), ("HyDE pipeline", hyde)):
        plain, piped = path(args.index, runner, False), path(args.index, runner, ALWAYS)
        print(f"== {name}: answers equal with and without pipelining: {[a for a, _ in plain] == [a for a, _ in piped]}")
        for q, (answer, spec) in zip(QUESTIONS, piped):
            print(f"  {q}\n    {answer[:100]!r}\n    speculation: {spec}")


if __name__ == "__main__":
    main()
