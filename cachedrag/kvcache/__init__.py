"""The chunk-cache policy layer: keys, knowledge tree, policies, variants, planner, focus.

Owns: everything about *which* KV to reuse, recompute or evict, as pure Python over opaque
handles (stdlib only: no torch, no numpy), so it is testable on tiny fakes and fast:

  keys       Namespace, chunk_key, path_key            chunk identity
  config     CacheConfig, RowPrecision, ExactFallback,   every threshold, validated once
             FocusConfig
  profile    PrefillProfile                            T(cached, computed), bilinear
  policy     LRU, LFU, GDSF, PGDSF, CacheCraftFR       sort-key strategies, make_policy
  tree       KnowledgeTree, TreeNode                   RAGCache exact-prefix tree
  variants   AttentionMetadata, score, select_tokens   Cache-Craft CCI / beta' / CFO
  index      VariantIndex, Variant                     N x M variants, f_r eviction
  planner    Planner, PlanRequest, Segment, Plan       per-request decisions
  focus      FocusTracker                              focused-chunk early termination
  simulator  make_workload, simulate, compare_policies hit-rate tables

Does not own: tensors, the model runner, tiers/stores, the engine (they call this API).
See ``docs/cache-policies.md``.
"""

from __future__ import annotations

from cachedrag.kvcache.config import CacheConfig, ExactFallback, FocusConfig, RowPrecision
from cachedrag.kvcache.focus import FocusDecision, FocusTracker, detect_focus, focused_set
from cachedrag.kvcache.index import AddResult, Variant, VariantIndex
from cachedrag.kvcache.keys import Namespace, chunk_key, path_key
from cachedrag.kvcache.planner import (
    MODES,
    Action,
    Mode,
    Plan,
    Planner,
    PlanRequest,
    Segment,
    SegmentPlan,
)
from cachedrag.kvcache.policy import (
    GDSF,
    LFU,
    LRU,
    PGDSF,
    POLICY_NAMES,
    CacheCraftFR,
    EntryStats,
    EvictionPolicy,
    make_policy,
)
from cachedrag.kvcache.profile import PrefillProfile
from cachedrag.kvcache.tree import InsertResult, KnowledgeTree, TreeNode
from cachedrag.kvcache.variants import (
    AttentionMetadata,
    ReuseScore,
    context_impact,
    kendall_tau_distance,
    prefix_overlap,
    recompute_count,
    score,
    select_leading_tokens,
    select_random_tokens,
    select_tokens,
)

__all__ = [
    "MODES",
    "Action",
    "AddResult",
    "AttentionMetadata",
    "CacheConfig",
    "CacheCraftFR",
    "EntryStats",
    "EvictionPolicy",
    "ExactFallback",
    "FocusConfig",
    "FocusDecision",
    "FocusTracker",
    "GDSF",
    "InsertResult",
    "KnowledgeTree",
    "LFU",
    "LRU",
    "Mode",
    "Namespace",
    "PGDSF",
    "POLICY_NAMES",
    "Plan",
    "PlanRequest",
    "Planner",
    "PrefillProfile",
    "ReuseScore",
    "RowPrecision",
    "Segment",
    "SegmentPlan",
    "TreeNode",
    "Variant",
    "VariantIndex",
    "chunk_key",
    "context_impact",
    "detect_focus",
    "focused_set",
    "kendall_tau_distance",
    "make_policy",
    "path_key",
    "prefix_overlap",
    "recompute_count",
    "score",
    "select_leading_tokens",
    "select_random_tokens",
    "select_tokens",
]
