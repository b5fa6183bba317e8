"""The typed state one request's prefill passes between its stages: what the prefill computed
(``_Prefill``), what it hands to the cache manager (``_HandOff``), the lead rows shared with the
question pre-pass (``_Lead``), and the failure of a planned load (``_LoadFailed``, a miss: the
segment is computed instead). Internal to the engine package."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cachedrag.model.runner import KVBuffer
from cachedrag.prompt import Segment


@dataclass
class _Prefill:
    kv: KVBuffer
    logits: torch.Tensor  # [V]
    info: dict
    hand_off: Callable[[], None] | None = None  # deferred store hand-off (``_prefill(defer_store=True)``)
    promote: Callable[..., float] | None = None  # exact path of a recurring sequence, to compute after the response
    segments: list[Segment] | None = None  # the prompt as served (order-aware reuse may reorder the chunks)
    exact_segments: int = 0  # leading segments whose KV equals full prefill (``_prefill`` sets it: the plan's


@dataclass
class _HandOff:
    """What a request computed fresh, kept until it is handed to the cache manager: raw K of the
    fresh rows (captured during the prefill; it cannot be recovered exactly later) and, for the
    chunks' attention metadata, the fresh rows' queries at the metadata layers. V and rotated K
    are read from the request's KV buffer, whose prompt rows no later step writes."""

    actions: list
    fresh_t: torch.Tensor  # [Tf] absolute positions of the fresh tokens
    raw_k: torch.Tensor  # [L, H_kv, Tf, D] pre-RoPE keys of the fresh tokens (store dtype)
    kv: KVBuffer
    total: int
    meta_q: list[tuple[int, torch.Tensor]]  # (metadata layer, rotated queries [H_q, Tf, D] of the fresh rows)
    bounds: list[int]
    n_system: int
    chunk_seg: list[int]
    capture: bool
    exact: int  # leading segments whose KV equals full prefill: stored as a tree path (``_Prefill.exact_segments``)


@dataclass
class _Lead:
    """Fresh rows the question pre-pass computes exactly as the prefill proper would (they precede
    every reused chunk, so both passes see the same rows before them): the prefill skips them
    below ``layer`` and takes over their pre-pass state. ``hidden`` stays None when the pre-pass
    did not run (or ran no layer below its last)."""

    rows: int  # the first ``rows`` fresh positions (0 when not shared)
    q_layers: frozenset[int]  # layers whose queries the hand-off needs (metadata layers)
    leading: int = 0  # fresh rows before every reused chunk, shared or not: the pre-pass then keeps the
    #                   runner's precision (``CacheConfig.precision.question``), so both paths choose alike
    low: bool = False  # CacheConfig.precision.leading_fresh="bfloat16" applies: those rows, in both passes (and the
    #                    pre-pass's question rows), run on the bfloat16 copies instead
    k: list = field(default_factory=list)  # per layer < ``layer``: raw K ``[H_kv, rows, D]``
    q: dict = field(default_factory=dict)  # metadata layer < ``layer`` -> rotated q ``[H_q, rows, D]``
    hidden: torch.Tensor | None = None  # [rows, Dm] the input of layer ``layer``
    layer: int | None = None


class _LoadFailed(Exception):
    """A committed layer-wise load failed mid-prefill; the segment is recomputed instead."""

    def __init__(self, segment: int, error: BaseException | None):
        super().__init__(f"segment {segment} failed to load: {error}")
        self.segment = segment
