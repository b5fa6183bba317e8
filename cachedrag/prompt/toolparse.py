"""Incremental parsers of a model's tool calls: text deltas in, text / call events out.

Owns: the events (``TextDelta``, ``CallStarted`` with the call's name, ``ArgumentsDelta``,
``CallEnded`` with the whole ``ToolCall``), one parser class per format of ``toolformat``
(``HermesParser``, ``Llama3Parser``, ``MistralParser``, ``EnvelopeParser``; ``parser_for``
picks one) with one interface: ``feed(text_delta) -> list[event]`` and ``finish() -> list[event]``,
and ``parse_tool_calls(text, fmt)`` for a whole answer. A call's name is announced as soon as
its string is closed, before any of its arguments; arguments stream as the raw JSON text the
model wrote (compact under a grammar). Text that might be the start of a call marker is held
back until it is decided. Partial JSON is tolerated: ``finish`` closes a call cut off by the
token limit (open strings and brackets closed, a dangling key dropped), so its arguments are
still a JSON object. A call that repeats an earlier one (name and arguments) is dropped (``repeats`` counts them): a
call named like an earlier call streams only once it ended and was not a repeat, so no stream
shows a dropped call; the constraint stops such an answer there (``model.constraint.RepeatWatch``).

Does not own: the formats themselves (``toolformat``) or the grammars (``toolgrammar``). Pure Python.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from cachedrag.prompt.toolformat import ToolFormat
from cachedrag.prompt.tools import ToolCall, new_call_id


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class CallStarted:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


@dataclass(frozen=True)
class CallEnded:
    index: int
    call: ToolCall


def scan_object(s: str, start: int = 0) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The top-level keys of the JSON object opening at ``s[start]``: ``{key: (value_start,
    value_end or None while open)}``, and the object's end (one past ``}``) or None."""
    keys: dict[str, tuple[int, int | None]] = {}
    depth, i, n = 0, start, len(s)
    key = None  # the key whose value is being read at depth 1
    expect_key, value_start, key_start = True, None, None
    in_str = esc = False
    while i < n:
        ch = s[i]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                if depth == 1 and key_start is not None:  # a key closed
                    try:
                        key = json.loads(s[key_start:i + 1])
                    except json.JSONDecodeError:
                        key = s[key_start + 1:i]
                    key_start = None
                elif depth == 1 and value_start is not None and s[value_start] == '"':
                    keys[key] = (value_start, i + 1)
        elif ch == '"':
            in_str = True
            if depth == 1 and expect_key:
                key_start, expect_key = i, False
            elif depth == 1 and key is not None and value_start is None:
                value_start = i
                keys[key] = (i, None)
        elif ch in "{[":
            depth += 1
            if depth == 2 and key is not None and value_start is None:
                value_start = i
                keys[key] = (i, None)
        elif ch in "}]":
            depth -= 1
            if depth == 1 and value_start is not None:
                keys[key] = (value_start, i + 1)
            if depth == 0:
                _close_scalar(s, keys, key, value_start, i)
                return keys, i + 1
        elif depth == 1 and ch == ",":
            _close_scalar(s, keys, key, value_start, i)
            key, expect_key, value_start = None, True, None
        elif depth == 1 and ch not in " \t\r\n:" and key is not None and value_start is None:
            value_start = i  # a number, true, false or null
            keys[key] = (i, None)
        i += 1
    return keys, None


def _close_scalar(s, keys, key, value_start, i):
    if key is not None and value_start is not None and keys.get(key, (0, 1))[1] is None:
        keys[key] = (value_start, i)
        while keys[key][1] > value_start and s[keys[key][1] - 1] in " \t\r\n":
            keys[key] = (value_start, keys[key][1] - 1)


def close_partial_json(text: str) -> str:
    """A cut-off JSON value closed: open string ended, dangling key / comma dropped, brackets closed."""
    stack: list[str] = []
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]" and stack:
            stack.pop()
    out = text + ('"' if in_str else "")
    for _ in range(4):
        try:
            json.loads(out + "".join(reversed(stack)))
            return out + "".join(reversed(stack))
        except json.JSONDecodeError:
            stripped = re.sub(r'(,\s*"(?:[^"\\]|\\.)*"\s*:?\s*|,\s*|:\s*)$', "", out)
            if stripped.rstrip().endswith(":") or stripped == out:
                stripped = re.sub(r'"(?:[^"\\]|\\.)*"\s*:?\s*$', "", out) if stripped == out else stripped
            if stripped == out:
                break
            out = stripped
    closed = out + "".join(reversed(stack))
    try:
        json.loads(closed)
        return closed
    except json.JSONDecodeError:
        return "{}"


class _CallParser:
    """The shared machinery: text mode (looking for the format's marker) and call mode (call
    objects, and whatever separates them)."""

    #: characters skipped between call objects
    between = " \t\r\n,;"

    def __init__(self, fmt: ToolFormat, id_factory=new_call_id):
        self.fmt = fmt
        self.ids = id_factory
        self.buf = ""  # text not yet decided
        self.in_calls = False
        self.calls: list[ToolCall] = []
        self._obj: str | None = None  # the open call object's text so far
        self._name: str | None = None
        self._id = ""
        self._args_sent = 0
        self.repeats = 0  # calls dropped for repeating an earlier call (name and arguments)
        self._hold: list | None = None  # events of an open call named like an earlier one (``_release``)

    # --- the interface ----------------------------------------------------------------------
    def feed(self, delta: str) -> list:
        self.buf += delta
        events: list = []
        while True:
            n = len(events)
            consumed = self._step(events)
            if not consumed and len(events) == n:
                return self._release(events)

    def finish(self) -> list:
        events: list = []
        while self._step(events, final=True):
            pass
        if self._obj is not None:
            self._end_object(self._obj, events, partial=True)
        if self.buf and not self.in_calls:
            events.append(TextDelta(self.buf))
        self.buf = ""
        events = self._release(events)
        self._hold = None  # a held call that never ended was a dropped repeat
        return events

    def _release(self, events: list) -> list:
        """``events`` less those of a call whose name an earlier call already has, which are held
        until the call ends: passed on with its ``CallEnded``, or never when it was a repeat (no
        ``CallEnded``), so a stream never shows a call the answer drops. Other calls stream as they come."""
        out = []
        for event in events:
            if isinstance(event, CallStarted):
                self._hold = [event] if any(c.name == event.name for c in self.calls[:event.index]) else None
                if self._hold is not None:
                    continue
            elif self._hold is not None and isinstance(event, ArgumentsDelta):
                self._hold.append(event)
                continue
            elif self._hold is not None and isinstance(event, CallEnded):
                out.extend(self._hold)
                self._hold = None
            out.append(event)
        return out

    # --- modes ------------------------------------------------------------------------------
    def _step(self, events: list, final: bool = False) -> bool:
        if self._obj is not None:
            return self._in_object(events)
        if self.in_calls:
            return self._between(events, final)
        return self._text(events, final)

    def _markers(self) -> list[str]:
        return [self.fmt.trigger] if self.fmt.trigger else []

    def _text(self, events: list, final: bool) -> bool:
        hit = self._find_start(self.buf)
        if hit is not None:
            at, skip = hit
            if at:
                events.append(TextDelta(self.buf[:at]))
            self.buf = self.buf[at + skip:]
            self.in_calls = True
            return True
        keep = 0 if final else self._held(self.buf)
        if len(self.buf) > keep:
            events.append(TextDelta(self.buf[:len(self.buf) - keep]))
            self.buf = self.buf[len(self.buf) - keep:]
        return False

    def _find_start(self, text: str) -> tuple[int, int] | None:
        """Where the calls start in ``text`` and how much marker to skip there."""
        hits = [(text.find(m), len(m)) for m in self._markers() if text.find(m) >= 0]
        return min(hits) if hits else None

    def _held(self, text: str) -> int:
        """How many trailing characters might begin a marker."""
        best = 0
        for m in self._markers():
            for k in range(min(len(m) - 1, len(text)), 0, -1):
                if text.endswith(m[:k]):
                    best = max(best, k)
                    break
        return best

    def _between(self, events: list, final: bool) -> bool:
        stripped = self.buf.lstrip(self.between + "[]")
        if stripped != self.buf:
            self.buf = stripped
            return True
        for m in (*self._markers(), self.fmt.closer):
            if m and self.buf.startswith(m):
                self.buf = self.buf[len(m):]
                return True
        if not self.buf:
            return False
        if self.buf[0] == "{":
            self._obj, self.buf = self.buf, ""
            self._name, self._args_sent = None, 0
            return True
        if not final and any(m.startswith(self.buf) for m in (*self._markers(), self.fmt.closer) if m):
            return False
        return self._after_calls(events)

    def _after_calls(self, events: list) -> bool:
        """Something that is not a call after the calls: text again (tagged formats) or dropped."""
        if self.fmt.layout == "tagged":
            self.in_calls = False
            return True
        self.buf = self.buf.lstrip("}]")  # the envelope's / array's closing brackets
        if self.buf:
            self.buf = ""  # trailing junk after the calls of an untagged format
        return False

    def _in_object(self, events: list) -> bool:
        self._obj += self.buf
        self.buf = ""
        keys, end = scan_object(self._obj)
        self._announce(keys, events)
        if end is None:
            return False
        rest = self._obj[end:]
        self._end_object(self._obj[:end], events, partial=False)
        self.buf = rest + self.buf
        return True

    def _announce(self, keys: dict, events: list) -> None:
        obj = self._obj
        if self._name is None and "name" in keys and keys["name"][1] is not None:
            try:
                self._name = str(json.loads(obj[keys["name"][0]:keys["name"][1]]))
            except json.JSONDecodeError:
                return
            self._id = self.ids()
            events.append(CallStarted(len(self.calls), self._id, self._name))
        args = keys.get(self.fmt.args_key) or keys.get("arguments") or keys.get("parameters")
        if self._name is not None and args is not None:
            stop = args[1] if args[1] is not None else len(obj)
            text = obj[args[0]:stop]
            if len(text) > self._args_sent:
                events.append(ArgumentsDelta(len(self.calls), text[self._args_sent:]))
                self._args_sent = len(text)

    def _end_object(self, obj: str, events: list, partial: bool) -> None:
        self._obj = None
        keys, _ = scan_object(obj)
        if self._name is None and partial and "name" in keys:
            start = keys["name"][0]
            raw = obj[start:keys["name"][1] or len(obj)]
            self._name = json.loads(close_partial_json(raw)) if raw.startswith('"') else None
            if self._name:
                self._id = self.ids()
                events.append(CallStarted(len(self.calls), self._id, self._name))
        if self._name is None:
            return  # an object with no name is not a call
        args = keys.get(self.fmt.args_key) or keys.get("arguments") or keys.get("parameters")
        raw = obj[args[0]:args[1] or len(obj)] if args is not None else ""
        arguments = _arguments_text(raw, partial)
        if args is None or partial:  # whatever the deltas lacked to make the final arguments
            sent = raw[:self._args_sent]
            if arguments.startswith(sent) and len(arguments) > len(sent):
                events.append(ArgumentsDelta(len(self.calls), arguments[len(sent):]))
        call = ToolCall(self._id, self._name, arguments)
        self._name = None
        if any(c.name == call.name and c.args == call.args for c in self.calls):
            self.repeats += 1  # a repeat of an earlier call (small models loop on parallel calls): dropped
            return
        events.append(CallEnded(len(self.calls), call))
        self.calls.append(call)


def _arguments_text(raw: str, partial: bool) -> str:
    raw = raw.strip()
    if not raw:
        return "{}"
    text = close_partial_json(raw) if partial else raw
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return "{}"
    if isinstance(value, str):  # arguments given as a JSON string holding the object
        try:
            inner = json.loads(value)
        except json.JSONDecodeError:
            return "{}"
        return json.dumps(inner, ensure_ascii=False) if isinstance(inner, dict) else "{}"
    return text if isinstance(value, dict) else "{}"


def _held_opening(text: str, opener: str, canonical: str) -> int:
    """The length of ``text``'s tail from its last ``opener`` when that tail, whitespace aside, may
    still become ``canonical`` (the start of a call)."""
    at = text.rfind(opener)
    if at < 0 or len(text) - at > 4 * len(canonical):
        return 0
    tail = re.sub(r"\s", "", text[at:])
    return len(text) - at if canonical.startswith(tail) and len(tail) < len(canonical) else 0


class HermesParser(_CallParser):
    """``<tool_call>{...}</tool_call>`` blocks among text (Hermes, Qwen)."""


class Llama3Parser(_CallParser):
    """``<|python_tag|>`` then call objects, or a bare ``{"name": ...`` object (Llama 3.x; also
    what remains of a tagged call when special tokens are skipped in decoding)."""

    _bare = re.compile(r'\{\s*"name"\s*:')

    def _find_start(self, text: str) -> tuple[int, int] | None:
        hit = super()._find_start(text)
        m = self._bare.search(text)
        if m and (hit is None or m.start() < hit[0]):
            return m.start(), 0  # the object itself opens the calls
        return hit

    def _held(self, text: str) -> int:
        return max(super()._held(text), _held_opening(text, "{", '{"name":'))


class MistralParser(_CallParser):
    """``[TOOL_CALLS]`` then a JSON array of call objects (Mistral); a bare ``[{"name": ...``
    array too (the special token is dropped when special tokens are skipped in decoding)."""

    _bare = re.compile(r'\[\s*\{\s*"name"\s*:')

    def _find_start(self, text: str) -> tuple[int, int] | None:
        hit = super()._find_start(text)
        m = self._bare.search(text)
        if m and (hit is None or m.start() < hit[0]):
            return m.start(), 0
        return hit

    def _held(self, text: str) -> int:
        return max(super()._held(text), _held_opening(text, "[", '[{"name":'))


class EnvelopeParser(_CallParser):
    """``{"tool_calls": [{...}, ...]}``, the generic envelope (whitespace inside it tolerated)."""

    _start = re.compile(r'\{\s*"tool_calls"\s*:')

    def _find_start(self, text: str) -> tuple[int, int] | None:
        m = self._start.search(text)
        return (m.start(), m.end() - m.start()) if m else None

    def _held(self, text: str) -> int:
        return _held_opening(text, "{", '{"tool_calls":')


_PARSERS = {"hermes": HermesParser, "llama3": Llama3Parser, "mistral": MistralParser, "envelope": EnvelopeParser}


def parser_for(fmt: ToolFormat, id_factory=new_call_id) -> _CallParser:
    """A fresh incremental parser for one answer in ``fmt``."""
    return _PARSERS[fmt.name](fmt, id_factory)


def parse_tool_calls(text: str, fmt: ToolFormat, id_factory=new_call_id) -> tuple[str, list[ToolCall]]:
    """A whole answer's text (outside the calls) and its calls."""
    parser = parser_for(fmt, id_factory)
    events = parser.feed(text) + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, TextDelta))
    return content, list(parser.calls)
