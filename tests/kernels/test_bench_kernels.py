"""`cachedrag bench kernels` on CPU at tiny sizes: runs the references, prints, writes sane JSON."""

from __future__ import annotations

import json

import pytest
import torch

from cachedrag.cli import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU (reference-only) report")
def test_bench_kernels_cpu_json(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    rc = main(["bench", "kernels", "--device", "cpu", "--context", "96", "--q-heads", "4", "--kv-heads", "2",
               "--head-dim", "16", "--segments", "4", "--repeats", "1", "--warmup", "0", "--copy-mib", "1",
               "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "only the torch references" in printed and "skipped" in printed

    res = json.loads(out.read_text())
    assert {"device", "backend", "rerotate", "selective_attention"} <= res.keys()
    assert res["device"] == "cpu" and res["backend"] == "torch"
    assert res["config"]["context"] == 96 and res["config"]["dtype"] == "float32"

    rr = res["rerotate"]
    assert rr["rows"] == 96 - round(96 * 0.15) and rr["buffer_rows"] == 96
    assert rr["bytes_moved"] > 2 * 2 * rr["rows"] * 16 * 4 - 1
    assert rr["copy_gb_per_s"] > 0 and set(rr["results"]) == {"torch"} and "triton" in rr["skipped"]
    assert rr["results"]["torch"]["ms"] > 0 and rr["results"]["torch"]["gb_per_s"] > 0

    at = res["selective_attention"]
    assert at["queries"] == round(96 * 0.15) and at["keys"] == 96 and at["segments"] == 4
    assert set(at["results"]) == {"torch", "torch_sdpa_dense"} and "triton" in at["skipped"]
    assert at["useful_flop"] > 0
    for r in at["results"].values():
        assert r["ms"] > 0 and r["tflop_per_s"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU report")
def test_bench_kernels_times_the_cpu_prefill_kernel_beside_sdpa(tmp_path, capsys):
    from cachedrag.model import attention

    out = tmp_path / "kernels.json"
    rc = main(["bench", "kernels", "--device", "cpu", "--context", "200", "--recompute", "0.4", "--q-heads", "6",
               "--kv-heads", "2", "--head-dim", "64", "--segments", "4", "--repeats", "1", "--warmup", "0",
               "--copy-mib", "1", "--json", str(out)])
    assert rc == 0
    at = json.loads(out.read_text())["selective_attention"]
    if attention.prefill_module() is None:
        assert "cpu_prefill_kernel" in at["skipped"] and "cpu_prefill_kernel" not in at["results"]
        return
    assert at["results"]["cpu_prefill_kernel"]["ms"] > 0
    assert at["max_abs_err_cpu_prefill_kernel"] < 1e-4  # against the torch reference, float32
    assert at["cpu_prefill_kernel_speedup_vs_sdpa"] > 0
    assert "cpu prefill kernel vs sdpa" in capsys.readouterr().out


def test_bench_kernels_rejects_bad_sizes(capsys):
    assert main(["bench", "kernels", "--device", "cpu", "--q-heads", "6", "--kv-heads", "4"]) == 2
    assert "multiple" in capsys.readouterr().err
