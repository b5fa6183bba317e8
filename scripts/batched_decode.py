"""The fused decode step for a batch: projections from packed tiles against row-major dot products.

The server decodes its running requests as one batched step (``FusedDecode.step_batch``). By
default the step reads float32 / bf16 projections from a copy packed in tiles of 32 rows
(``FusedDecode(packed=True)``, docs/speed.md "Decode, round 12"); ``packed=False`` is the
row-major layout the runner holds. This times one step of B requests (1, 2, 4, 8; ~1,300-token
contexts) with both, interleaved, and checks that each row of a batch equals its request's single
step bit for bit.

    python scripts/batched_decode.py                 # bf16, the server's numerics
    python scripts/batched_decode.py --dtype float32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cachedrag.model.fused_decode import FusedDecode
from cachedrag.model.runner import KVBuffer, ModelRunner


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--context", type=int, default=1300)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()

    runner = ModelRunner.from_pretrained(dtype=args.dtype)
    steps = {"packed": FusedDecode(runner, packed=True), "row-major": FusedDecode(runner, packed=False)}
    print(f"packed copies: {steps['packed'].packed_projections} projections, "
          f"{steps['packed'].packed_bytes / 1e6:.0f} MB")
    kvs = []
    for b in range(8):
        kv = runner.new_kv(args.context + 64)
        runner.prefill(torch.randint(10, 40000, (args.context,), generator=torch.Generator().manual_seed(b)), kv=kv)
        kvs.append(kv)

    times: dict = {}
    for rep in range(args.repeats):
        for batch in (1, 2, 4, 8):
            for name in (list(steps) if rep % 2 == 0 else list(steps)[::-1]):
                tokens = [100 + b for b in range(batch)]
                start = time.perf_counter()
                for s in range(6):
                    logits = steps[name].step_batch(tokens, [args.context + s] * batch, kvs[:batch])  # [B, V]
                    tokens = logits.argmax(-1).tolist()
                times.setdefault((batch, name), []).append((time.perf_counter() - start) / 6 * 1e3)
    for batch in (1, 2, 4, 8):
        packed, row_major = (statistics.median(times[(batch, n)]) for n in ("packed", "row-major"))
        print(f"B={batch}: packed {packed:5.1f} ms a step, row-major {row_major:5.1f} ms ({row_major / packed:.2f}x)")

    # each row of a batch is its request's single step, bit for bit (on copies of the buffers)
    batch_kvs = [KVBuffer(kv.k.clone(), kv.v.clone(), kv.length) for kv in kvs]
    alone_kvs = [KVBuffer(kv.k.clone(), kv.v.clone(), kv.length) for kv in kvs]
    position = args.context + 10
    together = steps["packed"].step_batch(list(range(200, 208)), [position] * 8, batch_kvs)  # [8, V]
    same = all(torch.equal(together[b], steps["packed"].step(200 + b, position, alone_kvs[b])) for b in range(8))
    print(f"each row of a batch of 8 equals its single step: {same}")


if __name__ == "__main__":
    main()
