"""Fixtures of the prompt tests: the default model's tokenizer (a byte-level BPE whose tokens cross
chunk boundaries)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tokenizer():
    from cachedrag.model.loader import load_tokenizer

    return load_tokenizer(None)
