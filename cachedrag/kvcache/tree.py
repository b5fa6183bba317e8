"""RAGCache knowledge tree: exact-prefix reuse of segment sequences.

Owns: ``KnowledgeTree`` and ``TreeNode``. A path from the (hidden) sentinel root is an ordered
sequence of segment keys: by convention the first is the system prompt / shared prefix
segment, then the documents (chunks) in request order. A node stands for the KV of its segment
computed exactly behind the segments of its ancestors, so a request whose segment sequence
starts with a tree path can take all of that path's KV as is.

Nodes hold an opaque ``handle`` (the engine's tensor-entry id), the token length, the byte
size, and policy stats (``policy.EntryStats``). Only leaves are evictable: a parent is never
evicted before its children (its KV is the prefix they were computed behind). Pinned nodes
(in use by an in-flight request) are never evicted.

Complexities: ``match_prefix`` O(depth) (one dict lookup per level); eviction O(log n) per
entry through a lazy heap of leaves keyed by the policy's sort key. One re-entrant lock makes
every public method thread-safe.

Does not own: tensors (only handles), tiers/placement (the store), what to insert (the engine
inserts only KV that equals full prefill in its path; see ``Plan.exact_prefix_segments``).
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from cachedrag.kvcache.policy import EntryStats, EvictionPolicy, make_policy, record_access
from cachedrag.kvcache.profile import PrefillProfile


class TreeNode:
    """One segment at one position of a path. Read its fields; mutate only via the tree."""

    __slots__ = (
        "key",
        "handle",
        "n_tokens",
        "nbytes",
        "parent",
        "children",
        "depth",
        "prefix_tokens",
        "stats",
        "pins",
        "attached",
        "_version",
    )

    def __init__(
        self,
        key: str,
        handle: Any,
        n_tokens: int,
        nbytes: int,
        parent: TreeNode | None,
        stats: EntryStats | None,
    ) -> None:
        self.key = key
        self.handle = handle
        self.n_tokens = n_tokens
        self.nbytes = nbytes
        self.parent = parent
        self.children: dict[str, TreeNode] = {}
        self.depth = 0 if parent is None else parent.depth + 1  # 1 for the first segment
        # tokens of all ancestors' segments (the absolute start position of this segment)
        self.prefix_tokens = 0 if parent is None else parent.prefix_tokens + parent.n_tokens
        self.stats = stats
        self.pins = 0
        self.attached = True
        self._version = 0

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def path_keys(self) -> list[str]:
        """Keys from the first segment down to this node."""
        keys = []
        node: TreeNode | None = self
        while node is not None and node.parent is not None:
            keys.append(node.key)
            node = node.parent
        return keys[::-1]

    def __repr__(self) -> str:
        return (
            f"TreeNode(key={self.key[:12]!r}, depth={self.depth}, tokens={self.n_tokens}, "
            f"nbytes={self.nbytes}, children={len(self.children)}, pins={self.pins})"
        )


@dataclass(frozen=True)
class InsertResult:
    """What ``insert`` did.

    nodes: the path's nodes, one per key, in order.
    created: how many of them are new (the last ``created`` nodes).
    unused_handles: handles passed for positions that already existed (another request got
        there first): the engine frees them. ``None`` handles are never reported.
    """

    nodes: tuple[TreeNode, ...]
    created: int
    unused_handles: tuple[Any, ...]


class KnowledgeTree:
    """Prefix tree of segment keys with policy-driven leaf eviction.

    >>> tree = KnowledgeTree("lru")
    >>> r = tree.insert(["sys", "d1", "d2"], ["h0", "h1", "h2"], [8, 4, 4], [80, 40, 40])
    >>> [n.key for n in tree.match_prefix(["sys", "d1", "d9"])]
    ['sys', 'd1']
    >>> tree.evict_until(40)
    ['h2']
    """

    def __init__(
        self,
        policy: str | EvictionPolicy = "pgdsf",
        profile: PrefillProfile | None = None,
        *,
        cfo_floor: float = 0.05,
    ) -> None:
        self.policy = make_policy(policy)
        self.profile = profile
        self.cfo_floor = cfo_floor
        self._lock = threading.RLock()
        self._root = TreeNode("", None, 0, 0, None, None)
        self._tick = 0
        self._clock = 0.0
        self._heap: list[tuple[tuple[float, ...], int, int, TreeNode]] = []
        self._seq = itertools.count()
        self._n_nodes = 0
        self._total_bytes = 0
        self._total_tokens = 0
        self.evictions = 0

    @classmethod
    def from_config(cls, config: Any, profile: PrefillProfile | None = None) -> KnowledgeTree:
        """From a ``CacheConfig`` (uses ``policy`` and ``cfo_floor``)."""
        return cls(config.policy, profile, cfo_floor=config.cfo_floor)

    # -- read --------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._n_nodes

    @property
    def total_bytes(self) -> int:
        return self._total_bytes

    @property
    def total_tokens(self) -> int:
        return self._total_tokens

    @property
    def clock(self) -> float:
        """The GDSF-family clock L (priority of the last evicted entry, non-decreasing)."""
        return self._clock

    @property
    def root(self) -> TreeNode:
        """The sentinel root (no segment; never evicted). Its children are first segments."""
        return self._root

    def match_prefix(self, keys: Iterable[str], *, pin: bool = False) -> list[TreeNode]:
        """The longest path from the root whose keys equal the leading ``keys``, in order.

        O(len(result)). ``pin=True`` pins the returned nodes atomically (release with ``unpin``).
        """
        with self._lock:
            out: list[TreeNode] = []
            node = self._root
            for key in keys:
                child = node.children.get(key)
                if child is None:
                    break
                out.append(child)
                node = child
            if pin:
                for n in out:
                    n.pins += 1
            return out

    def match_tokens(self, n_total: int, key_of: Callable[[int, int], str], *,
                     alternates: Callable[[str], Sequence[str]] | None = None) -> list[TreeNode]:
        """The longest path from the root whose segments, laid end to end, are a token prefix
        of a prompt of ``n_total`` tokens, whatever that prompt's own segment boundaries are (a
        conversation's next step: the previous prompt and its answer are a prefix of the new
        prompt's ids, cut elsewhere). ``key_of(start, end)`` is the key of the prompt's tokens
        ``start..end`` (the content key a segment of those ids would have); ``alternates(key)``
        lists further keys a child may carry for the same tokens (none by default). Children
        are probed by their distinct token lengths, longest first, one ``key_of`` per length and
        level; the first child that matches is taken (greedy: a longer segment covers more).
        Read-only: nothing is pinned or touched (``match_prefix`` with the keys pins)."""
        with self._lock:
            out: list[TreeNode] = []
            node, pos = self._root, 0
            while node.children:
                by_len: dict[int, list[TreeNode]] = {}
                for child in node.children.values():
                    by_len.setdefault(child.n_tokens, []).append(child)
                found = None
                for n in sorted(by_len, reverse=True):
                    if pos + n > n_total:
                        continue
                    key = key_of(pos, pos + n)
                    keys = (key, *(alternates(key) if alternates is not None else ()))
                    found = next((node.children[k] for k in keys if k in node.children
                                  and node.children[k].n_tokens == n), None)
                    if found is not None:
                        break
                if found is None:
                    break
                out.append(found)
                node, pos = found, pos + found.n_tokens
            return out

    def find(self, keys: Sequence[str]) -> TreeNode | None:
        """The node at exactly this path, or None."""
        with self._lock:
            nodes = self.match_prefix(keys)
            return nodes[-1] if nodes and len(nodes) == len(keys) else None

    def nodes(self) -> list[TreeNode]:
        """All nodes (breadth first), a snapshot."""
        with self._lock:
            out: list[TreeNode] = []
            frontier = list(self._root.children.values())
            while frontier:
                out.extend(frontier)
                frontier = [c for n in frontier for c in n.children.values()]
            return out

    def leaves(self) -> list[TreeNode]:
        return [n for n in self.nodes() if n.is_leaf]

    # -- write -------------------------------------------------------------------------------

    def insert(
        self,
        keys: Sequence[str],
        handles: Sequence[Any],
        token_lengths: Sequence[int],
        nbytes: Sequence[int],
        *,
        pin: bool = False,
    ) -> InsertResult:
        """Insert the path ``keys`` (full path from the first segment), creating missing nodes.

        ``handles``, ``token_lengths`` and ``nbytes`` have one entry per key; entries for
        positions that already exist are ignored (their handles come back in
        ``unused_handles``). A new node starts with frequency 1, f_r 1 and, for PGDSF, cost =
        ``profile.marginal_cost(prefix_tokens, n_tokens)`` (without a profile: ``n_tokens``).
        ``pin=True`` pins every node of the path. Does not evict: call ``evict_until``.
        """
        n = len(keys)
        if not (len(handles) == len(token_lengths) == len(nbytes) == n):
            raise ValueError(
                f"KnowledgeTree.insert: keys, handles, token_lengths, nbytes must have equal lengths, "
                f"got {n}, {len(handles)}, {len(token_lengths)}, {len(nbytes)}"
            )
        for t, b in zip(token_lengths, nbytes):
            if t < 0 or b < 0:
                raise ValueError(f"KnowledgeTree.insert: token_lengths and nbytes must be >= 0, got {t}, {b}")
        with self._lock:
            self._tick += 1
            path: list[TreeNode] = []
            unused: list[Any] = []
            created = 0
            node = self._root
            for i, key in enumerate(keys):
                child = node.children.get(key)
                if child is not None:
                    if child.n_tokens != token_lengths[i]:
                        raise ValueError(
                            f"KnowledgeTree.insert: segment {key[:12]!r} has {child.n_tokens} tokens in the "
                            f"tree but {token_lengths[i]} were given (same key, different tokens?)"
                        )
                    if handles[i] is not None and handles[i] is not child.handle:
                        unused.append(handles[i])
                else:
                    child = self._new_node(key, handles[i], int(token_lengths[i]), int(nbytes[i]), node)
                    created += 1
                path.append(child)
                node = child
            if pin:
                for p in path:
                    p.pins += 1
            return InsertResult(tuple(path), created, tuple(unused))

    def touch(self, nodes: Iterable[TreeNode], cfo: float | None = None) -> None:
        """Record one access (a hit) of each node: frequency, recency, clock, f_r.

        ``cfo`` is the recompute fraction of the reuse (None/0 for exact tree hits).
        Detached (evicted) nodes are ignored.
        """
        with self._lock:
            self._tick += 1
            for node in nodes:
                if not node.attached or node.stats is None:
                    continue
                record_access(node.stats, self._tick, self._clock, cfo, self.cfo_floor)
                node._version += 1
                if node.is_leaf:
                    self._push(node)

    def pin(self, nodes: Iterable[TreeNode]) -> None:
        """Protect nodes from eviction until ``unpin`` (counts; pin twice, unpin twice)."""
        with self._lock:
            for node in nodes:
                node.pins += 1

    def unpin(self, nodes: Iterable[TreeNode]) -> None:
        with self._lock:
            for node in nodes:
                if node.pins <= 0:
                    raise ValueError(f"KnowledgeTree.unpin: {node!r} is not pinned")
                node.pins -= 1
                if node.pins == 0 and node.attached and node.is_leaf:
                    self._push(node)

    def evict_until(self, bytes_needed: int, policy: str | EvictionPolicy | None = None, *,
                    spare: frozenset[str] | set[str] = frozenset()) -> list[Any]:
        """Evict unpinned leaves, lowest policy key first, until >= ``bytes_needed`` are freed.

        Returns the evicted nodes' handles in eviction order (free their tensors). Stops early
        when nothing evictable is left (check ``total_bytes``). ``policy`` defaults to the
        tree's own; another policy is served by a one-off scan of the leaves. Leaves whose key
        is in ``spare`` are passed over (they stay evictable by a later call without it).
        """
        with self._lock:
            if bytes_needed <= 0:
                return []
            if policy is None or make_policy(policy).name == self.policy.name:
                return self._evict(self.policy, self._heap, bytes_needed, persistent=True, spare=spare)
            other = make_policy(policy)
            heap = [(other.sort_key(n.stats), next(self._seq), n._version, n) for n in self.leaves()]
            heapq.heapify(heap)
            return self._evict(other, heap, bytes_needed, persistent=False, spare=spare)

    def remove(self, node: TreeNode) -> list[Any]:
        """Drop ``node`` and its subtree (e.g. the store lost its tensors); returns their handles.

        Pins are ignored: the tensors are already gone. Children come before parents.
        """
        with self._lock:
            if not node.attached or node.parent is None:
                return []
            handles: list[Any] = []
            self._detach_subtree(node, handles)
            parent = node.parent
            del parent.children[node.key]
            if parent is not self._root and parent.is_leaf:
                self._push(parent)
            return handles

    # -- private -----------------------------------------------------------------------------

    def _new_node(self, key: str, handle: Any, n_tokens: int, nbytes: int, parent: TreeNode) -> TreeNode:
        prefix_tokens = parent.prefix_tokens + parent.n_tokens
        if self.profile is not None:
            cost = self.profile.marginal_cost(prefix_tokens, n_tokens)
        else:
            cost = float(n_tokens)
        stats = EntryStats(nbytes=nbytes, n_tokens=n_tokens, cost=cost, last_access=self._tick, clock=self._clock)
        node = TreeNode(key, handle, n_tokens, nbytes, parent, stats)
        parent.children[key] = node
        self._n_nodes += 1
        self._total_bytes += nbytes
        self._total_tokens += n_tokens
        self._push(node)
        return node

    def _push(self, node: TreeNode) -> None:
        heapq.heappush(self._heap, (self.policy.sort_key(node.stats), next(self._seq), node._version, node))
        if len(self._heap) > 4 * self._n_nodes + 1024:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        self._heap = [
            (self.policy.sort_key(n.stats), next(self._seq), n._version, n)
            for n in self.nodes()
            if n.is_leaf and n.pins == 0
        ]
        heapq.heapify(self._heap)

    def _evict(self, policy: EvictionPolicy, heap: list, bytes_needed: int, *, persistent: bool,
               spare: frozenset[str] | set[str] = frozenset()) -> list[Any]:
        freed = 0
        out: list[Any] = []
        spared: list = []
        while freed < bytes_needed and heap:
            item = heapq.heappop(heap)
            _, _, version, node = item
            if not node.attached or not node.is_leaf or node.pins > 0:
                continue  # stale; pinned leaves come back on unpin, parents when they become leaves
            if persistent and version != node._version:
                continue  # stats changed since this entry was pushed; a newer entry exists
            if node.key in spare:
                spared.append(item)
                continue
            parent = node.parent
            assert parent is not None
            del parent.children[node.key]
            node.attached = False
            self._n_nodes -= 1
            self._total_bytes -= node.nbytes
            self._total_tokens -= node.n_tokens
            self._clock = policy.clock_after_evict(self._clock, node.stats)
            self.evictions += 1
            freed += node.nbytes
            out.append(node.handle)
            if parent is not self._root and parent.is_leaf and parent.pins == 0:
                if persistent:
                    self._push(parent)
                else:
                    heapq.heappush(heap, (policy.sort_key(parent.stats), next(self._seq), parent._version, parent))
        for item in spared:  # back in the heap, as they were
            heapq.heappush(heap, item)
        return out

    def _detach_subtree(self, node: TreeNode, handles: list[Any]) -> None:
        for child in list(node.children.values()):
            self._detach_subtree(child, handles)
        node.children.clear()
        node.attached = False
        self._n_nodes -= 1
        self._total_bytes -= node.nbytes
        self._total_tokens -= node.n_tokens
        handles.append(node.handle)

    def __iter__(self) -> Iterator[TreeNode]:
        return iter(self.nodes())

    def __repr__(self) -> str:
        return (
            f"KnowledgeTree(policy={self.policy.name}, nodes={self._n_nodes}, "
            f"bytes={self._total_bytes}, tokens={self._total_tokens})"
        )
