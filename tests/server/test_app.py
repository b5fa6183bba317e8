"""The OpenAI-compatible app over a live loopback server, through the real ``openai`` package."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from cachedrag.testing import TINY_DOCS

openai = pytest.importorskip("openai")

CHUNKS = [TINY_DOCS[0].text, TINY_DOCS[3].text]


def _messages(chunks, question="What does it do?"):
    context = "\n\n".join(chunks)
    return [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": f"Context:\n\n{context}\n\nQuestion: {question}"}]


def _client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)


def test_health_models_and_metrics(live_server):
    s = live_server()
    assert httpx.get(s.url + "/health").json()["status"] == "ok"
    assert [m.id for m in _client(s).models.list()] == ["tiny"]
    first = _client(s).chat.completions.create(model="tiny", messages=_messages(CHUNKS), max_tokens=3, temperature=0)
    text = httpx.get(s.url + "/metrics").text
    for name in ("cachedrag_requests_total", "cachedrag_time_to_first_token_seconds_bucket",
                 "cachedrag_time_per_output_token_seconds_bucket", "cachedrag_decode_batch_size_bucket",
                 "cachedrag_prefill_seconds_bucket",
                 "cachedrag_queue_length", "cachedrag_chunk_hits_total", "cachedrag_chunk_misses_total",
                 "cachedrag_cache_bytes"):
        assert name in text, name
    assert 'cachedrag_requests_total{endpoint="/v1/chat/completions",status="200"} 1.0' in text
    # one request alone: admitted without a choice to make
    assert "cachedrag_admissions_total 1.0" in text and "cachedrag_contested_admissions_total 0.0" in text
    assert "cachedrag_reordered_admissions_total 0.0" in text and "cachedrag_preempted_prefills_total 0.0" in text
    # nothing cached yet: its prefill computed every prompt row through every layer
    assert "cachedrag_prefill_seconds_count 1.0" in text
    assert f"cachedrag_prefill_rows_total {float(first.usage.prompt_tokens)}" in text


def test_idle_server_returns_freed_heap_memory_and_reports_it(live_server):
    """After ``trim_heap_idle_s`` with nothing to do the loop trims the heap once (not again while
    still idle); with None it never does. /metrics shows the trims and the process's RSS."""
    from cachedrag.heap import trim_heap
    from cachedrag.server.config import SchedulerConfig

    if trim_heap() is None:
        pytest.skip("the C library has no malloc_trim (not glibc)")
    never = live_server(scheduler=SchedulerConfig(trim_heap_idle_s=None))
    soon = live_server(scheduler=SchedulerConfig(trim_heap_idle_s=0.05))
    for s in (never, soon):
        _client(s).chat.completions.create(model="tiny", messages=_messages(CHUNKS), max_tokens=3, temperature=0)
    deadline = time.monotonic() + 10
    while soon.loop.heap_trims < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # idle on: no second trim, and the never-server has had time for one
    assert soon.loop.heap_trims == 1 and never.loop.heap_trims == 0
    text = httpx.get(soon.url + "/metrics").text
    assert "cachedrag_heap_trims_total 1.0" in text and "cachedrag_heap_released_bytes_total" in text
    assert "process_resident_memory_bytes" in text
    _client(soon).chat.completions.create(model="tiny", messages=_messages(CHUNKS), max_tokens=3, temperature=0)
    deadline = time.monotonic() + 10
    while soon.loop.heap_trims < 2 and time.monotonic() < deadline:  # work again, then idle again: one more
        time.sleep(0.01)
    assert soon.loop.heap_trims == 2


def test_chat_non_stream_and_stream_agree_and_count_cached_tokens(live_server):
    s = live_server()
    client = _client(s)
    extra = {"cachedrag": {"chunks": CHUNKS}}
    first = client.chat.completions.create(model="tiny", messages=_messages(CHUNKS), max_tokens=6, temperature=0,
                                           extra_body=extra)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert first.usage.completion_tokens == 6 and first.choices[0].finish_reason == "length"
    served = first.model_extra["cachedrag"]  # how the prompt was served: cold, so exact and all fresh
    assert served["approximations"] == [] and served["chunks_hit"] == 0 and served["chunks_missed"] >= 2
    assert served["exact_repeat"] is None and served["tie_guard"] is None and served["first_token_gap"] is None
    assert served["segment_actions"][0] in ("tree", "fresh") and "reuse" not in served["segment_actions"]
    assert served["segment_actions"].count("fresh") >= 2 and served["tie_guard_actions"] is None
    assert served["tie_guard_switch"] is None and served["tie_guard_agreed"] is None
    # chunks in another order: non-prefix reuse (random tiny weights attend everywhere, so the planner
    # recomputes most tokens; some still come from the chunk caches)
    again = client.chat.completions.create(model="tiny", messages=_messages(CHUNKS[::-1]), max_tokens=6,
                                           temperature=0, extra_body={"cachedrag": {"chunks": CHUNKS[::-1]}})
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    served = again.model_extra["cachedrag"]
    assert served["chunks_hit"] >= 2 and "chunk_reuse" in served["approximations"]
    assert "reuse" in served["segment_actions"] and served["first_token_gap"] >= 0
    stream = client.chat.completions.create(model="tiny", messages=_messages(CHUNKS), max_tokens=6, temperature=0,
                                            extra_body=extra, stream=True, stream_options={"include_usage": True})
    pieces, usage, reasons, extra = [], None, [], []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
        extra += [chunk.model_extra["cachedrag"]] if "cachedrag" in (chunk.model_extra or {}) else []
    assert "".join(pieces) == first.choices[0].message.content  # same prompt again: exact prefix hit, same tokens
    assert len(extra) == 1 and extra[0]["approximations"] == [] and extra[0]["chunks_hit"] >= 2  # on the last chunk
    assert reasons[-1] == "length" and usage.completion_tokens == 6
    assert usage.prompt_tokens_details.cached_tokens >= sum(len(c.encode()) for c in CHUNKS)  # a token per byte


def test_completions_endpoint_and_stop(live_server):
    s = live_server()
    client = _client(s)
    full = client.completions.create(model="tiny", prompt="Hello there, server.", max_tokens=10, temperature=0)
    text = full.choices[0].text
    assert full.usage.completion_tokens == 10 and full.object == "text_completion"
    stop = text[4:6]
    if stop and "\ufffd" not in stop and stop.strip():
        cut = client.completions.create(model="tiny", prompt="Hello there, server.", max_tokens=10, temperature=0,
                                        stop=[stop])
        assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="tiny", prompt="Hello there, server.", max_tokens=10,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text


def test_seeded_sampling_is_reproducible(live_server):
    client = _client(live_server())
    kw = dict(model="tiny", messages=_messages(CHUNKS[:1]), max_tokens=8, temperature=0.8, top_p=0.9, seed=3)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


@pytest.mark.parametrize("change, status, param", [
    ({"model": "gpt-4o"}, 404, "model"),
    ({"temperature": 3.0}, 400, "temperature"),
    ({"n": 9}, 400, "n"),  # more choices than the max batch (8)
    ({"n": 0}, 400, "n"),
    ({"max_tokens": 100_000}, 400, "messages"),
    ({"cachedrag": {"chunks": ["this text is not in the prompt at all, anywhere"]}}, 400, "cachedrag.chunks"),
    ({"frequency_penalty": 3.0}, 400, "frequency_penalty"),
    ({"response_format": {"type": "xml"}}, 400, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, 400, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, 400,
     "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, 400, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]},
     400, "tools"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"functions": [{"name": "f", "parameters": {}}]}, 400, "functions"),
])
def test_errors_have_the_openai_shape(live_server, change, status, param):
    s = live_server()
    body = {"model": "tiny", "messages": _messages(CHUNKS), "max_tokens": 4, **change}
    r = httpx.post(s.url + "/v1/chat/completions", json=body)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["param"] == param


PICK = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["ok", "n"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
             "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
             "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                              "b": {"type": "integer", "minimum": 0, "maximum": 999}},
             "required": ["a", "b"]}}}]  # bounded integers: a random-weight model would write digits to max_tokens
ASK = [{"role": "user", "content": "Pick one."}]


def test_response_format_gives_json_valid_for_the_schema(live_server):
    """A random-weight model writes bytes; with ``response_format`` every answer is JSON for the
    schema (the grammar constrains decoding), streamed or not, chat or completion."""
    client = _client(live_server())
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": PICK, "strict": True}}
    for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2)):
        r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=40, temperature=temperature,
                                           seed=seed, response_format=fmt)
        pick = json.loads(r.choices[0].message.content)
        assert set(pick) == {"ok", "n"} and isinstance(pick["ok"], bool) and 0 <= pick["n"] <= 99
        assert r.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=40, temperature=0,
                                              response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    plain = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=40, temperature=0,
                                           response_format=fmt)
    assert text == plain.choices[0].message.content
    done = client.completions.create(model="tiny", prompt="A pick: ", max_tokens=40, temperature=0,
                                     extra_body={"response_format": fmt})
    assert set(json.loads(done.choices[0].text)) == {"ok", "n"}
    anything = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=30, temperature=0,
                                              response_format={"type": "json_object"})
    content = anything.choices[0].message.content
    assert content.startswith("{")  # an unbounded object may run past max_tokens; a finished one parses
    assert anything.choices[0].finish_reason == "length" or isinstance(json.loads(content), dict)
    free = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=12, temperature=0)
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)  # the same model unconstrained: not JSON


def test_required_tool_calls_come_back_as_openai_tool_calls(live_server, long_engine):
    client = _client(live_server(long_engine))  # the offered tools take a system prompt
    args_of = {"get_weather": lambda a: a["city"] in ("Paris", "Rome") and set(a) == {"city"},
               "add": lambda a: set(a) == {"a", "b"} and all(isinstance(v, int) for v in a.values())}
    r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=120, temperature=0, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert call.type == "function" and call.id.startswith("call_")
    assert args_of[call.function.name](json.loads(call.function.arguments))
    named = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=120, temperature=1.0, seed=4,
                                           tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
                                           parallel_tool_calls=False)
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "add" and args_of["add"](json.loads(call.function.arguments))
    stream = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=120, temperature=0, tools=TOOLS,
                                            tool_choice="required", parallel_tool_calls=False, stream=True)
    calls, reasons = {}, []
    for chunk in stream:
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:  # OpenAI's shape: id and name first, then argument pieces
                if d.index not in calls:
                    assert d.id.startswith("call_") and d.function.name and d.type == "function"
                    calls[d.index] = [d.function.name, ""]
                calls[d.index][1] += d.function.arguments or ""
            reasons.append(choice.finish_reason)
    assert [tuple(c) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
    assert reasons[-1] == "tool_calls"
    cut = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=3, temperature=0, tools=TOOLS,
                                         tool_choice="required")  # cut before the call is complete: text
    assert cut.choices[0].finish_reason == "length" and not cut.choices[0].message.tool_calls
    assert cut.choices[0].message.content.startswith("{")
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    after = client.chat.completions.create(model="tiny", messages=turn, max_tokens=4, temperature=0, tools=TOOLS,
                                           tool_choice="none")  # the follow-up turn: a plain answer
    assert after.choices[0].finish_reason == "length" and after.choices[0].message.content


def test_logprobs_chat_and_completions(live_server):
    client = _client(live_server())
    kw = dict(model="tiny", messages=_messages(CHUNKS[:1]), max_tokens=6, temperature=0)
    r = client.chat.completions.create(**kw, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2 and entry.bytes == list(entry.token.encode())
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy: the chosen token is the top one
    stream = client.chat.completions.create(**kw, logprobs=True, stream=True)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(e.top_logprobs == [] for e in streamed)  # logprobs without top_logprobs: no alternatives
    assert client.chat.completions.create(**kw).choices[0].logprobs is None
    done = client.completions.create(model="tiny", prompt="Hello there, server.", max_tokens=5, temperature=0,
                                     logprobs=2)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset == sorted(lp.text_offset) and all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    r = httpx.post(live_server().url + "/v1/chat/completions",
                   json={**kw, "top_logprobs": 2})  # top_logprobs without logprobs: a 400
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_api_key_guards_the_v1_routes_only(live_server):
    s = live_server(api_key="s3cret")
    body = {"model": "tiny", "messages": _messages(CHUNKS[:1]), "max_tokens": 2, "temperature": 0}
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "s3cret"}):
        r = httpx.post(s.url + "/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(s.url + "/v1/models").status_code == 401
    assert httpx.get(s.url + "/health").status_code == 200 and httpx.get(s.url + "/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=s.base_url, api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=s.base_url, api_key="s3cret", max_retries=0)
    assert good.chat.completions.create(**body).usage.completion_tokens == 2
    assert 'cachedrag_requests_total{endpoint="/v1/chat/completions",status="401"} 3.0' in httpx.get(s.url + "/metrics").text


def test_openai_client_raises_its_typed_errors(live_server):
    client = _client(live_server())
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=_messages(CHUNKS), max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=_messages(CHUNKS), max_tokens=10**6)
    assert info.value.code == "context_length_exceeded"


def test_full_queue_answers_503(live_server):
    s = live_server(scheduler={"max_batch": 1, "max_waiting": 1})
    gate, entered = threading.Event(), threading.Event()
    prefill_task = s.engine.prefill_task

    def held_prefill(*args, **kwargs):  # the first prefill waits: the queue behind it fills up
        entered.set()
        gate.wait(30)
        return prefill_task(*args, **kwargs)

    s.engine.prefill_task = held_prefill
    body = {"model": "tiny", "messages": _messages(CHUNKS[:1]), "max_tokens": 2}
    results = []

    def post():
        results.append(httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60))

    threads = [threading.Thread(target=post), threading.Thread(target=post)]
    threads[0].start()
    assert entered.wait(30)  # the first request left the queue for its (held) prefill
    threads[1].start()
    deadline = time.monotonic() + 30
    while s.loop.waiting < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    rejected = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60)
    gate.set()
    for t in threads:
        t.join(60)
    assert rejected.status_code == 503
    assert rejected.json()["error"]["code"] == "queue_full"
    assert sorted(r.status_code for r in results) == [200, 200]


class _HoldDecoding:
    """Loop observer that holds decode steps from step 2 on until ``release`` is set (waits up to
    10 s once, then 20 ms per step), so a streaming request cannot finish by itself before its
    client has gone and the server has noticed, however loaded the machine is."""

    def __init__(self, loop):
        self.inner, self.loop = loop.observer, loop
        self.held, self.release, self.waited = threading.Event(), threading.Event(), False
        loop.observer = self

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def on_step(self, batch_size, waiting):
        if self.loop.steps >= 2 and not self.release.is_set():
            self.held.set()
            self.release.wait(0.02 if self.waited else 10.0)
            self.waited = True
        self.inner.on_step(batch_size, waiting)


def test_client_disconnect_mid_stream_frees_the_slot(live_server):
    s = live_server(scheduler={"max_batch": 1})
    hold = _HoldDecoding(s.loop)
    # greedy: this prompt then runs to max_tokens (sampled at temperature 1, an EOS can end it during the
    # held step, before the cancel is seen, and a request that finished counts its tokens)
    body = {"model": "tiny", "messages": _messages(CHUNKS[:1]), "max_tokens": 180, "temperature": 0, "stream": True}
    with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # the role chunk: the request is in
        assert hold.held.wait(30)  # it is decoding, and held: it cannot finish before the client goes
    deadline = time.monotonic() + 30
    while ("cachedrag_client_disconnects_total 1.0" not in httpx.get(s.url + "/metrics").text
           and time.monotonic() < deadline):
        time.sleep(0.02)
    hold.release.set()
    while (s.loop.running or s.loop.waiting) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert s.loop.running == 0 and s.loop.waiting == 0
    metrics = httpx.get(s.url + "/metrics").text
    assert "cachedrag_client_disconnects_total 1.0" in metrics
    assert "cachedrag_completion_tokens_total 0.0" in metrics  # it left early: never ran to max_tokens
    # the freed slot serves the next request (max_batch=1: a leaked slot would block it)
    r = httpx.post(s.url + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
    assert "cachedrag_client_disconnects_total 1.0" in httpx.get(s.url + "/metrics").text


def test_unmodified_client_gets_automatic_chunk_reuse(live_server):
    docs = [TINY_DOCS[i].text for i in (1, 2)]  # 160-171 characters: passages above the minimum
    cached = {}
    for name, passages, extra in (("auto", {"min_chars": 100}, None),
                                  ("explicit", {"min_chars": 100, "enabled": False}, True),
                                  ("none", {"min_chars": 100, "enabled": False}, None)):
        client = _client(live_server(passages=passages))
        for order in (docs, docs[::-1]):  # the second request has the passages in the other order
            body = {"cachedrag": {"chunks": order}} if extra else None
            r = client.chat.completions.create(model="tiny", messages=_messages(order), max_tokens=2,
                                               extra_body=body)
        cached[name] = r.usage.prompt_tokens_details.cached_tokens
    # detection finds the same chunks the explicit field names; without either, only the
    # system-prompt prefix is cached
    assert cached["auto"] == cached["explicit"] > cached["none"]


def test_disconnect_while_a_chunk_is_being_sent_frees_the_slot():
    """The race behind a once-seen flake: the client goes while the stream task is inside
    ``send`` (a chunk in flight), not waiting for the next event. Starlette then cancels the
    task in ``send``, which leaves the event generator suspended at its ``yield`` (its
    ``finally`` would run only when the generator is garbage-collected, with GC off here: never),
    so the slot must be freed by the response itself. Driven at the ASGI level so the moment of
    the disconnect is exact: the ``send`` of the first content chunk waits until decoding is held
    with the next chunk queued behind it, then the client disconnects."""
    import asyncio
    import gc
    import json

    from cachedrag.config import EngineConfig
    from cachedrag.engine import CachedEngine
    from cachedrag.model.lookup import LookupConfig
    from cachedrag.server.app import create_app
    from cachedrag.server.config import ServerConfig
    from cachedrag.testing import tiny_runner

    engine = CachedEngine(tiny_runner(), config=EngineConfig(lookup=LookupConfig(max_draft=0)))
    app = create_app(engine, ServerConfig(model_name="tiny", scheduler={"max_batch": 1}))
    loop = app.state.loop
    body = json.dumps({"model": "tiny", "messages": _messages(CHUNKS[:1]), "max_tokens": 180, "temperature": 0,
                       "stream": True}).encode()  # greedy: no EOS can end it by itself (see the test above)
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}

    async def drive():
        gone = asyncio.Event()
        sent = []
        requested = False

        async def receive():
            nonlocal requested
            if not requested:
                requested = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if gone.is_set():
                return  # the connection is closed: the server drops what it writes (as uvicorn does)
            sent.append(message)
            if message["type"] == "http.response.body" and b'"content": "' in message.get("body", b"") \
                    and b'"content": ""' not in message["body"]:
                while not hold.held.is_set():  # decoding reached step 2: the next chunk is queued
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.2)  # the stream task now waits to hand that chunk to this send
                gone.set()
                await asyncio.sleep(0.3)

        async with app.router.lifespan_context(app):
            await asyncio.wait_for(app(scope, receive, send), 30)
            deadline = time.monotonic() + 5  # decoding is still held (10 s): the request cannot finish by itself
            while b"cachedrag_client_disconnects_total 1.0" not in app.state.metrics.render() \
                    and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            noticed = b"cachedrag_client_disconnects_total 1.0" in app.state.metrics.render()
            hold.release.set()
            while (loop.running or loop.waiting) and time.monotonic() < deadline + 25:
                await asyncio.sleep(0.02)
            return noticed, loop.running, app.state.metrics.render().decode()

    hold = _HoldDecoding(loop)
    gc.disable()
    try:
        noticed, running, metrics = asyncio.run(drive())
    finally:
        hold.release.set()
        gc.enable()
    assert noticed  # the server saw the client go while the request was still decoding
    assert running == 0
    assert "cachedrag_client_disconnects_total 1.0" in metrics
    assert "cachedrag_completion_tokens_total 0.0" in metrics  # its slot was freed: it never ran to max_tokens


def test_queued_deltas_go_out_as_one_chunk():
    import asyncio

    from cachedrag.server.loop import Delta, Failed, TokenLogprob
    from cachedrag.server.stream import merge_deltas as _merge_deltas

    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        alone = Delta("a")
        assert _merge_deltas(alone, queue) == (alone, None)  # nothing queued behind it: as it was
        done = Failed(RuntimeError("gone"))
        lp = [TokenLogprob(1, -0.1, []), TokenLogprob(2, -0.2, []), TokenLogprob(3, -0.3, [])]
        for event in (Delta(" b", lp[1:2]), Delta(" c", lp[2:]), done, Delta("never")):
            queue.put_nowait(event)
        merged, pending = _merge_deltas(Delta("a", lp[:1]), queue)
        assert merged == Delta("a b c", lp) and pending is done
        assert queue.qsize() == 1  # what follows the first non-delta stays queued
        other = Delta("x", None, index=1)  # another choice's delta ends the run too
        for event in (Delta("b"), other, Delta("c")):
            queue.put_nowait(event)
        queue.get_nowait()  # the "never" left over
        assert _merge_deltas(Delta("a"), queue) == (Delta("ab"), other)

    asyncio.run(run())


def test_tie_guarded_requests_are_counted():
    from cachedrag.server.loop import Finished
    from cachedrag.server.metrics import ServerMetrics

    metrics = ServerMetrics()
    for gap in (0.12, None, None):
        metrics.on_finished(Finished("stop", 100, 4, 80, 0.1, 0.2, "ok", [1, 2, 3, 4],
                                     stats={"chunks_hit": 2, "approximations": [], "tie_guard": gap}))
    metrics.on_finished(Finished("stop", 100, 4, 80, 0.1, 0.2, "ok", [1, 2, 3, 4],
                                 stats={"chunks_hit": 2, "approximations": ["chunk_reuse"], "tie_guard_switch": 2}))
    text = metrics.render().decode()
    assert "cachedrag_tie_guard_switches_total 1.0" in text  # moved onto exact KV while decoding
    assert "cachedrag_tie_guarded_requests_total 1.0" in text
    assert "cachedrag_exact_hit_requests_total 3.0" in text  # guarded requests are exact too


def test_metrics_report_hits_and_load_time_per_store_tier(tmp_path):
    """With a tiered store, /metrics counts each tier's cache reads and their time (what `bench serve`
    reads per level), and the store's demotions and drops; the figures are the tiers' own counters."""
    from prometheus_client.parser import text_string_to_metric_families

    from cachedrag.config import EngineConfig
    from cachedrag.engine import CachedEngine
    from cachedrag.server.metrics import ServerMetrics
    from cachedrag.store.config import StoreConfig
    from cachedrag.store.tiered import TieredStore
    from cachedrag.testing import tiny_runner

    runner = tiny_runner()
    probe = CachedEngine(runner)
    cfg = StoreConfig(namespace=probe.model_namespace.digest, cpu_bytes=64 << 20, disk_dir=str(tmp_path),
                      disk_bytes=64 << 20, write_through=True)
    writer = CachedEngine(runner, config=EngineConfig(), store=TieredStore.from_config(cfg))
    writer.generate(CHUNKS, "What does it do?", max_new_tokens=1)
    writer.manager.store.close()  # a restarted server finds every entry on disk
    store = TieredStore.from_config(cfg)
    engine = CachedEngine(runner, config=EngineConfig(), store=store)
    engine.generate(CHUNKS[::-1], "What does it do?", max_new_tokens=1)
    assert store.wait_prefetches(30)  # the reused entries' promotion to the CPU tier reads the disk too

    def samples(name):
        text = ServerMetrics(engine=engine).render().decode()
        return {s.labels.get("tier"): s.value for f in text_string_to_metric_families(text)
                for s in f.samples if s.name == name}

    hits, load_s = samples("cachedrag_tier_hits_total"), samples("cachedrag_tier_load_seconds_total")
    disk, cpu = store.tier("disk"), store.tier("cpu")
    assert disk.stats.hits >= len(CHUNKS) and hits == {"cpu": cpu.stats.hits, "disk": disk.stats.hits}
    assert load_s["disk"] == disk.stats.load_seconds > 0
    assert samples("cachedrag_store_demotions_total") == {None: store.stats.demotions}
    assert samples("cachedrag_store_drops_total") == {None: store.stats.drops}
