"""``cachedrag bench serve``: the same numerics and cache budget in every configuration, and the queue level."""

from __future__ import annotations

import argparse
import json

import pytest

from cachedrag_bench import serve
from cachedrag.cli import main


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("argv, flags", [
    ((), ["--dtype", "bfloat16"]),  # bf16 by default: the numerics the targets are measured in
    (("--dtype", "float32"), ["--dtype", "float32"]),
    (("--weights", "int8-dynamic"), ["--dtype", "bfloat16", "--weights", "int8-dynamic"]),
    (("--dtype", "bfloat16", "--weights", "int4", "--threads", "1"),
     ["--dtype", "bfloat16", "--weights", "int4", "--threads", "1"]),
])
def test_every_server_gets_the_requested_numerics(argv, flags):
    assert serve.numerics_args(_args(*argv)) == flags


@pytest.mark.parametrize("argv, flags", [
    ((), []),  # the server's defaults
    (("--max-overtakes", "8", "--starvation-s", "5"), ["--starvation-s", "5.0", "--max-overtakes", "8"]),
    (("--max-delay-s", "inf"), ["--max-delay-s", "inf"]),
    (("--no-hold-waiting",), ["--no-hold-waiting"]),
    (("--hold-waiting",), ["--hold-waiting"]),
    (("--trim-heap-idle-s", "inf"), ["--trim-heap-idle-s", "inf"]),
    (("--passage-chars", "60", "--tokenization", "parts"), ["--passage-chars", "60", "--tokenization", "parts"]),
    (("--exact-when-waiting", "0"), ["--exact-when-waiting", "0"]),
    (("--no-exact-whole-answers",), ["--no-exact-whole-answers"]),
])
def test_every_server_gets_the_requested_admission_bounds(argv, flags):
    assert serve.scheduler_args(_args(*argv)) == flags


@pytest.mark.parametrize("name, argv, flags", [
    ("a", (), ["--mode", "full", "--max-batch", "1", "--order", "fifo"]),
    ("d", ("--max-batch", "4"), ["--mode", "cachedrag", "--order", "cache_aware", "--max-batch", "4"]),
    ("f", (), ["--order", "cache_aware", "--max-batch", "8", "--fidelity", "faithful"]),  # the level sets the mode
    ("f", ("--fidelity", "guarded"), ["--order", "cache_aware", "--max-batch", "8", "--fidelity", "guarded"]),
    ("g", (), ["--mode", "prefix", "--order", "cache_aware", "--max-batch", "8"]),
])
def test_each_configuration_is_its_flags(name, argv, flags):
    assert serve.config_args(name, _args(*argv)) == flags


def test_a_fidelity_level_is_compared_with_d_and_prefix_caching_request_for_request():
    """Config f (d at a fidelity level) gets f_vs_d ratios per level it shares with d, and d and f get them
    against prefix caching (g): throughput, TTFT and whole-answer latency."""
    row = {"requests_per_s": 2.0, "output_tokens_per_s": 100.0, "ttft_p50_s": 0.5, "ttft_mean_s": 0.6,
           "latency_p50_s": 2.0, "latency_mean_s": 2.5}
    results = {"configs": {"d": {"4": row}, "f": {"4": {**row, "requests_per_s": 1.5, "latency_p50_s": 3.0}},
                           "g": {"4": {**row, "ttft_p50_s": 1.0}, "8": row}}}
    serve._ratios(results)
    r = results["ratios"]
    assert r["f_vs_d_requests_per_s_c4"] == pytest.approx(0.75) and r["f_vs_d_latency_p50_s_c4"] == pytest.approx(1.5)
    assert r["f_vs_d_ttft_p50_s_c4"] == pytest.approx(1.0) and "f_vs_d_output_tokens_per_s_c4" in r
    # both against prefix caching (g), on the levels they share
    assert r["d_vs_g_ttft_p50_s_c4"] == pytest.approx(0.5) and r["f_vs_g_requests_per_s_c4"] == pytest.approx(0.75)
    assert not any(k.endswith("_c8") for k in r)


def test_answers_against_full_prefill_say_how_each_differing_one_was_served():
    """Exact match by how the prompt was served (exact / approximate / switched mid-answer) and each differing
    answer with its serving, request for request against b's."""
    full = {"2": [("a b c", None), ("d e f", None), ("g h", None), ("x y", None)]}
    ours = {"2": [("a b c", {"approximations": []}),
                  ("d e z", {"approximations": ["deviation_recompute"], "tie_guard_switch": 3, "tie_guard_agreed": 3}),
                  ("g h", {"approximations": ["deviation_recompute"]}),
                  ("x q", {"approximations": []})]}
    a = serve._answers_vs_b(ours, full, [2])
    assert a["exact_match_vs_b"] == 0.5
    assert a["served"] == {"approximate": {"requests": 1, "exact_match_vs_b": 1.0},
                           "exact": {"requests": 2, "exact_match_vs_b": 0.5},
                           "switched": {"requests": 1, "exact_match_vs_b": 0.0}}
    assert [(d["request"], d["served"], d["tie_guard_switch"]) for d in a["differs"]] == [(1, "switched", 3),
                                                                                         (3, "exact", None)]
    assert a["rewound"] == 0


@pytest.mark.parametrize("argv, flags", [((), []), (("--cache-gb", "0.25"), ["--cache-gb", "0.25"])])
def test_every_server_gets_the_requested_cache_budget(argv, flags):
    assert serve.cache_args(_args(*argv)) == flags


@pytest.mark.parametrize("argv, directory, flags", [
    ((), None, []),
    (("--disk-dir", "/x"), "/x/bench-serve-d-1", ["--disk-dir", "/x/bench-serve-d-1"]),
    (("--disk-dir", "/x", "--disk-gb", "2"), "/x/d", ["--disk-dir", "/x/d", "--disk-gb", "2.0"]),
])
def test_every_server_gets_its_own_disk_tier(argv, directory, flags):
    assert serve.disk_args(_args(*argv), directory) == flags


@pytest.mark.parametrize("argv, says", [
    (["--disk-gb", "1"], "--disk-gb needs --disk-dir"),
    (["--disk-dir", "{tmp}", "--disk-gb", "0"], "--disk-gb must be > 0"),
    (["--disk-dir", "{tmp}/missing"], "is not a directory"),
])
def test_a_bad_disk_tier_is_one_clear_line(argv, says, tmp_path, capsys):
    argv = [a.format(tmp=tmp_path) for a in argv]
    rc = main(["bench", "serve", "--tiny", "--no-soak", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and says in err and "Traceback" not in err


def test_int8_dynamic_in_float32_is_one_clear_line(capsys):
    rc = main(["bench", "serve", "--tiny", "--dtype", "float32", "--weights", "int8-dynamic", "--no-soak"])
    err = capsys.readouterr().err
    assert rc == 2 and "int8-dynamic" in err and "Traceback" not in err


def test_a_cache_budget_that_is_not_positive_is_one_clear_line(capsys):
    rc = main(["bench", "serve", "--tiny", "--cache-gb", "0", "--no-soak"])
    err = capsys.readouterr().err
    assert rc == 2 and "--cache-gb must be > 0" in err and "Traceback" not in err


@pytest.mark.slow  # make test's time budget; make test-slow runs it
@pytest.mark.timeout(300)
def test_bench_serve_tiny_bf16_with_a_queue_level(tmp_path):
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--tiny", "--configs", "c,d", "--levels", "1", "--requests", "2", "--warmup", "1",
               "--max-batch", "2", "--queue-level", "3", "--queue-requests", "4", "--max-tokens", "4",
               "--dtype", "bfloat16", "--max-overtakes", "1", "--no-soak", "--no-warm-c1",
               "--cache-gb", "0.0001", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    # the budget reached the servers: ~107 KB holds ~2 tiny chunks (without it the cache grows to ~0.22 MB here)
    assert data["config"]["cache_gb"] == 0.0001
    assert all(0 < row["cache_mb_after"] <= 0.0001 * 1024 for rows in data["configs"].values() for row in rows.values())
    assert data["config"]["dtype"] == "bfloat16" and data["config"]["weights"] == "dense"
    assert data["config"]["max_overtakes"] == 1 and data["config"]["queue_requests"] == 4
    for name in ("c", "d"):
        assert set(data["configs"][name]) == {"1", "3q"}  # the queue level runs for the FIFO / cache-aware pair
        row = data["configs"][name]["3q"]
        assert row["requests"] == row["completed"] == 4
        assert row["ttft_mean_s"] > 0 and 0.0 <= row["reordered_share"] <= row["contested_share"] <= 1.0
        assert len(row["ttft_s_by_request"]) == 4 and all(x > 0 for x in row["ttft_s_by_request"])
        # the server's prefill time and rows: part of the level's wall, every request computed its question
        assert 0 < row["prefill_s_sum"] <= row["wall_s"] and 0 < row["prefill_share"] <= 1.0
        assert row["prefill_rows_mean"] >= 1 and row["prefill_rows_per_s"] > 0
    assert "c_vs_d_ttft_mean_c3q" in data["ratios"]


@pytest.mark.slow  # make test's time budget; make test-slow runs it
@pytest.mark.timeout(300)
def test_bench_serve_runs_a_fidelity_level_beside_full_prefill(tmp_path):
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--tiny", "--configs", "b,f", "--fidelity", "guarded", "--levels", "2",
               "--requests", "3", "--warmup", "1", "--max-tokens", "4", "--no-soak", "--no-warm-c1", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["config"]["fidelity_f"] == "guarded" and set(data["answers"]) == {"f"}
    row = data["configs"]["f"]["2"]
    # guarded checks the first token only: no answer moves onto exact KV mid-way, none is admitted exactly for a queue
    assert row["completed"] == 3 and row["tie_switched_share"] == 0.0 and 0.0 <= row["tie_guarded_share"] <= 1.0
    assert row["exact_admission_share"] == 0.0
    assert row["latency_p50_s"] >= row["ttft_p50_s"] > 0
    assert 0.0 <= data["answers"]["f"]["exact_match_vs_b"] <= 1.0


@pytest.mark.slow  # several tiny servers for a benchmark option (~15-20 s)
@pytest.mark.timeout(300)
def test_bench_serve_can_ask_for_whole_answers(tmp_path):
    """--no-stream: every answer comes whole (its latency is its TTFT, no TPOT), and still compares with b's."""
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--tiny", "--configs", "b,f", "--no-stream", "--levels", "2", "--requests", "3",
               "--warmup", "1", "--max-tokens", "4", "--no-soak", "--no-warm-c1", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["config"]["stream"] is False
    for name in ("b", "f"):
        row = data["configs"][name]["2"]
        assert row["completed"] == 3 and row["tpot_p50_s"] is None
        assert row["ttft_p50_s"] == pytest.approx(row["latency_p50_s"])
    assert data["answers"]["f"]["exact_match_vs_b"] == 1.0  # faithful, whole answers: full prefill's


@pytest.mark.slow  # several tiny servers for a benchmark option (~15-20 s)
@pytest.mark.timeout(300)
def test_soak_rounds_read_memory_at_rest(tmp_path):
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--tiny", "--configs", "d", "--levels", "1", "--requests", "1", "--warmup", "1",
               "--max-tokens", "2", "--queue-level", "0", "--no-warm-c1", "--soak-requests", "8",
               "--soak-concurrency", "4", "--soak-rounds", "2", "--trim-heap-idle-s", "0.2", "--json", str(out)])
    assert rc == 0
    soak = json.loads(out.read_text())["soak"]
    assert len(soak["rounds"]) == 2 and soak["rss_before_mb"] == soak["rounds"][0]["rss_before_mb"]
    for r in soak["rounds"]:
        assert r["requests"] == 8 and r["stayed_completed"] == r["stayed"] and r["server_5xx"] == 0
        assert r["running_after"] == r["waiting_after"] == 0
        assert r["rss_before_mb"] > 0 and r["rss_after_mb"] > 0 and r["heap_released_mb"] >= 0


@pytest.mark.parametrize("argv, says", [
    (["--configs", "z"], "--configs"), (["--configs", ","], "--configs"),
    (["--levels", "x"], "--levels"), (["--levels", "0,2"], "--levels"),
])
def test_bad_configs_and_levels_exit_2_with_one_line(argv, says, capsys):
    from cachedrag.cli import main

    assert main(["bench", "serve", "--tiny", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("cachedrag: error:") and says in err and len(err.splitlines()) == 1


@pytest.mark.slow  # 16 s (make test-slow)
@pytest.mark.timeout(300)
def test_bench_serve_with_a_disk_tier_reports_hits_per_tier(tmp_path):
    """Below a tiny memory tier, chunks evicted from memory come back from each server's own disk
    directory, which is removed when the server stops."""
    out, disk = tmp_path / "serve.json", tmp_path / "disk"
    disk.mkdir()
    rc = main(["bench", "serve", "--tiny", "--configs", "d", "--levels", "1", "--requests", "6", "--warmup", "1",
               "--max-tokens", "2", "--queue-level", "0", "--no-soak", "--no-warm-c1", "--cache-gb", "0.0001",
               "--disk-dir", str(disk), "--disk-gb", "0.01", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["config"]["disk_tier"] is True and data["config"]["disk_gb"] == 0.01
    row = data["configs"]["d"]["1"]
    assert set(row["tier_hits"]) == {"cpu", "disk"} and row["tier_hits"]["disk"] > 0
    assert row["tier_load_s"]["disk"] > 0
    assert list(disk.iterdir()) == []  # the server's directory went with it


def _scrape(**counters: float) -> str:
    return "".join(f"{name} {value}\n" for name, value in counters.items())


def _request(t_start: float, ttft: float, tokens: int, deltas: list[float]) -> dict:
    return {"status": 200, "usage": {"completion_tokens": tokens, "prompt_tokens": 100,
                                     "prompt_tokens_details": {"cached_tokens": 40}},
            "ttft_s": ttft, "total_s": ttft + 0.1 * (tokens - 1), "t_start": t_start, "delta_times": deltas, "text": ""}


def test_a_level_pools_its_rounds():
    """--rounds: requests and wall times add up, the server's counters grow by the sum of each
    replay's growth (not by last-minus-first, which would count what ran between the replays),
    percentiles span every request, busy windows add up."""
    first = serve.Replay(
        [_request(0.0, 0.5, 4, [0.05, 0.1, 0.15, 0.5]), _request(0.2, 1.0, 4, [1.2, 1.3, 1.4, 1.5])], 2.0,
        _scrape(cachedrag_chunk_hits_total=10, cachedrag_chunk_misses_total=5, cachedrag_admissions_total=3),
        _scrape(cachedrag_chunk_hits_total=13, cachedrag_chunk_misses_total=6, cachedrag_admissions_total=5))
    second = serve.Replay(
        [_request(10.0, 2.0, 2, [10.1, 12.1]), _request(10.4, 3.0, 2, [13.4, 13.5])], 6.0,
        # another configuration's turn, or a level, ran in between: the counters moved on meanwhile
        _scrape(cachedrag_chunk_hits_total=50, cachedrag_chunk_misses_total=20, cachedrag_admissions_total=9),
        _scrape(cachedrag_chunk_hits_total=51, cachedrag_chunk_misses_total=23, cachedrag_admissions_total=11))
    row = serve._level_stats([first, second], level=1)
    assert row["rounds"] == 2 and row["requests"] == row["completed"] == 4
    assert row["wall_s"] == 8.0 and row["requests_per_s"] == 0.5 and row["output_tokens_per_s"] == 12 / 8
    assert row["chunk_hit_rate"] == 4 / 8  # (3 + 1) hits of (4 + 4) lookups
    assert row["ttft_s_by_request"] == [0.5, 1.0, 2.0, 3.0] and row["ttft_mean_s"] == 1.625
    assert row["cached_tokens_share"] == 0.4
    # busy windows (level 1: from the first request's start to the last one's): 0.2 s and 0.4 s
    assert row["busy_window_s"] == pytest.approx(0.6)
    # tokens counted by the share of each request's deltas inside its replay's window: 3 of 4, then 1 of 2
    assert row["busy_output_tokens_per_s"] == pytest.approx((4 * 3 / 4 + 2 * 1 / 2) / 0.6)
    assert serve._level_stats([first], level=1)["chunk_hit_rate"] == 3 / 4


@pytest.mark.slow  # several tiny servers for a benchmark option (~15-20 s)
@pytest.mark.timeout(300)
def test_bench_serve_interleaved_rounds(tmp_path):
    """--interleave --rounds 2: both servers alive, each level replayed twice on fresh requests and
    pooled; the two configurations served the same requests (the same answers at concurrency 1)."""
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--tiny", "--configs", "c,d", "--levels", "1,2", "--requests", "2", "--warmup", "1",
               "--max-tokens", "3", "--queue-level", "0", "--no-soak", "--no-warm-c1", "--interleave", "--rounds", "2",
               "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["config"]["interleave"] is True and data["config"]["rounds"] == 2
    for name in ("c", "d"):
        assert set(data["configs"][name]) == {"1", "2"}
        for row in data["configs"][name].values():
            assert row["rounds"] == 2 and row["requests"] == row["completed"] == 4
            assert len(row["ttft_s_by_request"]) == 4 and row["wall_s"] > 0
    assert data["configs"]["c"]["1"]["prompt_tokens_mean"] == data["configs"]["d"]["1"]["prompt_tokens_mean"]
    assert "c_vs_d_ttft_p50_c2" in data["ratios"]


def test_rounds_below_one_is_one_clear_line(capsys):
    assert main(["bench", "serve", "--tiny", "--rounds", "0", "--no-soak"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--rounds must be >= 1" in err and len(err.splitlines()) == 1


@pytest.mark.timeout(300)
def test_a_frozen_server_is_stopped_until_thawed_and_still_stops():
    """--interleave's freeze: the process is stopped (state T) between its turns, answers again once
    thawed, and stop() ends it even while frozen (a stopped process would hold SIGTERM)."""
    import httpx

    server = serve.ServerProcess(["--tiny"])
    try:
        def state() -> str:
            with open(f"/proc/{server.proc.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0]

        server.freeze()
        assert state() == "T"
        server.thaw()
        assert state() != "T" and httpx.get(server.url + "/health", timeout=30).status_code == 200
        server.freeze()
    finally:
        rc = server.stop()
    assert rc is not None and server.proc.poll() is not None


def test_c_and_d_ttfts_pair_request_by_request():
    """The ratios pair c's and d's TTFTs request by request (the same requests, in the same order):
    d's mean difference, how many it served sooner / later beyond a 20 ms tie, the extremes."""
    rows = {"c": {"4": {"ttft_p50_s": 1.0, "ttft_mean_s": 1.0, "ttft_p95_s": 2.0,
                        "ttft_s_by_request": [0.50, 0.60, 0.70, None, 0.40]}},
            "d": {"4": {"ttft_p50_s": 1.0, "ttft_mean_s": 1.0, "ttft_p95_s": 2.0,
                        "ttft_s_by_request": [0.10, 0.61, 0.90, 0.30, 0.40]}}}
    results = {"configs": rows}
    serve._ratios(results)
    r = results["ratios"]
    assert r["d_minus_c_paired_ttft_mean_s_c4"] == pytest.approx((-0.40 + 0.01 + 0.20 + 0.0) / 4)
    assert r["d_minus_c_paired_sooner_c4"] == 1 and r["d_minus_c_paired_later_c4"] == 1  # 0.01 s is a tie
    assert r["d_minus_c_paired_most_sooner_s_c4"] == pytest.approx(0.40)
    assert r["d_minus_c_paired_most_later_s_c4"] == pytest.approx(0.20)
