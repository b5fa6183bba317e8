"""Retrieval: chunking, embedding, IVF index, lookahead prefetch and staged search.

Owns the retrieval side of cachedrag (see ``docs/retrieval.md``):

    config         RetrievalConfig and its parts (every number lives there)
    chunker        Chunk records in LLM tokens, tokenizer identity
    embedder       sentence-transformers embeddings (default: all-MiniLM-L6-v2, offline)
    ivf            IVF-Flat as torch tensors (== Faiss IndexIVFFlat), assign/search_preassigned, staged search
    cluster_store  ClusterStore tiers: disk-backed (slow), RAM/GPU (fast)
    policy         pure-Python prefetch plan, profile-guided budget, stage split
    lookahead      LookaheadRetriever: prefetch(original) -> search(transformed), on_candidates hook
    index          build_index / load_index / RetrievalIndex (index directories)
    disk_ivf       DiskIVF: IVF with memory-mapped clusters on disk, IVF-PQ + exact re-rank, resumable build
    scale          the 1M-vector corpus: real chunk embeddings + synthetic distractors (ScaleIndex)
    cli            ``cachedrag index build|search``

Does not own: the chunk KV caches (``cachedrag.kvcache``/``cachedrag.store``) or query
transformations (``cachedrag.pipelines``). Names below import lazily so that
``import cachedrag.retrieval`` does not load torch or Faiss.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "RetrievalConfig": "config",
    "ChunkConfig": "config",
    "EmbedderConfig": "config",
    "IndexConfig": "config",
    "SearchConfig": "config",
    "LookaheadConfig": "config",
    "Chunk": "chunker",
    "chunk_documents": "chunker",
    "tokenizer_identity": "chunker",
    "Embedder": "embedder",
    "IVFIndex": "ivf",
    "Quantizer": "ivf",
    "ClusterBlock": "ivf",
    "ClusterStore": "cluster_store",
    "DiskClusterStore": "cluster_store",
    "MemoryClusterStore": "cluster_store",
    "plan_prefetch": "policy",
    "prefetch_budget": "policy",
    "LookaheadRetriever": "lookahead",
    "LookaheadResult": "lookahead",
    "PrefetchReport": "lookahead",
    "measure_bandwidth": "lookahead",
    "RetrievalIndex": "index",
    "Hit": "index",
    "build_index": "index",
    "load_index": "index",
    "DiskIndexConfig": "config",
    "PipeliningConfig": "config",
    "DiskIVF": "disk_ivf",
    "MmapClusterStore": "disk_ivf",
    "build_disk_ivf": "disk_ivf",
    "DistractorSource": "scale",
    "ScaleIndex": "scale",
    "build_scale_index": "scale",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cachedrag.retrieval' has no attribute {name!r}")
    return getattr(importlib.import_module(f"cachedrag.retrieval.{_EXPORTS[name]}"), name)
