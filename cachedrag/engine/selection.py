"""Which rows a prefill computes: picking the top-scored tokens of each chunk, fusing the question's
scores with the chunks' inter-attention metadata (ranks within each chunk), and the row sets of
reused positions. Pure tensor helpers; the scores come from the engine's layer loop."""

from __future__ import annotations


import torch

from cachedrag.kvcache.planner import Action
from cachedrag.model.transfer import device_tensor


def _reused_positions(plan, actions) -> list[int]:
    """Prompt positions of the chunks a plan serves from reuse, in order."""
    return [p for sp, a in zip(plan.segments, actions) if a is Action.REUSE for p in range(sp.start, sp.end)]


def _rows(positions: torch.Tensor, wanted: torch.Tensor) -> slice | torch.Tensor:
    """Rows of the sorted ``wanted`` positions ``[Tw]`` in the sorted ``positions`` ``[Tc]`` (all present):
    a slice when they are consecutive rows (a miss: the fresh tokens lead the compute set), so
    reading them is a view, not a gather; else the row indices ``[Tw]``."""
    idx = torch.searchsorted(positions, wanted)  # [Tw]
    n = idx.shape[0]
    if n:
        first, last = torch.stack([idx[0], idx[-1]]).tolist()  # one read of the device, not two
        if last - first == n - 1:
            return slice(first, first + n)
    return idx


def _pick(scores: torch.Tensor, count: int) -> list[int]:
    """Indices of the ``count`` tokens to recompute in one chunk: the highest ``scores [T]``."""
    return _pick_each([scores], [count])[0]


def _pick_each(scores: list[torch.Tensor], counts: list[int]) -> list[list[int]]:
    """``_pick`` of every chunk (``scores[c]`` ``[T_c]``, ``counts[c]`` tokens), read back to the host
    in one transfer: one wait for the GPU per request, not one per chunk."""
    parts = [torch.topk(x, min(count, x.shape[0])).indices for x, count in zip(scores, counts)]
    flat = torch.cat(parts).tolist() if parts else []
    out, at = [], 0
    for part in parts:
        out.append(flat[at:at + part.shape[0]])
        at += part.shape[0]
    return out


def _fuse_inter(scores: dict[int, torch.Tensor], plan, weight: float, device) -> None:
    """``question+inter``: each segment's question scores ``[T_i]`` become ``weight x rank(question) +
    (1 - weight) x rank(token_inter)`` (ranks within the segment, ``_rank01``) where its variant
    carries per-token inter fractions; every segment's in one transfer and one ranking pass."""
    segs, inter = [], []
    for i in scores:
        variant = plan.segments[i].variant
        values = list(variant.meta.token_inter) if variant is not None and variant.meta is not None else []
        if len(values) == plan.segments[i].n_tokens:
            segs.append(i)
            inter.extend(values)
    if not segs:
        return
    lengths = [plan.segments[i].n_tokens for i in segs]
    inter_t = device_tensor(inter, device, torch.float32)  # [N]
    question = torch.cat([scores[i] for i in segs])  # [N]
    fused = weight * _rank01_segments(question, lengths) + (1.0 - weight) * _rank01_segments(inter_t, lengths)  # [N]
    for i, part in zip(segs, fused.split(lengths)):
        scores[i] = part  # [T_i]


def _rank01_segments(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """``_rank01`` of each consecutive segment of ``x`` ``[N]`` (``lengths`` sum to N), equal to it
    segment by segment, in two sorts for all segments instead of one per segment."""
    n = x.shape[0]
    device = x.device
    lens = device_tensor(lengths, device)  # [S]
    seg = torch.repeat_interleave(torch.arange(len(lengths), device=device), lens, output_size=n)  # [N]
    flipped = torch.argsort(x.flip(0), stable=True)  # [N] ascending; among ties, later positions first
    flipped = flipped[torch.argsort(seg.flip(0)[flipped], stable=True)]  # [N] grouped by segment, order kept
    order = (n - 1) - flipped  # [N] indices into x: by segment, then ascending (ties: later first)
    starts = torch.cumsum(lens, 0) - lens  # [S]
    of = seg[order]  # [N] segment of each sorted entry
    r = torch.empty(n, dtype=torch.float32, device=device)  # [N]
    r[order] = (torch.arange(n, device=device) - starts[of]).float() / (lens[of] - 1).clamp_min(1).float()
    return r


def _rank01(x: torch.Tensor) -> torch.Tensor:
    """Ranks of ``x`` scaled to [0, 1] (0 = smallest), float32 ``[T]``: a scale-free score for fusing rankings.
    Ties rank the earlier position higher (as ``select_tokens`` breaks them: by position)."""
    n = x.shape[0]
    r = torch.empty_like(x, dtype=torch.float32)  # [T]
    order = (n - 1) - torch.argsort(x.flip(0), stable=True)  # [T] ascending; among ties, later positions first
    r[order] = torch.arange(n, dtype=torch.float32, device=x.device)
    return r / max(1, x.shape[0] - 1)
