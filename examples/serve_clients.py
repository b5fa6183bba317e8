"""Talk to `cachedrag serve` from the OpenAI SDK, LlamaIndex and LangChain.

Starts `cachedrag serve` on 127.0.0.1 (a free port) as a child process, then sends the same
retrieved chunks three ways and prints how many prompt tokens the server served from its
chunk cache (`usage.prompt_tokens_details.cached_tokens`; the response's `cachedrag` object says
which approximations served it):

1. the OpenAI SDK with the explicit extension field (`extra_body={"cachedrag": {"chunks": [...]}}`);
2. an unmodified client (no field): the server finds the passages it has seen before;
3. LlamaIndex `CachedRAGOpenAILike` and LangChain `ChatCachedRAGOpenAI`, which attach the
   chunks registered by cachedrag's retrievers (here registered by hand);

then asks for structured output: JSON valid for a schema (`response_format`) and a required
tool call (`tools` + `tool_choice`).

    python examples/serve_clients.py          # the default model (SmolLM2-135M)
    python examples/serve_clients.py --tiny   # a tiny random model: seconds, gibberish answers
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

from openai import OpenAI

from cachedrag.corpus import stdlib_corpus
from cachedrag.integrations import register_chunks


def start_server(tiny: bool, *flags: str) -> tuple[subprocess.Popen, str]:
    """`cachedrag serve` (with ``flags``) on a free port; returns the process and its URL."""
    cmd = [sys.executable, "-m", "cachedrag.cli", "serve", "--port", "0", "--log-level", "warning", *flags]
    proc = subprocess.Popen(cmd + (["--tiny", "--passage-chars", "100"] if tiny else []), stderr=subprocess.PIPE,
                            text=True)
    for line in proc.stderr:
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            return proc, m.group(1)
    raise SystemExit("the server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    proc, url = start_server(args.tiny)
    model = "tiny-random" if args.tiny else "SmolLM2-135M-Instruct"
    try:
        docs = [d.text for d in stdlib_corpus()[:3]]
        chunks = [d[:180 if args.tiny else 1200].strip() for d in docs]  # the tiny model has a 512-token window
        client = OpenAI(base_url=url + "/v1", api_key="none")

        def ask(order, explicit):
            context = "\n\n".join(order)
            r = client.chat.completions.create(
                model=model, max_tokens=24, temperature=0,
                messages=[{"role": "system", "content": "Answer from the documentation excerpts."},
                          {"role": "user", "content": f"Context:\n\n{context}\n\nQuestion: What are these modules for?"}],
                extra_body={"cachedrag": {"chunks": order}} if explicit else None)
            return r.usage, r.model_extra["cachedrag"]  # how the server served the prompt

        first, _ = ask(chunks[:2], explicit=True)
        again, served = ask(chunks[:2][::-1], explicit=True)
        print(f"explicit chunks: first request {first.prompt_tokens_details.cached_tokens}/{first.prompt_tokens} "
              f"cached; same chunks reordered: {again.prompt_tokens_details.cached_tokens}/{again.prompt_tokens}, "
              f"approximations {served['approximations'] or 'none'}")
        auto, _ = ask([chunks[1], chunks[0]], explicit=False)
        print(f"unmodified client (automatic detection): {auto.prompt_tokens_details.cached_tokens}/"
              f"{auto.prompt_tokens} cached")

        register_chunks(chunks)  # what CachedRAGRetriever / CachedRAGNodePostprocessor do with their results
        prompt = f"Context:\n\n{chunks[1]}\n\n{chunks[0]}\n\nQuestion: Name one function."
        try:
            from cachedrag.integrations.openai_llama_index import CachedRAGOpenAILike

            llm = CachedRAGOpenAILike(model=model, api_base=url + "/v1", max_tokens=24, temperature=0.0)
            print("LlamaIndex:", llm.complete(prompt).text.strip()[:80])
        except ImportError:
            print("LlamaIndex: pip install llama-index-llms-openai-like")
        try:
            from cachedrag.integrations.openai_langchain import ChatCachedRAGOpenAI

            chat = ChatCachedRAGOpenAI(model=model, base_url=url + "/v1", max_tokens=24, temperature=0.0)
            reply = chat.invoke(prompt)
            print("LangChain:", reply.content.strip()[:80], "| cache_read:",
                  reply.usage_metadata["input_token_details"].get("cache_read"))
        except ImportError:
            print("LangChain: pip install langchain-openai")

        # structured output: JSON valid for a schema (decoding is constrained), or a required tool call
        pick = {"type": "object", "required": ["module", "sure"],
                "properties": {"module": {"type": "string", "enum": ["json", "heapq", "hashlib", "uuid"]},
                               "sure": {"type": "boolean"}}}
        ask_pick = [{"role": "user", "content": "Which stdlib module pretty-prints JSON?"}]
        r = client.chat.completions.create(model=model, max_tokens=40, temperature=0, messages=ask_pick,
                                           response_format={"type": "json_schema",
                                                            "json_schema": {"name": "pick", "schema": pick}})
        print("response_format json_schema:", r.choices[0].message.content)
        if args.tiny:  # the offered tool's schema alone is longer than the tiny model's window
            print("tool call: not asked (the tiny model's 512-token window cannot hold the offered tool)")
            return
        tool = {"type": "function", "function": {"name": "open_docs", "parameters": pick}}
        r = client.chat.completions.create(model=model, max_tokens=40, temperature=0, messages=ask_pick,
                                           tools=[tool], tool_choice="required")
        call = r.choices[0].message.tool_calls[0].function
        print(f"tool call: {call.name}({call.arguments})  finish_reason={r.choices[0].finish_reason}")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
