"""A live server on loopback over a tiny random model (uvicorn in a thread, port chosen by the OS)."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


@dataclass
class LiveServer:
    url: str
    app: object
    engine: object
    server: object
    thread: threading.Thread

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def loop(self):
        return self.app.state.loop

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def make_long_engine(positions: int = 2048):
    """A tiny random-weight engine with a longer context window than ``tiny_runner``'s 512 positions
    (offered tools take a few hundred byte tokens of system prompt)."""
    from cachedrag.config import EngineConfig
    from cachedrag.engine import CachedEngine
    from cachedrag.model.lookup import LookupConfig
    from cachedrag.model.runner import ModelRunner
    from cachedrag.testing import byte_tokenizer, tiny_model

    tok = byte_tokenizer()
    model = tiny_model(vocab_size=len(tok), max_position_embeddings=positions)
    model.generation_config.eos_token_id = tok.eos_token_id
    return CachedEngine(ModelRunner(model, tok), config=EngineConfig(lookup=LookupConfig(max_draft=0)))


def start_server(engine=None, embedder=None, **config) -> LiveServer:
    import uvicorn

    from cachedrag.config import EngineConfig
    from cachedrag.engine import CachedEngine
    from cachedrag.model.lookup import LookupConfig
    from cachedrag.server.app import create_app
    from cachedrag.server.config import ServerConfig
    from cachedrag.testing import tiny_runner

    if engine is None:
        engine = CachedEngine(tiny_runner(), config=EngineConfig(lookup=LookupConfig(max_draft=0)))
    app = create_app(engine, ServerConfig(model_name="tiny", **config), embedder=embedder)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    return LiveServer(f"http://127.0.0.1:{sock.getsockname()[1]}", app, engine, server, thread)


@pytest.fixture
def live_server():
    servers = []

    def make(engine=None, embedder=None, **config):
        s = start_server(engine, embedder, **config)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.stop()


@pytest.fixture
def long_engine():
    """``make_long_engine()``: a tiny engine with 2048 positions."""
    return make_long_engine()


@pytest.fixture
def new_long_engine():
    """``make_long_engine`` itself: each call a fresh engine with the same weights."""
    return make_long_engine
