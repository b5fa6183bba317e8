"""A server whose answers are full prefill's: `cachedrag serve --fidelity faithful`.

Starts two servers on free ports, `cachedrag serve --mode full` (no reuse: the reference answers)
and `cachedrag serve --fidelity faithful` (chunk reuse at any position, 27% recomputed, plus the
tie guards on the first and every later token: an approximate prefill's answer moves onto an
exact prefill of the prompt and its first token before its second token). Then it sends both the
same questions over retrieved documentation excerpts whose order changes from request to request
(so the faithful server serves most of them from non-prefix reuse) and prints, per request, how
the faithful server served it (the response's `cachedrag` object: `approximations`, `tie_guard`:
prefilled again for a near-tied first token, `tie_guard_switch`: the answer token before which
decoding moved onto exact KV; `tie_guard_rewound`: tokens a whole answer took back because the exact
prefill would not have chosen them) and whether its answer equals full prefill's. These requests are
not streamed, so an answer whose approximate first token was not full prefill's is rewound and
decoded again from the exact KV: every answer is full prefill's.

    python examples/serve_fidelity.py          # the default model (SmolLM2-135M)
    python examples/serve_fidelity.py --tiny   # a tiny random model: seconds, gibberish answers
"""

from __future__ import annotations

import argparse
import random

from openai import OpenAI
from serve_clients import start_server  # the client example's launcher

from cachedrag.corpus import stdlib_corpus

SYSTEM = "Answer the question using the Python documentation excerpts given by the user. Be brief."
QUESTIONS = ["Which module memoizes function calls?", "How do I merge sorted inputs?",
             "What does functools.partial return?", "Which function finds an insertion point?",
             "How do I count hashable items?", "Which module keeps a heap invariant?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    model = "tiny-random" if args.tiny else "SmolLM2-135M-Instruct"
    docs = [d.text for d in stdlib_corpus()[:4]]
    chunks = [d[:80 if args.tiny else 900].strip() for d in docs]  # the tiny model has a 512-token window (bytes)
    servers = {name: start_server(args.tiny, *flags) for name, flags in
               (("full", ["--mode", "full"]), ("faithful", ["--fidelity", "faithful"]))}
    try:
        clients = {name: OpenAI(base_url=url + "/v1", api_key="none") for name, (_, url) in servers.items()}
        rng, equal = random.Random(0), 0
        for question in QUESTIONS:
            order = rng.sample(chunks, 3)  # three of the four excerpts, in a new order each time
            context = "\n\n".join(order)
            answers = {}
            for name, client in clients.items():
                r = client.chat.completions.create(
                    model=model, max_tokens=16 if args.tiny else 32, temperature=0,
                    messages=[{"role": "system", "content": SYSTEM},
                              {"role": "user", "content": f"Context:\n\n{context}\n\nQuestion: {question}"}],
                    extra_body={"cachedrag": {"chunks": order}})
                answers[name] = (r.choices[0].message.content, r.model_extra["cachedrag"])
            (full, _), (ours, served) = answers["full"], answers["faithful"]
            equal += ours == full
            how = ", ".join(served["approximations"]) or "exact"
            guard = ("first token prefilled again" if served["tie_guard"] is not None
                     else f"moved onto exact KV before token {served['tie_guard_switch'] + 1}"
                     if served["tie_guard_switch"] is not None else "no guard needed")
            if served["tie_guard_rewound"]:  # a whole answer taken back to the tokens the exact prefill agrees with
                guard += f", {served['tie_guard_rewound']} token(s) taken back"
            print(f"{question}\n  served: {how}; {guard}; answer equal to full prefill's: {ours == full}\n"
                  f"  {ours.strip()[:100]!r}")
        print(f"{equal} of {len(QUESTIONS)} answers equal to full prefill's")
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
