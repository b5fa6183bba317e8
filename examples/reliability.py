"""What the chunk-cache store does with damaged, crafted and odd things (tiny model, seconds).

Run:  python examples/reliability.py

1. An engine over a disk store answers a request; its cached entries are then (a) bit-flipped
   on disk and (b) replaced by crafted entries with valid checksums but one KV head too few.
   Both are misses with a note; the answer equals a full recompute.
2. A FIFO and a dangling symlink named like entries are planted: the store starts without
   hanging and leaves them alone.
3. A second store on the same directory is refused with ``DirectoryInUseError``.
See docs/reliability.md for the guarantees; ``python tests/faults/campaign.py`` runs a full campaign.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path

import torch

from cachedrag.config import EngineConfig
from cachedrag.engine import CachedEngine
from cachedrag.errors import DirectoryInUseError
from cachedrag.fingerprint import namespace_for
from cachedrag.store import KVEntry, StoreConfig, TieredStore
from cachedrag.testing import tiny_runner

SYSTEM = "You answer from the documents."
CHUNKS = ["Doc A: red blue green gold.", "Doc B: cyan pink gray teal."]
QUESTION = "Which colors?"


def main() -> None:
    torch.manual_seed(0)
    runner = tiny_runner()
    ns = namespace_for(runner.model, runner.tokenizer, None).digest
    reference = CachedEngine(runner, config=EngineConfig(mode="full")).generate(
        CHUNKS, QUESTION, SYSTEM, max_new_tokens=4).token_ids
    with tempfile.TemporaryDirectory() as tmp:
        config = StoreConfig(namespace=ns, disk_dir=Path(tmp), disk_bytes=64 << 20)

        def engine_on(store):
            return CachedEngine(runner, config=EngineConfig(mode="prefix", break_even_factor=1e6), store=store)

        store = TieredStore.from_config(config)
        engine = engine_on(store)
        first = engine.generate(CHUNKS, QUESTION, SYSTEM, max_new_tokens=4)
        print(f"first answer equals full recompute: {first.token_ids == reference}")

        # (a) a flipped bit in every file on disk
        disk = store.tier("disk")
        for key in disk.keys():
            blob = bytearray(disk.path(key).read_bytes())
            blob[-10] ^= 0x01
            disk.path(key).write_bytes(bytes(blob))
        r = engine.generate(CHUNKS, QUESTION, SYSTEM, max_new_tokens=4)
        print(f"after bit flips: same answer {r.token_ids == reference}, corrupt files found "
              f"{disk.stats.corrupt}, notes: {r.notes[:1]}")

        # (b) crafted entries: valid checksums, one KV head too few
        for key in store.keys():
            entry = store.get(key, promote=False)
            crafted = {**entry.tensors, "k": entry.k[:, :-1].clone(), "v": entry.v[:, :-1].clone()}
            store.put(key, KVEntry(crafted, dict(entry.meta)), replace=True)
        r = engine.generate(CHUNKS, QUESTION, SYSTEM, max_new_tokens=4)
        print(f"after crafted shapes: same answer {r.token_ids == reference}, notes: {r.notes[:1]}")
        store.close()

        # 2. odd things named like entries
        shard = Path(tmp) / ("ab" * 32)[:2]
        shard.mkdir(exist_ok=True)
        os.mkfifo(shard / f"{'ab' * 32}.safetensors")
        os.symlink("/nonexistent", shard / f"{'ac' * 32}.safetensors")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            store = TieredStore.from_config(config)  # starts; the FIFO is never opened
        r = engine_on(store).generate(CHUNKS, QUESTION, SYSTEM, max_new_tokens=4)
        print(f"with a FIFO and a dangling symlink planted: same answer {r.token_ids == reference}, "
              f"they are still there: {sorted(p.name[:8] for p in shard.iterdir())}")

        # 3. one owner per directory
        try:
            TieredStore.from_config(config)
        except DirectoryInUseError as exc:
            print(f"second store refused: {str(exc)[:80]}...")
        store.close()


if __name__ == "__main__":
    main()
