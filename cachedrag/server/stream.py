"""One request's answer as OpenAI bodies: its ``n`` choices assembled from the engine loop's events.

Owns: ``Choice`` (one choice as it arrives: its text, the logprobs of its tokens, and, when the
request offers tools, the tool calls a ``CallParser`` finds in its text), ``ToolEvent`` (what a
parser reports: content text, a call's start with its id and name, a piece of its arguments),
``collect`` (every choice of a non-streamed answer, then the whole ``chat.completion`` /
``text_completion`` body) and ``sse_events`` (the SSE chunks of a streamed answer: one role
chunk per choice, then per-choice content or ``tool_calls`` deltas in OpenAI's shape, where a
call's ``id``, ``type`` and ``function.name`` come first and its ``function.arguments`` follow in
pieces, each choice's finish chunk, the usage chunk, ``[DONE]``).

Usage of ``n`` choices: the prompt is counted once (one prefill), completion tokens summed.
A choice whose calls are whole (it stopped where its grammar accepts) finishes with
``"tool_calls"``. A call cut short (``max_tokens``, a stop string) is still a call, as OpenAI
reports it, with its own finish reason (``"length"``, ``"stop"``) saying it is not whole: its
arguments are what the parser closed (the open strings, arrays and objects ended: valid JSON,
as the in-process chat models parse the same text), in the whole answer and in the stream's
argument deltas alike; a call whose name was cut is dropped (``structured.FormatParser``).

Does not own: the events (``loop``), the wire shapes' builders (``protocol``), the tool-call
formats (``cachedrag.prompt.tools``), routing and disconnects (``app``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from cachedrag.server import protocol as P
from cachedrag.server.loop import Delta, Failed, Finished


@dataclass
class ToolEvent:
    """``content``: answer text; ``call``: call ``index`` begins (its ``id`` and ``name``);
    ``arguments``: the next piece of call ``index``'s JSON arguments."""

    kind: Literal["content", "call", "arguments"]
    text: str = ""
    index: int = 0
    id: str | None = None
    name: str | None = None


class CallParser(Protocol):
    """Finds tool calls in a choice's text as it grows (one parser per choice)."""

    def feed(self, text: str) -> list[ToolEvent]: ...

    def close(self, complete: bool) -> list[ToolEvent]:
        """The answer ended (``complete``: by EOS or a finished grammar, not cut short): what is left."""
        ...


@dataclass
class Choice:
    """One choice of a chat or completion answer as its events arrive. ``constraint``: the
    choice's grammar, which says whether an answer that stopped holds whole calls."""

    index: int
    parser: CallParser | None = None
    want_logprobs: bool = False
    constraint: object | None = None
    content: list[str] = field(default_factory=list)
    calls: list[dict] = field(default_factory=list)  # OpenAI tool calls, arguments as they grow
    records: list = field(default_factory=list)  # TokenLogprob of every token (when asked)
    unsent: list = field(default_factory=list)  # TokenLogprob not yet sent with a delta (streaming)
    finished: Finished | None = None
    reason: str | None = None
    sent: int = 0  # characters of completion text streamed: the legacy logprobs' text_offset

    def push(self, delta: Delta) -> list[dict]:
        """Take a text delta; the OpenAI chat deltas it yields (none while a parser holds text back)."""
        if self.want_logprobs:
            self.records += delta.logprobs or []
            self.unsent += delta.logprobs or []
        events = self.parser.feed(delta.text) if self.parser else [ToolEvent("content", delta.text)]
        return self._apply(events)

    def finish(self, event: Finished) -> list[dict]:
        """The choice ended: the last deltas its parser held back; sets ``reason``."""
        self.finished = event
        watch = getattr(self.constraint, "watch", None)
        repeated = bool(watch is not None and watch.repeated)  # a repeat of an earlier call ended the answer
        complete = event.finish_reason == "stop" and (getattr(self.constraint, "complete", True) or repeated)
        out = self._apply(self.parser.close(complete)) if self.parser else []
        self.reason = "tool_calls" if self.calls and complete else event.finish_reason
        return out

    @property
    def text(self) -> str:
        return "".join(self.content)

    def message(self) -> dict:
        """The assistant message of a whole chat answer: its text outside the calls and its calls,
        a call cut short (``max_tokens``, a stop string) included (``reason`` says it is not whole)."""
        if self.calls:
            return {"role": "assistant", "content": self.text or None, "tool_calls": self.calls}
        return {"role": "assistant", "content": self.text}

    def take_unsent(self) -> list:
        out, self.unsent = self.unsent, []
        return out

    def _apply(self, events: list[ToolEvent]) -> list[dict]:
        deltas: list[dict] = []
        for e in events:
            if e.kind == "content":
                if e.text:
                    self.content.append(e.text)
                    deltas.append({"content": e.text})
            elif e.kind == "call":
                cid = e.id or P.call_id()
                self.calls.append({"id": cid, "type": "function", "function": {"name": e.name, "arguments": ""}})
                deltas.append({"tool_calls": [{"index": len(self.calls) - 1, "id": cid, "type": "function",
                                               "function": {"name": e.name, "arguments": ""}}]})
            elif e.text:  # a piece of call ``e.index``'s arguments
                i = e.index if 0 <= e.index < len(self.calls) else len(self.calls) - 1
                self.calls[i]["function"]["arguments"] += e.text
                deltas.append({"tool_calls": [{"index": i, "function": {"arguments": e.text}}]})
        return deltas


@dataclass
class Answer:
    """The OpenAI bodies of one answer: ``logprobs(records, chat, offset)`` is the logprobs object
    of some tokens (None: not asked)."""

    id: str
    model: str
    chat: bool
    include_usage: bool
    logprobs: Callable

    def chunk(self, choice: Choice, delta: dict) -> dict:
        """A streamed chunk of ``choice`` with ``delta`` (a chat delta) and the logprobs not yet sent."""
        lp = self.logprobs(choice.take_unsent(), self.chat, choice.sent) if choice.want_logprobs else None
        if self.chat:
            return P.chat_chunk(self.id, self.model, delta, logprobs=lp, index=choice.index)
        text = delta.get("content", "")
        choice.sent += len(text)
        return P.completion_chunk(self.id, self.model, text, logprobs=lp, index=choice.index)

    def last(self, choice: Choice) -> dict:
        """``choice``'s finish chunk, with how its prompt was served."""
        body = (P.chat_chunk(self.id, self.model, {}, choice.reason, index=choice.index) if self.chat
                else P.completion_chunk(self.id, self.model, "", choice.reason, index=choice.index))
        return {**body, "cachedrag": P.served(choice.finished.stats)}

    def closing(self, choices: list[Choice]) -> list[dict]:
        """After every choice finished: the usage chunk, when the request asked for it."""
        if not self.include_usage:
            return []
        use = usage_of(choices)
        return [P.chat_chunk(self.id, self.model, {}, use=use, choices=False) if self.chat
                else P.completion_chunk(self.id, self.model, "", use=use, choices=False)]

    def whole(self, choices: list[Choice]) -> dict:
        """The whole (not streamed) response of finished ``choices``."""
        def lp(c: Choice):
            return self.logprobs(c.records, self.chat) if c.want_logprobs else None

        if self.chat:
            body = P.chat_response(self.id, self.model, [P.chat_choice(c.index, c.message(), c.reason, lp(c))
                                                         for c in choices], usage_of(choices))
        else:
            body = P.completion_response(self.id, self.model, [P.completion_choice(c.index, c.text, c.reason, lp(c))
                                                               for c in choices], usage_of(choices))
        return {**body, "cachedrag": P.served(choices[0].finished.stats)}


def usage_of(choices: list[Choice]) -> dict:
    """``usage`` of finished choices sharing one prefill: the prompt once, completions summed."""
    first = choices[0].finished
    return P.usage(first.prompt_tokens, sum(c.finished.completion_tokens for c in choices), first.cached_tokens)


async def next_event(queue: asyncio.Queue, poll_s: float, gone: Callable) -> object | None:
    """The next event, or None once ``gone()`` (an awaitable check: the client disconnected)."""
    while True:
        try:
            return await asyncio.wait_for(queue.get(), timeout=poll_s)
        except asyncio.TimeoutError:
            if await gone():
                return None


async def collect(queue: asyncio.Queue, choices: list[Choice], poll_s: float, gone: Callable) -> list[Choice] | None:
    """Every choice of a non-streamed answer, finished (None: the client went away first). A
    ``Failed`` event is raised as its error."""
    left = len(choices)
    while left:
        event = await next_event(queue, poll_s, gone)
        if event is None:
            return None
        if isinstance(event, Delta):
            choices[event.index].push(event)
        elif isinstance(event, Failed):
            raise event.error
        elif isinstance(event, Finished):
            choices[event.index].finish(event)
            left -= 1
    return choices


def merge_deltas(first: Delta, queue: asyncio.Queue) -> tuple[Delta, object | None]:
    """``first`` joined with the deltas of the same choice already queued behind it (one SSE chunk
    for them: when the event loop falls behind a batch of streams it catches up in fewer sends),
    and the first queued event that is not such a delta (``None`` if none was taken)."""
    if queue.empty():
        return first, None
    texts, records = [first.text], None if first.logprobs is None else list(first.logprobs)
    while not queue.empty():
        event = queue.get_nowait()
        if not isinstance(event, Delta) or event.index != first.index:
            return Delta("".join(texts), records, first.index), event
        texts.append(event.text)
        if records is not None:
            records += event.logprobs or []
    return Delta("".join(texts), records, first.index), None


async def sse_events(queue: asyncio.Queue, choices: list[Choice], chunk: Callable, last: Callable,
                     done: Callable) -> AsyncIterator[dict | str]:
    """The stream of one answer: ``chunk(choice, delta_or_text, reason=None)`` builds a chunk body,
    ``last(choice)`` a choice's finish chunk, ``done(choices)`` the closing bodies (usage). Yields
    bodies (dicts) and, for a failure, its ``P.APIError`` body; the caller adds ``[DONE]``."""
    left, pending = len(choices), None
    while left:
        event, pending = pending or await queue.get(), None
        if isinstance(event, Delta):
            event, pending = merge_deltas(event, queue)
            choice = choices[event.index]
            for body in choice.push(event):
                yield chunk(choice, body)
        elif isinstance(event, Failed):
            raise event.error
        elif isinstance(event, Finished):
            choice = choices[event.index]
            for body in choice.finish(event):
                yield chunk(choice, body)
            if choice.unsent:  # logprobs of text a parser held back and then dropped
                yield chunk(choice, {})
            yield last(choice)
            left -= 1
    for body in done(choices):
        yield body
