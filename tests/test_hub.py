"""cachedrag.hub: model names resolve to local directories without any network."""

from __future__ import annotations

import pytest

from cachedrag.errors import ModelNotFoundError
from cachedrag.hub import local_snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    cache = tmp_path / "hub"
    snapshot = cache / "models--some-org--some-model" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (cache / "models--some-org--some-model" / "refs").mkdir()
    (cache / "models--some-org--some-model" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return snapshot


def test_a_directory_is_returned_as_is(tmp_path):
    assert local_snapshot(str(tmp_path)) == str(tmp_path)


def test_a_cached_hub_id_resolves_to_its_snapshot(hub_cache):
    assert local_snapshot("some-org/some-model") == str(hub_cache)


def test_absent_or_invalid_names_are_none(hub_cache):
    assert local_snapshot("some-org/other-model") is None
    assert local_snapshot("some-org/some-model", marker="modules.json") is None
    assert local_snapshot("not a/valid//id") is None


def test_loader_fails_at_once_for_an_absent_model(hub_cache, monkeypatch):
    import socket

    from cachedrag.model.loader import load_tokenizer

    lookups = []

    def no_network(host, *args, **kwargs):
        lookups.append(host)  # recorded: libraries on the way may swallow the error below
        raise socket.gaierror("network disabled by the test")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    with pytest.raises(ModelNotFoundError, match="no-such-org/no-such-model"):
        load_tokenizer("no-such-org/no-such-model")
    assert lookups == []
