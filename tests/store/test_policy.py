"""PlacementPolicy on tiny fakes: victim order, duplicates first, children before parents."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cachedrag.store.policy import PlacementPolicy


def policy_with(entries: dict[str, tuple[float, set[int], str | None]], n_tiers: int = 3) -> PlacementPolicy:
    """entries: key -> (priority, copies, parent); insertion order is recency order."""
    p = PlacementPolicy(n_tiers)
    for key, (prio, copies, parent) in entries.items():
        p.ensure(key, prio, parent)
        p.touch(key)
        for t in copies:
            p.add_copy(key, t)
    return p


def size1(_key: str) -> int:
    return 1


def test_policy_module_needs_no_torch():
    code = "import sys, cachedrag.store.policy; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_lowest_priority_then_oldest_first():
    p = policy_with({"a": (2, {0}, None), "b": (1, {0}, None), "c": (1, {0}, None), "new": (5, set(), None)})
    assert p.victims(0, 1, size1, "new") == ["b"]
    assert p.victims(0, 2, size1, "new") == ["b", "c"]
    assert p.victims(0, 3, size1, "new") == ["b", "c", "a"]
    assert p.victims(0, 4, size1, "new") is None


def test_only_entries_ordered_below_the_incoming_one_are_victims():
    p = policy_with({"a": (3, {0}, None), "b": (1, {0}, None), "new": (2, set(), None)})
    assert p.victims(0, 1, size1, "new") == ["b"]
    assert p.victims(0, 2, size1, "new") is None


def test_duplicates_go_first_whatever_their_priority():
    p = policy_with({"hot": (9, {0, 1}, None), "cold": (0, {1}, None), "new": (5, set(), None)})
    assert p.victims(1, 1, size1, "new") == ["hot"]  # hot is still in tier 0: dropping its copy loses nothing
    assert p.victims(1, 2, size1, "new") == ["hot", "cold"]
    assert p.victims(1, 1, size1, "new", primaries=False) == ["hot"]
    assert p.victims(1, 2, size1, "new", primaries=False) is None


def test_children_leave_a_tier_before_their_parent():
    # parent has the lowest priority but a child in the same tier: the child goes first
    p = policy_with({"root": (0, {0}, None), "kid": (1, {0}, "root"), "other": (2, {0}, None), "new": (9, set(), None)})
    assert p.victims(0, 1, size1, "new") == ["kid"]
    assert p.victims(0, 2, size1, "new") == ["kid", "root"]


def test_parent_with_child_in_a_slower_tier_is_eligible():
    p = policy_with({"root": (0, {0}, None), "kid": (1, {1}, "root"), "new": (9, set(), None)})
    assert p.victims(0, 1, size1, "new") == ["root"]


def test_protected_keys_are_never_victims():
    p = policy_with({"root": (0, {0}, None), "x": (1, {0}, None), "new": (9, set(), "root")})
    assert p.victims(0, 1, size1, "new", protect=p.ancestors("new")) == ["x"]


def test_held_keys_leave_a_tier_after_every_other_eligible_entry():
    p = policy_with({"a": (1, {0}, None), "b": (2, {0}, None), "c": (3, {0}, None), "new": (5, set(), None)})
    p.held = frozenset({"a"})
    assert p.victims(0, 1, size1, "new") == ["b"]  # a is the lowest, but held
    assert p.victims(0, 3, size1, "new") == ["b", "c", "a"]  # still a victim when nothing else is left
    p.held = frozenset()
    assert p.victims(0, 1, size1, "new") == ["a"]


def test_tree_helpers():
    p = policy_with({"r": (0, {0}, None), "a": (0, {1}, "r"), "b": (0, {2}, "a"), "c": (0, set(), "a")})
    assert p.ancestors("b") == ["a", "r"]
    assert p.descendants("r") == ["b", "a"]  # deepest first
    assert list(p.allowed_levels("a")) == [0, 1, 2]
    assert p.tree_violations() == []
    p.drop_copy("r", 0)
    p.add_copy("r", 2)
    assert len(p.tree_violations()) == 1


def test_cycles_are_refused():
    p = policy_with({"a": (0, {0}, None), "b": (0, {0}, "a")})
    with pytest.raises(ValueError, match="cycle"):
        p.ensure("a", parent="b")


def test_custom_sort_key_is_a_strategy():
    p = PlacementPolicy(1, sort_key=lambda n: (-n.last_used,))  # evict the most recent first (MRU)
    for k in ["a", "b", "c"]:
        p.ensure(k)
        p.touch(k)
        p.add_copy(k, 0)
    p.ensure("new")
    p.nodes["new"].last_used = -1  # ordered after everything
    assert p.victims(0, 1, size1, "new") == ["c"]
