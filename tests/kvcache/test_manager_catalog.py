"""Parsing stored entries' metadata back (``cachedrag.kvcache.catalog``)."""

from __future__ import annotations

import json

import pytest

from cachedrag.kvcache.catalog import CatalogError, StoredSegment, tree_order, variant_metadata
from cachedrag.kvcache.keys import path_key


def meta(keys, role="chunk", exact=True, n_tokens=4, variant=None, **over):
    m = {"namespace": "ns", "segment_key": keys[-1], "path": json.dumps(list(keys)), "role": role,
         "exact": "1" if exact else "0", "n_tokens": str(n_tokens)}
    if variant is not None:
        m["variant"] = json.dumps(variant)
    m.update(over)
    return m


def seg(path, exact=True, **kw):
    return StoredSegment.parse(path_key(path), meta(path, exact=exact, **kw), 100, kw.get("n_tokens", 4))


def test_parse_roundtrip():
    s = StoredSegment.parse(path_key(["S", "A"]), meta(["S", "A"], variant={"prefix_keys": [], "inter": {},
                                                                           "intra": 2.0}), 640, 4)
    assert (s.segment_key, s.path, s.role, s.exact, s.n_tokens, s.nbytes) == ("A", ("S", "A"), "chunk", True, 4, 640)
    assert s.parent_handle == path_key(["S"]) and s.variant == {"prefix_keys": (), "inter": {}, "intra": 2.0}
    m = variant_metadata(s, [0.0, 0.5, 0.25, 0.0])
    assert m.is_cold and m.n_tokens == 4 and list(m.token_order)[:2] == [1, 2]
    assert seg(["S"], role="system").parent_handle is None


@pytest.mark.parametrize("change, handle", [
    ({"path": json.dumps(["S", "B"])}, None),  # does not hash to the handle
    ({"segment_key": "B"}, None),
    ({"role": "question"}, None),
    ({"n_tokens": "5"}, None),  # tensors say 4
    ({"n_tokens": "x"}, None),
    ({"path": "[]"}, path_key([])),
    ({"path": "not json"}, None),
    ({"variant": "{\"prefix_keys\": []}"}, None),
])
def test_parse_rejects_inconsistent_metadata(change, handle):
    with pytest.raises(CatalogError):
        StoredSegment.parse(handle or path_key(["S", "A"]), meta(["S", "A"], **change), 100, 4)


def test_parse_rejects_entries_without_engine_metadata():
    with pytest.raises(CatalogError, match="no engine metadata"):
        StoredSegment.parse(path_key(["S"]), {"namespace": "ns"}, 100)


def test_variant_metadata_checks_lengths_and_keys():
    s = seg(["S", "A", "B"], variant={"prefix_keys": ["A"], "inter": {"A": 0.3}, "intra": 1.0})
    assert variant_metadata(s, [0.1] * 4).inter == {"A": 0.3}
    with pytest.raises(CatalogError):
        variant_metadata(s, [0.1] * 3)
    bad = seg(["S", "A", "B"], variant={"prefix_keys": [], "inter": {"A": 0.3}, "intra": 1.0})
    with pytest.raises(CatalogError):
        variant_metadata(bad, [0.1] * 4)
    with pytest.raises(CatalogError):
        variant_metadata(seg(["S", "B"]), [0.1] * 4)


def test_tree_order_parents_first_and_orphans():
    segs = [seg(["S", "A", "B"]), seg(["S"]), seg(["S", "A"]), seg(["T", "X"]), seg(["S", "C"], exact=False),
            seg(["S", "A", "B", "C"])]
    ok, orphans = tree_order(segs, lambda path: False)
    assert [s.path for s in ok] == [("S",), ("S", "A"), ("S", "A", "B"), ("S", "A", "B", "C")]
    assert [s.path for s in orphans] == [("T", "X")]
    ok, orphans = tree_order([seg(["T", "X"])], lambda path: path == ("T",))  # parent already in the tree
    assert [s.path for s in ok] == [("T", "X")] and orphans == []
