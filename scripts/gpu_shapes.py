"""End to end at a real model shape with random weights: TTFT per reuse mode, decode, chunk loads.

On a CUDA machine this is the Llama-3.1-8B shape in bf16 (the figures of docs/gpu.md; ~2 minutes,
16 GB of GPU memory for the weights); elsewhere the tiny shape runs on the CPU in seconds, which
checks the code paths but says nothing about speed.

    python scripts/gpu_shapes.py
"""

from __future__ import annotations

import argparse

import torch

from cachedrag_bench import shapes


def main() -> None:
    parser = argparse.ArgumentParser()
    shapes.add_arguments(parser)
    if torch.cuda.is_available():
        argv = ["--shape", "llama-3.1-8b", "--chunks", "5,20", "--requests", "3"]
    else:
        argv = ["--shape", "tiny", "--chunks", "2,4", "--chunk-tokens", "64", "--requests", "2", "--decode-tokens", "8"]
    raise SystemExit(shapes.run(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
