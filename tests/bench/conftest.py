"""Fixtures for benchmark tests: a tiny saved model directory and a tiny corpus."""

from __future__ import annotations

import pytest

from cachedrag.testing import byte_tokenizer, tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random tiny Llama saved like an HF checkpoint (config + safetensors + tokenizer)."""
    path = tmp_path_factory.mktemp("tiny-model")
    tok = byte_tokenizer()
    model = tiny_model("llama", vocab_size=len(tok), max_position_embeddings=2048)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    docs = {
        "heapq.txt": "The heapq module implements a min-heap. heappush adds an item; heappop removes the smallest. " * 3,
        "bisect.txt": "bisect finds insertion points in sorted lists. insort inserts keeping order. " * 3,
        "json.txt": "json.dumps serialises objects; indent pretty-prints with the given number of spaces. " * 3,
        "textwrap.txt": "textwrap.fill wraps a paragraph to a width; dedent removes common indentation. " * 3,
    }
    for name, text in docs.items():
        (root / name).write_text(text)
    questions = root / "questions.txt"
    questions.write_text("\n".join(["How do I pretty-print JSON?", "What does heappush do?",
                                    "How do I pretty-print JSON?", "How do I wrap text?",
                                    "What does heappush do?", "How do I pretty-print JSON?"]))
    return str(root), str(questions)
