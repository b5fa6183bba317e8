"""The question pre-pass replayed from a captured CUDA graph, beside the eager pass (docs/gpu.md).

On a CUDA machine the second engine replays the pre-pass from a graph captured for its buffer size
and row bucket (opt-in: ``question_pass = "cuda-graph"``); elsewhere it runs the same padded pass
eagerly (``"static"``), which checks the path on the CPU. Both engines answer the same reordered
requests; the padded pass picks the same tokens to recompute, so the answers match.

    python scripts/question_pass.py
"""

from __future__ import annotations

import torch

from cachedrag.engine import CachedEngine
from cachedrag.model.runner import ModelRunner

CHUNKS = [
    "heapq.heappush(heap, item) pushes the value item onto the heap, maintaining the heap invariant.",
    "bisect.insort(a, x) inserts x in a in sorted order, after any existing entries of x.",
    "functools.lru_cache wraps a function with a memoizing callable that saves up to maxsize recent calls.",
]
SYSTEM = "Answer the question using the documentation excerpts. Be brief."
REQUESTS = [([2, 0, 1], "Which function memoizes calls?"), ([1, 2, 0], "How do I keep a list sorted?")]


def main() -> None:
    runner = ModelRunner.from_pretrained(device="auto")
    eager, padded = CachedEngine(runner), CachedEngine(runner)
    padded.question_pass = "cuda-graph" if runner.device.type == "cuda" else "static"
    for engine in (eager, padded):
        engine.generate(CHUNKS, "warm up", SYSTEM, max_new_tokens=1)  # every chunk cached
    for order, question in REQUESTS:
        chunks = [CHUNKS[i] for i in order]  # reordered: non-prefix reuse, so the pre-pass runs
        a = eager.generate(chunks, question, SYSTEM, max_new_tokens=16)
        b = padded.generate(chunks, question, SYSTEM, max_new_tokens=16)
        print(f"{question}\n  eager:  {a.text!r}\n  {padded.question_pass}: {b.text!r}  same: {a.text == b.text}")
    graphs = padded.question_graphs
    print(f"{padded.question_pass} pre-passes served: {graphs.passes}, graphs captured: {graphs.captures}"
          + (f", capture failed: {graphs.failed}" if graphs.failed else "")
          + ("" if torch.cuda.is_available() else " (no CUDA here: the padded pass ran eagerly)"))


if __name__ == "__main__":
    main()
