"""A request's working KV buffer.

Owns: ``KVBuffer``: rotated K and V ``[L, H_kv, C, D]`` for every layer, row ``j`` = absolute
position ``j``, and how many rows are valid. Does not own: allocating it (``ModelRunner.new_kv``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVBuffer:
    """Working KV of one request: rotated K and V for every layer; row j holds position j."""

    k: torch.Tensor  # [L, H_kv, C, D]
    v: torch.Tensor  # [L, H_kv, C, D]
    length: int = 0  # rows 0..length-1 are valid

    @property
    def capacity(self) -> int:
        return self.k.shape[2]
