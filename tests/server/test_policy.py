"""The torch-free admission policy: FIFO, cache-aware order, the FIFO-forecast delay bound, overtake cap,
starvation bound, queue limit."""

from __future__ import annotations

import sys

import pytest

from cachedrag.server.policy import Forecast, PrefillModel, QueueFullError, SchedulerPolicy, Ticket


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


@pytest.mark.parametrize("kwargs", [{"order": "lifo"}, {"max_waiting": 0}, {"starvation_s": -1}, {"max_overtakes": -1},
                                    {"max_delay_s": -0.5}])
def test_bad_settings_are_rejected(kwargs):
    with pytest.raises(ValueError):
        SchedulerPolicy(**kwargs)


def test_server_settings_reach_the_policy():
    from cachedrag.cli import build_parser
    from cachedrag.server.config import _bound
    from cachedrag.server.config import SchedulerConfig
    from cachedrag.server.loop import EngineLoop
    from cachedrag.server.policy import MAX_DELAY_S

    # one default: library, config and CLI (the forecast bound on, no overtake cap)
    assert SchedulerConfig().max_delay_s == SchedulerPolicy().max_delay_s == MAX_DELAY_S
    assert SchedulerConfig().max_overtakes is None and SchedulerPolicy().max_overtakes is None
    args = build_parser().parse_args(["serve", "--tiny"])
    assert (args.max_delay_s, args.max_overtakes) == (MAX_DELAY_S, None)
    args = build_parser().parse_args(["serve", "--tiny", "--max-overtakes", "5", "--starvation-s", "3",
                                      "--max-delay-s", "inf"])
    loop = EngineLoop(None, SchedulerConfig(max_overtakes=args.max_overtakes, starvation_s=args.starvation_s,
                                            max_delay_s=_bound(args.max_delay_s)))
    assert (loop.policy.max_overtakes, loop.policy.starvation_s, loop.policy.max_delay_s) == (5, 3.0, None)
    with pytest.raises(ValueError):
        SchedulerConfig(max_overtakes=-1)
    with pytest.raises(ValueError):
        SchedulerConfig(max_delay_s=-1.0)


# ---------------------------------------------------------------- the FIFO-forecast delay bound
def test_forecast_admission_times_take_free_slots_then_freeing_ones_and_stall_decoding():
    fc = Forecast(slot_free_in=[5.0], step_s=0.1, prefill_s_base=0.2, prefill_s_per_token=0.001)
    a = Ticket(1, 0.0, 1000, 0, max_new_tokens=100)  # prefill 0.2 + 1000 x 0.001 = 1.2 s, then 10 s of decoding
    b = Ticket(2, 0.1, 1000, 800, max_new_tokens=50)  # prefill 0.4 s, then 5 s
    c = Ticket(3, 0.2, 500, 400, max_new_tokens=50)
    # a: a free slot at once; b: the other free slot once a's prefill is done (1.2 s); c: the running
    # request's slot, which frees at 5.0 + the two prefills that stalled its decoding (1.2 + 0.4)
    assert fc.admission_times([a, b, c], free_slots=2) == pytest.approx([0.0, 1.2, 6.6])
    # one free slot: b takes the running request's slot (5.0 + a's stall), c the slot b's stall delayed
    # (a's: 1.2 + 10 = 11.2, + 0.4) or b's own (6.6 + 5 = 11.6): both 11.6
    assert fc.admission_times([a, b, c], free_slots=1) == pytest.approx([0.0, 6.2, 11.6])


def test_prefill_model_fits_base_and_per_token_cost():
    m = PrefillModel()
    for tokens in (40, 800, 120, 600, 40, 300):
        m.observe(tokens, 0.08 + 0.0004 * tokens)
    assert m.base_s == pytest.approx(0.08, rel=1e-6) and m.per_token_s == pytest.approx(0.0004, rel=1e-6)


def _wave_queue(**kwargs):
    """A cold request A waits with two hot ones, B and C; two slots are free now and the next one
    frees only after a whole answer (5 s): FIFO would admit A and B now and C after 5 s."""
    p = SchedulerPolicy("cache_aware", starvation_s=1e9, **kwargs)
    for t in (Ticket(1, 0.0, 1000, 0), Ticket(2, 0.1, 1000, 950), Ticket(3, 0.2, 1000, 950)):
        t.max_new_tokens = 100  # 5 s of decoding each
        p.push(t)
    return p, Forecast(slot_free_in=[5.0], step_s=0.05, prefill_s_base=0.1, prefill_s_per_token=0.0)


@pytest.mark.parametrize("max_delay_s, first_two", [
    (0.0, [1, 2]),   # B ahead of A would admit A one prefill (0.1 s) later than FIFO: not within 0 s
    (0.5, [2, 1]),   # within 0.5 s: B goes first, but C ahead of A would push A past the next wave (5 s)
    (10.0, [2, 3]),  # a bound longer than the wave: C passes A too
    (None, [2, 3]),  # no forecast bound: the ratio alone
])
def test_reordering_stays_within_the_fifo_forecast(max_delay_s, first_two):
    p, fc = _wave_queue(max_delay_s=max_delay_s)
    assert [t.id for t in p.admit(2, now=1.0, forecast=fc)] == first_two


def test_without_a_forecast_the_delay_bound_is_off():
    p, _ = _wave_queue(max_delay_s=0.0)
    assert [t.id for t in p.admit(2, now=1.0)] == [2, 3]


def test_deadlines_are_fifo_forecasts_fixed_when_first_seen():
    p, fc = _wave_queue(max_delay_s=0.25)
    p.ranked(now=1.0, forecast=fc, free_slots=2)
    assert [t.deadline for t in p.waiting] == pytest.approx([1.25, 1.35, 1.0 + 5.2 + 0.25])
    later = Forecast(slot_free_in=[1.0], step_s=0.05)  # a later view does not move them
    p.ranked(now=2.0, forecast=later, free_slots=0)
    assert [t.deadline for t in p.waiting] == pytest.approx([1.25, 1.35, 6.45])


@pytest.mark.parametrize("seed", range(6))
def test_every_pick_keeps_the_others_within_their_deadlines_on_random_queues(seed):
    """Random queues, cache estimates and forecasts: each admission is either the earliest
    deadline or one that leaves every other waiting ticket's forecast admission no later than
    its deadline or than earliest-deadline-first order would give it; and the order does reorder."""
    import random

    rng = random.Random(seed)
    p = SchedulerPolicy("cache_aware", starvation_s=1e9, max_delay_s=rng.choice((0.0, 0.3, 1.0)))
    now, next_id, reordered = 0.0, 0, 0
    for _ in range(150):
        now += rng.uniform(0.05, 0.5)
        for _ in range(rng.choice((0, 1, 1, 2, 3))):
            p.push(Ticket(next_id, now, rng.randint(100, 1200), max_new_tokens=rng.randint(8, 64)))
            next_id += 1
        fc = Forecast([rng.uniform(0, 4) for _ in range(rng.randint(0, 7))], rng.uniform(0.02, 0.08),
                      rng.uniform(0.02, 0.2), rng.uniform(0, 0.001))
        free = rng.choice((0, 1, 1, 2))
        p.ranked(now, estimate=lambda t: rng.randint(0, t.prompt_tokens), forecast=fc, free_slots=free)
        waiting = p.waiting
        if not waiting or free == 0:
            continue
        edf = sorted(waiting, key=lambda t: (t.deadline, t.arrival))
        base = dict(zip((t.id for t in edf), fc.admission_times(edf, free)))
        pick = p.admit(free, now, limit=1, forecast=fc)[0]
        if pick is edf[0]:
            continue
        reordered += 1
        plan = [pick] + [t for t in edf if t is not pick]
        for t, x in zip(plan[1:], fc.admission_times(plan, free)[1:]):
            assert now + x <= max(t.deadline, now + base[t.id]) + 1e-9
    assert reordered > 0


# ---------------------------------------------------------------- preemption of a running prefill
_PREFILL_COST = Forecast(slot_free_in=[], step_s=0.05, prefill_s_base=0.05, prefill_s_per_token=0.0005)


@pytest.mark.parametrize("remaining_s,ratio,expect", [
    (0.20, 0.5, 2),  # the hot request's prefill (0.05 + 50 x 0.0005 = 0.075 s) <= 0.5 x 0.2 s: it goes first
    (0.14, 0.5, None),  # 0.075 > 0.07: the running prefill finishes first
    (0.15, 0.5, 2),  # the boundary: at most ratio x remaining
    (1.00, 0.0, None),  # ratio 0: never
])
def test_preempt_takes_the_next_pick_only_when_it_is_short_against_the_running_prefill(remaining_s, ratio, expect):
    p = SchedulerPolicy("cache_aware", starvation_s=1e9, preempt_ratio=ratio)
    p.push(Ticket(2, 0.1, 1000, 950, max_new_tokens=64))  # compute 50 tokens: 0.075 s
    got = p.preempt(remaining_s, free_slots=1, now=1.0, forecast=_PREFILL_COST)
    assert (got.id if got else None) == expect
    assert p.preempted == p.admitted == (1 if expect else 0) and len(p) == (0 if expect else 1)


def test_preempt_passes_the_running_prefill_only_never_a_waiting_request():
    """A hot request behind an older waiting cold one does not preempt, even where the order ranks
    it first (no bound here): each request already waiting would wait for it too. Once the cold
    one is admitted, the hot one, alone, preempts the cold one's prefill."""
    p = SchedulerPolicy("cache_aware", starvation_s=1e9, max_delay_s=None, preempt_ratio=0.5)
    p.push(Ticket(1, 0.0, 1000, 100))  # compute 900 tokens: 0.5 s
    p.push(Ticket(2, 0.1, 1000, 950))
    assert p.ranked(now=1.0)[0].id == 2  # the order's own pick
    assert p.preempt(1.0, free_slots=2, now=1.0, forecast=_PREFILL_COST) is None and len(p) == 2
    alone = SchedulerPolicy("cache_aware", starvation_s=1e9, max_delay_s=None, preempt_ratio=0.5)
    alone.push(Ticket(2, 0.1, 1000, 950))  # the cold one's prefill is the running one now
    assert alone.preempt(1.0, free_slots=2, now=1.0, forecast=_PREFILL_COST).id == 2


def test_preempt_needs_cache_aware_order_a_forecast_a_free_slot_and_a_waiting_request():
    def policy(order="cache_aware"):
        p = SchedulerPolicy(order, starvation_s=1e9, preempt_ratio=1.0)
        p.push(Ticket(1, 0.0, 100, 90))
        return p

    assert policy("fifo").preempt(10.0, 1, now=1.0, forecast=_PREFILL_COST) is None
    assert policy().preempt(10.0, 1, now=1.0, forecast=None) is None
    assert policy().preempt(10.0, 0, now=1.0, forecast=_PREFILL_COST) is None
    assert policy().preempt(0.0, 1, now=1.0, forecast=_PREFILL_COST) is None
    assert SchedulerPolicy(preempt_ratio=1.0).preempt(10.0, 1, now=1.0, forecast=_PREFILL_COST) is None
    assert policy().preempt(10.0, 1, now=1.0, forecast=_PREFILL_COST).id == 1


def test_preempt_ratio_is_validated_and_reaches_the_policy():
    from cachedrag.server.config import SchedulerConfig
    from cachedrag.server.loop import EngineLoop
    from cachedrag.server.policy import PREEMPT_RATIO

    assert SchedulerConfig().preempt_ratio == SchedulerPolicy().preempt_ratio == PREEMPT_RATIO
    assert EngineLoop(None, SchedulerConfig(preempt_ratio=0.25)).policy.preempt_ratio == 0.25
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError):
            SchedulerPolicy(preempt_ratio=bad)
        with pytest.raises(ValueError):
            SchedulerConfig(preempt_ratio=bad)
