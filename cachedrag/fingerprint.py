"""Fingerprints of a loaded model and tokenizer: the namespace chunk caches are valid in.

Owns: hashing a model (config + samples of several weight tensors) and a tokenizer (vocab
size, special tokens, chat template, sample encodings) into a ``Namespace``. A cache made
with one model, dtype or tokenizer never serves another; cheap enough to run at engine start.
"""

from __future__ import annotations

import hashlib
import json

import torch

from cachedrag.kvcache.keys import Namespace

_SAMPLE = 4096
_PROBE_TEXT = "The quick brown fox jumps over 13 lazy dogs. héllo 世界 def f(x): return x**2"


def model_fingerprint(model) -> str:
    h = hashlib.sha256()
    config = model.config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "_attn_implementation_autoset"):
        config.pop(volatile, None)
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    # a GGUF load with int8/int4 weights leaves the HF linear weights empty (meta): the fused copies are the weights
    params = {name: p for name, p in model.named_parameters() if not p.is_meta}
    names = sorted(params)
    for name in names[:2] + names[len(names) // 2: len(names) // 2 + 2] + names[-2:]:
        flat = params[name].detach().reshape(-1)[:_SAMPLE].to("cpu", torch.float32)  # [<=4096]
        h.update(name.encode())
        h.update(flat.numpy().tobytes())
    arch = (getattr(model.config, "architectures", None) or [type(model).__name__])[0]
    return f"{arch}:{h.hexdigest()[:32]}"


def tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.sha256()
    h.update(str(len(tokenizer)).encode())
    h.update(json.dumps(sorted(map(str, getattr(tokenizer, "all_special_tokens", []))), ensure_ascii=False).encode())
    h.update(str(getattr(tokenizer, "chat_template", "") or "").encode())
    h.update(json.dumps(tokenizer.encode(_PROBE_TEXT, add_special_tokens=False)).encode())
    return h.hexdigest()[:32]


def namespace_for(model, tokenizer, tenant_salt: str | None = None, dtype: str | None = None) -> Namespace:
    """``dtype``: the runner's numerics tag (``ModelRunner.numerics.tag``: dtype, int8 weights,
    stored-KV dtype); default the dtype of the model's parameters."""
    dtype = dtype or str(next(model.parameters()).dtype).replace("torch.", "")
    return Namespace(model_fingerprint(model), dtype, tokenizer_fingerprint(tokenizer), tenant_salt)
