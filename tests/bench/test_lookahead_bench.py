"""``cachedrag bench lookahead`` at tiny sizes on the CPU: structure, recalls, coverage, bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch

from cachedrag_bench.lookahead import VARIANTS, LookaheadBenchConfig, auto_nlist, measure, perturb
from cachedrag.cli import main
from cachedrag.errors import ConfigError

TINY = ["--vectors", "20000", "--nlist", "64", "--queries", "12", "--warmup", "1", "--seed", "3"]
FRACTIONS = "0.03,0.12,0.5"  # nprobe 2, 8, 32 of 64


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One tiny run through the command line, with its JSON."""
    out = tmp_path_factory.mktemp("lookahead") / "lookahead.json"
    code = main(["bench", "lookahead", *TINY, "--nprobe-fractions", FRACTIONS, "--window-ms", "2",
                 "--device", "cpu", "--json", str(out)])
    assert code == 0
    return json.loads(out.read_text())


def _recall(variant: dict) -> float:
    return variant["recall_at_10"]


def test_config_block_and_structure(cpu_run):
    cfg = cpu_run["config"]
    assert (cfg["vectors"], cfg["dim"], cfg["nlist"], cfg["device"], cfg["device_name"]) == (20000, 384, 64, "cpu", "cpu")
    assert cfg["torch"] == torch.__version__ and cfg["faiss"] and cfg["window_kind"] == "sleep"
    assert cpu_run["complete"] is True and "not GPU figures" in cpu_run["note"]
    assert cpu_run["build"]["rows_per_list"]["mean"] == 20000 / 64
    assert cpu_run["bandwidth"]["h2d_bulk_gb_per_s"] > 0 and cpu_run["bandwidth"]["per_cluster_gb_per_s"] > 0
    assert [r["nprobe"] for r in cpu_run["runs"]] == [2, 8, 32]
    for run in cpu_run["runs"]:
        assert run["errors"] == {}
        assert set(run["variants"]) == set(VARIANTS)
        for name, v in run["variants"].items():
            assert 0 < v["median_ms"] <= v["p95_ms"], (name, v)
            assert 0.0 <= _recall(v) <= 1.0
        assert 0.0 < run["cluster_coverage"] <= 1.0
        for name in ("lookahead", "lookahead_split"):
            assert 0.0 <= run["variants"][name]["hit_fraction"] <= 1.0
            assert run["variants"][name]["window_ms_median"] >= 2.0 * 0.9  # the window really elapsed


def test_recalls_agree_with_faiss_and_grow_with_nprobe(cpu_run):
    ours = []
    for run in cpu_run["runs"]:
        v = run["variants"]
        # every tiering searches the same probed clusters with the same kernel: the same results (a
        # block's alignment may change a BLAS's rounding, so a near-tie may swap: 1 of 120 ids allowed);
        # a lookahead that lost its missed clusters would drop by ~1 - coverage (~0.1)
        for name in ("on_demand", "lookahead", "lookahead_split"):
            assert _recall(v[name]) == pytest.approx(_recall(v["resident"]), abs=0.01), (name, run)
        # Faiss over the same centroids and lists at the same nprobe (near-ties may order differently)
        assert abs(_recall(v["resident"]) - _recall(v["faiss_cpu"])) <= 0.02, run
        assert _recall(v["faiss_cpu"]) == _recall(v["faiss_cpu_1thread"])
        assert v["resident"]["ids_equal_to_faiss_fraction"] >= 0.9
        ours.append(_recall(v["resident"]))
    assert ours == sorted(ours)  # nested probe sets: recall cannot drop
    assert ours[-1] >= 0.95 and ours[1] >= 0.75 and ours[0] >= 0.5  # 50%, 12% and 3% of the clusters


def test_probe_budget_prefetch_covers_the_rewrite(tmp_path, capsys):
    """With the original query's nprobe clusters as the budget, the hit fraction is the cluster coverage."""
    out = tmp_path / "probe.json"
    code = main(["bench", "lookahead", *TINY, "--queries", "8", "--nprobe-fractions", "0.12", "--window-ms", "30",
                 "--budget", "probe", "--device", "cpu", "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "lookahead" in printed and "coverage" in printed
    run = json.loads(out.read_text())["runs"][0]
    la = run["variants"]["lookahead"]
    assert run["cluster_coverage"] > 0.5  # rewrite at cosine 0.9: most clusters shared
    assert la["prefetch_planned_clusters_mean"] == pytest.approx(run["nprobe"], abs=1)
    if la["prefetch_complete_fraction"] == 1.0:
        assert la["hit_fraction"] == pytest.approx(run["cluster_coverage"], abs=0.05)
    assert la["hit_fraction"] <= run["cluster_coverage"] + 0.05


@pytest.mark.parametrize("argv, needle", [
    (["--vectors", "100", "--nlist", "200"], "--nlist (200) must not exceed --vectors (100)"),
    (["--nprobe-fractions", "0.1,1.5"], "--nprobe-fractions must be in (0, 1]"),
    (["--nprobe-fractions", "a,b"], "bad --nprobe-fractions"),
    (["--nprobe-fractions", ""], "nprobe_fractions"),
    (["--queries", "0"], "queries"),
    (["--vectors", "1000", "--nlist", "10", "--train-size", "5"], "--train-size (5)"),
    (["--dim", "16", "--latent-dim", "32"], "--latent-dim (32) must not exceed --dim (16)"),
    (["--window-ms", "-1"], "window_ms"),
    (["--device", "cpu", "--window-kind", "gpu", "--vectors", "1000", "--nlist", "8"], "--window-kind gpu needs"),
])
def test_bad_input_is_one_line_and_exit_2(argv, needle, capsys):
    assert main(["bench", "lookahead", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cachedrag: error:") and needle in err[0], err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: --device cuda is valid here")
def test_cuda_without_gpu_is_a_config_error(capsys):
    assert main(["bench", "lookahead", "--vectors", "1000", "--nlist", "8", "--device", "cuda"]) == 2
    assert "torch.cuda.is_available() is false" in capsys.readouterr().err


def test_argparse_rejects_unknown_choices():
    with pytest.raises(SystemExit) as exc:
        main(["bench", "lookahead", "--budget", "all"])
    assert exc.value.code == 2


def test_auto_nlist_and_defaults():
    assert [auto_nlist(n) for n in (20_000, 1_000_000, 2_000_000, 5_000_000)] == [512, 4096, 4096, 8192]
    config = LookaheadBenchConfig()
    assert (config.vectors, config.dim, config.resolved_nlist, config.queries) == (2_000_000, 384, 4096, 64)
    assert config.resolved_train_size == 131_072 and config.resolved_modes == 8192
    assert config.nprobes() == [(0.03, 123), (0.06, 246), (0.12, 492)]
    with pytest.raises(ConfigError):
        LookaheadBenchConfig(vectors=10, k=11, nlist=2)


def test_perturb_gives_unit_vectors_at_the_cosine():
    gen = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(32, 384, generator=gen), dim=1)  # [32, 384]
    for cos in (0.9, 0.5, 1.0):
        p = perturb(q, cos, gen)  # [32, 384]
        torch.testing.assert_close(p.norm(dim=1), torch.ones(32), atol=1e-5, rtol=0)
        torch.testing.assert_close((p * q).sum(1), torch.full((32,), cos), atol=1e-5, rtol=0)
    assert not math.isclose(float((perturb(q, 0.9, gen) - perturb(q, 0.9, gen)).abs().max()), 0.0)  # random directions


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_run_small():
    """The GPU path end to end at a small size: pinned slow tier, GPU fast tier, busy-GPU window."""
    config = LookaheadBenchConfig(vectors=50_000, nlist=128, queries=8, warmup=1, nprobe_fractions=(0.03, 0.12),
                                  window_ms=10, device="cuda")
    res = measure(config)
    assert res["config"]["device"] == "cuda" and res["config"]["window_kind"] == "gpu" and res["bandwidth"]["pinned"]
    assert res["window"]["reps"] >= 1 and res["window"]["alone_ms"] > 0
    for run in res["runs"]:
        assert run["errors"] == {}
        v = run["variants"]
        assert abs(_recall(v["resident"]) - _recall(v["faiss_cpu"])) <= 0.05  # GPU rounding may swap near-ties
        for name in ("on_demand", "lookahead", "lookahead_split"):  # split: misses scored on the CPU
            assert abs(_recall(v[name]) - _recall(v["resident"])) <= 0.03, (name, run)
        assert v["lookahead"]["prefetch_copied_clusters_mean"] > 0
