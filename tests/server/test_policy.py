"""The torch-free admission policy: FIFO, cache-aware order, overtake cap, starvation bound, queue limit."""

from __future__ import annotations

import sys

import pytest

from cachedrag.server.policy import QueueFullError, SchedulerPolicy, Ticket


def _tickets():
    # id, arrival, prompt tokens, cached tokens -> priority cached / (prompt - cached)
    return [Ticket(1, 0.0, 1000, 0), Ticket(2, 0.1, 1000, 900), Ticket(3, 0.2, 1000, 500), Ticket(4, 0.3, 100, 90)]


def test_policy_module_never_imports_torch():
    import subprocess

    code = "import sys, cachedrag.server.policy, cachedrag.server.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


def test_fifo_admits_in_arrival_order():
    p = SchedulerPolicy("fifo", starvation_s=100)
    for t in _tickets():
        p.push(t)
    assert [t.id for t in p.admit(2, now=1.0)] == [1, 2]
    assert [t.id for t in p.admit(5, now=1.0)] == [3, 4]
    assert len(p) == 0


def test_cache_aware_admits_highest_cached_to_compute_ratio_first():
    p = SchedulerPolicy("cache_aware", starvation_s=100, max_overtakes=10**9)  # the ratio alone
    for t in _tickets():
        p.push(t)
    # priorities: 1 -> 0, 2 -> 9, 3 -> 1, 4 -> 9 (tie with 2: earlier arrival first)
    assert [t.id for t in p.admit(4, now=1.0)] == [2, 4, 3, 1]


def test_estimate_refreshes_cached_len_before_ranking():
    p = SchedulerPolicy("cache_aware", starvation_s=100)
    for t in _tickets():
        p.push(t)
    # the cache changed while they waited: now only request 1 is fully cached (clamped to its prompt)
    chosen = p.admit(1, now=1.0, estimate=lambda t: 5000 if t.id == 1 else 0)
    assert [t.id for t in chosen] == [1]
    assert chosen[0].cached_len == 1000


def test_starved_requests_go_first_oldest_first():
    p = SchedulerPolicy("cache_aware", starvation_s=5.0)
    for t in _tickets():
        p.push(t)
    # at t=5.15 tickets 1 (waited 5.15 s) and 2 (5.05 s) are starved: they lead in arrival order
    assert [t.id for t in p.ranked(now=5.15)] == [1, 2, 4, 3]


def test_no_request_waits_past_the_bound_under_a_stream_of_better_ones():
    """A cold request keeps losing to fully cached newcomers only until the starvation window ends."""
    p = SchedulerPolicy("cache_aware", starvation_s=3.0, max_overtakes=10**9)  # the time window alone
    p.push(Ticket(0, 0.0, 1000, 0))
    admitted_at = None
    for step in range(1, 20):  # one slot per second, one hot newcomer per second
        now = float(step)
        p.push(Ticket(step, now - 0.5, 1000, 990))
        if any(t.id == 0 for t in p.admit(1, now=now)):
            admitted_at = now
            break
    assert admitted_at == 3.0


@pytest.mark.parametrize("seed", range(5))
def test_starvation_bound_holds_on_random_streams(seed):
    """Random arrivals, cache estimates and slot counts (fake clock): a request that has waited the
    window is never passed by a younger one, and none waits longer than the window plus the time
    until the next admission that could take it, as long as slots come often enough."""
    import random

    rng = random.Random(seed)
    window, p = 2.0, SchedulerPolicy("cache_aware", starvation_s=2.0, max_overtakes=10**9)
    waits, now, next_id = [], 0.0, 0
    for _ in range(400):
        now += rng.uniform(0.05, 0.3)  # one admission decision per step
        for _ in range(rng.choice((0, 0, 1, 2))):  # arrivals since the last step (some hot, some cold)
            p.push(Ticket(next_id, now - rng.uniform(0, 0.05), rng.randint(200, 2000), 0))
            next_id += 1
        before = p.waiting
        chosen = p.admit(rng.choice((0, 1, 1, 2)), now=now, estimate=lambda t: rng.randint(0, t.prompt_tokens))
        left = [t for t in before if t.id not in {c.id for c in chosen}]
        for c in chosen:
            waits.append(now - c.arrival)
            # nobody starved was left behind for a younger request
            assert not any(now - t.arrival >= window and t.arrival < c.arrival for t in left)
    assert p.admitted == len(waits) and p.reordered > 0 and p.contested >= p.reordered
    assert max(waits) < window + 3.0  # the queue drains: admissions keep up with arrivals on average


@pytest.mark.parametrize("cap", [1, 2, 3])
def test_a_cold_request_goes_first_once_passed_cap_times(cap):
    """One slot per step, a fully cached newcomer before every step: the cold request is passed by
    exactly ``cap`` of them, then admitted ahead of the hotter ones still waiting."""
    p = SchedulerPolicy("cache_aware", starvation_s=1e9, max_overtakes=cap)
    p.push(Ticket(0, 0.0, 1000, 0))
    order = []
    for step in range(1, 10):
        p.push(Ticket(step, step - 0.5, 1000, 990))
        order += [t.id for t in p.admit(1, now=float(step))]
    assert order[:cap + 1] == list(range(1, cap + 1)) + [0]


def test_no_overtakes_is_arrival_order():
    tickets = [Ticket(i, 0.1 * i, 1000, 100 * i) for i in range(8)]  # later = better cached
    p = SchedulerPolicy("cache_aware", starvation_s=1e9, max_overtakes=0)
    for t in tickets:
        p.push(t)
    assert [t.id for t in p.admit(3, now=1.0)] + [t.id for t in p.admit(8, now=2.0)] == list(range(8))


@pytest.mark.parametrize("cap,seed", [(1, 0), (2, 1), (2, 2), (4, 3), (4, 4)])
def test_overtake_cap_holds_on_random_streams(cap, seed):
    """Random arrivals (some pushed out of arrival order), cache estimates and slot counts (up to 2
    per admission): no request is passed by more than ``cap`` younger ones while it waits."""
    import random

    rng = random.Random(seed)
    p = SchedulerPolicy("cache_aware", starvation_s=1e9, max_overtakes=cap)
    now, next_id, admitted, arrival, pushed_at = 0.0, 0, [], {}, {}
    for _ in range(400):
        now += rng.uniform(0.05, 0.3)
        for _ in range(rng.choice((0, 0, 1, 2, 3))):
            arrival[next_id], pushed_at[next_id] = now - rng.uniform(0, 0.2), len(admitted)
            p.push(Ticket(next_id, arrival[next_id], rng.randint(200, 2000), 0))
            next_id += 1
        chosen = p.admit(rng.choice((0, 1, 1, 2)), now=now, estimate=lambda t: rng.randint(0, t.prompt_tokens))
        admitted += [t.id for t in chosen]
        for t in p.waiting:
            assert t.overtaken <= cap
    assert p.reordered > 0
    for j, rid in enumerate(admitted):  # younger requests admitted while it waited
        passed_by = sum(arrival[x] > arrival[rid] for x in admitted[pushed_at[rid]:j])
        assert passed_by <= cap, (rid, passed_by)


def test_counters_say_when_the_order_had_a_choice():
    p = SchedulerPolicy("cache_aware", starvation_s=100)
    p.push(Ticket(1, 0.0, 1000, 0))
    p.admit(4, now=0.1)  # alone: no choice
    for t in _tickets():
        p.push(t)
    p.admit(1, now=1.0)  # 2 of 4 (priority 9) goes ahead of 1
    assert (p.admitted, p.contested, p.reordered) == (2, 1, 1)


def test_queue_limit_and_remove():
    p = SchedulerPolicy(max_waiting=2)
    p.push(Ticket(1, 0.0, 10))
    p.push(Ticket(2, 0.0, 10))
    with pytest.raises(QueueFullError):
        p.push(Ticket(3, 0.0, 10))
    assert p.remove(1).id == 1
    assert p.remove(1) is None
    p.push(Ticket(3, 0.0, 10))
    assert [t.id for t in p.admit(10, now=0.0, limit=1)] in ([2], [3])
    assert len(p) == 1


@pytest.mark.parametrize("kwargs", [{"order": "lifo"}, {"max_waiting": 0}, {"starvation_s": -1}, {"max_overtakes": -1}])
def test_bad_settings_are_rejected(kwargs):
    with pytest.raises(ValueError):
        SchedulerPolicy(**kwargs)


def test_server_settings_reach_the_policy():
    from cachedrag.cli import build_parser
    from cachedrag.server.config import SchedulerConfig
    from cachedrag.server.loop import EngineLoop
    from cachedrag.server.policy import MAX_OVERTAKES

    assert SchedulerConfig().max_overtakes == MAX_OVERTAKES  # one default: library, config and CLI
    args = build_parser().parse_args(["serve", "--tiny"])
    assert args.max_overtakes == MAX_OVERTAKES
    args = build_parser().parse_args(["serve", "--tiny", "--max-overtakes", "5", "--starvation-s", "3"])
    loop = EngineLoop(None, SchedulerConfig(max_overtakes=args.max_overtakes, starvation_s=args.starvation_s))
    assert (loop.policy.max_overtakes, loop.policy.starvation_s) == (5, 3.0)
    with pytest.raises(ValueError):
        SchedulerConfig(max_overtakes=-1)
