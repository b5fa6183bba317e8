"""Re-rotate cached keys into a working buffer and run selective-recompute attention.

Runs anywhere: on a CUDA machine the Triton kernels run (and are checked against the torch
references); elsewhere the references run, and the result says so. Then it runs the kernel
benchmark at small sizes (``cachedrag bench kernels`` does the same with full options).

    python scripts/kernels_bench.py
"""

from __future__ import annotations

import argparse

import torch

from cachedrag_bench import kernels as kernel_bench
from cachedrag.kernels import rerotate, rerotate_reference, selective_attention, selective_attention_reference


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    H_q, H_kv, D, T = 9, 3, 64, 300  # SmolLM2-135M head layout, a 300-token context
    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, D, 2, dtype=torch.float32, device=device) / D))  # [D/2]

    # Two cached chunks of 100 tokens, each stored raw (pre-RoPE), reused at positions 50.. and 150..
    buf_k = torch.zeros(H_kv, T, D, dtype=dtype, device=device)  # [H_kv, T, D] working buffer
    for start in (50, 150):
        raw = torch.randn(H_kv, 100, D, dtype=dtype, device=device)  # [H_kv, 100, D] from the cache
        rows = torch.arange(start, start + 100, device=device)  # [100] rows == absolute positions
        res = rerotate(raw, rows, inv_freq, out=buf_k, out_rows=rows)
        print(f"re-rotated chunk into rows {start}..{start + 99} with {res.backend}")

    # Recompute 15% of chunk tokens plus the last 20 (question) tokens, attend over the buffer.
    recompute = torch.cat([torch.arange(50, 250, 7), torch.arange(280, 300)]).to(device)  # [T_q]
    q = torch.randn(H_q, recompute.numel(), D, dtype=dtype, device=device)  # [H_q, T_q, D]
    v = torch.randn(H_kv, T, D, dtype=dtype, device=device)  # [H_kv, T, D]
    bounds = [0, 50, 150, 250, 300]  # system prompt, chunk 1, chunk 2, question
    res = selective_attention(q, buf_k, v, recompute, segment_bounds=bounds)
    print(f"attention {tuple(res.out.shape)} with {res.backend}")
    mean_mass = res.segment_mass / H_q  # [T_q, S] mean attention mass per segment over heads
    print("mean attention mass of the last question token per segment:",
          [round(x, 3) for x in mean_mass[-1].tolist()])
    if res.backend.name == "triton":
        want, _ = selective_attention_reference(q, buf_k, v, recompute, segment_bounds=bounds)
        print("max abs diff vs reference:", (res.out.float() - want.float()).abs().max().item())
        raw = torch.randn(H_kv, 10, D, dtype=dtype, device=device)
        diff = rerotate(raw, torch.arange(10, device=device), inv_freq).k.float() - \
            rerotate_reference(raw, torch.arange(10, device=device), inv_freq).float()
        print("re-rotation max abs diff vs reference:", diff.abs().max().item())

    print()
    parser = argparse.ArgumentParser()
    kernel_bench.add_arguments(parser)
    small = [] if device == "cuda" else ["--context", "512", "--q-heads", "16", "--kv-heads", "4", "--head-dim", "64"]
    kernel_bench.run(parser.parse_args(small))


if __name__ == "__main__":
    main()
