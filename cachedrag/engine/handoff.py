"""What a prefill hands to the cache manager: the stored payload of one new entry (raw K, V and its
attention metadata, ``entry_payload``)."""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch

from cachedrag.kvcache.manager import ChunkCacheManager
from cachedrag.kvcache.variants import AttentionMetadata
from cachedrag.model.transfer import device_tensor


def entry_payload(namespace: str, path: Sequence[str], role: str, exact: bool, k: torch.Tensor, v: torch.Tensor,
                  meta: AttentionMetadata | None) -> tuple[dict, dict]:
    """Tensors and string metadata of a stored segment, self-describing so that another process
    (shared Redis) or a restarted one (disk) can rebuild the tree path and the variant from the
    entry alone (``ChunkCacheManager.rebuild``): ``path`` = segment keys up to this one,
    ``exact`` = computed on an exact prefix (may join the knowledge tree), ``variant`` = the
    attention metadata (``token_inter`` as a float32 tensor)."""
    tensors = {"k": k, "v": v}  # [L, H_kv, T, D] each
    info = {"namespace": namespace, "segment_key": path[-1], "path": json.dumps(list(path)), "role": role,
            "exact": "1" if exact else "0", "n_tokens": str(k.shape[2])}
    if meta is not None:
        tensors["token_inter"] = device_tensor(list(meta.token_inter), k.device, torch.float32)  # [T]
        info["variant"] = json.dumps({"prefix_keys": list(meta.prefix_keys), "inter": dict(meta.inter),
                                      "intra": meta.intra})
    return tensors, info
