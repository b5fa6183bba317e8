"""``cachedrag bench kernels``: Triton kernels vs their torch references, side by side.

Owns: building one RAG-sized workload (a context of ``--context`` tokens of which ``--recompute``
are recomputed queries, the rest cached rows re-rotated into the working buffer; Llama-3-8B head
layout by default), timing each implementation on it in the same run, and reporting a table and
JSON. Does not own: the kernels (``cachedrag.kernels``) or any model.

Figures (all measured in this run; the machine is shared, so compare ratios, not absolutes):

* re-rotation: time, achieved bandwidth (bytes read + written / time) and its ratio to the
  device's measured copy bandwidth (a large ``Tensor.copy_``);
* selective attention: time and useful TFLOP/s (4 * D flops per visible (head, query, key)
  pair, the same count for every implementation), for the Triton kernel with and without the
  segment-mass by-product, the torch reference, and ``scaled_dot_product_attention`` on the
  dense masked equivalent (boolean mask, ``enable_gqa``);
* max abs error of each Triton output against the reference;
* on the CPU, the runner's prefill kernel (``cachedrag.model.attention.prefill_attention``) on the
  same workload, its speedup over SDPA and its max abs error.

On a machine without CUDA only the torch implementations run (smaller default sizes); the
output says so, and Triton entries are reported as skipped. GPU figures need a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch

from cachedrag.bench import write_json
from cachedrag.errors import ConfigError

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where to run (auto: cuda when available)")
    parser.add_argument("--context", type=int, default=None,
                        help="context tokens in the working KV buffer (default 8192 on cuda, 1024 on cpu)")
    parser.add_argument("--recompute", type=float, default=0.15,
                        help="fraction of context tokens recomputed (queries of the attention)")
    parser.add_argument("--q-heads", type=int, default=32, help="query heads (Llama-3-8B: 32)")
    parser.add_argument("--kv-heads", type=int, default=8, help="key/value heads (Llama-3-8B: 8)")
    parser.add_argument("--head-dim", type=int, default=128, help="head dimension (Llama-3-8B: 128)")
    parser.add_argument("--segments", type=int, default=16,
                        help="chunks the context is split into for the segment-mass by-product")
    parser.add_argument("--dtype", choices=("auto", *_DTYPES), default="auto",
                        help="storage dtype (auto: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (default 20 cuda, 5 cpu)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed warmup runs (default 5 cuda, 2 cpu)")
    parser.add_argument("--copy-mib", type=int, default=None,
                        help="size of the copy-bandwidth probe in MiB (default 1024 cuda, 64 cpu)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="OUT", default=None, help="also write the results as JSON to OUT")


def run(args: argparse.Namespace) -> int:
    results = measure(args)
    print(format_table(results))
    if args.json:
        write_json(results, args.json)
    return 0


# ----------------------------------------------------------------------------------------------
# measurement


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run every implementation on one workload; returns the JSON-ready results."""
    from cachedrag.kernels import rerotate, selective_attention, triton_available

    device = _pick_device(args.device)
    on_cuda = device.type == "cuda"
    context = args.context or (8192 if on_cuda else 1024)
    dtype = _DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if on_cuda else torch.float32)
    repeats = args.repeats or (20 if on_cuda else 5)
    warmup = args.warmup if args.warmup is not None else (5 if on_cuda else 2)
    copy_mib = args.copy_mib or (1024 if on_cuda else 64)
    _check_sizes(args, context)
    run_triton = on_cuda and triton_available()
    skip_reason = "needs CUDA and triton" + ("" if on_cuda else f" (this run: {device.type})")
    if on_cuda:
        note = "cuda: Triton kernels vs torch references" if run_triton else \
            "cuda but triton does not import: torch references only"
    else:
        note = ("cpu: no CUDA, so only the torch references (and SDPA) run; Triton figures, "
                "bandwidth ratios and TFLOP/s of the kernels need a GPU")
    timer = _Timer(device, warmup, repeats)
    work = _workload(args, context, dtype, device)

    # --- copy bandwidth probe ---
    n_copy = copy_mib * 2**20 // 4
    src = torch.empty(n_copy, dtype=torch.float32, device=device).uniform_()  # [N]
    dst = torch.empty_like(src)
    copy_s = timer(lambda: dst.copy_(src))
    copy_gbs = 2 * src.numel() * 4 / copy_s / 1e9
    del src, dst

    # --- re-rotation ---
    H_kv, D = args.kv_heads, args.head_dim
    n_rows = work["rows"].numel()
    es = torch.tensor([], dtype=dtype).element_size()
    rr_bytes = 2 * H_kv * n_rows * D * es + 2 * n_rows * 8 + (D // 2) * 4  # k in + rows out, pos + rows, inv_freq
    buf = torch.zeros(H_kv, context, D, dtype=dtype, device=device)  # [H_kv, T, D]

    def rr(backend: str) -> Callable[[], Any]:
        return lambda: rerotate(work["k_raw"], work["rows"], work["inv_freq"], out=buf, out_rows=work["rows"],
                                backend=backend, validate=False)

    rr_results: dict[str, Any] = {}
    rr_ref = rr("torch")().k.clone()
    for name in ("torch", "triton") if run_triton else ("torch",):
        seconds = timer(rr(name))
        gbs = rr_bytes / seconds / 1e9
        rr_results[name] = {"ms": seconds * 1e3, "gb_per_s": gbs, "fraction_of_copy": gbs / copy_gbs}
    rerotate_out: dict[str, Any] = {
        "rows": n_rows, "buffer_rows": context, "kv_heads": H_kv, "head_dim": D,
        "bytes_moved": rr_bytes, "copy_gb_per_s": copy_gbs, "results": rr_results,
    }
    if run_triton:
        got = rr("triton")()
        rerotate_out["triton_backend"] = str(got.backend)
        rerotate_out["max_abs_err"] = (got.k.float() - rr_ref.float()).abs().max().item()
        rerotate_out["triton_speedup_vs_torch"] = rr_results["torch"]["ms"] / rr_results["triton"]["ms"]
    else:
        rerotate_out["skipped"] = {"triton": skip_reason}
    del buf

    # --- selective attention ---
    q, k, v, pos, bounds = work["q"], work["k"], work["v"], work["q_positions"], work["bounds"]
    flop = 4 * D * args.q_heads * int((pos + 1).clamp(max=context).sum())
    at_results: dict[str, Any] = {}

    def add(name: str, fn: Callable[[], Any]) -> None:
        seconds = timer(fn)
        at_results[name] = {"ms": seconds * 1e3, "tflop_per_s": flop / seconds / 1e12}

    ref_out, ref_mass = selective_attention(q, k, v, pos, segment_bounds=bounds, backend="torch")[:2]
    add("torch", lambda: selective_attention(q, k, v, pos, segment_bounds=bounds, backend="torch", validate=False))
    mask = torch.arange(context, device=device)[None, :] <= pos[:, None]  # [T_q, T_k] dense causal
    add("torch_sdpa_dense", _sdpa_dense(q, k, v, mask))
    attention_out: dict[str, Any] = {
        "queries": q.shape[1], "keys": context, "q_heads": args.q_heads, "kv_heads": H_kv, "head_dim": D,
        "segments": len(bounds) - 1, "useful_flop": flop, "results": at_results,
    }
    if run_triton:
        add("triton", lambda: selective_attention(q, k, v, pos, backend="triton", validate=False))
        add("triton_with_mass", lambda: selective_attention(q, k, v, pos, segment_bounds=bounds,
                                                            backend="triton", validate=False))
        got = selective_attention(q, k, v, pos, segment_bounds=bounds, backend="triton")
        attention_out["triton_backend"] = str(got.backend)
        attention_out["max_abs_err_out"] = (got.out.float() - ref_out.float()).abs().max().item()
        attention_out["max_abs_err_mass"] = (got.segment_mass - ref_mass).abs().max().item()
        attention_out["triton_speedup_vs_torch"] = at_results["torch"]["ms"] / at_results["triton"]["ms"]
        attention_out["triton_speedup_vs_sdpa"] = at_results["torch_sdpa_dense"]["ms"] / at_results["triton"]["ms"]
    else:
        attention_out["skipped"] = {"triton": skip_reason}
    if device.type == "cpu":  # the runner's CPU prefill kernel (model/attention.py) on the same workload
        from cachedrag.model import attention as native

        module = native.prefill_module()
        why = None if module is not None else f"native library: {native.kernel_status()} (AVX-512 only)"
        if why is None and (D not in (64, 128) or args.q_heads // H_kv > 8 or dtype not in (torch.float32, torch.bfloat16)):
            why = "head dim 64/128, at most 8 query heads per KV head, float32/bfloat16 only"
        if why is None:
            add("cpu_prefill_kernel", lambda: native.prefill_attention(q, k, v, pos, context, D ** -0.5))
            got = native.prefill_attention(q, k, v, pos, context, D ** -0.5)  # [T_q, H_q*D]
            expected = ref_out.transpose(0, 1).reshape(q.shape[1], -1)  # [T_q, H_q*D]
            attention_out["max_abs_err_cpu_prefill_kernel"] = (got.float() - expected.float()).abs().max().item()
            attention_out["cpu_prefill_kernel_speedup_vs_sdpa"] = (
                at_results["torch_sdpa_dense"]["ms"] / at_results["cpu_prefill_kernel"]["ms"])
        else:
            attention_out.setdefault("skipped", {})["cpu_prefill_kernel"] = why

    return {
        "device": torch.cuda.get_device_name(device) if on_cuda else "cpu",
        "backend": "triton" if run_triton else "torch",
        "note": note,
        "config": {"context": context, "recompute": args.recompute, "dtype": str(dtype).removeprefix("torch."),
                   "repeats": repeats, "warmup": warmup, "torch": torch.__version__},
        "rerotate": rerotate_out,
        "selective_attention": attention_out,
    }


def _pick_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but torch.cuda.is_available() is false")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


def _check_sizes(args: argparse.Namespace, context: int) -> None:
    if context < 2:
        raise ConfigError(f"--context must be >= 2, got {context}")
    if not 0.0 < args.recompute < 1.0:
        raise ConfigError(f"--recompute must be in (0, 1), got {args.recompute}")
    if args.kv_heads < 1 or args.q_heads % args.kv_heads:
        raise ConfigError(f"--q-heads ({args.q_heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if args.head_dim % 2:
        raise ConfigError(f"--head-dim must be even, got {args.head_dim}")
    if not 1 <= args.segments <= context:
        raise ConfigError(f"--segments must be in [1, context], got {args.segments}")


def _workload(args: argparse.Namespace, context: int, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(args.seed)
    H_q, H_kv, D = args.q_heads, args.kv_heads, args.head_dim
    n_q = max(1, round(context * args.recompute))
    # recomputed positions: random, sorted, gapped; the last position (question) always among them
    picked = torch.randperm(context - 1, generator=gen)[: n_q - 1]
    q_positions = torch.cat([picked.sort().values, torch.tensor([context - 1])])  # [T_q]
    cached = torch.ones(context, dtype=torch.bool)
    cached[q_positions] = False
    rows = cached.nonzero().squeeze(1)  # [T_cached] rows re-rotated into the buffer
    bounds = torch.linspace(0, context, args.segments + 1).round().long().tolist()
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))  # [D/2] Llama-3 base

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    return {
        "q": randn(H_q, n_q, D),  # [H_q, T_q, D]
        "k": randn(H_kv, context, D),  # [H_kv, T, D]
        "v": randn(H_kv, context, D),  # [H_kv, T, D]
        "k_raw": randn(H_kv, rows.numel(), D),  # [H_kv, T_cached, D]
        "q_positions": q_positions.to(device),
        "rows": rows.to(device),
        "bounds": bounds,
        "inv_freq": inv_freq.to(device),
    }


def _sdpa_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> Callable[[], Any]:
    import torch.nn.functional as F

    q4, k4, v4 = q[None], k[None], v[None]  # [1, H, T, D]
    return lambda: F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, enable_gqa=True)


class _Timer:
    """Median wall time of a callable (CUDA events on GPU)."""

    def __init__(self, device: torch.device, warmup: int, repeats: int) -> None:
        self.cuda = device.type == "cuda"
        self.warmup, self.repeats = warmup, max(1, repeats)

    def __call__(self, fn: Callable[[], Any]) -> float:
        for _ in range(self.warmup):
            fn()
        samples = []
        for _ in range(self.repeats):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
        return statistics.median(samples)


# ----------------------------------------------------------------------------------------------
# report


def format_table(res: dict[str, Any]) -> str:
    cfg, rr, at = res["config"], res["rerotate"], res["selective_attention"]
    lines = [
        f"cachedrag bench kernels  device={res['device']}  backend={res['backend']}  dtype={cfg['dtype']}",
        f"  {res['note']}",
        "",
        f"re-rotation: {rr['rows']} cached rows -> buffer of {rr['buffer_rows']} rows, "
        f"{rr['kv_heads']} kv heads x D={rr['head_dim']}, {rr['bytes_moved'] / 1e6:.2f} MB moved; "
        f"copy bandwidth {rr['copy_gb_per_s']:.1f} GB/s",
        f"  {'impl':<20}{'ms':>10}{'GB/s':>10}{'of copy':>10}",
    ]
    for name, r in rr["results"].items():
        lines.append(f"  {name:<20}{r['ms']:>10.3f}{r['gb_per_s']:>10.1f}{r['fraction_of_copy']:>10.1%}")
    for name, why in rr.get("skipped", {}).items():
        lines.append(f"  {name:<20}{'skipped: ' + why:>30}")
    if "max_abs_err" in rr:
        lines.append(f"  triton vs torch: {rr['triton_speedup_vs_torch']:.2f}x, max abs err {rr['max_abs_err']:.2e}")
    lines += [
        "",
        f"selective attention: {at['queries']} queries over {at['keys']} keys, "
        f"{at['q_heads']}/{at['kv_heads']} heads x D={at['head_dim']}, {at['segments']} segments, "
        f"{at['useful_flop'] / 1e9:.2f} useful GFLOP",
        f"  {'impl':<20}{'ms':>10}{'TFLOP/s':>10}",
    ]
    for name, r in at["results"].items():
        lines.append(f"  {name:<20}{r['ms']:>10.3f}{r['tflop_per_s']:>10.3f}")
    for name, why in at.get("skipped", {}).items():
        lines.append(f"  {name:<20}{'skipped: ' + why:>30}")
    if "max_abs_err_cpu_prefill_kernel" in at:
        lines.append(f"  cpu prefill kernel vs sdpa {at['cpu_prefill_kernel_speedup_vs_sdpa']:.2f}x; "
                     f"max abs err {at['max_abs_err_cpu_prefill_kernel']:.2e}")
    if "max_abs_err_out" in at:
        lines.append(f"  triton vs torch {at['triton_speedup_vs_torch']:.2f}x, "
                     f"vs sdpa {at['triton_speedup_vs_sdpa']:.2f}x; max abs err out {at['max_abs_err_out']:.2e}, "
                     f"mass {at['max_abs_err_mass']:.2e}")
    return "\n".join(lines)
