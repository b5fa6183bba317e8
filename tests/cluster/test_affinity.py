"""The chunk-affinity routing policy: rendezvous owners, bounded load, least-loaded fallback."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest

from cachedrag.cluster.affinity import AffinityConfig, AffinityPolicy, hrw_weight, owner

REPLICAS = ["r0", "r1", "r2", "r3"]


def idle(replicas=REPLICAS) -> dict[str, int]:
    return dict.fromkeys(replicas, 0)


def test_same_chunks_go_to_the_same_replica_and_order_of_replicas_does_not_matter():
    policy = AffinityPolicy()
    fps = ["doc-a", "doc-b", "doc-c"]
    first = policy.rank(fps, idle())[0]
    assert len(first) == 1
    assert policy.rank(fps, idle())[0] == first
    assert policy.rank(fps, dict.fromkeys(reversed(REPLICAS), 0))[0] == first


def test_the_choice_is_the_replica_owning_most_chunk_weight():
    fps = [f"chunk-{i}" for i in range(40)]
    owners = Counter(owner(f, REPLICAS) for f in fps)
    expected = max(REPLICAS, key=lambda r: owners[r])
    assert owners[expected] > sorted(owners.values())[-2], "fixture must have a unique majority owner"
    assert AffinityPolicy().choose(fps, idle()) == expected


def test_weights_decide_between_owners():
    a = next(f"x{i}" for i in range(1000) if owner(f"x{i}", ["r0", "r1"]) == "r0")
    b1, b2 = [f"y{i}" for i in range(1000) if owner(f"y{i}", ["r0", "r1"]) == "r1"][:2]
    policy = AffinityPolicy()
    q = idle(["r0", "r1"])
    assert policy.choose([a, b1, b2], q) == "r1"  # two chunks beat one at equal weight
    assert policy.choose([a, b1, b2], q, weights=[900, 100, 100]) == "r0"  # one long chunk beats two short


def test_distinct_chunk_sets_spread_evenly():
    policy = AffinityPolicy()
    counts = Counter(policy.choose([f"req{i}-c{j}" for j in range(5)], idle()) for i in range(2000))
    assert set(counts) == set(REPLICAS)
    for r in REPLICAS:
        assert 0.18 < counts[r] / 2000 < 0.32, counts


def test_losing_a_replica_moves_only_its_chunks():
    fps = [f"c{i}" for i in range(500)]
    before = {f: owner(f, REPLICAS) for f in fps}
    after = {f: owner(f, REPLICAS[:-1]) for f in fps}
    moved = [f for f in fps if before[f] != after[f]]
    assert moved and all(before[f] == "r3" for f in moved)
    assert len(moved) == sum(1 for f in fps if before[f] == "r3")


@pytest.mark.parametrize("queues,bound", [([0, 0, 0, 0], 2), ([0, 4, 4, 4], 4), ([3, 3, 3, 3], 5), ([10, 0], 8)])
def test_load_bound(queues, bound):
    assert AffinityPolicy(AffinityConfig(slack=2, load_factor=1.5)).load_bound(queues) == bound


def test_an_overloaded_owner_yields_to_the_chunks_runner_up():
    fp = "hot-chunk"
    ranked = sorted(REPLICAS, key=lambda r: hrw_weight(fp, r), reverse=True)
    policy = AffinityPolicy(AffinityConfig(slack=2, load_factor=1.0))
    q = idle()
    q[ranked[0]] = 2
    assert policy.choose([fp], q) == ranked[0]  # within min + slack
    q[ranked[0]] = 3
    assert policy.choose([fp], q) == ranked[1]  # over the bound: the stable runner-up
    q[ranked[1]] = 3
    assert policy.choose([fp], q) == ranked[2]


def test_a_hot_chunk_set_cannot_overload_one_replica():
    """All requests carry the same chunks and none completes: queues stay within the bound."""
    config = AffinityConfig(slack=2, load_factor=1.5)
    policy = AffinityPolicy(config)
    q = idle()
    hot = ["hot-1", "hot-2", "hot-3"]
    for _ in range(200):
        chosen = policy.rank(hot, q)[0][0]
        q[chosen] += 1
        assert max(q.values()) <= policy.load_bound(list(q.values())) + 1
    assert sum(1 for v in q.values() if v) >= 2  # the hot set spilled to its runner-ups
    assert max(q.values()) <= config.load_factor * 200 / len(q) + 1  # never above the bounded-load cap


@pytest.mark.parametrize("queues,eligible", [
    ({"r0": 1, "r1": 2}, {"r0"}),          # the default never queues behind a busier replica
    ({"r0": 2, "r1": 2}, {"r0", "r1"}),    # equal loads: affinity decides
    ({"r0": 0, "r1": 0}, {"r0", "r1"}),
    ({"r0": 3, "r1": 1, "r2": 1}, {"r1", "r2"}),
])
def test_default_bound_is_least_loaded_with_affinity_among_ties(queues, eligible):
    policy = AffinityPolicy()
    bound = policy.load_bound(list(queues.values()))
    assert {r for r, q in queues.items() if q <= bound} == eligible
    for i in range(200):  # whatever the chunks, the choice is one of the eligible replicas
        assert policy.choose([f"c{i}", f"d{i}"], queues) in eligible


def test_slack_lets_the_owner_take_more_before_spilling():
    fp = next(f"k{i}" for i in range(1000) if owner(f"k{i}", ["r0", "r1"]) == "r1")
    assert AffinityPolicy().choose([fp], {"r0": 1, "r1": 2}) == "r0"
    assert AffinityPolicy(AffinityConfig(slack=1)).choose([fp], {"r0": 1, "r1": 2}) == "r1"
    assert AffinityPolicy(AffinityConfig(slack=1)).choose([fp], {"r0": 1, "r1": 3}) == "r0"
    assert AffinityPolicy(AffinityConfig(load_factor=1.5)).choose([fp], {"r0": 1, "r1": 2}) == "r1"


def test_no_chunks_falls_back_to_least_loaded():
    policy = AffinityPolicy()
    q = {"r0": 3, "r1": 1, "r2": 2}
    assert policy.rank([], q) == [["r1"], ["r2", "r0"]]
    assert policy.choose([], q) is None


def test_rank_tiers_and_unknown_queue_lengths():
    policy = AffinityPolicy()
    tiers = policy.rank(["a", "b"], {"r0": None, "r1": 5, "r2": None})
    assert len(tiers) == 2 and len(tiers[0]) == 1
    assert sorted(tiers[0] + tiers[1]) == ["r0", "r1", "r2"]
    assert tiers[1][-1] == "r1"  # the busiest is tried last
    assert policy.rank(["a"], {"only": 7}) == [["only"]]
    assert policy.rank(["a"], {}) == []


def test_fingerprints_beyond_the_cap_are_ignored_and_bad_weights_refused():
    policy = AffinityPolicy(AffinityConfig(max_fingerprints=1))
    first = owner("first", ["r0", "r1"])
    many_other = [f"z{i}" for i in range(50) if owner(f"z{i}", ["r0", "r1"]) != first]
    assert policy.choose(["first", *many_other], idle(["r0", "r1"])) == first
    with pytest.raises(ValueError):
        AffinityPolicy().choose(["a", "b"], idle(), weights=[1.0])
    with pytest.raises(ValueError):
        AffinityConfig(load_factor=0.5)


def test_policy_imports_neither_torch_nor_ray():
    code = ("import sys, cachedrag.cluster.affinity, cachedrag.cluster.board, cachedrag.cluster.fingerprints, cachedrag.cluster.timeline; "
            "bad = [m for m in ('torch', 'ray', 'numpy') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_requests_before_their_first_token_outweigh_decoding_ones():
    """The convoy case measured on 2 replicas: r0 just took a request (pending its prefill),
    r1 holds two decoding requests. By count r0 is less loaded; by pending prefills it is not."""
    policy = AffinityPolicy()
    queues = {"r0": 1, "r1": 2}
    for i in range(100):
        fps = [f"c{i}", f"d{i}"]
        assert policy.choose(fps, queues) == "r0"  # queue lengths alone
        assert policy.choose(fps, queues, pending={"r0": 1, "r1": 0}) == "r1"
        assert policy.rank(fps, queues, pending={"r0": 1})[0] == ["r1"]
    assert policy.rank([], queues, pending={"r0": 1, "r1": 0}) == [["r1"], ["r0"]]  # least-loaded fallback too
    # equal pending counts: the queue bound decides; prefill_slack widens the candidates
    assert policy.candidates({"r0": 1, "r1": 2}, {"r0": 1, "r1": 1}) == ["r0"]
    loose = AffinityPolicy(AffinityConfig(prefill_slack=1, slack=5))
    assert sorted(loose.candidates({"r0": 1, "r1": 2}, {"r0": 1, "r1": 0})) == ["r0", "r1"]
