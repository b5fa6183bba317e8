"""bench speed --shape (benchmarks/cachedrag_bench/speed_shapes.py) and its artifacts (cpu_shapes.py)."""

import argparse

import pytest
import torch

from cachedrag.errors import ConfigError
from cachedrag_bench import cpu_shapes, speed, speed_shapes

# the published parameter counts of the models whose configs CPU_SHAPES writes out
PUBLISHED = {"qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304, "llama-3.2-3b": 3_212_749_824}


@pytest.mark.parametrize("shape", sorted(PUBLISHED))
def test_shape_configs_build_the_published_models(shape):
    from transformers import AutoModelForCausalLM

    config = cpu_shapes.make_config(shape)
    with torch.device("meta"):  # shapes only: no memory
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[shape]
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as published
    assert type(model).__name__ == config.architectures[0]


def test_unknown_shape_and_gguf_type_are_config_errors():
    with pytest.raises(ConfigError, match="unknown shape"):
        cpu_shapes.shape_dir("qwen9-1t")
    with pytest.raises(ConfigError, match="unknown GGUF type"):
        cpu_shapes.gguf_path("qwen2.5-0.5b", "Q2_K")


def _args(*argv):
    parser = argparse.ArgumentParser()
    speed.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("argv, message", [
    (("--shape", "qwen2.5-0.5b", "--formats", "fp8"), "--formats"),
    (("--shape", "qwen2.5-0.5b", "--chunks", "0"), "--chunks"),
    (("--shape", "qwen2.5-0.5b", "--rounds", "0"), "--chunks"),
])
def test_bad_counts_exit_2_with_one_line(argv, message, capsys):
    assert speed.run(_args(*argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def _row(ours_prefill, ours_decode, theirs_prefill, theirs_decode, gguf):
    return {"ours": {"prefill_s": 1.0, "prefill_tokens_per_s": ours_prefill, "decode_ms_per_token": ours_decode},
            "llamacpp": {"gguf": gguf, "prefill_s": 2600 / theirs_prefill, "prefill_tokens_per_s": theirs_prefill,
                         "decode_ms_per_token": theirs_decode}}


def test_targets_compare_each_format_with_its_class():
    int4 = _row(200.0, 50.0, 100.0, 40.0, "Q4_K_M")
    int4["reuse"] = {"llamacpp_prompt_cache_new_order": {"ttft_s": 24.0},
                     "ours_cached_balanced": {"ttft_s": 6.0}, "ours_cached_fast": {"ttft_s": 2.0}}
    results = {"formats": {"int4": int4, "int8": _row(150.0, 60.0, 160.0, 70.0, "Q8_0")}}
    t = speed_shapes.targets(results)
    assert t["int4 decode <= llama.cpp Q4_K_M"] == {"ratio": 1.25, "met": False}
    assert t["int8 decode <= llama.cpp Q8_0"]["met"] and t["int8 decode <= llama.cpp Q8_0"]["ratio"] == 60 / 70
    assert t["int4 prefill tok/s >= llama.cpp Q4_K_M"] == {"ratio": 2.0, "met": True}
    assert not t["int8 prefill tok/s >= llama.cpp Q8_0"]["met"]
    # llama.cpp's full prefill of 2600 tokens at 100 tok/s = 26 s
    full = "int4 TTFT all cached ({}) >= 8x below llama.cpp Q4_K_M full prefill"
    assert t[full.format("balanced")] == {"ratio": 26 / 6, "met": False}
    assert t[full.format("fast")] == {"ratio": 13.0, "met": True}
    cached = "int4 TTFT all cached ({}) >= 3x below llama.cpp Q4_K_M prompt cache, new order"
    assert t[cached.format("balanced")] == {"ratio": 4.0, "met": True}
