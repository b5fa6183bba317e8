"""Tiered chunk-cache store on a CPU-only machine: CPU RAM -> disk (-> Redis when available).

Run:  python examples/tiered_store.py

Builds a store from a ``StoreConfig``, caches a few synthetic chunk KV caches (shaped like
SmolLM2-135M's: 30 layers, 3 KV heads, head dim 64) with priorities and a prefix parent,
shows where each entry landed, reuses one from disk (promotion), prefetches, loads one layer
by layer, restarts the store on the same directory and prints the statistics.
"""

from __future__ import annotations

import hashlib
import json
import tempfile

import torch

from cachedrag.store import KVEntry, StoreConfig, TieredStore, preload_depth
from cachedrag.store.redis_server import RedisUnavailableError, start_redis_server

NAMESPACE = "smollm2-135m-demo"
LAYERS, KV_HEADS, HEAD_DIM, TOKENS = 30, 3, 64, 128


def chunk_key(text: str) -> str:
    return hashlib.sha256(f"{NAMESPACE}:{text}".encode()).hexdigest()


def fake_chunk_kv(seed: int) -> KVEntry:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(LAYERS, KV_HEADS, TOKENS, HEAD_DIM, generator=g, dtype=torch.float32).half()  # [L, H_kv, T, D]
    v = torch.randn(LAYERS, KV_HEADS, TOKENS, HEAD_DIM, generator=g, dtype=torch.float32).half()  # [L, H_kv, T, D]
    inter = torch.rand(TOKENS, generator=g)  # [T]
    return KVEntry({"k": k, "v": v, "token_inter": inter}, {"namespace": NAMESPACE, "chunk": str(seed)})


def main() -> None:
    entry_bytes = fake_chunk_kv(0).nbytes
    print(f"one chunk cache: {entry_bytes / 2**20:.2f} MiB")
    server = None
    try:
        server = start_redis_server()
        print(f"redis tier: {server.url}")
    except RedisUnavailableError as exc:
        print(f"no redis tier ({exc})")
    with tempfile.TemporaryDirectory() as disk_dir:
        config = StoreConfig(
            namespace=NAMESPACE,
            cpu_bytes=3 * entry_bytes,  # room for 3 chunks in RAM
            disk_dir=disk_dir,
            disk_bytes=6 * entry_bytes,  # ~5 on disk (files carry a small header)
            redis_url=server.url if server else None,
            redis_bytes=20 * entry_bytes if server else 0,
        )
        store = TieredStore.from_config(config)
        keys = [chunk_key(f"chunk {i}") for i in range(8)]
        prefix = keys[0]
        for i, key in enumerate(keys):
            # priorities come from the engine (e.g. PGDSF); chunk 0 is a shared prefix of chunk 1
            store.put(key, fake_chunk_kv(i), priority=float(i % 4), parent=prefix if i == 1 else None)
        print("after puts:", {k[:8]: store.where(k) for k in keys})

        slow = keys[5]
        store.set_priority(slow, 10.0)  # the engine's score rose (it is being reused)
        entry = store.get(slow)  # reuse from a slow tier: promoted to RAM, a lower-priority chunk demoted
        print(f"get {slow[:8]}: {entry.n_layers} layers x {entry.n_tokens} tokens, was on disk, now in {store.where(slow)}")

        handle = store.prefetch(keys[:3])  # as soon as a request's chunks are known
        handle.wait(30)
        print("prefetch -> in RAM now? (low-priority chunks stay below):",
              {k[:8]: ok for k, ok in handle.results().items()})

        target = next((k for k in keys if store.where(k) == "disk"), slow)
        depth = preload_depth(LAYERS, t_prefill_per_layer=0.002, t_load_per_layer=0.003)
        with store.open_layers(target, "cpu", depth=depth) as loader:
            for layer in range(LAYERS):
                k_l, v_l = loader.layer(layer)  # [H_kv, T, D] each
            print(f"layer-wise load of {target[:8]} (depth {depth}): {loader.mean_layer_seconds * 1e3:.2f} ms/layer")
        print(f"flush: {store.flush()} RAM-only entries copied to a persistent tier")
        store.close()

        again = TieredStore.from_config(config)  # a restart: the disk tier's index is rebuilt
        print(f"after restart: {len(again.keys())} entries on local disk, "
              f"{sum(again.contains(k) for k in keys)} of {len(keys)} reachable (disk + redis)")
        print(json.dumps(again.stats_dict()["tiers"]["disk"], indent=1)[:400])
        print(json.dumps(store.stats_dict()["store"], indent=1))
        again.close()
    if server is not None:
        server.stop()


if __name__ == "__main__":
    main()
