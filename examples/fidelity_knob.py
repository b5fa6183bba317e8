"""The fidelity knob and what each answer's stats say about it.

Five engines over the same reordered retrieval (every chunk cached before, in another order):
``fidelity="exact"`` (exact-prefix reuse only: answers equal full prefill), ``"faithful"`` (as
guarded, and the tie guard during decoding at every token, ``tie_guard_decode=inf``: after the first
token the answer moves onto an exact prefill of the prompt and the answer so far, so the rest of it
is full prefill's; ``tie_guard_switch`` says before which token),
``"guarded"`` (as
balanced, but a request whose approximate first token is within 0.25 nats of a rival is prefilled
again exactly; ``tie_guard`` in the result says when), ``"balanced"`` (non-prefix chunk reuse, 27%
recompute chosen by the question and the chunk's inter-chunk attention) and ``"fast"`` (10%, and a
cached order of the same chunks is served exactly). Each result names the approximations it used
(docs/fidelity.md).

    python examples/fidelity_knob.py            # embedded SmolLM2-135M-Instruct
"""

from __future__ import annotations

from cachedrag.config import EngineConfig
from cachedrag.corpus import stdlib_corpus
from cachedrag.engine import CachedEngine
from cachedrag.model.loader import load_model
from cachedrag.model.runner import ModelRunner

SYSTEM = "Answer the question using the Python documentation excerpts given by the user. Be brief."


def main() -> None:
    runner = ModelRunner(*load_model(None))  # one loaded model shared by the engines
    docs = {d.id: d.text for d in stdlib_corpus(("heapq", "bisect", "functools"))}
    chunks = [docs["stdlib/heapq"][:900], docs["stdlib/bisect"][:900], docs["stdlib/functools"][:900]]
    question = "Which heapq function pushes an item on the heap and then pops and returns the smallest item?"
    for level in ("exact", "faithful", "guarded", "balanced", "fast"):
        engine = CachedEngine(runner, config=EngineConfig(fidelity=level))
        engine.generate(chunks[::-1], "What are these modules for?", SYSTEM, max_new_tokens=1)  # warm, other order
        r = engine.generate(chunks, question, SYSTEM, max_new_tokens=24)
        print(f"{level:>9}: TTFT {r.ttft_s:.3f} s, computed {r.computed_fraction:.2f}, "
              f"approximations {r.approximations or 'none'}, served order {r.chunk_order or 'as retrieved'}"
              + (f", near tie ({r.tie_guard:.2f} nats) prefilled again" if r.tie_guard is not None else "")
              + (f", exact from answer token {r.tie_guard_switch} on" if r.tie_guard_switch is not None else ""))
        print(f"           {r.text.strip()!r}")
        # the same chunk set in a new order, with order-aware reuse off, to show chunk reuse itself
        plain = CachedEngine(runner, config=EngineConfig(fidelity=level).model_copy(update={"order_aware": False}),
                             manager=engine.manager)
        r2 = plain.generate([chunks[1], chunks[2], chunks[0]], question, SYSTEM, max_new_tokens=24)
        print(f"           without order-aware reuse: approximations {r2.approximations or 'none'}, "
              f"token choice {r2.token_choice}, computed {r2.computed_fraction:.2f}")


if __name__ == "__main__":
    main()
