"""``cachedrag bench shapes`` at the tiny shape on CPU: structure, what each arm computes, bad input."""

from __future__ import annotations

import argparse
import json

import pytest

from cachedrag_bench import shapes
from cachedrag.prompt import CHUNK_SEPARATOR


def _args(**kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    shapes.add_arguments(parser)
    base = ["--shape", "tiny", "--chunks", "2,3", "--chunk-tokens", "40", "--requests", "2", "--decode-tokens", "4",
            "--cache-gib", "0.05"]
    args = parser.parse_args(base)
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_tiny_run_reports_every_arm_and_what_it_computed(tmp_path):
    out = tmp_path / "shapes.json"
    assert shapes.run(_args(json=str(out))) == 0
    res = json.loads(out.read_text())
    assert res["config"]["shape"] == "tiny" and res["config"]["layers"] == 2
    for n in ("2", "3"):
        row = res["ttft"][n]
        assert set(row) == {"hf_sdpa", "full", "prefix", "cachedrag", "cachedrag_cpu", "cachedrag_disk"}
        assert all(r["n"] == 2 and r["median_ms"] > 0 for r in row.values())
        prompt = row["full"]["mean_prompt_tokens"]
        assert row["full"]["mean_computed_tokens"] == prompt  # full prefill computes everything
        assert row["cachedrag"]["mean_chunks_hit"] == int(n)  # every chunk of the pool is cached
        assert row["cachedrag"]["mean_computed_tokens"] < row["prefix"]["mean_computed_tokens"] <= prompt
        # the same reuse whichever tier serves the caches
        assert row["cachedrag_cpu"]["mean_computed_tokens"] == row["cachedrag"]["mean_computed_tokens"]
        # from disk the engine may recompute a chunk whose load would outlast its break-even time
        assert row["cachedrag_disk"]["mean_chunks_hit"] <= int(n)
        assert row["cachedrag_disk"]["mean_computed_tokens"] >= row["cachedrag"]["mean_computed_tokens"]
    d = res["decode"]
    assert d["fused"]["tokens_per_s"] > 0 and d["weight_bandwidth_limit_ms"] > 0
    loads = res["loads"]
    assert loads["chunk_tokens"] == 40 + len(CHUNK_SEPARATOR.encode()) and loads["recompute_ms"] > 0  # byte tokens
    assert {"memory", "cpu", "disk"} <= set(loads) and loads["disk"]["bytes"] == loads["cpu"]["bytes"] > 0
    assert set(res["targets"]) >= {"cachedrag_vs_full", "cachedrag_vs_prefix", "decode_ratio_to_weight_limit"}
    assert res["question_pass"] == {"cachedrag": {"kind": "eager", "captures": 0, "passes": 0,
                                                  "capture_failed": None}}  # the graph arm only on CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_cuda_run_times_the_captured_question_pass_beside_the_eager_one(tmp_path):
    out = tmp_path / "shapes.json"
    assert shapes.run(_args(json=str(out), no_tiers=True, no_hf=True, device="cuda")) == 0
    res = json.loads(out.read_text())
    for row in res["ttft"].values():
        assert row[shapes.GRAPH_PASS_ARM]["mean_computed_tokens"] == row["cachedrag"]["mean_computed_tokens"]
    qp = res["question_pass"][shapes.GRAPH_PASS_ARM]
    assert qp["capture_failed"] is None
    assert qp["kind"] == "cuda-graph" and qp["passes"] > qp["captures"] >= 1  # replayed, not captured each time
    assert res["question_pass"]["cachedrag"]["kind"] == "eager"
    assert res["targets"]["graph_pass_vs_eager_pass"] > 0


@pytest.mark.parametrize("kw, message", [
    ({"chunks": "2,x"}, "comma-separated integers"),
    ({"chunks": "0"}, "positive counts"),
    ({"recompute": 0.0}, "--recompute"),
    ({"pool": 2}, "smaller than the most chunks"),
])
def test_bad_input_is_one_line_and_exit_2(kw, message, capsys):
    assert shapes.run(_args(**kw)) == 2
    out = capsys.readouterr().out.strip()
    assert "\n" not in out and message in out


def test_cuda_without_cuda_is_refused(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    assert shapes.run(_args(device="cuda")) == 2
    assert "torch.cuda.is_available() is false" in capsys.readouterr().out


def test_profile_reports_where_one_request_spends_its_time(tmp_path):
    out = tmp_path / "shapes.json"
    assert shapes.run(_args(json=str(out), profile=True, no_tiers=True, no_hf=True)) == 0
    prof = json.loads(out.read_text())["profile"]
    assert prof["wall_ms"] > 0 and prof["host_ms"] > 0
    assert prof["device_ms"] == 0 and prof["kernels"] == [] and "host_waits" not in prof  # no CUDA here


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_profile_on_cuda_names_kernels_and_host_waits(tmp_path):
    out = tmp_path / "shapes.json"
    assert shapes.run(_args(json=str(out), profile=True, no_tiers=True, no_hf=True, device="cuda")) == 0
    prof = json.loads(out.read_text())["profile"]
    assert prof["device_ms"] > 0 and prof["kernels"] and prof["runtime_calls"].get("cudaLaunchKernel", 0) > 0
    assert isinstance(prof["host_waits"], dict)  # sites where the host waited (a reuse request has a couple)
