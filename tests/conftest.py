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
