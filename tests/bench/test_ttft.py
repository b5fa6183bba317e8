"""``cachedrag bench ttft`` end to end on a tiny model and corpus."""

from __future__ import annotations

import json

from cachedrag.cli import main


def test_bench_ttft_reports_every_mode(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    corpus, questions = tiny_corpus
    out = tmp_path / "ttft.json"
    rc = main(["bench", "ttft", "--corpus", corpus, "--questions", questions, "--model", tiny_model_dir,
               "--top-k", "2", "--chunk-tokens", "48", "--max-new-tokens", "3", "--warmup", "1",
               "--planning-chunks", "200", "--skip-simulation", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["n_requests"] == 5
    assert set(data["modes"]) == {"full", "prefix", "naive", "random", "cachedrag"}
    full, prefix = data["modes"]["full"], data["modes"]["prefix"]
    assert full["rouge_l_vs_full"] == 1.0 and full["first_token_match_vs_full"] == 1.0
    assert full["chunk_hit_rate"] == 0.0 and full["computed_token_fraction"] == 1.0
    assert full["teacher_forced_top1"] == 1.0 and full["teacher_forced_kl"] == 0.0
    assert prefix["teacher_forced_top1"] == 1.0 and prefix["teacher_forced_kl"] < 1e-6
    for row in data["modes"].values():
        assert 0.0 <= row["teacher_forced_top1"] <= 1.0 and row["teacher_forced_kl"] >= -1e-6
    assert full["answer_divergence"] is None
    assert prefix["answer_divergence"]["parted"] == 0 and prefix["answer_divergences"] == []
    for name in ("naive", "random", "cachedrag"):
        row = data["modes"][name]
        div = row["answer_divergence"]
        assert div["answers"] == 5 and len(row["answer_divergences"]) == div["parted"]
        assert (div["parted"] == 0) == (row["teacher_forced_top1"] == 1.0)  # parted iff a position disagrees
        assert all(0 <= p["position"] < 3 and p["reference_gap"] >= 0 for p in row["answer_divergences"])
    assert prefix["chunk_hit_rate"] > 0  # repeated questions hit their exact prefix
    assert prefix["rouge_l_vs_full"] == 1.0  # exact reuse does not change answers
    for row in data["modes"].values():
        assert row["ttft_median_s"] > 0 and row["speedup_vs_full"] > 0
    assert data["planning"]["n_chunks"] == 200
    printed = capsys.readouterr().out
    assert "TTFT over 5 requests" in printed
    for m in ("naive", "random", "cachedrag"):  # a line for each mode whose answers part
        parted = data["modes"][m]["answer_divergence"]["parted"]
        assert (f"answers parting from full, {m}:" in printed) == (parted > 0)


def test_bench_ttft_runs_the_default_beside_the_previous_one(tiny_model_dir, tiny_corpus, tmp_path):
    corpus, questions = tiny_corpus
    out = tmp_path / "ttft.json"
    assert main(["bench", "ttft", "--corpus", corpus, "--questions", questions, "--model", tiny_model_dir,
                 "--top-k", "4", "--chunk-tokens", "48", "--max-new-tokens", "2", "--warmup", "1",
                 "--modes", "full,prefix,cachedrag", "--previous-default", "--planning-chunks", "50",
                 "--skip-simulation", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["config"]["early_termination"] is False and data["config"]["cache"]["token_choice"] == "question+inter"
    assert data["config"]["cache"]["recompute_ratio"] == 0.27
    modes = data["modes"]
    assert set(modes) == {"full", "prefix", "cachedrag", "cachedrag:previous"}
    assert modes["cachedrag"]["token_choices"] == ["question+inter"]
    assert modes["cachedrag:previous"]["token_choices"] == ["deviation"]
    assert modes["full"]["approximations"] == {} and modes["prefix"]["approximations"] == {}
    reused = modes["cachedrag"]["approximations"].get("chunk_reuse", 0)
    assert reused > 0 and modes["cachedrag"]["approximations"]["partial_recompute:question+inter"] == reused


def test_bench_ttft_in_bfloat16(tiny_model_dir, tiny_corpus, tmp_path):
    """``--dtype bfloat16``: every mode on a bf16 runner (the numerics `bench serve` measures in), recorded in
    the config; prefix reuse stays exact there too."""
    corpus, questions = tiny_corpus
    out = tmp_path / "ttft.json"
    assert main(["bench", "ttft", "--corpus", corpus, "--questions", questions, "--model", tiny_model_dir,
                 "--dtype", "bfloat16", "--top-k", "2", "--chunk-tokens", "48", "--max-new-tokens", "3",
                 "--warmup", "1", "--modes", "full,prefix", "--planning-chunks", "50", "--skip-simulation",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["config"]["dtype"] == "bfloat16"
    prefix = data["modes"]["prefix"]
    assert prefix["chunk_hit_rate"] > 0 and prefix["rouge_l_vs_full"] == 1.0 and prefix["teacher_forced_top1"] == 1.0


def test_bench_ttft_reference_rows_run_the_reference_reuse_path(tiny_model_dir, tiny_corpus, tmp_path):
    """``--reference-ratios``: rows on the float32 pre-pass and zero-filled buffer beside the default
    fast paths, named ``cachedrag@R:ref``, reusing and recomputing as much as the fast rows."""
    corpus, questions = tiny_corpus
    out = tmp_path / "ttft.json"
    assert main(["bench", "ttft", "--corpus", corpus, "--questions", questions, "--model", tiny_model_dir,
                 "--top-k", "4", "--chunk-tokens", "48", "--max-new-tokens", "2", "--warmup", "1",
                 "--modes", "full,prefix", "--ratios", "0.3", "--reference-ratios", "0.3", "--planning-chunks", "50",
                 "--skip-simulation", "--json", str(out)]) == 0
    modes = json.loads(out.read_text())["modes"]
    assert set(modes) == {"full", "prefix", "cachedrag@0.3", "cachedrag@0.3:ref"}
    fast, ref = modes["cachedrag@0.3"], modes["cachedrag@0.3:ref"]
    assert ref["approximations"].get("chunk_reuse", 0) > 0
    assert ref["computed_token_fraction"] == fast["computed_token_fraction"]


def _repeated_question_rows(model_dir, tiny_corpus, tmp_path, repeats: int, *flags: str) -> dict:
    """``bench ttft``'s rows for one question and then another asked ``repeats`` times (its chunks
    were first cached in another order, by the first question's retrieval)."""
    corpus, _ = tiny_corpus
    questions = tmp_path / "q.txt"
    questions.write_text("\n".join(["How do I wrap text?"] + ["How do I pretty-print JSON?"] * repeats))
    out = tmp_path / "ttft.json"
    assert main(["bench", "ttft", "--corpus", corpus, "--questions", str(questions), "--model", model_dir,
                 "--top-k", "4", "--chunk-tokens", "48", "--warmup", "1", "--planning-chunks", "50",
                 "--skip-simulation", "--json", str(out), *flags]) == 0
    return json.loads(out.read_text())["modes"]


def test_bench_ttft_exact_repeat_rows(tiny_model_dir, tiny_corpus, tmp_path):
    """``--exact-repeats``: rows with exact repeats off and inline beside the default (promoted after the
    response). A question asked four times over chunks first cached in another order: served from reuse
    once, then (default) promoted after its second answer, exact after that."""
    modes = _repeated_question_rows(tiny_model_dir, tiny_corpus, tmp_path, 4, "--max-new-tokens", "2",
                                    "--modes", "full,prefix,cachedrag", "--exact-repeats", "off,2:inline")
    off, inline, default = modes["cachedrag:repeats=off"], modes["cachedrag:repeats=2:inline"], modes["cachedrag"]
    assert off["exact_repeats"] == {} and off["promotion_s"] == 0.0 and off["approximations"]["chunk_reuse"] == 4
    assert default["exact_repeats"] == {"promoted": 1} and default["promotion_s"] > 0
    assert default["approximations"]["chunk_reuse"] == 2  # the last two are exact prefix hits
    assert inline["exact_repeats"] == {"inline": 1} and inline["approximations"]["chunk_reuse"] == 1
    assert main(["bench", "ttft", "--exact-repeats", "2:idle"]) == 2  # refused before any model loads


def test_bench_ttft_tie_guard_rows(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    """``--tie-guards``: rows with CacheConfig.exact.tie_guard beside the default. A guard larger than any
    logit gap re-prefills every approximate request exactly (the first one stores the exact path, so
    the repeats after it are exact prefix hits): no reuse approximation is left, and its answers
    equal full prefill's."""
    modes = _repeated_question_rows(tiny_model_dir, tiny_corpus, tmp_path, 3, "--max-new-tokens", "3",
                                    "--modes", "full,cachedrag", "--tie-guards", "1e9")
    guarded, plain = modes["cachedrag:tie_guard=1e9"], modes["cachedrag"]
    assert plain["tie_guarded"] == 0 and plain["approximations"].get("chunk_reuse", 0) >= 1
    assert guarded["tie_guarded"] == 1
    assert "chunk_reuse" not in guarded["approximations"]
    assert guarded["rouge_l_vs_full"] == 1.0 and guarded["teacher_forced_top1"] == 1.0
    # per request: which one was prefilled again, from what approximate plan, and what each prefill did
    assert [q["request"] for q in guarded["requests"]] == [1, 2, 3]
    first = guarded["requests"][0]
    assert first["tie_guard"] is not None and "R" in first["guarded_plan"] and "R" not in first["plan"]
    assert all(q["guarded_plan"] is None and set(q["plan"]) == {"T"} for q in guarded["requests"][1:])
    assert all(q["first_token_match"] and q["ttft_s"] > 0 for q in guarded["requests"])
    assert "R" in plain["requests"][0]["plan"] and all(q["guarded_plan"] is None for q in plain["requests"])
    for bad in ("-1", "x", "inf", "0.3/0.5"):
        assert main(["bench", "ttft", "--tie-guards", bad]) == 2  # refused before any model loads
        assert "--tie-guards" in capsys.readouterr().err


def test_bench_ttft_cache_rows(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    """``--cache-rows``: rows with any scalar CacheConfig fields (GROUP.FIELD in a group) beside the default, named
    ``cachedrag:SPEC``. Each row really runs its settings: every reused token recomputed in float32
    gives full prefill's answers, a guard above any logit gap prefills the approximate request again,
    and one during decoding moves the approximate answer onto exact KV before its second token."""
    modes = _repeated_question_rows(tiny_model_dir, tiny_corpus, tmp_path, 3, "--max-new-tokens", "3",
                                    "--modes", "full,cachedrag", "--cache-rows",
                                    "recompute_ratio=1+precision.recompute=float32+exact.repeats=0,exact.tie_guard=1e9,"
                                    "exact.tie_guard_decode=1e9")
    plain = modes["cachedrag"]
    every = modes["cachedrag:recompute_ratio=1+precision.recompute=float32+exact.repeats=0"]
    guarded = modes["cachedrag:exact.tie_guard=1e9"]
    assert plain["approximations"].get("chunk_reuse", 0) >= 1 and plain["tie_guarded"] == 0
    assert every["approximations"].get("chunk_reuse", 0) >= 1
    assert "recompute_bfloat16" not in every["approximations"] and "recompute_bfloat16" in plain["approximations"]
    assert every["rouge_l_vs_full"] == 1.0 and every["teacher_forced_top1"] == 1.0
    assert guarded["tie_guarded"] == 1 and "chunk_reuse" not in guarded["approximations"]
    # the guard during decoding: the first (approximate) answer switches before its second token and
    # stores the exact path, so the repeats are exact hits; after the switch the answer is full prefill's
    # continuation of its first token, so it equals full's whole answer exactly when that token does
    decoding = modes["cachedrag:exact.tie_guard_decode=1e9"]
    assert plain["tie_guard_switches"] == 0 and all(q["switch"] is None for q in plain["requests"])
    assert decoding["tie_guard_switches"] == 1 and decoding["tie_guard_switch_s"] > 0
    first = decoding["requests"][0]
    assert first["switch"] == 1 and "R" in first["plan"] and first["answer_match"] == first["first_token_match"]
    assert all(set(q["plan"]) == {"T"} and q["answer_match"] for q in decoding["requests"][1:])
    assert decoding["total_median_s"] >= decoding["ttft_median_s"] > 0
    out = capsys.readouterr().out  # the run's own output
    assert "tie guard during decoding, cachedrag:exact.tie_guard_decode=1e9: 1 answers moved onto exact KV" in out
    for bad in ("exact.tie_guard", "no_such_field=1", "exact.tie_guard=-1", "precision.fresh=float16",
                "exact.tie_guard=1+exact.tie_guard=2", "question_layers=4", "tie_guard=0.25", "nogroup.x=1"):
        assert main(["bench", "ttft", "--cache-rows", bad]) == 2  # refused before any model loads
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--cache-rows" in err
