"""``cachedrag bench integrations``: a LlamaIndex RetrieverQueryEngine with ``CachedRAGLLM`` vs plain transformers.

Owns: the integrations suite. The same questions go through two LlamaIndex
``RetrieverQueryEngine``s (streaming, default compact synthesizer) that share one
``CachedRAGRetriever`` and differ only in the LLM:

- ``CachedRAGLLM`` on a ``CachedEngine`` (chunk KV reuse), and
- ``TransformersLLM`` below, the **baseline**: the same weights driven by plain Hugging Face
  ``model.generate`` with a ``TextIteratorStreamer``, the tokenizer's chat template and greedy
  decoding, which is what an app has today without cachedrag.

Requests are interleaved (per request both engines answer, the order alternating), so machine
noise hits both alike; the first ``--warmup`` requests are not counted. TTFT = from
``query_engine.query(question)`` to the first non-empty streamed text delta (retrieval,
synthesis and prompt formatting included, the same for both); the LLMs' own TTFT (from the
LLM call to its first token) is reported too. Prints a table; ``--json OUT`` writes
``{"config", "n_requests", "cachedrag": {...}, "baseline": {...}, "ttft_speedup", ...}``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cachedrag_bench import write_json
from cachedrag_bench.metrics import rouge_l, summary

DEFAULT_TOP_K = 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--corpus", help="directory of .txt/.md files or a JSONL of {id, text} (default: stdlib docs)")
    parser.add_argument("--questions",
                        help="one question per line, used in order (default: a Zipf stream of stdlib questions)")
    parser.add_argument("--index", help="index directory to use; built there (and kept) when it does not exist "
                        "(default: a temporary index of the corpus)")
    parser.add_argument("--model", default=None, help="HF model id or path (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, help="chunks retrieved per question")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="chunk size when building the index")
    parser.add_argument("--requests", type=int, default=30, help="stream length when no --questions file is given")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the generated stream")
    parser.add_argument("--warmup", type=int, default=None,
                        help="leading requests not counted (default 20%% of the stream)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_out", help="write results as JSON to this path")


def run(args: argparse.Namespace) -> int:
    import torch

    from cachedrag.corpus import STDLIB_QUESTIONS, load_questions
    from cachedrag_bench.workload import zipf_stream
    from cachedrag.engine import CachedEngine
    from cachedrag.model.loader import load_model
    from cachedrag.model.runner import ModelRunner

    runner = ModelRunner(*load_model(args.model))
    if args.questions:
        questions, source = load_questions(args.questions), str(args.questions)
    else:
        questions = zipf_stream(list(STDLIB_QUESTIONS), args.requests, args.zipf, args.seed)
        source = f"zipf(s={args.zipf}) stream of {args.requests} over {len(STDLIB_QUESTIONS)} stdlib questions"
    warmup = max(0, min(len(questions) - 1, args.warmup if args.warmup is not None else len(questions) // 5))
    with tempfile.TemporaryDirectory(prefix="cachedrag-bench-index-") as tmp:
        index_dir = _index(args, runner.tokenizer, Path(tmp) / "index")
        results = compare(CachedEngine(runner), runner, index_dir, questions, top_k=args.top_k,
                          max_new_tokens=args.max_new_tokens, warmup=warmup, progress=True)
    results["config"].update({
        "model": args.model or "SmolLM2-135M-Instruct", "corpus": args.corpus or "stdlib docs", "questions": source,
        "index": args.index or "(temporary)", "chunk_tokens": args.chunk_tokens,
        "torch_threads": torch.get_num_threads(), "device": str(runner.device),
    })
    _print(results)
    if args.json_out:
        write_json(results, args.json_out)
    return 0


def compare(engine, runner, index_dir: str | Path, questions: Sequence[str], *, top_k: int = DEFAULT_TOP_K,
            max_new_tokens: int = 16, warmup: int = 0, progress: bool = False) -> dict:
    """Both query engines over ``questions`` (interleaved); medians after ``warmup`` and their ratio."""
    from llama_index.core.query_engine import RetrieverQueryEngine

    from cachedrag.integrations.llama_index import CachedRAGLLM, CachedRAGRetriever

    retriever = CachedRAGRetriever(index_dir=str(index_dir), similarity_top_k=top_k)
    cached_llm = CachedRAGLLM(engine=engine, max_new_tokens=max_new_tokens)
    baseline_llm = _baseline_llm_class()(model=runner.model, tokenizer=runner.tokenizer, max_new_tokens=max_new_tokens,
                                   context_window=runner.max_context)
    engines = {
        "cachedrag": RetrieverQueryEngine.from_args(retriever, llm=cached_llm, streaming=True),
        "baseline": RetrieverQueryEngine.from_args(retriever, llm=baseline_llm, streaming=True),
    }
    records: dict[str, list[dict]] = {"cachedrag": [], "baseline": []}
    iterator = range(len(questions))
    if progress:
        from tqdm import tqdm

        iterator = tqdm(iterator, desc="bench integrations", unit="req", file=sys.stderr)
    for i in iterator:
        order = ("cachedrag", "baseline") if i % 2 == 0 else ("baseline", "cachedrag")
        for name in order:
            rec = _query(engines[name], questions[i])
            if name == "cachedrag":
                stats = cached_llm.last_stats or {}
                rec.update(llm_ttft_s=stats.get("ttft_s"), registered_chunks=stats.get("registered_chunks"),
                           chunks_computed=stats.get("registered_chunks_computed"),
                           prompt_tokens=stats.get("prompt_tokens"), computed_tokens=stats.get("computed_tokens"),
                           cached_tokens=stats.get("cached_tokens"))
            else:
                rec.update(llm_ttft_s=baseline_llm.last_ttft_s, prompt_tokens=baseline_llm.last_prompt_tokens)
            if i >= warmup:
                records[name].append(rec)
    retriever.close()
    out: dict[str, Any] = {"config": {"top_k": top_k, "max_new_tokens": max_new_tokens, "warmup": warmup,
                                      "n_questions": len(questions)},
                           "n_requests": len(records["cachedrag"])}
    for name, recs in records.items():
        ttft = [r["ttft_s"] for r in recs]
        llm_ttft = [r["llm_ttft_s"] for r in recs if r["llm_ttft_s"] is not None]
        row = {"ttft_median_s": summary(ttft)["median"], "ttft_mean_s": summary(ttft)["mean"],
               "ttft_p95_s": summary(ttft)["p95"], "llm_ttft_median_s": summary(llm_ttft)["median"],
               "total_median_s": summary([r["total_s"] for r in recs])["median"],
               "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] or 0 for r in recs) if recs else 0.0}
        if name == "cachedrag" and recs:
            matched = sum(r["registered_chunks"] or 0 for r in recs)
            row["registered_chunks_per_request"] = matched / len(recs)
            row["computed_token_fraction"] = statistics.fmean(
                r["computed_tokens"] / r["prompt_tokens"] for r in recs if r["prompt_tokens"])  # at full depth
            row["cached_token_fraction"] = statistics.fmean(  # served from cache (not recomputed at full depth)
                r["cached_tokens"] / r["prompt_tokens"] for r in recs if r["prompt_tokens"])
            warm = [r["ttft_s"] for r in recs if r["chunks_computed"] == 0]
            cold = [r["ttft_s"] for r in recs if r["chunks_computed"]]
            row["all_chunks_cached_requests"] = len(warm)
            row["ttft_median_all_cached_s"] = summary(warm)["median"]
            row["ttft_median_some_missed_s"] = summary(cold)["median"]
        out[name] = row
    out["ttft_speedup"] = out["baseline"]["ttft_median_s"] / out["cachedrag"]["ttft_median_s"]
    out["llm_ttft_speedup"] = out["baseline"]["llm_ttft_median_s"] / out["cachedrag"]["llm_ttft_median_s"]
    pairs = list(zip(records["cachedrag"], records["baseline"]))
    out["rouge_l_vs_baseline"] = statistics.fmean(rouge_l(c["text"], b["text"]) for c, b in pairs) if pairs else None
    out["same_answer_fraction"] = statistics.fmean(float(c["text"] == b["text"]) for c, b in pairs) if pairs else None
    return out


def _query(query_engine, question: str) -> dict:
    """TTFT = query start -> first non-empty streamed delta; the whole answer's text and time."""
    t0 = time.perf_counter()
    response = query_engine.query(question)
    ttft, parts = None, []
    for delta in response.response_gen:
        if delta and ttft is None:
            ttft = time.perf_counter() - t0
        parts.append(delta)
    total = time.perf_counter() - t0
    return {"ttft_s": ttft if ttft is not None else total, "total_s": total, "text": "".join(parts)}


def _index(args, tokenizer, tmp: Path) -> Path:
    """``--index`` when it holds an index; else build one (there, or in ``tmp``)."""
    from cachedrag.corpus import load_corpus, stdlib_corpus
    from cachedrag.retrieval.config import ChunkConfig, RetrievalConfig
    from cachedrag.retrieval.embedder import Embedder
    from cachedrag.retrieval.index import build_index

    if args.index and (Path(args.index) / "manifest.json").is_file():
        return Path(args.index)
    out = Path(args.index) if args.index else tmp
    docs = load_corpus(args.corpus) if args.corpus else stdlib_corpus()
    config = RetrievalConfig(chunk=ChunkConfig(chunk_tokens=args.chunk_tokens))
    print(f"building an index of {len(docs)} documents in {out} ...", file=sys.stderr)
    build_index(docs, tokenizer, Embedder(), config, out=out)
    return out


def _print(results: dict) -> None:
    c, b, cfg = results["cachedrag"], results["baseline"], results["config"]
    print(f"\nLlamaIndex RetrieverQueryEngine over {results['n_requests']} requests "
          f"({cfg.get('questions', '')}), top-k {cfg['top_k']}, {cfg['max_new_tokens']} new tokens")
    print(f"{'LLM':>24}  {'ttft_med':>9}  {'ttft_p95':>9}  {'llm_ttft':>9}  {'total_med':>9}  {'prompt_tok':>10}")
    for name, row in (("CachedRAGLLM", c), ("plain transformers", b)):
        print(f"{name:>24}  {row['ttft_median_s']:>9.3f}  {row['ttft_p95_s']:>9.3f}  {row['llm_ttft_median_s']:>9.3f}"
              f"  {row['total_median_s']:>9.3f}  {row['prompt_tokens_mean']:>10.0f}")
    print(f"median TTFT speedup (query -> first token): {results['ttft_speedup']:.2f}x;"
          f" LLM-only: {results['llm_ttft_speedup']:.2f}x")
    print(f"CachedRAGLLM: {c.get('all_chunks_cached_requests', 0)} requests with every chunk cached (median TTFT "
          f"{c.get('ttft_median_all_cached_s', float('nan')):.3f} s), the rest "
          f"{c.get('ttft_median_some_missed_s', float('nan')):.3f} s")
    print(f"cachedrag prompt tokens served from cache {c.get('cached_token_fraction', float('nan')):.3f} "
          f"(computed at full depth {c.get('computed_token_fraction', float('nan')):.3f}), "
          f"ROUGE-L vs baseline answer {results['rouge_l_vs_baseline']:.3f}, "
          f"identical answers {results['same_answer_fraction']:.2f}")


# ---------------------------------------------------------------------- the baseline
@functools.cache
def _baseline_llm_class():
    """Defined lazily so ``cachedrag bench --help`` does not import LlamaIndex."""
    from llama_index.core.base.llms.types import (
        ChatMessage,
        ChatResponse,
        CompletionResponse,
        LLMMetadata,
        MessageRole,
    )
    from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
    from llama_index.core.llms.custom import CustomLLM
    from pydantic import Field, PrivateAttr

    class TransformersLLM(CustomLLM):
        """BASELINE (what a user has today): a LlamaIndex LLM over plain ``transformers`` generation.

        ``model.generate`` (greedy) on the tokenizer's chat template, streamed through a
        ``TextIteratorStreamer`` that emits each token's text at once; no cache reuse.
        ``last_ttft_s`` = from the LLM call to the first generated token.
        """

        max_new_tokens: int = Field(default=16, ge=1, description="tokens generated per answer")
        context_window: int = Field(default=2048, ge=1, description="the model's context window")
        model_name: str = Field(default="transformers-baseline", description="name in metadata")

        _model: Any = PrivateAttr(default=None)
        _tokenizer: Any = PrivateAttr(default=None)
        _last: dict = PrivateAttr(default_factory=dict)

        def __init__(self, model, tokenizer, **kwargs: Any):
            super().__init__(**kwargs)
            self._model = model
            self._tokenizer = tokenizer

        @property
        def last_ttft_s(self) -> float | None:
            return self._last.get("ttft_s")

        @property
        def last_prompt_tokens(self) -> int | None:
            return self._last.get("prompt_tokens")

        @property
        def metadata(self) -> LLMMetadata:
            return LLMMetadata(context_window=self.context_window, num_output=self.max_new_tokens,
                               model_name=self.model_name, is_chat_model=True)

        @llm_completion_callback()
        def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
            text = "".join(self._generate([{"role": "user", "content": prompt}]))
            return CompletionResponse(text=text)

        @llm_completion_callback()
        def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any):
            def gen():
                text = ""
                for delta in self._generate([{"role": "user", "content": prompt}]):
                    text += delta
                    yield CompletionResponse(text=text, delta=delta)
            return gen()

        @llm_chat_callback()
        def chat(self, messages, **kwargs: Any) -> ChatResponse:
            text = "".join(self._generate(_dicts(messages)))
            return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text))

        @llm_chat_callback()
        def stream_chat(self, messages, **kwargs: Any):
            def gen():
                text = ""
                for delta in self._generate(_dicts(messages)):
                    text += delta
                    yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta)
            return gen()

        def _generate(self, messages: list[dict]):
            import torch

            start = time.perf_counter()
            ids = self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                      return_dict=True)["input_ids"]  # [1, T]
            self._last = {"prompt_tokens": int(ids.shape[1])}
            streamer = _token_streamer(self._tokenizer)
            kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.max_new_tokens,
                          do_sample=False, streamer=streamer, pad_token_id=self._tokenizer.pad_token_id
                          if self._tokenizer.pad_token_id is not None else self._tokenizer.eos_token_id)
            errors: list[BaseException] = []

            def work():
                try:
                    with torch.inference_mode():
                        self._model.generate(**kwargs)
                except BaseException as exc:  # re-raised below, after the stream ends
                    errors.append(exc)
                    streamer.end()

            thread = threading.Thread(target=work, name="baseline-generate", daemon=True)
            thread.start()
            yield from streamer
            thread.join()
            if errors:
                raise errors[0]
            self._last["ttft_s"] = (streamer.first_token_at or time.perf_counter()) - start

    def _dicts(messages) -> list[dict]:
        return [{"role": m.role.value, "content": m.content or ""} for m in messages]

    return TransformersLLM


def _token_streamer(tokenizer):
    """A ``TextIteratorStreamer`` that emits each token's text at once and timestamps the first token."""
    from transformers import TextIteratorStreamer

    class TokenStreamer(TextIteratorStreamer):
        first_token_at: float | None = None

        def put(self, value):
            if self.skip_prompt and self.next_tokens_are_prompt:
                self.next_tokens_are_prompt = False
                return
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            self.token_cache.extend(value.reshape(-1).tolist())
            text = self.tokenizer.decode(self.token_cache, **self.decode_kwargs)
            if text.endswith("\ufffd"):  # half a character: wait for the next token
                return
            self.on_finalized_text(text[self.print_len:])
            self.print_len = len(text)

    return TokenStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=600)


def __getattr__(name: str):
    if name == "TransformersLLM":
        cls = _baseline_llm_class()
        globals()["TransformersLLM"] = cls
        return cls
    raise AttributeError(name)
