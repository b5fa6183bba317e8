"""The paired task-accuracy statistics of ``bench fidelity`` (``cachedrag_bench.paired``) on hand-computed
and published cases, and their place in the fidelity summary (per row, merged over runs)."""

from __future__ import annotations

import copy
import json

import pytest

from cachedrag_bench.paired import PairedAccuracy, newcombe_paired, sign_test, wilson
from cachedrag.errors import ConfigError


@pytest.mark.parametrize("b, c, expected", [
    (0, 5, 2 / 32),  # 2 * P(X <= 0), X ~ Bin(5, 1/2)
    (5, 0, 2 / 32),
    (1, 9, 2 * (1 + 10) / 1024),  # 2 * (C(10,0) + C(10,1)) / 2^10
    (2, 8, 2 * (1 + 10 + 45) / 1024),
    (3, 3, 1.0),  # capped at 1
    (0, 1, 1.0),
    (0, 0, 1.0),  # no discordant question: no evidence either way
    (4, 16, 2 * (1 + 20 + 190 + 1140 + 4845) / 2**20),
])
def test_sign_test_is_the_exact_two_sided_binomial_tail(b, c, expected):
    assert sign_test(b, c) == pytest.approx(expected, rel=1e-12)


def test_sign_test_agrees_with_scipy_where_installed():
    stats = pytest.importorskip("scipy.stats")
    for b in range(0, 15):
        for c in range(0, 15):
            if b + c:
                assert sign_test(b, c) == pytest.approx(stats.binomtest(b, b + c, 0.5).pvalue, rel=1e-9), (b, c)


def test_sign_test_refuses_negative_counts():
    with pytest.raises(ValueError):
        sign_test(-1, 3)


@pytest.mark.parametrize("k, n, lo, hi", [
    (81, 263, 0.2553, 0.3662),  # Newcombe (1998), single proportion, Wilson score without correction
    (15, 148, 0.0624, 0.1605),
    (0, 10, 0.0, 0.2775),
])
def test_wilson_interval_matches_published_values(k, n, lo, hi):
    assert wilson(k, n) == pytest.approx((lo, hi), abs=5e-5)


def test_newcombe_paired_interval_matches_a_published_table():
    # Fagerland, Lydersen & Laake, "Statistical Analysis of Contingency Tables", ch. 8 (Cavo et al. 2012):
    # table [[59, 6], [16, 80]], p1 - p2 = -0.0621, Newcombe square-and-add 95% CI -0.1186 to -0.0046.
    # Here the reference is the first margin and the row the second, so row - ref = +0.0621.
    lo, hi = newcombe_paired(59, 6, 16, 80)
    assert (lo, hi) == pytest.approx((0.0046, 0.1186), abs=5e-5)
    acc = PairedAccuracy(both=59, ref_only=6, row_only=16, neither=80)
    assert acc.delta == pytest.approx(10 / 161) and acc.interval() == (lo, hi)


def test_newcombe_paired_interval_is_antisymmetric_and_contains_the_estimate():
    for table in [(59, 6, 16, 80), (36, 12, 2, 0), (5, 3, 3, 31), (0, 2, 7, 40)]:
        both, ref_only, row_only, neither = table
        lo, hi = newcombe_paired(*table)
        lo2, hi2 = newcombe_paired(both, row_only, ref_only, neither)  # swap which system is the reference
        assert (lo2, hi2) == pytest.approx((-hi, -lo))
        d = (row_only - ref_only) / sum(table)
        assert -1.0 <= lo < d < hi <= 1.0
    lo, hi = newcombe_paired(5, 3, 3, 31)  # equal accuracies: symmetric about 0
    assert lo == pytest.approx(-hi) and hi > 0.05


def test_a_wider_gap_gives_a_smaller_p_value_and_an_interval_away_from_zero():
    near = PairedAccuracy(both=10, ref_only=3, row_only=2, neither=109)
    far = PairedAccuracy(both=2, ref_only=11, row_only=0, neither=111)
    assert near.p_value() > 0.5 and far.p_value() < 0.001
    assert near.interval()[0] < 0 < near.interval()[1]
    assert far.interval()[1] < 0


def test_paired_accuracy_counts_pairs():
    pairs = [(True, True), (True, False), (True, False), (False, True), (False, False), (1.0, 0.0)]
    acc = PairedAccuracy.from_pairs(pairs)
    assert (acc.both, acc.ref_only, acc.row_only, acc.neither, acc.n) == (1, 3, 1, 1, 6)
    d = acc.to_dict()
    assert d["full_only"] == 3 and d["row_only"] == 1 and d["delta_pts"] == pytest.approx(-100 * 2 / 6)
    assert d["p_value"] == pytest.approx(2 * (1 + 4) / 16)  # b=3, c=1
    assert d["ci95_pts"][0] < d["delta_pts"] < d["ci95_pts"][1]


# ------------------------------------------------------------------ in the fidelity summary


def _record(seed: int, full: bool, row: bool, noise: bool) -> dict:
    def metrics(gold: bool) -> dict:
        return {"ttft_s": 0.1, "computed_fraction": 0.5, "tf_top1": 1.0, "tf_kl": 0.0, "tf_top1_decisive": 1.0,
                "tf_top1_tied": None, "first_token": 1.0, "rouge_l": 1.0, "exact": 1.0, "gold": float(gold),
                "approximations": [], "chunks_hit": 0}

    return {"corpus": "stdlib", "seed": seed, "question": "q", "gold": "g", "decisive_share": 1.0,
            "rows": {"full": metrics(full), "noise": metrics(noise), "prefix": metrics(full),
                     "question+inter@0.27": metrics(row)}}


def _run(seed: int, outcomes) -> dict:
    from cachedrag_bench.fidelity import _summarise

    records = [_record(seed, *o) for o in outcomes]
    config = {"model": "m", "corpora": ["stdlib"], "seeds": [seed], "requests_per_corpus_seed": {"stdlib": len(records)},
              "ratios": [0.27], "max_new_tokens": 24, "seconds": 10.0}
    return json.loads(json.dumps(_summarise(records, list(records[0]["rows"]), config)))


def test_fidelity_summary_pairs_each_row_with_full_and_merges_runs(tmp_path, capsys):
    from cachedrag_bench.fidelity import merge_runs
    from cachedrag.cli import main

    # (full right, row right, noise right) per question
    seed0 = _run(0, [(True, True, True), (True, False, False), (False, True, False), (False, False, False)])
    seed1 = _run(1, [(True, False, True), (True, False, True), (False, False, False)])
    assert seed0["rows"]["question+inter@0.27"]["gold_paired"] == {
        "n": 4, "both": 1, "full_only": 1, "row_only": 1, "neither": 1, "delta_pts": 0.0,
        "ci95_pts": pytest.approx([100 * x for x in newcombe_paired(1, 1, 1, 1)]), "p_value": 1.0}
    merged = merge_runs([seed0, seed1])
    row = merged["rows"]["question+inter@0.27"]["gold_paired"]
    assert (row["n"], row["both"], row["full_only"], row["row_only"], row["neither"]) == (7, 1, 3, 1, 2)
    assert row["p_value"] == pytest.approx(sign_test(3, 1)) and row["delta_pts"] == pytest.approx(-200 / 7)
    noise = merged["noise"]["order_noise_gold_paired"]
    assert (noise["both"], noise["full_only"], noise["row_only"], noise["neither"]) == (3, 1, 0, 3)
    assert merged["rows"]["prefix"]["gold_paired"]["full_only"] == 0 and merged["n_requests"] == 7
    assert merged["config"]["seeds"] == [0, 1] and merged["config"]["seconds"] == 20.0
    with pytest.raises(ConfigError, match="share a"):  # the same stream twice would count questions twice
        merge_runs([seed0, copy.deepcopy(seed0)])
    other = copy.deepcopy(seed1)
    other["config"]["ratios"] = [0.3]
    with pytest.raises(ConfigError, match="differ"):
        merge_runs([seed0, other])
    # the CLI: --replot A,B merges, prints the paired table and writes the merge with --json
    paths = []
    for i, run in enumerate((seed0, seed1)):
        paths.append(tmp_path / f"seed{i}.json")
        paths[-1].write_text(json.dumps(run))
    out = tmp_path / "merged.json"
    assert main(["bench", "fidelity", "--replot", f"{paths[0]},{paths[1]}", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "paired over 7 gold questions (full right: 4/7" in printed
    assert json.loads(out.read_text())["rows"]["question+inter@0.27"]["gold_paired"]["full_only"] == 3
