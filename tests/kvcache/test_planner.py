from __future__ import annotations

import random
import threading

import pytest

from cachedrag.errors import ConfigError
from cachedrag.kvcache.config import CacheConfig
from cachedrag.kvcache.index import VariantIndex
from cachedrag.kvcache.planner import (
    MODES,
    Action,
    Planner,
    PlanRequest,
    Segment,
)
from cachedrag.kvcache.tree import KnowledgeTree
from cachedrag.kvcache.variants import AttentionMetadata

# prompt layout: S (8) | A (10) | B (10) | C (20) | question (5)
REQ = PlanRequest((Segment("S", 8),), (Segment("A", 10), Segment("B", 10), Segment("C", 20)), question_tokens=5)
C_TOKEN_INTER = [0.01 * i for i in range(20)]
C_TOKEN_INTER[3] = 5.0  # planted outliers: 3 and 7 lead, then the ramp from the end
C_TOKEN_INTER[7] = 4.0


def setup(**cfg):
    cfg.setdefault("token_choice", "inter")  # Cache-Craft's planner-side choice; others tested below
    cfg.setdefault("recompute_ratio", None)  # Cache-Craft's per-chunk ceil(CFO x len) counts; fixed ratios below
    config = CacheConfig(**cfg)
    tree = KnowledgeTree.from_config(config)
    tree.insert(["S", "A"], ["tS", "tA"], [8, 10], [80, 100])
    index = VariantIndex.from_config(config)
    b_ti = [0.0] * 10
    b_ti[6], b_ti[2] = 0.9, 0.8
    vb1 = index.add("B", "vB1", AttentionMetadata(("A",), {"A": 1.0}, 1.0, b_ti)).variant  # CCI .5
    vb2 = index.add("B", "vB2", AttentionMetadata.standalone(10)).variant  # cold
    vc = index.add("C", "vC", AttentionMetadata(("X", "Y"), {"X": 1.0, "Y": 1.0}, 2.0, C_TOKEN_INTER)).variant
    return Planner(tree, index, config), {"vB1": vb1, "vB2": vb2, "vC": vc}


def actions(plan):
    return [s.action.value for s in plan.segments]


def test_cachedrag_mode():
    planner, v = setup()
    plan = planner.plan(REQ)
    assert actions(plan) == ["tree", "tree", "reuse", "reuse"]
    s, a, b, c = plan.segments
    assert (s.handle, a.handle) == ("tS", "tA")
    assert plan.prefix_hit_segments == 2 and plan.prefix_hit_tokens == 18
    # B behind A, exactly as its variant vB1 was computed: CFO 0, nothing to recompute
    assert b.variant is v["vB1"] and b.cfo == 0.0 and b.recompute == ()
    # C's variant saw X, Y; none is here: CFO = CCI = 0.5 -> 10 of 20 tokens, top token_inter
    assert c.variant is v["vC"] and c.cfo == pytest.approx(0.5)
    assert c.recompute == (3, 7, 12, 13, 14, 15, 16, 17, 18, 19)
    assert [s.start for s in plan.segments] == [0, 8, 18, 28] and plan.question_start == 48
    assert c.recompute_positions()[:2] == [31, 35]
    assert plan.compute_tokens == 10 + 5 and plan.total_tokens == 53
    assert plan.reused_tokens == 30
    assert plan.exact_prefix_segments == 2
    planner.release(plan)


def test_full_mode_reads_nothing():
    planner, _ = setup()
    plan = planner.plan(REQ, "full")
    assert actions(plan) == ["fresh"] * 4 and plan.prefix_hit_tokens == 0
    assert plan.compute_tokens == plan.total_tokens == 53
    planner.release(plan)
    assert planner.tree.find(["S"]).stats.frequency == 1  # not touched


def test_prefix_mode_uses_only_the_tree():
    planner, _ = setup()
    plan = planner.plan(REQ, "prefix")
    assert actions(plan) == ["tree", "tree", "fresh", "fresh"]
    assert plan.compute_tokens == 35 and plan.exact_prefix_segments == 4


def test_naive_mode_reuses_without_recompute():
    planner, v = setup()
    plan = planner.plan(REQ, "naive")
    assert actions(plan) == ["tree", "tree", "reuse", "reuse"]
    assert all(s.recompute == () for s in plan.segments)
    assert plan.segments[3].variant is v["vC"]
    assert plan.compute_tokens == 5


def test_random_mode_same_count_other_tokens_seeded():
    planner, _ = setup(seed=7)
    plan = planner.plan(REQ, "random")
    c = plan.segments[3]
    assert len(c.recompute) == 10 and list(c.recompute) == sorted(set(c.recompute))
    assert c.recompute != (3, 7, 12, 13, 14, 15, 16, 17, 18, 19)
    assert planner.plan(REQ, "random").segments[3].recompute == c.recompute  # deterministic
    other, _ = setup(seed=8)
    assert other.plan(REQ, "random").segments[3].recompute != c.recompute


def test_token_choice_leading_and_deferred_deviation():
    planner, _ = setup(token_choice="leading")
    c = planner.plan(REQ).segments[3]
    assert c.recompute == tuple(range(10)) and c.deferred == 0  # CFO .5 x 20: the first 10 tokens
    planner, _ = setup(token_choice="deviation")
    plan = planner.plan(REQ)
    b, c = plan.segments[2], plan.segments[3]
    assert b.recompute == () and b.deferred == 0  # CFO 0: nothing to choose
    assert c.recompute == () and c.deferred == 10  # the engine picks 10 by K/V deviation
    assert c.compute_tokens == 10 and plan.compute_tokens == 10 + 5
    # random mode keeps its planner-drawn tokens whatever the choice; a full ratio lists every token
    assert len(planner.plan(REQ, "random").segments[3].recompute) == 10
    planner, _ = setup(token_choice="deviation", recompute_ratio=1.0)
    c = planner.plan(REQ).segments[3]
    assert c.recompute == tuple(range(20)) and c.deferred == 0


def test_fixed_ratio_mode():
    planner, _ = setup(recompute_ratio=0.2)
    plan = planner.plan(REQ)
    b, c = plan.segments[2], plan.segments[3]
    assert b.recompute == (2, 6)  # ceil(0.2 x 10) = 2, top token_inter of vB1
    assert c.recompute == (3, 7, 18, 19)  # ceil(0.2 x 20) = 4
    assert planner.plan(REQ, "naive").segments[3].recompute == ()


def test_full_recompute_ratio_is_reuse_of_every_token():
    planner, _ = setup(recompute_ratio=1.0)
    c = planner.plan(REQ).segments[3]
    assert c.action is Action.REUSE and c.recompute == tuple(range(20))


def test_cfo_limit_sends_chunk_fresh():
    planner, _ = setup(reuse_cfo_limit=0.5)
    c = planner.plan(REQ).segments[3]
    assert c.action is Action.FRESH and "reuse_cfo_limit" in c.reason and c.cfo == pytest.approx(0.5)


def test_first_chunk_after_system_prefix_in_its_own_context_has_zero_cfo():
    planner, _ = setup()
    planner.index.add("D", "vD", AttentionMetadata.standalone(6))
    req = PlanRequest((Segment("S", 8),), (Segment("D", 6), Segment("B", 10)), 4)
    plan = planner.plan(req)
    assert actions(plan) == ["tree", "reuse", "reuse"]
    d, b = plan.segments[1], plan.segments[2]
    assert d.cfo == 0.0 and d.recompute == ()
    # B behind D: vB1 saw A (absent) -> CFO .5; the cold vB2 behind D -> cold_cci .15 wins
    assert b.handle == "vB2" and b.cfo == pytest.approx(0.15) and b.recompute == (0, 1)


def test_system_prefix_missing_from_tree_is_fresh_but_chunks_reuse():
    planner, _ = setup()
    req = PlanRequest((Segment("S2", 8),), (Segment("A", 10), Segment("B", 10)), 0)
    plan = planner.plan(req)
    assert actions(plan) == ["fresh", "fresh", "reuse"]
    assert plan.segments[0].reason == "system prefix not in tree"
    assert plan.segments[1].reason == "no cached variant"


def test_token_count_mismatch_is_reported_not_swallowed():
    planner, _ = setup()
    req = PlanRequest((Segment("S", 8),), (Segment("A", 10), Segment("B", 11)), 0)
    plan = planner.plan(req)
    assert plan.segments[2].action is Action.FRESH
    assert len(plan.notes) == 2 and "11" in plan.notes[0]


def test_tree_token_mismatch_cuts_the_prefix_and_unpins():
    planner, _ = setup()
    req = PlanRequest((Segment("S", 8),), (Segment("A", 11),), 0)
    plan = planner.plan(req)
    assert actions(plan) == ["tree", "fresh"] and "tree prefix cut" in plan.notes[0]
    assert planner.tree.find(["S", "A"]).pins == 0 and planner.tree.find(["S"]).pins == 1
    planner.release(plan)
    assert planner.tree.find(["S"]).pins == 0


def test_release_records_hits_and_unpins():
    planner, v = setup()
    plan = planner.plan(REQ)
    s_node = planner.tree.find(["S"])
    assert s_node.pins == 1 and v["vB1"].pins == 1 and v["vC"].pins == 1
    planner.release(plan)
    assert s_node.pins == 0 and v["vB1"].pins == 0 and v["vC"].pins == 0
    assert s_node.stats.frequency == 2
    assert v["vB1"].reuse_score == pytest.approx(1 + 1 / 0.05)  # CFO 0 -> guarded
    assert v["vC"].reuse_score == pytest.approx(1 + 1 / 0.5)
    planner.release(plan)  # idempotent
    assert s_node.stats.frequency == 2


def test_pins_protect_planned_entries_from_eviction():
    planner, v = setup()
    plan = planner.plan(REQ)
    assert planner.tree.evict_until(10_000) == []
    assert planner.index.evict(10) == ["vB2"]  # the one variant the plan does not use
    planner.release(plan, used=False)
    assert sorted(planner.index.evict(10)) == ["vB1", "vC"]
    assert planner.tree.evict_until(10_000) == ["tA", "tS"]


def test_planned_context_manager():
    planner, v = setup()
    with planner.planned(REQ) as plan:
        assert plan.segments[3].action is Action.REUSE
    assert v["vC"].uses == 1 and v["vC"].pins == 0
    with pytest.raises(RuntimeError):
        with planner.planned(REQ):
            raise RuntimeError("engine failed")
    assert v["vC"].uses == 1 and v["vC"].pins == 0  # released unused


def test_unknown_mode_and_bad_inputs():
    planner, _ = setup()
    with pytest.raises(ValueError, match="mode"):
        planner.plan(REQ, "fast")
    with pytest.raises(ValueError):
        Segment("x", 0)
    with pytest.raises(ValueError):
        PlanRequest((), (), -1)
    assert set(MODES) == {"full", "prefix", "naive", "random", "cachedrag"}


def test_summary_is_plain():
    planner, _ = setup()
    s = planner.plan(REQ).summary()
    assert s["actions"] == ["tree", "tree", "reuse", "reuse"] and s["compute_tokens"] == 15


def test_thread_safety_smoke():
    planner, _ = setup(max_chunks=15, max_variants_per_chunk=2)
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        try:
            for _ in range(200):
                keys = rng.sample([f"k{i}" for i in range(20)], 3)
                req = PlanRequest((Segment("S", 8),), tuple(Segment(k, 4) for k in keys), 2)
                plan = planner.plan(req, rng.choice(MODES))
                for i, k in enumerate(keys):
                    planner.index.add(k, (seed, k, i), AttentionMetadata(tuple(keys[:i]), {}, 1.0, [0.0] * 4))
                path = ["S"] + keys[: rng.randint(0, 3)]
                planner.tree.insert(path, [None] * len(path), [8] + [4] * (len(path) - 1), [1] * len(path))
                planner.tree.evict_until(max(0, planner.tree.total_bytes - 10))
                planner.release(plan, used=rng.random() < 0.8)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert all(n.pins == 0 for n in planner.tree.nodes())
    assert all(v.pins == 0 for v in planner.index.all_variants())



def test_glue_below_min_reuse_tokens_is_computed_fresh():
    """Separators and short template text between chunks are never reused (nothing to save);
    retrieved chunks are reused at any length, and tree prefixes stay exact hits."""
    glue = PlanRequest(REQ.system, (Segment("A", 10, glue=True), Segment("B", 10, glue=True), Segment("C", 20)),
                       question_tokens=5)
    plan = setup(min_reuse_tokens=12)[0].plan(glue)
    assert actions(plan) == ["tree", "tree", "fresh", "reuse"]
    assert "min_reuse_tokens" in plan.segments[2].reason
    assert actions(setup(min_reuse_tokens=12)[0].plan(REQ)) == ["tree", "tree", "reuse", "reuse"]  # chunks: reused
    assert actions(setup(min_reuse_tokens=0)[0].plan(glue)) == ["tree", "tree", "reuse", "reuse"]
    with pytest.raises(ConfigError):
        CacheConfig(min_reuse_tokens=-1)
