"""The server's batched decode step: B running requests, each with its own ``KVBuffer``, its last
token and that token's position, through the model as ONE forward (continuous batching).

The step itself belongs to the model layer (``cachedrag.model.batch_decode``, reached through
``ModelRunner.decode_batch`` / ``ModelRunner.prepare_batch``); this module is the server's name for
it. Reference path: ``ModelRunner.decode_step`` per request, which the batched step equals to
float rounding and token for token under greedy decoding (``tests/server/test_batch.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cachedrag.model.batch_decode import PACKED_ROWS, batch_weights
from cachedrag.model.kv_buffer import KVBuffer

__all__ = ["PACKED_ROWS", "batch_weights", "batched_decode_step", "prepare"]


def batched_decode_step(runner, tokens: Sequence[int], positions: Sequence[int], kvs: Sequence[KVBuffer],
                        fast: bool | None = None, packed: bool | None = None,
                        fused: bool | None = None) -> torch.Tensor:
    """Feed ``tokens[b]`` at ``positions[b]`` into ``kvs[b]`` for every b; returns logits ``[B, V]``
    (``ModelRunner.decode_batch``; ``fast`` / ``packed`` / ``fused`` force a path, for tests)."""
    return runner.decode_batch(tokens, positions, kvs, fast=fast, packed=packed, fused=fused)


def prepare(runner, max_batch: int) -> None:
    """Build the batched step's packed weights and per-shape setup before the first request."""
    runner.prepare_batch(max_batch)
