"""Shared fixtures: tiny runners per architecture and the real default model (session-scoped)."""

from __future__ import annotations

import pytest
import torch

from cachedrag.testing import TINY_ARCHITECTURES, tiny_runner


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
