"""Chunk caches that survive a restart (disk) and are shared by processes (Redis).

Run it twice; the second run is a new process and is served from the disk at once:

    .venv/bin/python examples/persistent_cache.py          # 1st: computes, stores chunk KV on disk
    .venv/bin/python examples/persistent_cache.py          # 2nd: "chunks from cache" on its first request

Options: ``--dir PATH`` (default ``$CACHEDRAG_HOME/examples/persistent-cache``), ``--redis URL``
(also share through a Redis server: run it on two machines or two shells), ``--tiny`` (a random
tiny model: seconds instead of the embedded SmolLM2), ``--clear`` (start empty).

The store keeps hot entries in RAM and writes every entry through to the persistent tiers
(``write_through=True``): without it a CPU tier in front of the disk would keep new entries in
RAM only, and a restart would find nothing. At construction the engine's cache manager
rebuilds its knowledge tree and chunk variants from the entries' headers (no K/V read).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from cachedrag.config import EngineConfig
from cachedrag.corpus import stdlib_corpus
from cachedrag.engine import CachedEngine
from cachedrag.fingerprint import namespace_for
from cachedrag.kvcache.manager import ChunkCacheManager
from cachedrag.paths import cache_home
from cachedrag.store import StoreConfig, TieredStore

SYSTEM = "Answer the question using the Python documentation excerpts. Be brief."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=str(cache_home() / "examples" / "persistent-cache"))
    parser.add_argument("--redis", default=None, help="redis://host:port/0 shared by every process")
    parser.add_argument("--tiny", action="store_true", help="random tiny model (fast, meaningless text)")
    parser.add_argument("--clear", action="store_true", help="delete the cache directory first")
    args = parser.parse_args()
    if args.clear:
        shutil.rmtree(args.dir, ignore_errors=True)

    if args.tiny:
        from cachedrag.testing import tiny_runner

        runner = tiny_runner()
    else:
        from cachedrag.model.loader import load_model
        from cachedrag.model.runner import ModelRunner

        runner = ModelRunner(*load_model())
    config = EngineConfig()
    namespace = namespace_for(runner.model, runner.tokenizer, config.tenant_salt).digest
    shared = {"redis_url": args.redis, "redis_bytes": 1 << 30} if args.redis else {}
    store = TieredStore.from_config(StoreConfig(namespace=namespace, cpu_bytes=512 << 20, disk_dir=Path(args.dir),
                                                disk_bytes=4 << 30, write_through=True, **shared))
    # capacity_bytes=None: the tiers' budgets govern what is kept (see docs/store.md)
    manager = ChunkCacheManager(store, config.cache, capacity_bytes=None)
    engine = CachedEngine(runner, config=config, manager=manager)
    found = manager.last_refresh
    print(f"store {args.dir}: {found.tree_nodes} tree entries and {found.variants} chunk variants found "
          f"at start ({found.seconds * 1000:.0f} ms, headers only)")

    tok = runner.tokenizer
    docs = [d.text for d in stdlib_corpus(("heapq", "bisect", "functools"))]
    n = 80 if args.tiny else 200  # the tiny model's byte tokens and 512-token context
    chunks = [tok.decode(tok.encode(text, add_special_tokens=False)[:n]) for text in docs]
    for question, order in [("What does heapq.heappush do?", chunks), ("How do I keep a list sorted?", chunks[::-1])]:
        r = engine.generate(order, question, SYSTEM, max_new_tokens=24)
        print(f"{question!r}: TTFT {r.ttft_s * 1000:.0f} ms, {r.chunks_hit}/{len(order)} chunks from cache"
              f"{' (' + '; '.join(r.notes) + ')' if r.notes else ''}")
        print(f"  {r.text.strip()[:100]!r}")
    tiers = store.stats_dict()["tiers"]
    print("tiers: " + ", ".join(f"{name} {t['entries']} entries / {t['used_bytes'] / 2**20:.1f} MiB"
                                for name, t in tiers.items()))
    store.close()


if __name__ == "__main__":
    main()
