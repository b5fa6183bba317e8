"""The prefill's attention: the C++ kernel (``ModelRunner(prefill_attention="kernel")``, the default
where it builds) against torch's SDPA (the reference), on the same weights.

A prefill computes some of a request's positions: all of them (full prefill), those after a cached
prefix, or, on the reuse path, fresh chunks, ~27% of each reused chunk and the question. This
times each kind on both runners (interleaved, medians) and prints how far the logits differ
(docs/speed.md, "Prefill attention, round 11").

    python scripts/prefill_attention.py            # embedded SmolLM2-135M-Instruct
"""

from __future__ import annotations

import statistics
import time

import torch

from cachedrag.corpus import stdlib_corpus
from cachedrag.model.loader import load_model
from cachedrag.model.runner import ModelRunner


def main() -> None:
    runners = {c: ModelRunner(*load_model(None), prefill_attention=c) for c in ("kernel", "sdpa")}
    kernel = runners["kernel"]
    print(f"kernel runner: prefill_attention={kernel.prefill_attention!r} {kernel.prefill_attention_note}")
    text = " ".join(d.text for d in stdlib_corpus(("heapq", "bisect", "functools")))
    ids = torch.tensor(kernel.tokenizer(text)["input_ids"][:1200])  # [T]
    n = ids.shape[0]
    g = torch.Generator().manual_seed(0)
    reuse = torch.nonzero(torch.rand(n, generator=g) < 0.27).flatten()  # recomputed rows of reused chunks
    kinds = {
        "full prefill": torch.arange(0, n),
        "after a 300-token cached prefix": torch.arange(300, n),
        "reuse path (27% + 40-token question)": torch.cat([reuse[reuse < n - 40], torch.arange(n - 40, n)]),
    }
    kvs = {}
    for c, r in runners.items():  # every row valid: the buffer a reuse-path prefill reads
        kvs[c] = r.new_kv(n)
        r.prefill(ids, kv=kvs[c])
    for name, pos in kinds.items():
        times = {c: [] for c in runners}
        logits = {}
        for rep in range(5):
            for c in (("kernel", "sdpa") if rep % 2 else ("sdpa", "kernel")):
                t0 = time.perf_counter()
                logits[c] = runners[c].prefill(ids[pos], pos, kv=kvs[c], kv_len=n)  # [V]: the last row's
                times[c].append(time.perf_counter() - t0)
        k_s, s_s = statistics.median(times["kernel"]), statistics.median(times["sdpa"])
        diff = float((logits["kernel"] - logits["sdpa"]).abs().max())
        print(f"{name:>38}: {len(pos):>5} rows  kernel {k_s * 1e3:7.1f} ms  sdpa {s_s * 1e3:7.1f} ms  "
              f"({s_s / k_s:.2f}x)  max |logit diff| {diff:.1e}")


if __name__ == "__main__":
    main()
