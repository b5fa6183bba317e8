"""Choose a dtype: prefill and decode speed of the runner per numerics, and how far each moves
the answer from float32.

Loads the default model once per dtype (float32, bfloat16, bfloat16 + int8, int8-dynamic where the CPU has
VNNI, or int4 weights), builds one
RAG prompt (system prompt + stdlib chunks + a question), and for each runner times a full
prefill and greedy decode steps, then scores float32's greedy continuation teacher-forced in
every runner (top-1 agreement and KL against float32, as `cachedrag bench speed` reports).
For the side-by-side figures with transformers and llama.cpp, run `cachedrag bench speed`.

Every runner decodes through the fused native step where it applies (fp32, bf16, int8: every
layer and the LM head in one call; docs/speed.md "Decode, round 8"), its attention the split-K
kernel ("Decode, round 7"); --torch-step adds the fp32 and bf16 runners with the op-by-op torch step
(``decode_step="torch"``), --sdpa the fp32 torch step with torch's SDPA attention, to see each
difference here.

With --compile, also the fp32 and int4 runners with ``compile=True`` (the decode step's static-shape
parts from AOTInductor packages, built once per machine in ~25 s each and cached; docs/speed.md).

Run: .venv/bin/python examples/speed.py [--threads 2] [--tokens 24] [--compile] [--torch-step] [--sdpa]
"""

import argparse
import time

import torch

from cachedrag_bench.speed import dtype_fidelity
from cachedrag.corpus import stdlib_corpus
from cachedrag.engine import CachedEngine
from cachedrag.model.runner import ModelRunner
from cachedrag.model.weights import vnni_available

parser = argparse.ArgumentParser()
parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the cores this process may use)")
parser.add_argument("--tokens", type=int, default=24, help="decode steps timed, and teacher-forced tokens scored")
parser.add_argument("--compile", action="store_true", help="also the compile=True fp32 and int4 runners")
parser.add_argument("--torch-step", action="store_true", help="also fp32 and bf16 with decode_step='torch' (op by op)")
parser.add_argument("--sdpa", action="store_true", help="also fp32 with decode_attention='sdpa' (torch's kernel)")
args = parser.parse_args()

runners = {
    "cachedrag-fp32": ModelRunner.from_pretrained(dtype="float32", threads=args.threads),
    "cachedrag-bf16": ModelRunner.from_pretrained(dtype="bfloat16", threads=args.threads),
    "cachedrag-int8": ModelRunner.from_pretrained(dtype="bfloat16", weights="int8", threads=args.threads),
    "cachedrag-int4": ModelRunner.from_pretrained(weights="int4", threads=args.threads),
}
if vnni_available():  # int8 weights and per-token int8 decode activations (fbgemm's VNNI kernel)
    runners["cachedrag-int8-dynamic"] = ModelRunner.from_pretrained(weights="int8-dynamic", threads=args.threads)
if args.compile:
    runners["cachedrag-fp32-compiled"] = ModelRunner.from_pretrained(dtype="float32", threads=args.threads, compile=True)
    runners["cachedrag-int4-compiled"] = ModelRunner.from_pretrained(weights="int4", threads=args.threads, compile=True)
if args.torch_step:
    for name, dtype in (("cachedrag-fp32-torch", "float32"), ("cachedrag-bf16-torch", "bfloat16")):
        runners[name] = ModelRunner.from_pretrained(dtype=dtype, threads=args.threads, decode_step="torch")
if args.sdpa:
    runners["cachedrag-fp32-sdpa"] = ModelRunner.from_pretrained(dtype="float32", threads=args.threads,
                                                                 decode_attention="sdpa")
tokenizer = runners["cachedrag-fp32"].tokenizer
docs = [d.text for d in stdlib_corpus(("json", "heapq", "bisect", "functools", "csv"))]
chunks = [tokenizer.decode(tokenizer.encode(t, add_special_tokens=False)[:256]) for t in docs]
segments = CachedEngine(runners["cachedrag-fp32"]).prompts.chat(chunks, "How do I pretty-print JSON?",
                                                                "Answer from the excerpts. Be brief.")
ids = [t for s in segments for t in s.ids]

print(f"{len(ids)}-token prompt, {runners['cachedrag-fp32'].threads} threads, decode attention: "
      f"{runners['cachedrag-fp32'].decode_attention} {runners['cachedrag-fp32'].decode_attention_note}")
print(f"{'runner':<22} {'numerics':<20} {'step':<6} {'weights MB':>10} {'prefill tok/s':>14} {'decode ms/token':>16}")
for name, runner in runners.items():
    kv = runner.new_kv(len(ids) + args.tokens + 1)
    t0 = time.perf_counter()
    token = int(runner.prefill(torch.tensor(ids), kv=kv).argmax())
    prefill_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    for step in range(args.tokens):
        token = int(runner.decode_step(token, len(ids) + step, kv).argmax())
    decode_ms = (time.perf_counter() - t1) / args.tokens * 1000
    print(f"{name:<22} {runner.numerics.tag:<20} {runner.decode_step_kind:<6} {runner.weight_bytes / 1e6:>10.0f} "
          f"{len(ids) / prefill_s:>14.0f} {decode_ms:>16.1f}")

print("\nagainst float32, teacher-forced on its greedy continuation:")
for name, row in dtype_fidelity(runners, [ids], args.tokens).items():
    print(f"{name:<22} top-1 agreement {row['top1_agreement']:.2f}, KL mean {row['kl_mean']:.4f} "
          f"(max {row['kl_max']:.3f}), same first token: {bool(row['first_token_agreement'])}")
