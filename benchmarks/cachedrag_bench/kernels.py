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

Timing. On CUDA each implementation gets two figures: ``ms``, the time per call on the device,
from a CUDA graph of K back-to-back calls (replayed; per call = replay time / K, median of
``--repeats`` replays), and ``call_ms``, one eager call between two events with a synchronize on
either side (Python, argument checks and launch overhead included). A call that cannot be
captured (a host sync inside it) is timed as K back-to-back eager calls between two events
instead, and its ``timing`` says so (``"back-to-back"``, with the reason in ``timing_note``).
Bandwidth and TFLOP/s use ``ms``. The re-rotation calls cycle over several input/output buffer
sets, enough to exceed 4x the L2 cache, so a replay does not re-read what the previous call left
in L2: its bandwidth is DRAM-cold like the copy probe's (a graph of large copies). On the CPU,
``ms`` is the median wall time of one call (``timing`` ``"wall"``; ``call_ms`` the same).

On a machine without CUDA only the torch implementations run (smaller default sizes); the
output says so, and Triton entries are reported as skipped. GPU figures need a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from cachedrag_bench import write_json
from cachedrag.errors import ConfigError
from cachedrag.model.runner import resolve_device

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

    device = resolve_device(args.device)
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
    copy_t = timer(lambda: dst.copy_(src))
    copy_gbs = 2 * src.numel() * 4 / copy_t.seconds / 1e9
    del src, dst
    if on_cuda:
        torch.cuda.empty_cache()

    # --- re-rotation ---
    H_kv, D = args.kv_heads, args.head_dim
    n_rows = work["rows"].numel()
    es = torch.tensor([], dtype=dtype).element_size()
    rr_bytes = 2 * H_kv * n_rows * D * es + 2 * n_rows * 8 + (D // 2) * 4  # k in + rows out, pos + rows, inv_freq
    # input/output sets the timed calls cycle over (CUDA: > 4x L2, so no call finds its data in L2)
    n_sets = _rotating_sets(device, H_kv * (n_rows + context) * D * es)
    sets = [(work["k_raw"] if i == 0 else work["k_raw"].clone(),
             torch.zeros(H_kv, context, D, dtype=dtype, device=device))  # [H_kv, T_cached, D], [H_kv, T, D]
            for i in range(n_sets)]

    def rr_once(backend: str, i: int = 0) -> Any:
        k_raw, buf = sets[i]
        return rerotate(k_raw, work["rows"], work["inv_freq"], out=buf, out_rows=work["rows"],
                        backend=backend, validate=False)

    def rr(backend: str) -> Callable[[], Any]:
        turn = itertools.cycle(range(n_sets))
        return lambda: rr_once(backend, next(turn))

    rr_results: dict[str, Any] = {}
    rr_ref = rr_once("torch").k.clone()
    for name in ("torch", "triton") if run_triton else ("torch",):
        t = timer(rr(name), multiple_of=n_sets)
        gbs = rr_bytes / t.seconds / 1e9
        rr_results[name] = {"ms": t.seconds * 1e3, "gb_per_s": gbs, "fraction_of_copy": gbs / copy_gbs, **t.fields()}
    rerotate_out: dict[str, Any] = {
        "rows": n_rows, "buffer_rows": context, "kv_heads": H_kv, "head_dim": D,
        "bytes_moved": rr_bytes, "copy_gb_per_s": copy_gbs, "copy_timing": copy_t.method,
        "buffer_sets": n_sets, "results": rr_results,
    }
    if run_triton:
        got = rr_once("triton")
        rerotate_out["triton_backend"] = str(got.backend)
        rerotate_out["max_abs_err"] = (got.k.float() - rr_ref.float()).abs().max().item()
        rerotate_out["triton_speedup_vs_torch"] = rr_results["torch"]["ms"] / rr_results["triton"]["ms"]
    else:
        rerotate_out["skipped"] = {"triton": skip_reason}
    del sets
    if on_cuda:
        torch.cuda.empty_cache()

    # --- selective attention ---
    q, k, v, pos, bounds = work["q"], work["k"], work["v"], work["q_positions"], work["bounds"]
    flop = 4 * D * args.q_heads * int((pos + 1).clamp(max=context).sum())
    at_results: dict[str, Any] = {}

    def add(name: str, fn: Callable[[], Any]) -> None:
        t = timer(fn)
        at_results[name] = {"ms": t.seconds * 1e3, "tflop_per_s": flop / t.seconds / 1e12, **t.fields()}

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
                   "repeats": repeats, "warmup": warmup, "torch": torch.__version__,
                   "timing": _TIMING_NOTE if on_cuda else "wall time, median of single calls"},
        "rerotate": rerotate_out,
        "selective_attention": attention_out,
    }


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


_TIMING_NOTE = ("ms: per call from a CUDA graph of K calls, replayed (device time); call_ms: one eager call "
                "with Python and launch overhead; back-to-back: K eager calls between two events (not capturable)")


def _rotating_sets(device: torch.device, set_bytes: int) -> int:
    """How many copies of a workload's buffers the timed calls cycle over: on CUDA enough to exceed
    4x the L2 cache (at most 16 and 2 GiB), else 1."""
    if device.type != "cuda" or set_bytes <= 0:
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 50 * 2**20
    return max(1, min(16, math.ceil(4 * l2 / set_bytes), 2**31 // set_bytes))


@dataclass(frozen=True)
class _Timing:
    """One implementation's time: ``seconds`` per call (device time on CUDA), ``call_seconds`` of
    one eager call, the ``method`` used for ``seconds``, ``calls`` (K) per sample, and why a
    capture fell back (``note``)."""

    seconds: float
    call_seconds: float
    method: str  # "cuda-graph" | "back-to-back" | "wall"
    calls: int = 1
    note: str | None = None

    def fields(self) -> dict[str, Any]:
        out = {"call_ms": self.call_seconds * 1e3, "timing": self.method, "calls_per_sample": self.calls}
        if self.note:
            out["timing_note"] = self.note
        return out


class _Timer:
    """Times a callable. CPU: median wall time of single calls. CUDA: median per-call time from a
    CUDA graph of K calls (K back-to-back eager calls between two events if capture fails), plus
    the median time of one eager call."""

    TARGET_S = 5e-3  # eager time one sample of K calls aims at
    MAX_CALLS = 200

    def __init__(self, device: torch.device, warmup: int, repeats: int) -> None:
        self.cuda = device.type == "cuda"
        self.warmup, self.repeats = warmup, max(1, repeats)

    def __call__(self, fn: Callable[[], Any], multiple_of: int = 1) -> _Timing:
        for _ in range(self.warmup):
            fn()
        if not self.cuda:
            samples = []
            for _ in range(self.repeats):
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
            wall = statistics.median(samples)
            return _Timing(wall, wall, "wall")
        call = statistics.median(self._eager_call(fn) for _ in range(self.repeats))
        calls = max(3, min(self.MAX_CALLS, math.ceil(self.TARGET_S / max(call, 1e-6))))
        calls = multiple_of * math.ceil(calls / multiple_of)
        try:
            graph = self._capture(fn, calls)
        except Exception as exc:  # not capturable (e.g. a host sync inside): K eager calls instead
            _recover()
            note = f"capture failed ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
            per_call = statistics.median(self._back_to_back(fn, calls) for _ in range(self.repeats))
            return _Timing(per_call, call, "back-to-back", calls, note)
        graph.replay()  # first replay outside the samples (uploads the graph)
        torch.cuda.synchronize()
        per_call = statistics.median(self._replay(graph) / calls for _ in range(self.repeats))
        del graph
        return _Timing(per_call, call, "cuda-graph", calls)

    @staticmethod
    def _eager_call(fn: Callable[[], Any]) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3

    @staticmethod
    def _back_to_back(fn: Callable[[], Any], calls: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / calls

    @staticmethod
    def _capture(fn: Callable[[], Any], calls: int) -> Any:
        """``calls`` calls of ``fn`` captured into one CUDA graph (warm-up on the side stream first,
        as torch's CUDA graph docs do). The previous stream is restored whatever happens."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            graph.capture_begin()
            try:
                for _ in range(calls):
                    fn()
            except BaseException:
                try:
                    graph.capture_end()
                except Exception:
                    pass
                raise
            graph.capture_end()
        torch.cuda.current_stream().wait_stream(side)
        return graph

    @staticmethod
    def _replay(graph: Any) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3


def _recover() -> None:
    """After a failed capture: wait for the device and drop what the capture left cached."""
    try:
        torch.cuda.synchronize()
    except Exception:
        pass
    torch.cuda.empty_cache()


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
        f"copy bandwidth {rr['copy_gb_per_s']:.1f} GB/s" + _sets_note(rr),
        f"  {'impl':<20}{'ms':>10}{'call ms':>10}{'GB/s':>10}{'of copy':>10}  timing",
    ]
    for name, r in rr["results"].items():
        lines.append(f"  {name:<20}{r['ms']:>10.4f}{_call_ms(r):>10}{r['gb_per_s']:>10.1f}"
                     f"{r['fraction_of_copy']:>10.1%}  {_timing(r)}")
    for name, why in rr.get("skipped", {}).items():
        lines.append(f"  {name:<20}{'skipped: ' + why:>30}")
    if "max_abs_err" in rr:
        lines.append(f"  triton vs torch: {rr['triton_speedup_vs_torch']:.2f}x, max abs err {rr['max_abs_err']:.2e}")
    lines += [
        "",
        f"selective attention: {at['queries']} queries over {at['keys']} keys, "
        f"{at['q_heads']}/{at['kv_heads']} heads x D={at['head_dim']}, {at['segments']} segments, "
        f"{at['useful_flop'] / 1e9:.2f} useful GFLOP",
        f"  {'impl':<20}{'ms':>10}{'call ms':>10}{'TFLOP/s':>10}  timing",
    ]
    for name, r in at["results"].items():
        lines.append(f"  {name:<20}{r['ms']:>10.4f}{_call_ms(r):>10}{r['tflop_per_s']:>10.3f}  {_timing(r)}")
    for name, why in at.get("skipped", {}).items():
        lines.append(f"  {name:<20}{'skipped: ' + why:>30}")
    if "max_abs_err_cpu_prefill_kernel" in at:
        lines.append(f"  cpu prefill kernel vs sdpa {at['cpu_prefill_kernel_speedup_vs_sdpa']:.2f}x; "
                     f"max abs err {at['max_abs_err_cpu_prefill_kernel']:.2e}")
    if "max_abs_err_out" in at:
        lines.append(f"  triton vs torch {at['triton_speedup_vs_torch']:.2f}x, "
                     f"vs sdpa {at['triton_speedup_vs_sdpa']:.2f}x; max abs err out {at['max_abs_err_out']:.2e}, "
                     f"mass {at['max_abs_err_mass']:.2e}")
    if "timing" in cfg:
        lines += ["", f"timing: {cfg['timing']}"]
    return "\n".join(lines)


def _call_ms(r: dict[str, Any]) -> str:
    return f"{r['call_ms']:.4f}" if "call_ms" in r else "-"


def _timing(r: dict[str, Any]) -> str:
    method = r.get("timing", "")
    if "calls_per_sample" in r and method != "wall":
        method += f" (K={r['calls_per_sample']})"
    return method


def _sets_note(rr: dict[str, Any]) -> str:
    n = rr.get("buffer_sets", 1)
    return f"; calls cycle over {n} buffer sets (> 4x L2)" if n > 1 else ""
