"""The prefill board: requests routed to a replica and still before their first token."""

from __future__ import annotations

from cachedrag.cluster.board import PrefillBoard


def test_routed_started_and_rerouted():
    board = PrefillBoard()
    board.routed("t1", "r0")
    board.routed("t2", "r0")
    board.routed("t3", "r1")
    assert board.pending(["r0", "r1", "r2"]) == {"r0": 2, "r1": 1, "r2": 0}
    board.routed("t2", "r1")  # the ingress corrects the router's choice with the answering replica
    assert board.pending() == {"r0": 1, "r1": 2}
    board.started("t1")
    board.started("t1")  # idempotent
    board.started("unknown")
    assert board.pending(["r0", "r1"]) == {"r0": 0, "r1": 2} and len(board) == 2


def test_stale_tickets_expire():
    now = [0.0]
    board = PrefillBoard(max_age_s=10, clock=lambda: now[0])
    board.routed("lost", "r0")
    now[0] = 5.0
    board.routed("fresh", "r0")
    assert board.pending() == {"r0": 2}
    now[0] = 11.0
    assert board.pending() == {"r0": 1} and len(board) == 1
