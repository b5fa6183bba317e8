"""Hand-off of what a prefill computed fresh to the cache manager.

Owns: capturing it during the layer loop (``Capture``, a prefill hook: pre-RoPE K of the fresh rows,
which cannot be recovered exactly later, and their queries at the metadata layers), turning it
into new entries once the prefill is done (``hand_off``: the chunks' inter/intra attention
metadata, ``new_entries``, ``metadata``) and the stored payload of one entry (``entry_payload``:
raw K, V and metadata, self-describing). The manager's admission (tree path or variant, eviction)
is ``ChunkCacheManager.admit``'s. A hand-off reads the request's buffer rows of the prompt, which
no later step writes; the engine runs it before returning or once the first token is out."""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch

from cachedrag.kvcache.keys import path_key
from cachedrag.kvcache.manager import NewEntry
from cachedrag.kvcache.planner import Action
from cachedrag.kvcache.variants import AttentionMetadata
from cachedrag.model.transfer import device_tensor
from cachedrag.engine.selection import _rows
from cachedrag.engine.state import LayerState, _HandOff, _Lead


class Capture:
    """Prefill hook: after each layer, the fresh rows' raw K into ``raw_k`` ``[L, H_kv, Tf, D]`` and, at the
    metadata layers where fresh chunks are stored with metadata, their rotated queries into ``meta_q``.
    Lead rows (``_Lead``) computed by the question pre-pass below ``lead.layer`` come from it."""

    def __init__(self, engine, fresh_t: torch.Tensor, lead: _Lead, with_meta: bool):
        runner = engine.runner
        self.fresh_t = fresh_t  # [Tf]
        self.n_lead, self.lead = lead.shared, lead
        self.fresh_main = fresh_t[self.n_lead:]  # [Tf'] the rows the loop computes before the lead rows join
        self.raw_k = torch.empty(runner.n_layers, runner.n_kv_heads, fresh_t.shape[0], runner.head_dim,
                                 dtype=engine._store_dtype, device=runner.device)  # [L, H_kv, Tf, D]
        self.meta_layers = engine.metadata_layers if with_meta else ()
        self.meta_q: list[tuple[int, torch.Tensor]] = []  # (metadata layer, rotated q of the fresh rows)
        self._rows, self._of = None, None  # rows of the fresh tokens in the compute set, and for which positions

    def after_layer(self, state: LayerState, layer: int, raw: dict) -> None:
        early = self.n_lead and layer < self.lead.layer  # the lead rows' K and q of this layer are the pre-pass's
        if self._of is not state.positions:  # fresh tokens are never dropped
            self._rows, self._of = _rows(state.positions, self.fresh_main if early else self.fresh_t), state.positions
        rows = self._rows
        self.raw_k[layer, :, self.n_lead if early else 0:] = raw["k"][:, rows]  # [H_kv, Tf, D]
        if early:
            self.raw_k[layer, :, :self.n_lead] = self.lead.k[layer]  # [H_kv, Tl, D]
        if layer in self.meta_layers:
            q_f = raw["q"][:, rows]  # [H_q, Tf, D] (a view when the rows are a range)
            self.meta_q.append((layer, torch.cat([self.lead.q[layer], q_f], 1) if early else q_f))


def hand_off(engine, plan, keys: list[str], h: _HandOff) -> None:
    """Store what the request computed fresh: the chunks' attention metadata (segment masses of
    the fresh rows' queries at the metadata layers, against the buffer's keys: the same values
    as inside the layer loop, since a layer's K rows are final once it ran), the entries' copies
    and the manager's admission."""
    fresh_mass = None
    for layer, q in h.meta_q:
        m = engine.runner.segment_attention_mass(layer, q, h.fresh_t, h.kv, h.total, h.bounds)  # [Tf, S]
        fresh_mass = m if fresh_mass is None else fresh_mass + m
    entries = new_entries(engine, plan, h, keys, fresh_mass)
    if entries:
        engine.manager.admit(plan, keys, entries, exact=h.exact)


def new_entries(engine, plan, h: _HandOff, keys: list[str], fresh_mass) -> list[NewEntry]:
    """One ``NewEntry`` per fresh segment: its raw K rows, V copied out of the buffer in the store's
    dtype, and for a chunk (when captured) its attention metadata."""
    from cachedrag.store.entry import KVEntry

    offset = 0
    out = []
    row_of = {}
    for i, (sp, action) in enumerate(zip(plan.segments, h.actions)):
        if action is not Action.FRESH:
            continue
        row_of[i] = offset
        offset += sp.n_tokens
    for i, r0 in row_of.items():
        sp = plan.segments[i]
        k = h.raw_k[:, :, r0:r0 + sp.n_tokens].contiguous()  # [L, H_kv, T, D]
        v = h.kv.v[:, :, sp.start:sp.end].to(engine._store_dtype, copy=True)  # [L, H_kv, T, D]
        meta = None
        if h.capture and sp.role == "chunk" and fresh_mass is not None:
            meta = metadata(i, fresh_mass[r0:r0 + sp.n_tokens], keys, h.chunk_seg)
        entry = KVEntry(*entry_payload(engine.model_namespace.digest, keys[: i + 1], sp.role, i < h.exact, k, v, meta))
        out.append(NewEntry(segment=i, handle=path_key(keys[: i + 1]), entry=entry, nbytes=entry.nbytes, meta=meta))
    return out


def metadata(i: int, mass: torch.Tensor, keys, chunk_seg) -> AttentionMetadata:
    """Inter/intra attention of fresh chunk ``i`` from its tokens' segment masses ``[T, S]``."""
    prior = [j for j in chunk_seg if j < i]
    prior_mass = mass[:, prior] if prior else torch.zeros(mass.shape[0], 1, device=mass.device)  # [T, P]
    intra_t = mass[:, i]  # [T]
    inter_t = prior_mass.sum(-1)  # [T]
    token_inter_t = inter_t / (inter_t + intra_t).clamp_min(1e-12)  # [T]
    means = torch.stack([prior_mass[:, c].mean() for c in range(len(prior))] + [intra_t.mean()])  # [P + 1]
    values = torch.cat([token_inter_t, means.to(token_inter_t.dtype)]).tolist()  # one read of the device
    t = token_inter_t.shape[0]
    inter = {keys[j]: values[t + c] for c, j in enumerate(prior)}
    return AttentionMetadata(
        prefix_keys=tuple(keys[j] for j in prior), inter=inter, intra=values[-1], token_inter=values[:t],
    )


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
