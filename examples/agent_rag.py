"""Agentic RAG with cachedrag: LangGraph's ReAct agent and LlamaIndex's FunctionAgent search an index.

Both agents get one tool, ``search_docs``, over cachedrag's retriever, and follow a ``ToolScript``
(two searches, then the answer: the small default model seldom calls a tool on its own). Each
step's prompt is the previous step's prompt, its tool call and the new passages: the previous
prompt and call come from the cache as an exact prefix, the new passages as reused chunks, so a
step computes little more than what is new. The printed lines show it per step.

Run: .venv/bin/python examples/agent_rag.py [--index DIR] [--tiny]
(--tiny: a tiny random-weight model, seconds; its answers are noise, its tool calls valid)
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from cachedrag.integrations.langchain import CachedRAGRetriever as LangChainRetriever
from cachedrag.integrations.langchain import ChatCachedRAG
from cachedrag.integrations.llama_index import CachedRAGLLM
from cachedrag.integrations.llama_index import CachedRAGRetriever as LlamaIndexRetriever
from cachedrag.pipelines.agent import ToolScript, function_agent, langgraph_agent

QUESTION = "How do I pretty-print a JSON document with indentation?"
MODULES = ("json", "heapq", "bisect", "textwrap")


def setup(tiny: bool, out: Path) -> tuple[str, Path]:
    """The model name the classes use and an index of a few stdlib modules' docs."""
    from cachedrag.corpus import stdlib_corpus
    from cachedrag.retrieval import Embedder, build_index
    from cachedrag.retrieval.config import ChunkConfig, IndexConfig, RetrievalConfig

    if tiny:
        from cachedrag.engine import CachedEngine
        from cachedrag.integrations.engines import register_engine
        from cachedrag.model.runner import ModelRunner
        from cachedrag.testing import byte_tokenizer, tiny_model

        tokenizer = byte_tokenizer()
        model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=4096)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        register_engine("tiny", CachedEngine(ModelRunner(model, tokenizer)))
        name = "tiny"
        config = RetrievalConfig(chunk=ChunkConfig(chunk_tokens=96, overlap=8), index=IndexConfig(nlist=2))
    else:
        from cachedrag.model.loader import load_default_tokenizer

        tokenizer, name = load_default_tokenizer(), "default"
        config = RetrievalConfig(chunk=ChunkConfig(chunk_tokens=96, overlap=16), index=IndexConfig(nlist=4))
    docs = stdlib_corpus(MODULES, max_chars_per_doc=2500)
    build_index(docs, tokenizer, Embedder(), config, out=out, progress=False)
    return name, out


def run_langgraph(model: str, index_dir: Path) -> None:
    agent = langgraph_agent(ChatCachedRAG(model=model, max_tokens=48),
                            LangChainRetriever(index_dir=str(index_dir), k=3), script=ToolScript(2, 2))
    out = agent.invoke({"messages": [("user", QUESTION)]})
    print("LangGraph create_react_agent over ChatCachedRAG:")
    for m in out["messages"]:
        if m.type == "ai":
            c = m.response_metadata["cache"]
            what = ", ".join(f"{t['name']}({t['args']})" for t in m.tool_calls) or repr(m.content[:80])
            print(f"  step: prompt {c['prompt_tokens']} tokens, computed {c['computed_tokens']}, "
                  f"prefix hit {c['prefix_hit_tokens']}, chunks reused {c['chunks_hit']} -> {what}")
        elif m.type == "tool":
            print(f"  tool result: {len(m.content)} characters")


def run_llama_index(model: str, index_dir: Path) -> None:
    llm = CachedRAGLLM(model=model, max_new_tokens=48)
    agent = function_agent(llm, LlamaIndexRetriever(index_dir=str(index_dir), similarity_top_k=3),
                           script=ToolScript(2, 2))
    async def run():  # the workflow needs a running event loop
        return await agent.run(user_msg=QUESTION)

    out = asyncio.run(run())
    print("LlamaIndex FunctionAgent over CachedRAGLLM:")
    for call in out.tool_calls:
        print(f"  {call.tool_name}({call.tool_kwargs}) -> {len(call.tool_output.content)} characters")
    stats = llm.last_stats
    print(f"  answer: {str(out.response.content)[:100]!r} (prompt {stats['prompt_tokens']} tokens, "
          f"computed {stats['computed_tokens']})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index", help="an index directory from `cachedrag index build` (the model's tokenizer)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random-weight model (seconds)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.index:
            model, index_dir = ("tiny" if args.tiny else "default"), Path(args.index)
            if args.tiny:
                parser.error("--index with --tiny: the tiny model's index is built here")
        else:
            model, index_dir = setup(args.tiny, Path(tmp) / "index")
        run_langgraph(model, index_dir)
        run_llama_index(model, index_dir)


if __name__ == "__main__":
    main()
