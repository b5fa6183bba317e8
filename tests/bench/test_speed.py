"""bench speed (benchmarks/cachedrag_bench/speed.py) and its llama.cpp anchor helpers (cachedrag_bench.anchor)."""

import gguf
import numpy as np
import pytest

from cachedrag_bench import speed
from cachedrag_bench.anchor import dequantize_gguf


def test_dequantize_gguf_writes_f32_tensors_and_keeps_metadata(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 64)).astype(np.float32)  # [rows, cols]
    src = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(src, "llama")
    writer.add_uint32("llama.block_count", 1)
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q8_0))
    writer.add_array("tokenizer.ggml.tokens", ["a", "b"])
    writer.add_tensor("blk.0.ffn_up.weight", gguf.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    out = tmp_path / "m.f32.gguf"
    dequantize_gguf(src, out)
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.file_type"].contents() == int(gguf.LlamaFileType.ALL_F32)
    assert reader.fields["llama.block_count"].contents() == 1
    assert reader.fields["tokenizer.ggml.tokens"].contents() == ["a", "b"]
    tensors = {t.name: t for t in reader.tensors}
    up = tensors["blk.0.ffn_up.weight"]
    assert up.tensor_type == gguf.GGMLQuantizationType.F32
    got = np.asarray(up.data).reshape(4, 64)
    want = gguf.dequantize(gguf.quantize(w, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(got, want)
    assert np.abs(got - w).max() < 0.05  # Q8_0 rounding only
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically, no temp file left


def _results(**over):
    systems = {
        "cachedrag-fp32": {"dtype": "float32", "threads": 2, "prefill_tokens_per_s": 700.0, "decode_ms_per_token": 40.0,
                           "prefill_s": 1.9},
        "cachedrag-bf16": {"dtype": "bfloat16", "threads": 2, "prefill_tokens_per_s": 2000.0,
                           "decode_ms_per_token": 30.0, "prefill_s": 0.65},
        "llamacpp-f32": {"dtype": "float32", "threads": 2, "prefill_tokens_per_s": 500.0, "decode_ms_per_token": 35.0,
                         "prefill_s": 2.6},
        "llamacpp-q4_1": {"dtype": "q4_1", "threads": 2, "prefill_tokens_per_s": 100.0, "decode_ms_per_token": 20.0,
                          "prefill_s": 13.0},
    }
    results = {"systems": systems, "miss_ratio": 1.02, "first_request_ratio": 1.2,
               "end_to_end": {"cachedrag-bf16": {"ttft_s": 0.5, "seconds": 4.34},
                              "llamacpp-q4_1": {"ttft_s": 13.0, "seconds": 15.56}}}
    results.update(over)
    return results


def test_targets_compare_the_measured_rows():
    t = speed._targets(_results())
    assert t["fp32 decode <= llama.cpp F32"] == {"ratio": 40.0 / 35.0, "met": False}
    assert t["bf16 decode <= 0.6x fp32"]["met"] is False and abs(t["bf16 decode <= 0.6x fp32"]["ratio"] - 0.75) < 1e-9
    assert t["fp32 prefill >= llama.cpp F32"]["met"] is True
    assert t["bf16 prefill >= 1.5x fp32"]["met"] is True
    assert t["end to end cachedrag-bf16 >= 1.5x llama.cpp Q4_1"]["met"] is True
    assert t["first request <= 1.1x"]["met"] is False
    assert t["miss <= 1.05x full"]["met"] is True
    assert "int8 decode <= llama.cpp Q4_1" not in t  # no int8 row measured: no claim
    assert "int4 decode <= llama.cpp Q4_1" not in t


def test_int4_row_is_compared_with_llama_cpp_q4_1():
    res = _results()
    res["systems"]["cachedrag-int4"] = {"dtype": "bfloat16+int4w-g32", "threads": 2, "prefill_tokens_per_s": 1900.0,
                                        "decode_ms_per_token": 16.0, "prefill_s": 0.7}
    t = speed._targets(res)
    assert t["int4 decode <= llama.cpp Q4_1"] == {"ratio": 16.0 / 20.0, "met": True}


def test_compiled_rows_are_compared_with_their_anchors():
    res = _results()
    res["systems"]["cachedrag-fp32-compiled"] = {"dtype": "float32", "threads": 2, "prefill_tokens_per_s": 700.0,
                                                 "decode_ms_per_token": 34.0, "prefill_s": 1.9}
    res["systems"]["cachedrag-int4-compiled"] = {"dtype": "bfloat16+int4w-g32", "threads": 2,
                                                 "prefill_tokens_per_s": 1900.0, "decode_ms_per_token": 21.0,
                                                 "prefill_s": 0.7}
    t = speed._targets(res)
    assert t["fp32 decode <= llama.cpp F32 (compile=True)"] == {"ratio": 34.0 / 35.0, "met": True}
    assert t["int4 decode <= llama.cpp Q4_1 (compile=True)"] == {"ratio": 21.0 / 20.0, "met": False}
    assert "int8 decode <= llama.cpp Q4_1 (compile=True)" not in t
    assert "cachedrag-fp32-compiled" in speed.ALL_SYSTEMS


def test_unknown_system_is_a_clear_error(capsys):
    import argparse

    parser = argparse.ArgumentParser()
    speed.add_arguments(parser)
    assert speed.run(parser.parse_args(["--systems", "cachedrag-fp64"])) == 2
    assert "unknown systems" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--stream", "1"], "--stream must be 0"),
    (["--rounds", "0"], "--rounds and --new-tokens"),
    (["--threads", "2,x"], "--threads must be positive whole numbers"),
    (["--fidelity-prompts", "-1"], "--fidelity-prompts must be at least 0"),
])
def test_bad_counts_are_one_clear_error_before_anything_is_measured(argv, message, capsys, monkeypatch):
    import argparse

    from cachedrag.model import loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("loaded a model for a bad argument"))
    parser = argparse.ArgumentParser()
    speed.add_arguments(parser)
    assert speed.run(parser.parse_args(argv)) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_fidelity_compares_each_dtype_with_fp32_teacher_forced():
    from cachedrag.model.runner import ModelRunner
    from cachedrag.testing import tiny_model

    runners = {"cachedrag-fp32": ModelRunner(tiny_model("llama")),
               "cachedrag-same": ModelRunner(tiny_model("llama")),  # the same weights and dtype: agrees exactly
               "cachedrag-int8": ModelRunner(tiny_model("llama"), dtype="bfloat16", weights="int8")}
    prompts = [list(range(5, 40)), list(range(60, 81))]
    out = speed.dtype_fidelity(runners, prompts, tokens=6)
    assert set(out) == {"cachedrag-same", "cachedrag-int8"}
    same, int8 = out["cachedrag-same"], out["cachedrag-int8"]
    assert same["top1_agreement"] == 1.0 and same["first_token_agreement"] == 1.0
    assert same["kl_mean"] < 1e-6 and same["prompts"] == 2 and same["tokens"] == 6
    assert 0.0 <= int8["top1_agreement"] <= 1.0
    assert int8["kl_max"] >= int8["kl_mean"] > 1e-6  # int8 weights move the distribution


def test_miss_rows_per_system_become_targets():
    misses = {"cachedrag-fp32": {"ratio": 1.01}, "cachedrag-bf16": {"ratio": 1.08}}
    t = speed._targets(_results(miss_ratio=1.01, miss_by_system=misses))
    assert t["miss <= 1.05x full"] == {"ratio": 1.01, "met": True}
    assert t["miss <= 1.05x full (cachedrag-bf16)"] == {"ratio": 1.08, "met": False}


def test_miss_ratio_times_cold_engines_against_full_on_the_same_prompts():
    from types import SimpleNamespace

    from cachedrag.testing import tiny_runner

    chunks = [["heapq pushes items onto a heap. " * 3, "bisect keeps a list sorted. " * 3],
              ["textwrap fills paragraphs. " * 3, "functools caches calls. " * 3]]
    work = SimpleNamespace(retrieved=chunks, questions=["what pushes?", "what caches?"])
    ratio, d = speed._miss_ratio(tiny_runner("llama", seed=1), work, 4)
    assert d["requests"] == 4 and d["chunks_hit"] == 0  # every miss found nothing cached
    assert ratio == d["ratio"] == d["miss_ttft_s"] / d["full_ttft_s"] > 0
    assert d["total_ratio"] == d["miss_total_s"] / d["full_total_s"] > 0
    assert d["miss_total_s"] >= d["miss_ttft_s"]


def test_int8_dynamic_row_is_compared_with_llama_cpp_q4_1_and_joins_end_to_end():
    res = _results()
    res["systems"]["cachedrag-int8-dynamic"] = {"dtype": "bfloat16+int8w-a8dyn", "threads": 2,
                                                "prefill_tokens_per_s": 1900.0, "decode_ms_per_token": 22.0,
                                                "prefill_s": 0.7}
    res["end_to_end"]["cachedrag-int8-dynamic"] = {"ttft_s": 0.5, "seconds": 3.3}
    t = speed._targets(res)
    assert t["int8-dynamic decode <= llama.cpp Q4_1"] == {"ratio": 22.0 / 20.0, "met": False}
    assert t["end to end cachedrag-int8-dynamic >= 1.5x llama.cpp Q4_1"]["met"] is True
    assert "int8 decode <= llama.cpp Q4_1" not in t  # the weight-only row is its own claim


def test_dtype_fidelity_scores_through_the_decode_step():
    """fp32 against a second fp32 runner of the same weights: full agreement, KL ~0; the scoring
    runs the decode step (where the quantised formats' decode kernels run), once per teacher token."""
    from cachedrag.model.runner import ModelRunner
    from cachedrag.testing import byte_tokenizer, tiny_model

    tok = byte_tokenizer()
    ref = ModelRunner(tiny_model("llama", vocab_size=len(tok)), tok)
    twin = ModelRunner(tiny_model("llama", vocab_size=len(tok)), tok)
    calls = []
    step = twin.decode_step
    twin.decode_step = lambda *a: calls.append(a[1]) or step(*a)
    out = speed.dtype_fidelity({"cachedrag-fp32": ref, "twin": twin}, [[1, 2, 3, 4, 5], [9, 8, 7]], tokens=4)
    assert out["twin"]["top1_agreement"] == 1.0 and out["twin"]["first_token_agreement"] == 1.0
    assert out["twin"]["kl_max"] < 1e-6
    assert calls == [5, 6, 7, 3, 4, 5]  # positions of the teacher tokens, one decode step each
