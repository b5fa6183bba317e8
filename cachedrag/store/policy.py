"""Placement policy of the tiered store: priorities, the prefix tree, copies and victims.

Owns: the per-key bookkeeping (``Node``: priority, parent link, which tiers hold a copy,
recency, version), the tree-consistency rule and the choice of eviction victims. Pure
Python — no torch, no I/O — so it is testable on tiny fakes. Does not own: moving bytes
(``tiered`` executes the decisions on real tiers).

Vocabulary: tiers are numbered fastest first (0 = fastest). A key's *level* is the fastest
tier holding a copy. A copy in a tier slower than the key's level is a *duplicate* (kept
after a promotion, so a later demotion needs no rewrite: swap-out-only-once); the copy at
the level is the *primary*.

Rules:

- Tree consistency: for a cached parent p of a cached child c, ``level(p) <= level(c)``.
- Victims in tier t, to free ``need`` bytes for an incoming key: duplicates first (dropping
  them loses nothing), then primaries ordered by ``sort_key`` (lowest first, default
  ``(priority, last_used)``) whose sort key is below the incoming key's, and only once no
  child of theirs is still a primary in t (children leave first, so a parent is never
  slower than its children). Protected keys (the incoming key and its ancestors) are never
  victims. Held keys (``held``: what waiting requests will read) come after every other
  eligible primary. If the eligible set cannot free enough, there is no victim list: the
  incoming entry does not belong in this tier.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

SortKey = Callable[["Node"], tuple]


@dataclass
class Node:
    """What the policy knows about one key."""

    key: str
    priority: float = 0.0
    parent: str | None = None
    copies: frozenset[int] = frozenset()  # tiers holding a valid copy
    last_used: int = 0  # logical clock of the last put/get
    version: int = 0  # bumped when the content is replaced

    @property
    def level(self) -> int | None:
        return min(self.copies) if self.copies else None


def priority_then_recency(node: Node) -> tuple:
    """Default eviction order: lowest priority first, then least recently used."""
    return (node.priority, node.last_used)


class PlacementPolicy:
    """Bookkeeping and victim choice for ``n_tiers`` ordered tiers."""

    def __init__(self, n_tiers: int, sort_key: SortKey = priority_then_recency) -> None:
        self.n_tiers = n_tiers
        self.sort_key = sort_key
        self.nodes: dict[str, Node] = {}
        self.members: list[set[str]] = [set() for _ in range(n_tiers)]
        self._parent: dict[str, str] = {}  # child key -> parent key (links outlive nodes)
        self._children: dict[str, set[str]] = {}  # parent key -> child keys
        self._clock = 0
        self.held: frozenset[str] = frozenset()  # keys waiting requests will read: evicted last

    # ---- nodes ---------------------------------------------------------------------------
    def node(self, key: str) -> Node | None:
        return self.nodes.get(key)

    def ensure(self, key: str, priority: float | None = None, parent: str | None = None) -> Node:
        """The node for ``key`` (created if needed), with ``priority``/``parent`` updated when given."""
        node = self.nodes.get(key)
        if node is None:
            node = self.nodes[key] = Node(key, parent=self._parent.get(key))
        if priority is not None:
            node.priority = float(priority)
        if parent is not None and parent != self._parent.get(key):
            self.link(key, parent)
        return node

    def link(self, key: str, parent: str) -> None:
        """Record ``parent`` as ``key``'s parent (links outlive nodes, for when keys come back)."""
        if parent == key or key in self.ancestors(parent, cached_only=False):
            raise ValueError(f"parent link {key} -> {parent} would make a cycle")
        self.unlink(key)
        self._parent[key] = parent
        self._children.setdefault(parent, set()).add(key)
        node = self.nodes.get(key)
        if node is not None:
            node.parent = parent

    def unlink(self, key: str) -> None:
        """Forget ``key``'s parent link."""
        parent = self._parent.pop(key, None)
        if parent is not None:
            kids = self._children.get(parent)
            if kids is not None:
                kids.discard(key)
                if not kids:
                    del self._children[parent]
        node = self.nodes.get(key)
        if node is not None:
            node.parent = None

    def touch(self, key: str) -> None:
        node = self.nodes.get(key)
        if node is not None:
            self._clock += 1
            node.last_used = self._clock

    def add_copy(self, key: str, tier: int) -> None:
        node = self.nodes[key]
        node.copies = node.copies | {tier}
        self.members[tier].add(key)

    def drop_copy(self, key: str, tier: int) -> None:
        node = self.nodes.get(key)
        if node is not None:
            node.copies = node.copies - {tier}
        self.members[tier].discard(key)

    def forget(self, key: str) -> None:
        """Remove ``key``'s node (its tree links stay, for when it comes back)."""
        node = self.nodes.pop(key, None)
        if node is not None:
            for t in node.copies:
                self.members[t].discard(key)

    # ---- tree ----------------------------------------------------------------------------
    def cached(self, key: str | None) -> Node | None:
        """The node of ``key`` if it holds at least one copy."""
        node = self.nodes.get(key) if key is not None else None
        return node if node is not None and node.copies else None

    def parent_of(self, key: str) -> Node | None:
        """The cached parent of ``key``."""
        return self.cached(self._parent.get(key))

    def children_of(self, key: str) -> list[Node]:
        """Cached children of ``key``."""
        return [n for c in self._children.get(key, ()) if (n := self.cached(c)) is not None]

    def ancestors(self, key: str, *, cached_only: bool = True) -> list[str]:
        """Parent, grandparent, ... of ``key`` (nearest first; only cached ones by default)."""
        out: list[str] = []
        seen = {key}
        parent = self._parent.get(key)
        while parent is not None and parent not in seen:
            seen.add(parent)
            if not cached_only or self.cached(parent) is not None:
                out.append(parent)
            parent = self._parent.get(parent)
        return out

    def descendants(self, key: str) -> list[str]:
        """Cached descendants of ``key``, deepest first (safe deletion order)."""
        out: list[str] = []
        stack = [key]
        seen = {key}
        while stack:
            for child in self.children_of(stack.pop()):
                if child.key not in seen:
                    seen.add(child.key)
                    out.append(child.key)
                    stack.append(child.key)
        return out[::-1]

    def allowed_levels(self, key: str) -> range:
        """Tiers where ``key`` may live given its cached parent and children."""
        parent = self.parent_of(key)
        lo = parent.level if parent is not None else 0
        children = [c.level for c in self.children_of(key)]
        hi = min(children) if children else self.n_tiers - 1
        return range(lo, hi + 1)

    # ---- victims -------------------------------------------------------------------------
    def victims(
        self,
        tier: int,
        need: int,
        size_of: Callable[[str], int | None],
        incoming: str,
        protect: Iterable[str] = (),
        *,
        primaries: bool = True,
    ) -> list[str] | None:
        """Keys to move out of ``tier`` (in order) to free ``need`` bytes, or ``None``."""
        if need <= 0:
            return []
        protected = set(protect) | {incoming}
        in_tier = [self.nodes[k] for k in self.members[tier] if k not in protected and k in self.nodes]
        chosen: list[str] = []
        freed = 0
        for node in sorted((n for n in in_tier if n.level is not None and n.level < tier), key=self.sort_key):
            chosen.append(node.key)
            freed += size_of(node.key) or 0
            if freed >= need:
                return chosen
        if not primaries:
            return None
        bar = self.sort_key(self.nodes[incoming])
        pool = sorted((n for n in in_tier if n.level == tier and self.sort_key(n) < bar),
                      key=lambda n: (n.key in self.held, self.sort_key(n)))
        picked: set[str] = set()
        progress = True
        while freed < need and progress:
            progress = False
            for node in pool:
                if node.key in picked or not self._leaves_tier_last(node, tier, picked):
                    continue
                picked.add(node.key)
                chosen.append(node.key)
                freed += size_of(node.key) or 0
                progress = True
                break  # restart: a pick may have made a lower-ordered parent eligible
        return chosen if freed >= need else None

    def _leaves_tier_last(self, node: Node, tier: int, picked: set[str]) -> bool:
        return all(c.level != tier or c.key in picked for c in self.children_of(node.key))

    # ---- checks --------------------------------------------------------------------------
    def tree_violations(self) -> list[str]:
        """Cached (parent, child) pairs where the parent sits in a slower tier."""
        out = []
        for node in self.nodes.values():
            parent = self.parent_of(node.key)
            if node.copies and parent is not None and parent.level > node.level:
                out.append(f"parent {parent.key[:8]} at tier {parent.level} is slower than child {node.key[:8]} at {node.level}")
        return out
