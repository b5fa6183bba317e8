"""Calling the server's ASGI app in-process from a Ray Serve replica, streaming its response.

Owns: ``ForwardedRequest`` (a picklable HTTP request: method, path, headers, body),
``ResponseStart`` and ``call_app(app, request)``, an async generator that runs the app on the
request and yields the response start, then each body chunk as the app sends it (so SSE
streams keep their per-token timing across the Ray hop). Closing the generator early (the
client went away: Serve cancels the replica call) tells the app ``http.disconnect``, so the
server frees the request's batch slot exactly as it does for a direct client.

Why hand-written: the replica must run the *same* app as ``cachedrag serve`` (routes, errors,
usage, SSE), and the ASGI call is ~40 lines; ``httpx.ASGITransport`` buffers whole responses
(no streaming) and Starlette's ``TestClient`` runs its own thread and event loop.

Does not own: the app (``cachedrag.server.app``), Ray, routing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

_DONE = object()


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    body: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    query_string: bytes = b""


@dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: list[tuple[bytes, bytes]]

    def header(self, name: str) -> str | None:
        key = name.lower().encode()
        return next((v.decode() for k, v in self.headers if k.lower() == key), None)


async def call_app(app, request: ForwardedRequest, extra_headers: Sequence[tuple[bytes, bytes]] = (),
                   close_timeout_s: float = 5.0) -> AsyncIterator[ResponseStart | bytes]:
    """Run ``app`` on ``request``; yield ``ResponseStart`` then the body chunks."""
    messages: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": request.method.upper(), "scheme": "http", "path": request.path,
        "raw_path": request.path.encode(), "root_path": "", "query_string": request.query_string,
        "headers": list(request.headers), "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80), "state": {},
    }
    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _t: messages.put_nowait(_DONE))
    try:
        while True:
            message = await messages.get()
            if message is _DONE:
                if task.exception() is not None:
                    raise task.exception()
                raise RuntimeError("the app returned without completing its response")
            if message["type"] == "http.response.start":
                yield ResponseStart(int(message["status"]), [*message.get("headers", []), *extra_headers])
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
    finally:
        disconnected.set()
        if not task.done():  # abandoned (or finishing): the app sees the disconnect; cancel if it lingers
            await asyncio.wait({task}, timeout=close_timeout_s)
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
