"""A server whose answers are full prefill's: `cachedrag serve --fidelity faithful`.

Starts two servers on free ports, `cachedrag serve --mode full` (no reuse: the reference answers)
and `cachedrag serve --fidelity faithful` (chunk reuse at any position, 27% recomputed, plus the
tie guards on the first and every later token: an approximate prefill's answer moves onto an
exact prefill of the prompt and its first token before its second token). Then it sends both the
same questions over retrieved documentation excerpts whose order changes from request to request
(so the faithful server serves most of them from non-prefix reuse) and prints, per request, how
the faithful server served it (the `cachedrag` object of the stream's last chunk: `approximations`,
`first_token_gap`: how near the approximate first token was to a rival, `tie_guard`: prefilled again
for a near-tied first token, `tie_guard_switch`: the answer token before which decoding moved onto
exact KV) and whether its answer equals full prefill's. The faithful server's answers are streamed,
where reuse shows its first token early; a last question is asked whole (`stream: false`), which a
faithful server prefills exactly from the start (nobody sees its first token early).

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

        def ask(name: str, question: str, order: list[str], stream: bool) -> tuple[str, dict]:
            """The answer's text and the response's `cachedrag` object (a stream's is on its last chunk)."""
            context = "\n\n".join(order)
            r = clients[name].chat.completions.create(
                model=model, max_tokens=16 if args.tiny else 32, temperature=0, stream=stream,
                messages=[{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": f"Context:\n\n{context}\n\nQuestion: {question}"}],
                extra_body={"cachedrag": {"chunks": order}})
            if not stream:
                return r.choices[0].message.content, r.model_extra["cachedrag"]
            text, served = [], {}
            for chunk in r:
                for choice in chunk.choices:
                    text.append(choice.delta.content or "")
                served = (chunk.model_extra or {}).get("cachedrag") or served
            return "".join(text), served

        for question in QUESTIONS:
            order = rng.sample(chunks, 3)  # three of the four excerpts, in a new order each time
            full, _ = ask("full", question, order, stream=False)
            ours, served = ask("faithful", question, order, stream=True)
            equal += ours == full
            how = ", ".join(served["approximations"]) or "exact"
            gap = "" if served["first_token_gap"] is None else f" (first-token gap {served['first_token_gap']:.2f})"
            guard = ("first token prefilled again" if served["tie_guard"] is not None
                     else f"moved onto exact KV before token {served['tie_guard_switch'] + 1}"
                     if served["tie_guard_switch"] is not None else "no guard needed")
            print(f"{question}\n  served: {how}{gap}; {guard}; answer equal to full prefill's: {ours == full}\n"
                  f"  {ours.strip()[:100]!r}")
        print(f"{equal} of {len(QUESTIONS)} streamed answers equal to full prefill's")
        order = rng.sample(chunks, 3)
        full, _ = ask("full", QUESTIONS[0], order, stream=False)
        whole, served = ask("faithful", QUESTIONS[0], order, stream=False)
        print(f"asked whole: served {', '.join(served['approximations']) or 'exact'} "
              f"(prefilled exactly from the start); equal to full prefill's: {whole == full}")
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
