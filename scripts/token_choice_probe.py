"""Which tokens of a reused chunk are worth recomputing? A controlled probe on the default model.

For each of the first N distinct questions of the ``bench ttft`` stream, the top-5 chunks are
first computed in reversed order (so every chunk's cached KV saw other neighbours than it will
now), then the question is answered from those caches with each token choice at fixed
recompute ratios. Reported per choice: KL(full || reuse) of the next-token distribution,
first-token agreement and ROUGE-L of a 32-token greedy answer, both against full prefill.

    python scripts/token_choice_probe.py --questions 8

Choices: naive (none), random, leading (first tokens), inter (Cache-Craft: most attention to
prior chunks when cached), deviation / deviation_k / deviation_kv (CacheBlend: largest V, K or
K+V deviation at layer 1 after computing layer 0 for every token; costs 1/L extra), oracle (largest true V deviation over all
layers, needs full prefill: an upper bound). Results are in docs/engine.md.
"""

from __future__ import annotations

import argparse
import math
import random

import torch

from cachedrag_bench.metrics import rouge_l
from cachedrag_bench.ttft import DEFAULT_SYSTEM_PROMPT
from cachedrag_bench.workload import build_workload
from cachedrag.fingerprint import namespace_for
from cachedrag.model.loader import load_model
from cachedrag.model.runner import ModelRunner
from cachedrag.prompt import PromptBuilder

METADATA_LAYERS = (1, 15, 28)  # where the engine measures inter-attention (3 of 30 layers)


def bounds_of(segments) -> list[int]:
    out = [0]
    for s in segments:
        out.append(out[-1] + len(s))
    return out


def full_pass(runner, ids, bounds=None):
    """Full prefill; returns the buffer, last logits, raw K ``[L, H, T, D]`` and (with
    ``bounds``) the per-token attention mass to each segment summed over METADATA_LAYERS."""
    kv = runner.new_kv(len(ids) + 40)
    pos = torch.arange(len(ids))
    hidden = runner.embed(torch.tensor(ids))  # [T, Dm]
    rope = runner.rotary.cos_sin(pos, runner.dtype, runner.device)
    raw_k, mass = [], None
    for i in range(runner.n_layers):
        raw = {}
        hidden = runner.forward_layer(i, hidden, pos, kv, len(ids), raw_out=raw, rope=rope)
        raw_k.append(raw["k"])
        if bounds is not None and i in METADATA_LAYERS:
            m = runner.segment_attention_mass(i, raw["q"], pos, kv, len(ids), bounds)  # [T, S]
            mass = m if mass is None else mass + m
    kv.length = len(ids)
    return kv, runner.logits(hidden[-1:])[0], torch.stack(raw_k), mass


def greedy(runner, kv, logits, start, eos, n=32):
    out = []
    for j in range(n):
        t = int(logits.argmax())
        out.append(t)
        if t == eos:
            break
        logits = runner.decode_step(t, start + j, kv)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--ratios", default="0.15,0.3")
    ap.add_argument("--choices", default="naive,random,leading,inter,deviation,deviation_k,deviation_kv,oracle")
    args = ap.parse_args()
    ratios = [float(r) for r in args.ratios.split(",")]
    torch.set_grad_enabled(False)
    runner = ModelRunner(*load_model(None))
    tok = runner.tokenizer
    work = build_workload(tok, top_k=5, chunk_tokens=256, n_requests=40)
    prompts = PromptBuilder(tok, namespace_for(runner.model, tok))
    seen, requests = set(), []
    for q, chunks in zip(work.questions, work.retrieved):
        if q not in seen:
            seen.add(q)
            requests.append((q, chunks))
    rows: dict[str, list[tuple[float, float, float]]] = {}
    for q, chunks in requests[: args.questions]:
        segs = prompts.chat(chunks, q, DEFAULT_SYSTEM_PROMPT)
        ids = [t for s in segs for t in s.ids]
        bounds = bounds_of(segs)
        ref_kv, ref_logits, _, _ = full_pass(runner, ids)
        ref_v = ref_kv.v.clone()
        ref_answer = greedy(runner, ref_kv, ref_logits, len(ids), tok.eos_token_id)
        ref_logp = ref_logits.log_softmax(-1)

        # cache every chunk from the reversed order, with Cache-Craft's per-token inter fraction
        warm = prompts.chat(list(reversed(chunks)), "What is this about?", DEFAULT_SYSTEM_PROMPT)
        wb = bounds_of(warm)
        wkv, _, wk, wmass = full_pass(runner, [t for s in warm for t in s.ids], wb)
        cache, inter = {}, {}
        for si, s in enumerate(warm):
            if s.kind == "chunk":
                a, b = wb[si], wb[si + 1]
                cache[s.key] = (wk[:, :, a:b].clone(), wkv.v[:, :, a:b].clone())
                prior = wmass[a:b, 1:si].sum(-1) if si > 1 else torch.zeros(b - a)
                inter[s.key] = prior / (prior + wmass[a:b, si]).clamp_min(1e-12)
        chunk_ranges = [(si, bounds[si], bounds[si + 1]) for si, s in enumerate(segs) if s.kind == "chunk"]

        def loaded():
            kv = runner.new_kv(len(ids) + 40)
            for si, a, _ in chunk_ranges:
                runner.write_rotated(kv, *cache[segs[si].key], a)
            return kv

        def choose(name, ratio, kv):
            out = []
            for si, a, b in chunk_ranges:
                n = math.ceil(ratio * (b - a))
                if name == "random":
                    out += random.Random(f"{si}").sample(range(a, b), n)
                elif name == "leading":
                    out += range(a, a + n)
                elif name == "inter":
                    out += [a + int(j) for j in inter[segs[si].key].topk(n).indices]
                elif name == "oracle":
                    dev = (kv.v[:, :, a:b] - ref_v[:, :, a:b]).float().norm(dim=-1).mean((0, 1))  # [T]
                    out += [a + int(j) for j in dev.topk(n).indices]
                elif name.startswith("deviation"):
                    out += [a + int(j) for j in deviation[a - chunk_ranges[0][1]:b - chunk_ranges[0][1]].topk(n).indices]
            return out

        for name in args.choices.split(","):
            for ratio in ([0.0] if name == "naive" else ratios):
                kv = loaded()
                if name.startswith("deviation"):  # layer 0 for every token, then V (K, K+V) deviation at layer 1
                    pos = torch.arange(len(ids))
                    probe = runner.new_kv(len(ids))
                    probe.k.copy_(kv.k[:, :, : len(ids)])
                    probe.v.copy_(kv.v[:, :, : len(ids)])
                    h = runner.forward_layer(0, runner.embed(torch.tensor(ids)), pos, probe, len(ids))
                    lo, hi = chunk_ranges[0][1], chunk_ranges[-1][2]
                    on = {"deviation": "v", "deviation_k": "k", "deviation_kv": "kv"}[name]
                    deviation = runner.kv_deviation(1, h[lo:hi], pos[lo:hi], kv, on=on)  # [T_chunks]
                compute = sorted(set(range(bounds[1])) | set(choose(name, ratio, kv)) | set(range(bounds[-2], len(ids))))
                pos = torch.tensor(compute)
                hidden = runner.embed(torch.tensor(ids)[pos])
                rope = runner.rotary.cos_sin(pos, runner.dtype, runner.device)
                for i in range(runner.n_layers):
                    hidden = runner.forward_layer(i, hidden, pos, kv, len(ids), rope=rope)
                kv.length = len(ids)
                logits = runner.logits(hidden[-1:])[0]
                kl = float((ref_logp.exp() * (ref_logp - logits.log_softmax(-1))).sum())
                answer = greedy(runner, kv, logits, len(ids), tok.eos_token_id)
                rows.setdefault(f"{name}@{ratio:g}", []).append(
                    (kl, float(answer[:1] == ref_answer[:1]), rouge_l(tok.decode(answer), tok.decode(ref_answer))))
        print(f"done: {q}", flush=True)
    n_questions = len(next(iter(rows.values())))
    print(f"\n{'choice@ratio':>16} {'KL':>8} {'tok1':>6} {'rougeL':>7}   ({n_questions} questions)")
    for name, vals in rows.items():
        n = len(vals)
        print(f"{name:>16} {sum(v[0] for v in vals) / n:8.4f} {sum(v[1] for v in vals) / n:6.2f} "
              f"{sum(v[2] for v in vals) / n:7.3f}")


if __name__ == "__main__":
    main()
