"""Shared fixtures: tiny runners per architecture and the real default model (session-scoped)."""

from __future__ import annotations

import os

import pytest
import torch

from cachedrag.testing import TINY_ARCHITECTURES, tiny_runner

# Every Python the tests start (the CLI, a server, Ray workers, child processes) runs as if with -P:
# its working directory, often the checkout root, stays off sys.path, so it imports the installed
# package as users get it (tests/test_layout.py).
os.environ["PYTHONSAFEPATH"] = "1"


@pytest.fixture(params=TINY_ARCHITECTURES)
def any_runner(request):
    return tiny_runner(request.param)


@pytest.fixture(scope="session")
def default_runner():
    """The real default model (SmolLM2-135M-Instruct); converted once per machine."""
    from cachedrag.model.loader import load_model
    from cachedrag.model.runner import ModelRunner

    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, tok = load_model()
    return ModelRunner(model, tok)


@pytest.fixture(scope="session")
def docs_env(tmp_path_factory):
    """The tiny default model's directory and a tiny ``my-index`` of ``TINY_DOCS``: the documentation's
    code (tests/test_docs.py) and the examples (tests/test_examples.py) run on them."""
    from cachedrag.retrieval.config import ChunkConfig, IndexConfig, RetrievalConfig
    from cachedrag.retrieval.embedder import Embedder
    from cachedrag.retrieval.index import build_index
    from cachedrag.testing import TINY_DOCS, byte_tokenizer, save_tiny_model

    base = tmp_path_factory.mktemp("docs-env")
    model_dir = save_tiny_model(base / "tiny-default", max_position_embeddings=8192)  # examples' long prompts
    index_dir = base / "my-index"
    config = RetrievalConfig(chunk=ChunkConfig(chunk_tokens=96, overlap=8), index=IndexConfig(nlist=2))
    build_index(TINY_DOCS, byte_tokenizer(), Embedder(), config, out=index_dir, progress=False)
    return model_dir, index_dir
