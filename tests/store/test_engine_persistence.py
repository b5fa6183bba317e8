"""The engine over a persistent / shared TieredStore: restarts reuse the disk caches from the
first request (a real second process), two processes share chunk caches through one real
Redis, and a damaged disk entry is a miss, never a wrong answer.

The tiny random model (``cachedrag.testing.tiny_runner``) is deterministic by seed, so every
process computes the same namespace and the same keys. Run as
``python -P tests/store/test_engine_persistence.py '<json spec>'`` this module is the child
process: it builds the same engine on the given store and prints its results as JSON.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from cachedrag.config import EngineConfig
from cachedrag.engine import CachedEngine
from cachedrag.fingerprint import namespace_for
from cachedrag.store.config import StoreConfig
from cachedrag.store.tiered import TieredStore

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = "You answer from the documents."
_rng = random.Random(7)
DOCS = [f"Doc {i}: " + " ".join(_rng.choice(["red", "blue", "green", "cyan", "gold", "pink"]) for _ in range(9))
        for i in range(8)]
REQUESTS = [([DOCS[0], DOCS[1], DOCS[2]], "Which colors?"), ([DOCS[3], DOCS[1]], "What is first?"),
            ([DOCS[2], DOCS[0], DOCS[4]], "Any gold?"), ([DOCS[5], DOCS[6], DOCS[7]], "Count them.")]


def engine_config(mode: str = "cachedrag") -> EngineConfig:
    # a cached entry is always worth waiting for here (the tiny model recomputes faster than it loads)
    wanted = {"mode": mode, "break_even_factor": 1e6}
    return EngineConfig(**{k: v for k, v in wanted.items() if k in EngineConfig.model_fields})


def build(runner, store_kwargs: dict, mode: str = "cachedrag") -> tuple[CachedEngine, TieredStore]:
    """The engine as a user builds it: ``CachedEngine(runner, config, store=...)``; its manager
    rebuilds from the store's persistent tiers at construction."""
    cfg = engine_config(mode)
    ns = namespace_for(runner.model, runner.tokenizer, cfg.tenant_salt).digest
    store = TieredStore.from_config(StoreConfig(namespace=ns, **store_kwargs))
    return CachedEngine(runner, config=cfg, store=store), store


def ask(engine: CachedEngine, request, mode: str | None = None):
    chunks, question = request
    return engine.generate(chunks, question, SYSTEM, max_new_tokens=4, mode=mode)


def summary(r) -> dict:
    return {"chunks_hit": r.chunks_hit, "chunks_missed": r.chunks_missed, "prefix_hit_tokens": r.prefix_hit_tokens,
            "prompt_tokens": r.prompt_tokens, "question_tokens": r.question_tokens, "token_ids": r.token_ids,
            "token_logprobs": r.token_logprobs, "notes": r.notes}


def run_child(jobs: dict) -> dict:
    """Run this module as a separate process doing ``jobs`` (name -> spec); its JSON output."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-P", __file__, json.dumps(jobs)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def child(jobs: dict) -> dict:
    """The second process: for each job, a fresh engine on the job's store answers its requests."""
    import torch

    from cachedrag.testing import tiny_runner

    torch.set_num_threads(1)
    runner = tiny_runner()
    out = {}
    for name, spec in jobs.items():
        store_kwargs = dict(spec["store"])
        if store_kwargs.get("disk_dir"):
            store_kwargs["disk_dir"] = Path(store_kwargs["disk_dir"])
        engine, store = build(runner, store_kwargs)
        refresh = engine.manager.last_refresh.as_dict() if engine.manager.last_refresh else None
        results = [summary(ask(engine, REQUESTS[i])) for i in spec["requests"]]
        out[name] = {"refresh": refresh, "results": results,
                     "problems": store.check_invariants() + engine.manager.check()}
        store.close()
    return out


@pytest.fixture(scope="module")
def runner():
    import torch

    from cachedrag.testing import tiny_runner

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread is fastest, and robust on a busy machine
    yield tiny_runner()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def second_process(tmp_path_factory, runner, request):
    """Process A (this one) writes through a disk store and, when a real Redis can run, a
    Redis store; then one separate process B, started after, reuses both (one child process
    serves both tests: starting Python + torch is most of its cost)."""
    disk = {"cpu_bytes": 1 << 20, "disk_dir": str(tmp_path_factory.mktemp("restart")), "disk_bytes": 64 << 20,
            "write_through": True}
    engine, store = build(runner, {**disk, "disk_dir": Path(disk["disk_dir"])})
    written = {"restart": [ask(engine, r) for r in REQUESTS[:3]]}
    checks = {"restart": engine.manager.check()}
    store.close()  # the process ends
    jobs = {"restart": {"store": disk, "requests": [0, 2, 3]}}
    redis_setup = None
    try:
        server = request.getfixturevalue("redis_server")
    except pytest.skip.Exception:
        server = None
    if server is not None:
        prefix = f"cdtest{uuid.uuid4().hex[:10]}"
        shared = {"cpu_bytes": 1 << 20, "redis_url": server.url, "redis_bytes": 64 << 20, "redis_prefix": prefix,
                  "write_through": True}
        late = build(runner, shared)  # a process already running before A writes
        engine, store = build(runner, shared)
        written["redis"] = [ask(engine, r) for r in REQUESTS[:3]]
        store.close()
        jobs["redis"] = {"store": shared, "requests": [0, 2]}
        redis_setup = (server, prefix, late)
    out = run_child(jobs)
    yield out, written, checks, redis_setup
    if redis_setup is not None:
        redis_setup[2][1].close()
        client = server.client()
        keys = list(client.scan_iter(match=f"{prefix}:*"))
        if keys:
            client.delete(*keys)
        client.close()


# ------------------------------------------------------------------------------ restart
def test_restart_reuses_disk_caches_from_the_first_request(second_process):
    out, written, checks, _ = second_process
    first, job = written["restart"], out["restart"]
    assert first[0].chunks_hit == 0 and checks["restart"] == []
    assert job["problems"] == []
    assert job["refresh"]["tree_nodes"] > 0 and job["refresh"]["variants"] > 0
    r0, r2, r3 = job["results"]
    # first request of the new process: the whole path comes from the disk, the answer is the same
    assert r0["chunks_hit"] == 3 and r0["chunks_missed"] == 0 and r0["notes"] == []
    assert r0["prefix_hit_tokens"] == r0["prompt_tokens"] - r0["question_tokens"]
    assert r0["token_ids"] == first[0].token_ids
    assert r0["token_logprobs"] == pytest.approx(first[0].token_logprobs, abs=2e-5)
    assert r2["chunks_hit"] > 0  # its chunks were stored by the first process too
    assert r3["chunks_hit"] == 0  # never seen: computed


# ------------------------------------------------------------------------------ damage
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_disk_entry_is_a_miss_not_a_wrong_answer(tmp_path, runner, damage):
    """Prefix mode: exact-prefix reuse equals full prefill, so the answer must equal the
    ``full`` answer whatever was damaged."""
    full = CachedEngine(runner, config=engine_config("full"))
    reference = ask(full, REQUESTS[0])
    engine, store = build(runner, {"disk_dir": tmp_path, "disk_bytes": 64 << 20}, mode="prefix")
    assert ask(engine, REQUESTS[0]).token_ids == reference.token_ids
    victim = engine.manager.tree.match_prefix([s.key for s in engine.prompts.chat(*REQUESTS[0][:1], "q", SYSTEM)])[1]
    path = store.tier("disk").path(victim.handle)
    store.close()
    blob = bytearray(path.read_bytes())
    if damage == "flip":
        blob[len(blob) // 2] ^= 0x40  # inside K/V: the header still verifies, the layer checksum does not
    else:
        blob = blob[: len(blob) - 100]
    path.write_bytes(bytes(blob))

    engine, store = build(runner, {"disk_dir": tmp_path, "disk_bytes": 64 << 20}, mode="prefix")  # restart
    r = ask(engine, REQUESTS[0])
    assert r.token_ids == reference.token_ids
    assert r.token_logprobs == pytest.approx(reference.token_logprobs, abs=2e-5)
    assert store.tier("disk").stats.corrupt == 1
    assert r.chunks_missed >= 1
    again = ask(engine, REQUESTS[0])  # the entry was stored again: everything hits
    assert again.chunks_hit == 3 and again.token_ids == reference.token_ids
    assert store.check_invariants() == [] and engine.manager.check() == []


# ------------------------------------------------------------------------------ Redis sharing
@pytest.mark.redis
def test_two_processes_share_chunk_caches_through_redis(second_process):
    out, written, _, redis_setup = second_process
    if redis_setup is None:
        pytest.skip("no redis-server could be started")
    job = out["redis"]
    assert job["problems"] == [] and job["refresh"]["tree_nodes"] > 0
    r0, r2 = job["results"]  # process B, started after A wrote
    assert r0["chunks_hit"] == 3 and r0["notes"] == [] and r0["token_ids"] == written["redis"][0].token_ids
    assert r0["token_logprobs"] == pytest.approx(written["redis"][0].token_logprobs, abs=2e-5)
    assert r2["chunks_hit"] > 0

    late, late_store = redis_setup[2]
    assert late.manager.stats()["tree_nodes"] == 0  # saw nothing at start ...
    report = late.manager.refresh()  # ... and picks up what others wrote since
    assert report.tree_nodes > 0 and report.variants > 0
    r = ask(late, REQUESTS[0])
    assert r.chunks_hit == 3 and r.token_ids == written["redis"][0].token_ids
    assert r.token_logprobs == pytest.approx(written["redis"][0].token_logprobs, abs=2e-5)
    assert late_store.check_invariants() == [] and late.manager.check() == []


if __name__ == "__main__":
    print(json.dumps(child(json.loads(sys.argv[1]))))
