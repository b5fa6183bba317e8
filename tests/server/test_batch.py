"""Batched decode and the engine loop against their reference paths (tiny random models)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from prometheus_client import generate_latest

from cachedrag.config import EngineConfig
from cachedrag.engine import CachedEngine
from cachedrag.model.generation import SamplingParams
from cachedrag.model.lookup import LookupConfig
from cachedrag.server.batch import PACKED_ROWS, batch_weights, batched_decode_step, prepare
from cachedrag.server.config import SchedulerConfig
from cachedrag.server.loop import EngineLoop, Failed, Finished, ServeRequest
from cachedrag.server.metrics import ServerMetrics
from cachedrag.model.runner import ModelRunner
from cachedrag.testing import TINY_DOCS, byte_tokenizer, serve_requests, tiny_model, tiny_runner

QUESTIONS = ["What does heapq do?", "How do I parse JSON?", "Explain itertools.chain briefly.", "What is a deque?"]
NO_DRAFTS = EngineConfig(lookup=LookupConfig(max_draft=0))


def _chunks(i):
    docs = [d.text for d in TINY_DOCS]
    return [docs[i % len(docs)], docs[(i + 2) % len(docs)]]


@pytest.mark.parametrize("arch,fast,packed", [
    ("llama", True, False), ("llama", True, True), ("llama", False, None), ("mistral", True, False),
    ("mistral", True, True), ("mistral", False, None), ("qwen3", None, None),
])  # mistral: sliding window of 24 < prompt; qwen3: q/k norms; packed: the oneDNN float32 copies of the weights
def test_batched_step_equals_decode_step_per_request(arch, fast, packed):
    runner = tiny_runner(arch)
    assert runner._decode_fast == (fast is not None)  # the fast path applies to llama/mistral, not qwen3
    if packed:
        assert batch_weights(runner) is not None  # tiny float32 Llama/Mistral: the packed layout applies
    prompts = [torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 31, 17, 40, 2)]
    kv_a = [runner.new_kv(len(p) + 4) for p in prompts]
    kv_b = [runner.new_kv(len(p) + 4) for p in prompts]
    first = []
    for p, a, b in zip(prompts, kv_a, kv_b):
        logits = runner.prefill(p, kv=a)
        runner.prefill(p, kv=b)
        first.append(int(logits.argmax()))
    tokens, positions = list(first), [len(p) for p in prompts]
    for _ in range(3):
        batched = batched_decode_step(runner, tokens, positions, kv_a, fast=fast, packed=packed)  # [B, V]
        single = torch.stack([runner.decode_step(t, pos, kv) for t, pos, kv in zip(tokens, positions, kv_b)])
        torch.testing.assert_close(batched, single, rtol=1e-4, atol=1e-4)
        assert batched.argmax(-1).tolist() == single.argmax(-1).tolist()
        tokens = batched.argmax(-1).tolist()
        positions = [p + 1 for p in positions]
    for a, b, p in zip(kv_a, kv_b, positions):
        torch.testing.assert_close(a.k[:, :, :p], b.k[:, :, :p], rtol=1e-4, atol=1e-5)


def test_packed_weights_from_packed_rows_on_and_only_for_dense_float32():
    runner = tiny_runner()
    prompts = [torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(n)) for n in range(3, 3 + PACKED_ROWS)]
    kvs = [runner.new_kv(len(p) + 2) for p in prompts]
    for p, kv in zip(prompts, kvs):
        runner.prefill(p, kv=kv)
    tokens, positions = [7] * len(prompts), [len(p) for p in prompts]
    auto = batched_decode_step(runner, tokens, positions, kvs, fused=False)  # [B, V] the op-by-op step at
    forced = batched_decode_step(runner, tokens, positions, kvs, packed=True)  # PACKED_ROWS rows: packed by default
    plain = batched_decode_step(runner, tokens, positions, kvs, packed=False)
    assert torch.equal(auto, forced)
    torch.testing.assert_close(auto, plain, rtol=1e-4, atol=1e-4)  # another kernel: equal to float rounding
    one = batched_decode_step(runner, tokens[:1], positions[:1], kvs[:1], fused=False)  # one row: the runner's own
    with_torch_step = ModelRunner(runner.model, runner.tokenizer, decode_step="torch")  # weights, bit for bit its
    assert torch.equal(one[0], with_torch_step.decode_step(tokens[0], positions[0], kvs[0]))  # op-by-op step
    if runner.fused is not None:  # the default batched step: the fused one, each row bit for bit its decode step
        fused = batched_decode_step(runner, tokens, positions, kvs)  # [B, V]
        torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
    prepare(runner, 8)  # builds once, runs each row count once
    assert batch_weights(runner) is batch_weights(runner)
    bf16 = ModelRunner(tiny_model(vocab_size=len(byte_tokenizer())), byte_tokenizer(), dtype="bfloat16")
    assert batch_weights(bf16) is None  # bf16 weights are oneDNN-packed already: any row count


def _run_loop(engine, requests, max_batch):
    return serve_requests(engine, requests, max_batch)


def test_batch_of_one_equals_engine_generate():
    engine = CachedEngine(tiny_runner(), config=NO_DRAFTS)
    reference = CachedEngine(tiny_runner(), config=NO_DRAFTS)
    for i, q in enumerate(QUESTIONS[:2]):
        segments = engine.prompts.chat(_chunks(i), q)
        params = SamplingParams(max_new_tokens=12)
        (got,), _ = _run_loop(engine, [(segments, params)], max_batch=1)
        want = reference.generate(_chunks(i), q, max_new_tokens=12)
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.prompt_tokens == want.prompt_tokens and got.finish_reason == want.finish_reason


def test_batched_greedy_equals_unbatched_greedy_and_requests_join_between_steps():
    engine_a = CachedEngine(tiny_runner(), config=NO_DRAFTS)
    engine_b = CachedEngine(tiny_runner(), config=NO_DRAFTS)
    lengths = [3, 14, 9, 20, 6]  # different lengths: requests leave at different steps, waiting ones join
    reqs_a = [(engine_a.prompts.chat(_chunks(i), QUESTIONS[i % 4]), SamplingParams(max_new_tokens=n))
              for i, n in enumerate(lengths)]
    reqs_b = [(engine_b.prompts.chat(_chunks(i), QUESTIONS[i % 4]), SamplingParams(max_new_tokens=n))
              for i, n in enumerate(lengths)]
    batched, loop = _run_loop(engine_a, reqs_a, max_batch=3)
    single, loop1 = _run_loop(engine_b, reqs_b, max_batch=1)
    assert [r.token_ids for r in batched] == [r.token_ids for r in single]
    wide, _ = _run_loop(engine_a, reqs_a, max_batch=len(lengths))  # all at once: the packed weights' row counts
    assert len(lengths) >= PACKED_ROWS and [r.token_ids for r in wide] == [r.token_ids for r in single]
    assert [len(r.token_ids) for r in batched] == lengths  # random tiny model: no EOS this early
    assert loop.steps < loop1.steps  # the batch really shared decode steps


def test_seeded_sampling_is_reproducible_in_a_batch():
    engine = CachedEngine(tiny_runner(), config=NO_DRAFTS)
    params = SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.9, seed=7)
    reqs = [(engine.prompts.chat(_chunks(0), QUESTIONS[0]), params),
            (engine.prompts.chat(_chunks(1), QUESTIONS[1]), params)]
    batched, _ = _run_loop(engine, reqs, max_batch=2)
    alone, _ = _run_loop(engine, reqs[:1], max_batch=1)
    assert batched[0].token_ids == alone[0].token_ids


def test_constrained_and_penalised_requests_in_a_batch_equal_generate():
    """Structured output and OpenAI penalties through the loop: each request, batched beside
    others, gives the tokens ``generate_segments`` gives it alone (the same ``process_logits``)."""
    from cachedrag.model.constraint import JsonConstraint

    engine = CachedEngine(tiny_runner(), config=NO_DRAFTS)
    reference = CachedEngine(tiny_runner(), config=NO_DRAFTS)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                               "maximum": 99}},
              "required": ["ok", "n"]}

    def kinds():  # fresh constraints each time: a constraint follows one generation
        return [SamplingParams(max_new_tokens=40, constraint=JsonConstraint(schema, engine.runner.tokenizer,
                                                                            engine.eos_ids)),
                SamplingParams(max_new_tokens=12, frequency_penalty=1.5, presence_penalty=0.5),
                SamplingParams(max_new_tokens=12, presence_penalty=-2.0),
                SamplingParams(max_new_tokens=9)]

    segments = [engine.prompts.chat(_chunks(i)[:1], QUESTIONS[i]) for i in range(4)]  # short: tiny's window
    batched, _ = _run_loop(engine, list(zip(segments, kinds())), max_batch=4)
    want = [reference.generate_segments(reference.prompts.chat(_chunks(i)[:1], QUESTIONS[i]), p)
            for i, p in enumerate(kinds())]
    assert [r.token_ids for r in batched] == [w.token_ids for w in want]
    assert json.loads(batched[0].text).keys() == {"ok", "n"} and batched[0].finish_reason == "stop"
    plain = reference.generate_segments(reference.prompts.chat(_chunks(2)[:1], QUESTIONS[2]),
                                        SamplingParams(max_new_tokens=12))
    assert plain.token_ids != batched[2].token_ids  # the (negative: repeat-seeking) penalty was applied


def test_logprobs_through_the_loop_equal_generate_and_ride_with_the_text():
    """Each token's log p (the model's own distribution) comes with the text delta it completes,
    batched or not, and equals what ``generate`` reports; the alternatives are the top-k."""
    engine = CachedEngine(tiny_runner(), config=NO_DRAFTS)
    reference = CachedEngine(tiny_runner(), config=NO_DRAFTS)
    loop = EngineLoop(engine, SchedulerConfig(max_batch=3, order="fifo"))
    deltas: dict[int, list] = {0: [], 1: [], 2: []}
    finished: dict[int, Finished] = {}
    done = threading.Event()

    def emitter(i):
        def emit(event):
            if isinstance(event, (Finished, Failed)):
                finished[i] = event
                if len(finished) == 3:
                    done.set()
            else:
                deltas[i].append(event)
        return emit

    asks = [(3, SamplingParams(max_new_tokens=10)), (None, SamplingParams(max_new_tokens=7)),
            (0, SamplingParams(max_new_tokens=12, temperature=0.9, seed=5))]
    for i, (k, params) in enumerate(asks):
        loop.submit(ServeRequest(segments=engine.prompts.chat(_chunks(i)[:1], QUESTIONS[i]), params=params,
                                 emit=emitter(i), logprobs=k))
    loop.start()
    assert done.wait(60)
    loop.stop()
    for i, (k, params) in enumerate(asks):
        got = finished[i]
        want = reference.generate_segments(reference.prompts.chat(_chunks(i)[:1], QUESTIONS[i]), params)
        assert got.token_ids == want.token_ids
        records = [r for d in deltas[i] for r in (d.logprobs or [])]
        if k is None:
            assert all(d.logprobs is None for d in deltas[i])
            continue
        assert [r.token for r in records] == got.token_ids
        torch.testing.assert_close(torch.tensor([r.logprob for r in records]), torch.tensor(want.token_logprobs),
                                   rtol=0, atol=1e-4)
        assert all(len(r.top) == k for r in records)
        for r in records:
            assert [lp for _, lp in r.top] == sorted((lp for _, lp in r.top), reverse=True)
            if params.temperature == 0.0:  # greedy: the chosen token is the most likely one
                assert r.top[0] == (r.token, r.logprob)


def test_stop_strings_and_cached_tokens_through_the_loop():
    engine = CachedEngine(tiny_runner(), config=NO_DRAFTS)
    segments = engine.prompts.chat(_chunks(0), QUESTIONS[0])
    (first,), _ = _run_loop(engine, [(segments, SamplingParams(max_new_tokens=16))], max_batch=2)
    assert first.cached_tokens == 0
    stop = first.text[3:5]
    assert stop and stop in first.text
    (second,), _ = _run_loop(engine, [(segments, SamplingParams(max_new_tokens=16, stop=[stop]))], max_batch=2)
    assert second.text == first.text[:first.text.index(stop)] and second.finish_reason == "stop"
    assert second.cached_tokens > 0  # the whole context came from the chunk cache this time
    assert second.cached_tokens == second.prompt_tokens - second.stats["computed_tokens"] or \
        "cached_tokens" in second.stats


def test_cancelled_request_leaves_and_frees_its_slot():
    engine = CachedEngine(tiny_runner(), config=NO_DRAFTS)
    loop = EngineLoop(engine, SchedulerConfig(max_batch=1))
    events = []
    finished = threading.Event()

    def emit_second(event):
        events.append(("b", event))
        if isinstance(event, Finished):
            finished.set()

    long_prompt = engine.prompts.chat(_chunks(0)[:1], QUESTIONS[0])
    room = engine.runner.max_context - sum(len(s) for s in long_prompt)
    first = loop.submit(ServeRequest(long_prompt, SamplingParams(max_new_tokens=room),
                                     lambda e: events.append(("a", e))))
    loop.submit(ServeRequest(engine.prompts.chat(_chunks(1)[:1], QUESTIONS[1]), SamplingParams(max_new_tokens=4),
                             emit_second))
    loop.start()
    deadline = time.monotonic() + 30
    while loop.steps < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    loop.cancel(first)  # the only slot holds a long request: cancelling it lets the second one in
    assert finished.wait(30)
    loop.stop()
    assert not any(isinstance(e, Finished) for who, e in events if who == "a")
    assert loop.running == 0 and loop.waiting == 0


def test_chunked_prefill_interleaves_decode_steps_and_keeps_the_tokens():
    """A long prefill admitted while another request decodes is cut between layers: the running
    request gets decode steps inside it, and every token equals the run without chunking."""
    outputs = {}
    for chunk in (0, 1):
        engine = CachedEngine(tiny_runner(), config=NO_DRAFTS)
        loop = EngineLoop(engine, SchedulerConfig(max_batch=2, order="fifo", prefill_chunk_tokens=chunk))
        events: dict[str, list] = {"a": [], "b": []}
        done = threading.Event()

        def emitter(name):
            def emit(event):
                events[name].append((loop.steps, event))
                if name == "b" and isinstance(event, (Finished, Failed)):
                    done.set()
            return emit

        loop.submit(ServeRequest(engine.prompts.chat(_chunks(0)[:1], QUESTIONS[0]), SamplingParams(max_new_tokens=30),
                                 emitter("a")))
        loop.start()
        deadline = time.monotonic() + 30
        while loop.steps < 2 and time.monotonic() < deadline:  # a is decoding
            time.sleep(0.001)
        loop.submit(ServeRequest(engine.prompts.chat(_chunks(1), QUESTIONS[1]),
                                 SamplingParams(max_new_tokens=4), emitter("b")))
        assert done.wait(30)
        deadline = time.monotonic() + 30
        while loop.running and time.monotonic() < deadline:
            time.sleep(0.001)
        loop.stop()
        finals = {k: [e for _, e in v if isinstance(e, (Finished, Failed))] for k, v in events.items()}
        assert all(len(f) == 1 and isinstance(f[0], Finished) for f in finals.values()), finals
        outputs[chunk] = (finals["a"][0].token_ids, finals["b"][0].token_ids, loop.interleaved_steps)
    assert outputs[0][:2] == outputs[1][:2]  # chunking changes when tokens come, never which
    assert outputs[0][2] == 0
    n_layers = tiny_runner().n_layers
    assert len(outputs[1][0]) == 30  # a (random tiny model: no EOS) was still decoding while b prefilled
    # a's decode steps ran inside b's prefill: one after each layer but the last (budget 1 token)
    assert outputs[1][2] == n_layers - 1


@pytest.mark.slow
def test_batched_step_on_the_default_model_equals_decode_step(default_runner):
    """The real model through the packed float32 weights (5 rows) and the runner's own (2 rows)."""
    runner = default_runner
    prompts = [torch.randint(10, 40000, (n,), generator=torch.Generator().manual_seed(n)) for n in (40, 75, 9, 60, 23)]
    for rows in (5, 2):
        kv_a = [runner.new_kv(len(p) + 4) for p in prompts[:rows]]
        kv_b = [runner.new_kv(len(p) + 4) for p in prompts[:rows]]
        tokens = []
        for p, a, b in zip(prompts, kv_a, kv_b):
            tokens.append(int(runner.prefill(p, kv=a).argmax()))
            runner.prefill(p, kv=b)
        positions = [len(p) for p in prompts[:rows]]
        for _ in range(3):
            batched = batched_decode_step(runner, tokens, positions, kv_a)  # [B, V]
            single = torch.stack([runner.decode_step(t, pos, kv) for t, pos, kv in zip(tokens, positions, kv_b)])
            torch.testing.assert_close(batched, single, rtol=1e-3, atol=1e-3)
            assert batched.argmax(-1).tolist() == single.argmax(-1).tolist()
            tokens, positions = batched.argmax(-1).tolist(), [p + 1 for p in positions]


@pytest.mark.parametrize("weights", ["dense", "int8", "int8-dynamic"])
def test_one_row_is_the_runners_decode_step_in_low_precision(weights):
    """bf16 and int8 runners (int8-dynamic decodes in a float32 stream): one batched row is the
    runner's own decode step bit for bit."""
    from cachedrag.model.weights import vnni_available

    if weights == "int8-dynamic" and not vnni_available():
        pytest.skip("int8-dynamic needs VNNI")
    tok = byte_tokenizer()
    runner = ModelRunner(tiny_model(vocab_size=len(tok)), tok, dtype="bfloat16", weights=weights)
    prompt = torch.randint(0, 250, (9,), generator=torch.Generator().manual_seed(9))
    kv_a, kv_b = runner.new_kv(12), runner.new_kv(12)
    runner.prefill(prompt, kv=kv_a)
    runner.prefill(prompt, kv=kv_b)
    for step, token in enumerate([3, 70, 11]):
        one = batched_decode_step(runner, [token], [9 + step], [kv_a])[0]  # [V]
        assert torch.equal(one, runner.decode_step(token, 9 + step, kv_b))


def test_idle_loop_promotes_a_recurring_sequence_to_an_exact_path():
    """Exact repeats through the server: the second reuse-served request of one chunk sequence hands
    its promotion to the loop, which computes the exact path while idle; the third is an exact hit."""
    engine = CachedEngine(tiny_runner(), config=NO_DRAFTS)
    docs = [d.text for d in TINY_DOCS]
    engine.generate([docs[1], docs[0]], "warm", max_new_tokens=1)  # both chunks cached, in the other order
    loop = EngineLoop(engine, SchedulerConfig(max_batch=1))
    loop.start()
    try:
        got = []
        for i in range(3):
            done, box = threading.Event(), []

            def emit(event, box=box, done=done):
                if isinstance(event, (Finished, Failed)):
                    box.append(event)
                    done.set()

            loop.submit(ServeRequest(segments=engine.prompts.chat(docs[:2], QUESTIONS[i]),
                                     params=SamplingParams(max_new_tokens=3), emit=emit))
            assert done.wait(60) and isinstance(box[0], Finished)
            got.append(box[0])
            if i == 1:  # the loop is idle now: it computes the exact path
                deadline = time.monotonic() + 60
                while loop.promotions < 1 and time.monotonic() < deadline:
                    time.sleep(0.01)
    finally:
        loop.stop()
    assert got[0].stats["approximations"] == ["chunk_reuse", "partial_recompute:question+inter", "recompute_bfloat16"]
    assert got[1].stats["exact_repeat"] == "promote" and loop.promotions == 1
    assert got[2].stats["approximations"] == [] and got[2].stats["exact_repeat"] is None  # an exact prefix hit
    full = engine.generate(docs[:2], QUESTIONS[2], max_new_tokens=3, mode="full")
    assert got[2].token_ids == full.token_ids


def test_idle_promotion_yields_to_an_arriving_request():
    """A promotion running in idle time gives way after a layer when a request waits: nothing is
    stored, it is queued again, and it completes at the next idle turn."""
    engine = CachedEngine(tiny_runner(), config=NO_DRAFTS)
    docs = [d.text for d in TINY_DOCS]
    engine.generate([docs[1], docs[0]], "warm", max_new_tokens=1)
    segments = engine.prompts.chat(docs[:2], "q")
    keys = [s.key for s in segments[:-1]]
    assert engine.prefill(segments, 1).promote is None
    promote = engine.prefill(segments, 1).promote
    assert promote is not None
    loop = EngineLoop(engine, SchedulerConfig(max_batch=1))  # not started: a submitted request stays waiting
    loop._promotions.append(promote)
    rid = loop.submit(ServeRequest(segments=segments, params=SamplingParams(max_new_tokens=1), emit=lambda e: None))
    loop._promote()
    assert loop.promotions == 0 and loop.promotions_yielded == 1 and len(loop._promotions) == 1
    assert engine.manager.tree.find(keys) is None and engine.manager.check() == []
    loop.policy.remove(rid)  # the request left: idle again
    loop._promote()
    assert loop.promotions == 1 and not loop._promotions and engine.manager.tree.find(keys) is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_loop_on_cuda_equals_the_cpu_engine():
    """The server's loop (batched steps, requests joining and leaving) on a CUDA runner gives the
    CPU engine's greedy tokens."""
    gpu = CachedEngine(tiny_runner(device="cuda"), config=NO_DRAFTS)
    cpu = CachedEngine(tiny_runner(), config=NO_DRAFTS)
    lengths = [3, 14, 9, 20]
    reqs = [(gpu.prompts.chat(_chunks(i), QUESTIONS[i]), SamplingParams(max_new_tokens=n)) for i, n in enumerate(lengths)]
    batched, loop = _run_loop(gpu, reqs, max_batch=3)
    want = [cpu.generate(_chunks(i), QUESTIONS[i], max_new_tokens=n) for i, n in enumerate(lengths)]
    assert [r.token_ids for r in batched] == [w.token_ids for w in want]
    assert loop.steps < sum(lengths)  # steps were shared


@pytest.mark.parametrize("hold", [True, False])
def test_waiting_requests_chunks_are_evicted_last(hold):
    """``hold_waiting``: a prefill's store hand-off that must evict (a budget below the working
    set) passes over the chunks a waiting request will read, so it still finds them cached; off,
    the policy's order alone decides and the oldest chunks (the waiting request's) go."""
    docs = [d.text for d in TINY_DOCS]
    probe = CachedEngine(tiny_runner(), config=NO_DRAFTS)
    probe.generate(docs[:2], "warm", max_new_tokens=1)
    budget = probe.manager.used_bytes * 2  # the system prompt, two chunks and about as much again
    engine = CachedEngine(tiny_runner(), config=EngineConfig(lookup=LookupConfig(max_draft=0), cache_bytes=budget))
    engine.generate(docs[:2], "warm", max_new_tokens=1)  # the waiting request's chunks, cached first (oldest)
    loop = EngineLoop(engine, SchedulerConfig(max_batch=2, hold_waiting=hold))  # not started: requests stay waiting
    waiting = engine.prompts.chat(docs[1::-1], "a question over the cached chunks")
    loop.submit(ServeRequest(waiting, SamplingParams(max_new_tokens=1), emit=lambda e: None))
    ticket = loop.policy.waiting[0]
    # all cached when it arrived: the system prompt as the tree's exact prefix, the rest (another
    # order) as variants, of which the recomputed share still costs compute
    arrived = loop._estimate(ticket)
    kept_share = 1 - engine.config.cache.recompute_ratio
    assert arrived == len(waiting[0]) + int(kept_share * sum(len(s) for s in waiting[1:-1]))
    for i in range(2):  # two more requests over new chunks fill the budget
        loop._prefill(ServeRequest(engine.prompts.chat(docs[2 + 2 * i:4 + 2 * i], "another question"),
                                   SamplingParams(max_new_tokens=1), emit=lambda e: None))
    m = engine.manager
    assert m.used_bytes <= budget and m.check() == [] and m.tree.evictions + m.index.evictions > 0
    assert (loop._estimate(ticket) == arrived) == hold


def test_a_short_request_preempts_a_running_prefill_and_every_token_stays():
    """Cache-aware order with preemption: a short request waiting while a long prefill runs is
    prefilled between the long one's layers and answers first; both answers equal the run
    without preemption (where the long request's first token comes first)."""
    runs = {}
    for ratio in (0.0, 1.0):
        engine = CachedEngine(tiny_runner(), config=NO_DRAFTS)
        loop = EngineLoop(engine, SchedulerConfig(max_batch=2, preempt_ratio=ratio))
        order, finals, done = [], {}, threading.Event()

        def emitter(name):
            def emit(event):
                order.append(name)
                if isinstance(event, (Finished, Failed)):
                    finals[name] = event
                    if len(finals) == 2:
                        done.set()
            return emit

        long = engine.prompts.chat([d.text for d in TINY_DOCS[:2]], QUESTIONS[0])
        short = engine.prompts.chat([], QUESTIONS[1])
        n_long, n_short = (sum(len(s) for s in p) for p in (long, short))
        # the forecast's first guess (PrefillModel: 0.05 s + 0.5 ms a token): after layer 0 of 2 the long
        # prefill has half its time left, and the short one's whole prefill fits in it
        assert 0.05 + 0.0005 * n_short <= 0.5 * (0.05 + 0.0005 * n_long)
        loop.submit(ServeRequest(long, SamplingParams(max_new_tokens=6), emitter("long")))
        loop.submit(ServeRequest(short, SamplingParams(max_new_tokens=6), emitter("short")))
        loop.start()  # the first step sees both waiting and admits the older, long one
        assert done.wait(60)
        loop.stop()
        assert all(isinstance(f, Finished) for f in finals.values()), finals
        runs[ratio] = (order[0], loop.policy.preempted, {k: f.token_ids for k, f in finals.items()})
        scrape = generate_latest(ServerMetrics(engine, loop).registry).decode()
        assert f"cachedrag_preempted_prefills_total {float(loop.policy.preempted)}" in scrape
    assert runs[0.0][:2] == ("long", 0)
    assert runs[1.0][:2] == ("short", 1)  # the short request's first token came before the long one's
    assert runs[1.0][2] == runs[0.0][2] and all(len(t) == 6 for t in runs[1.0][2].values())
