"""``cachedrag bench fidelity`` end to end on a tiny model and corpus; the gold QA set."""

from __future__ import annotations

import json

import pytest

from cachedrag_bench.gold import STDLIB_GOLD, gold_match
from cachedrag.cli import main
from cachedrag.corpus import stdlib_corpus


@pytest.mark.slow  # the fidelity suite end to end (~20 s)
def test_bench_fidelity_reports_the_frontier_and_the_noise_floor(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    corpus, questions = tiny_corpus
    out, png = tmp_path / "fidelity.json", tmp_path / "frontier.png"
    rc = main(["bench", "fidelity", "--corpora", "", "--corpus", corpus, "--questions", questions,
               "--model", tiny_model_dir, "--top-k", "3", "--chunk-tokens", "48", "--max-new-tokens", "3",
               "--seeds", "0,1", "--requests", "2", "--ratios", "0,0.2", "--choices", "question,deviation,oracle",
               "--variants", "question/fp32,question/decode25", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["n_requests"] == 4 and set(data["by_seed"]) == {"0", "1"}
    rows = data["rows"]
    assert set(rows) == {"full", "prefix", "order_aware", "naive", "question@0.2", "deviation@0.2", "oracle@0.2",
                         "question/et@0.2", "question/fp32@0.2", "question/decode25@0.2"}
    assert data["config"]["variants"] == {"question/fp32": {"precision": {"recompute": "float32"}},
                                          "question/decode25": {"exact": {"tie_guard": 0.25, "tie_guard_decode": 0.25}}}
    # the guard during decoding (last row: its exact prefills store paths): where an answer switched and
    # how long whole answers took
    switched = [r["rows"]["question/decode25@0.2"]["switch"] for r in data["requests"]]
    assert rows["question/decode25@0.2"]["switches"] == sum(s is not None for s in switched)
    assert all(s is None or 1 <= s < 3 for s in switched) and rows["question@0.2"]["switches"] == 0
    assert all(row["total_median_s"] >= row["ttft_median_s"] > 0 for row in rows.values())
    # the repairs' precision changes how the rows are computed, not how many
    assert rows["question/fp32@0.2"]["computed_fraction"] == pytest.approx(rows["question@0.2"]["computed_fraction"])
    assert data["config"]["early_termination"] is False and data["config"]["et_choices"] == ["question"]
    assert rows["full"]["tf_top1"] == 1.0 and rows["full"]["rouge_l"] == 1.0
    # exact prefix reuse changes nothing; order-aware reuse serves the shuffled order: = the noise floor
    assert rows["prefix"]["tf_top1"] == 1.0 and rows["prefix"]["exact"] == 1.0
    assert rows["order_aware"]["tf_top1"] == pytest.approx(data["noise"]["order_noise_top1"])
    assert rows["order_aware"]["rouge_l"] == pytest.approx(data["noise"]["order_noise_rouge_l"])
    for record in data["requests"]:
        assert record["rows"]["order_aware"]["approximations"] == ["reordered"]
        assert record["rows"]["question@0.2"]["chunks_hit"] == 3  # every chunk reused, not in prefix order
        assert "partial_recompute:question" in record["rows"]["question@0.2"]["approximations"]
    for name in ("naive", "question@0.2", "oracle@0.2"):
        assert 0.0 <= rows[name]["tf_top1"] <= 1.0 and rows[name]["tf_kl"] >= 0.0
        assert rows[name]["computed_fraction"] < 1.0
    for record in data["requests"]:  # early termination only in the /et rows
        assert "early_termination" not in record["rows"]["question@0.2"]["approximations"]
    assert all(row["gold_n"] == 0 and row["gold_delta_pts"] is None and row["gold_paired"] is None
               for row in rows.values())
    assert data["noise"]["order_noise_gold_paired"] is None
    assert png.stat().st_size > 0
    assert "order-noise floor" in capsys.readouterr().out
    # --replot: the same table and a plot from the JSON alone, nothing run
    again = tmp_path / "again.png"
    assert main(["bench", "fidelity", "--replot", str(out), "--plot", str(again)]) == 0
    assert again.stat().st_size > 0 and "question/et@0.2" in capsys.readouterr().out
    assert main(["bench", "fidelity", "--replot", str(png)]) == 2  # one line, exit 2
    assert "not a bench fidelity JSON" in capsys.readouterr().err


def test_seeds_ask_disjoint_questions_and_a_run_per_seed_asks_the_same():
    from cachedrag_bench.fidelity import _picks

    items = list(range(50))
    s0, s1 = _picks(items, "stdlib", 0, 25), _picks(items, "stdlib", 1, 25)
    assert len(set(s0)) == 25 and not set(s0) & set(s1)
    assert _picks(items, "stdlib", 1, 25) == s1 and _picks(items, "info", 0, 25) != s0
    assert sorted(_picks(items[:18], "info", 0, 40)) == items[:18]  # capped at the set


@pytest.mark.parametrize("args", [["--choices", "psychic"], ["--variants", "question/bogus"],
                                  ["--variants", "deviation/fp32"]])
def test_bench_fidelity_refuses_bad_arguments(args, capsys):
    try:
        code = main(["bench", "fidelity", *args])
    except SystemExit as exc:  # argparse's own refusal
        code = exc.code
    assert code == 2 and "error" in capsys.readouterr().err


def test_every_gold_answer_is_in_its_document():
    docs = {d.id: d.text for d in stdlib_corpus()}
    assert len(STDLIB_GOLD) >= 120 and len({g.question for g in STDLIB_GOLD}) == len(STDLIB_GOLD)
    assert len({(g.doc, g.answer) for g in STDLIB_GOLD}) == len(STDLIB_GOLD)  # one question per answer
    for item in STDLIB_GOLD:
        assert gold_match(docs[item.doc], item.answer), item
        assert not gold_match(item.question, item.answer), item  # the question does not give it away


@pytest.mark.parametrize("answer, gold, expected", [
    ("Use heapq.heappushpop(heap, x).", "heappushpop", True),
    ("Use heappush then heappop.", "heappushpop", False),
    ("math.comb(n, k)", "comb", True),
    ("combinations", "comb", False),
    ("COPY2 copies metadata", "copy2", True),
])
def test_gold_match_is_a_whole_word_match(answer, gold, expected):
    assert gold_match(answer, gold) is expected


@pytest.mark.parametrize("text, expected", [
    ("4", {"stdlib": 4, "info": 4}),
    ("stdlib=21,info=2", {"stdlib": 21, "info": 2}),
    ("stdlib=21", {"stdlib": 21, "info": 0}),
])
def test_requests_per_corpus(text, expected):
    from cachedrag_bench.fidelity import _requests

    assert _requests(text, ["stdlib", "info"]) == expected


@pytest.mark.parametrize("text", ["x", "man=3", "stdlib=-1", "0", "stdlib=0,info=0"])
def test_requests_per_corpus_refuses_bad_counts(text):
    from cachedrag_bench.fidelity import _requests

    from cachedrag.errors import ConfigError

    with pytest.raises(ConfigError):
        _requests(text, ["stdlib", "info"])
