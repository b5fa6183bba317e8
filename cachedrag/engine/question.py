"""The question pre-pass (ProphetKV-like token scoring): the question and fresh tokens run through
the first layers against the loaded cache, and the question's attention to each reused token
ranks which tokens to recompute (``selection.QuestionScorer`` reads it).

Owns: ``question_scores`` (the eager pass, the reference), the padded static / CUDA-graph pass
choice (``question_pass_graphs``, ``model/question_graph.py``), which layers score
(``question_layers``) and whether the pass may leave rows out (``can_hide_rows``). The engine
calls the pass through ``CachedEngine._question_scores`` (an override point for measurements)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cachedrag.errors import ConfigError
from cachedrag.model.runner import KVBuffer
from cachedrag.model.scoring import scoring_layers
from cachedrag.model.transfer import device_tensor
from cachedrag.engine.state import _Lead


def question_layers(engine) -> list[int]:
    """The layers whose question attention ranks reused tokens (``CacheConfig.question_layers``
    within the model; its last layer when none is)."""
    n = engine.runner.n_layers
    return [x for x in engine.config.cache.question_layers if x < n] or [n - 1]


def can_hide_rows(engine) -> bool:
    """Whether the pre-pass can leave rows out (``hidden_keys`` of ``causal_blocks`` and
    ``segment_attention_mass``): not on the Triton backend, nor with sliding-window layers
    among the pass's, whose attention ignores block plans."""
    runner = engine.runner
    last = max(engine._question_layers())
    return runner.kernel_backend != "triton" and all(w is None for w in runner.windows[:last + 1])


def question_pass_graphs(engine):
    """The padded static pre-pass (``model/question_graph.py``) per ``engine.question_pass``, or None (eager)."""
    if engine.question_pass == "eager":
        return None
    if engine.question_pass not in ("cuda-graph", "static"):
        raise ConfigError(f"question_pass must be 'cuda-graph', 'static' or 'eager', got {engine.question_pass!r}")
    capture = engine.question_pass == "cuda-graph"
    if capture and engine.runner.device.type != "cuda":
        raise ConfigError("question_pass='cuda-graph' needs a CUDA runner")
    graphs = engine.question_graphs
    if graphs is None or graphs.capture != capture:
        from cachedrag.model.question_graph import QuestionPassGraphs

        graphs = engine.question_graphs = QuestionPassGraphs(engine.runner, capture=capture)
    return graphs


def question_scores(engine, ids: torch.Tensor, kv: KVBuffer, total: int, fresh_pos: list[int],
                    question_pos: list[int], plan, deferred: dict[int, int], load_layer,
                    lead: _Lead | None = None, hidden: Sequence[int] = ()) -> torch.Tensor:
    """The question's attention to every prompt position ``[T]`` (float32): the question and
    fresh tokens run through layers ``0..max(question_layers)`` against the loaded cache (the
    reused chunks' K re-rotated to their new positions); at each of ``question_layers`` the
    attention probability of every question token to each position, averaged over heads,
    is summed over question tokens and normalised to sum 1 over the deferred segments' tokens.
    Rows it writes (question and fresh tokens) are written again by the prefill proper, except
    ``lead.rows`` leading fresh rows (before every reused chunk, so computed as the prefill
    would): their raw K, metadata-layer queries and the hidden states entering the last scoring
    layer go into ``lead`` for the prefill to take over.
    Its projections run on bfloat16 copies of the weights (``CacheConfig.precision.question``,
    ``model/scoring.py``) unless fresh rows lead every reused chunk (``lead.leading``): those
    are the prefill's own rows and stay in the runner's precision, or go on the copies with
    every other row of the pass where the prefill computes them there (``lead.low``:
    ``CacheConfig.precision.leading_fresh="bfloat16"``).
    ``hidden``: positions of fresh rows left out of the pass (``CacheConfig.question_pass_fresh``
    "leading": fresh chunks after a reused one): zeroed in the buffer's pass layers and masked
    from every query's attention, as if those rows were absent (attention is position-free
    once K is rotated); the prefill writes them. Their scores are 0."""
    runner = engine.runner
    layers = engine._question_layers()
    weights = None  # None: the runner's own projections
    if (lead is not None and lead.low) or (engine.config.cache.precision.question == "bfloat16"
                                           and not (lead is not None and lead.leading)):
        weights = scoring_layers(runner, max(layers) + 1)
    rows = sorted(set(fresh_pos) | set(question_pos))
    last = max(layers)
    n_lead = lead.rows if lead is not None and last > 0 else 0
    graphs = question_pass_graphs(engine)
    if graphs is not None and not hidden and not n_lead and all(w is None for w in runner.windows):
        for layer in range(last + 1):  # every layer the pass reads, loaded before the replay
            load_layer(layer)
        scores = graphs.scores(kv, ids, rows, len(question_pos),
                               [(plan.segments[i].start, plan.segments[i].end) for i in deferred], total,
                               layers, weights)  # [T] or None (too many rows: the pass below)
        if scores is not None:
            return scores
    return _eager_pass(engine, ids, kv, total, rows, len(question_pos), plan, deferred, load_layer, layers,
                       weights, lead if n_lead else None, hidden)


def _eager_pass(engine, ids, kv: KVBuffer, total: int, rows: list[int], n_question: int, plan, deferred,
                load_layer, layers: list[int], weights, lead: _Lead | None, hidden: Sequence[int]) -> torch.Tensor:
    """``question_scores`` op by op (the reference); ``lead``: None when no lead rows are shared."""
    runner = engine.runner
    device = runner.device
    last = max(layers)
    n_lead = lead.rows if lead is not None else 0
    pos = device_tensor(rows, device)  # [Tp]
    q_rows = torch.arange(pos.shape[0] - n_question, pos.shape[0], device=device)  # question: the last rows
    inside = torch.zeros(total, dtype=torch.bool, device=device)  # [T]
    for i in deferred:
        inside[plan.segments[i].start:plan.segments[i].end] = True
    every = list(range(total + 1))  # one segment per position
    hidden_keys = hidden_idx = None
    if hidden:
        hidden_idx = device_tensor(list(hidden), device)  # [Th]
        hidden_keys = torch.zeros(total, dtype=torch.bool, device=device)  # [T]
        hidden_keys[hidden_idx] = True
    x = runner.embed(ids[pos])  # [Tp, Dm]
    rope = runner.rotary.cos_sin(pos, runner.dtype, device)  # [Tp, D] each
    blocks = runner.causal_blocks(pos, total, hidden_keys)
    scores = torch.zeros(total, dtype=torch.float32, device=device)  # [T]
    for layer in range(last + 1):
        load_layer(layer)
        if hidden_idx is not None:  # masked rows must be finite: 0 x NaN would still poison the attention
            kv.k[layer].index_fill_(1, hidden_idx, 0.0)  # rows of [H_kv, C, D]
            kv.v[layer].index_fill_(1, hidden_idx, 0.0)
        raw: dict = {}
        lw = weights[layer] if weights is not None else None
        if layer == last:  # the last scoring layer: its queries and K/V, not its output
            runner.write_layer(layer, x, pos, kv, raw_out=raw, rope=rope, weights=lw)
        else:
            x = runner.forward_layer(layer, x, pos, kv, total, raw_out=raw, rope=rope, blocks=blocks, weights=lw)
            if n_lead:
                lead.k.append(raw["k"][:, :n_lead])  # [H_kv, Tl, D]
                if layer in lead.q_layers:
                    lead.q[layer] = raw["q"][:, :n_lead]  # [H_q, Tl, D]
        if layer in layers:
            mass = runner.segment_attention_mass(layer, raw["q"][:, q_rows], pos[q_rows], kv, total, every,
                                                 hidden_keys=hidden_keys)  # [Tq, T]
            s = mass.sum(0).float()  # [T]
            scores += s / torch.where(inside, s, 0.0).sum().clamp_min(1e-12)  # (s[inside] waits for the GPU)
    if n_lead:
        lead.hidden, lead.layer = x[:n_lead], last  # [Tl, Dm]: the input of layer ``last``
    return scores  # [T]
