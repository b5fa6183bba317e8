"""The split-K decode attention kernel (model/attention.py) against its torch reference, the native
library's build and cache (model/native.py), and the runner's choice between the kernel and SDPA."""

import shutil

import pytest
import torch

from cachedrag.errors import ConfigError
from cachedrag.model import attention, native
from cachedrag.model.runner import ModelRunner
from cachedrag.model.weights import cpu_flags
from cachedrag.testing import byte_tokenizer, prefilled, tiny_model, tiny_runner

needs_kernel = pytest.mark.skipif(attention.kernel() is None, reason=f"decode attention kernel {attention.kernel_status()}")


@needs_kernel
@pytest.mark.parametrize("heads,dim", [((9, 3), 64), ((4, 2), 16), ((8, 8), 128), ((6, 1), 48), ((12, 3), 64)])
@pytest.mark.parametrize("kv_dtype,q_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("span", [(0, 1), (0, 7), (3, 130), (0, 700), (250, 1201)])
@pytest.mark.parametrize("splits", [0, 1, 5])
def test_kernel_equals_reference(heads, dim, kv_dtype, q_dtype, span, splits):
    h_q, h_kv = heads
    g = torch.Generator().manual_seed(h_q * dim + span[1])
    k = torch.randn(h_kv, 1300, dim, generator=g).to(kv_dtype)  # [H_kv, C, D]
    v = torch.randn(h_kv, 1300, dim, generator=g).to(kv_dtype)  # [H_kv, C, D]
    q = (torch.randn(h_q, dim, generator=g) * 3).to(q_dtype)  # [H_q, D]: peaked softmax rows too
    got = attention.decode_attention(q, k, v, *span, dim ** -0.5, splits)
    want = attention.decode_attention_reference(q, k, v, *span, dim ** -0.5)
    assert got.dtype == q_dtype and got.shape == (h_q, dim)
    tol = dict(rtol=1e-5, atol=1e-5) if q_dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tol)


@needs_kernel
def test_kernel_reads_views_of_the_layer_buffer_and_any_thread_count():
    """A layer's ``[H_kv, C, D]`` slice of the ``[L, H_kv, C, D]`` buffer is read in place; 1 and 2
    threads agree to float rounding (the key split differs)."""
    kv = torch.randn(2, 3, 900, 64)  # [L, H_kv, C, D]
    q = torch.randn(9, 64)  # [H_q, D]
    want = attention.decode_attention_reference(q, kv[1], kv[0], 0, 800, 0.125)
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(attention.decode_attention(q, kv[1], kv[0], 0, 800, 0.125))
    finally:
        torch.set_num_threads(before)
    for out in outs:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("kv_dtype,q_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("threads", [1, 2])
def test_batched_call_equals_each_single_call_bit_for_bit(kv_dtype, q_dtype, threads):
    """``decode_attention_batch``: B requests of different lengths (one past a window start) in one
    call give each request exactly the bits of its own ``decode_attention`` call, and the reference
    to float rounding; q is a strided view, as the server's batched step passes it."""
    g = torch.Generator().manual_seed(7)
    spans = [(0, 1), (0, 37), (0, 600), (300, 1100), (0, 1300)]
    bufs = [(torch.randn(3, 3, 1300 + 64 * b, 64, generator=g).to(kv_dtype),
             torch.randn(3, 3, 1300 + 64 * b, 64, generator=g).to(kv_dtype)) for b in range(len(spans))]  # [L, H_kv, C, D]
    qk = (torch.randn(len(spans), 12, 64, generator=g) * 3).to(q_dtype).transpose(0, 1)  # [H_q + H_kv, B, D] view
    q = qk[:9]  # [H_q, B, D], strided
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = attention.decode_attention_batch(q, [k for k, _ in bufs], [v for _, v in bufs], 1,
                                               [s for s, _ in spans], [e for _, e in spans], 0.125)
        singles = [attention.decode_attention(q[:, b], k[1], v[1], s, e, 0.125).reshape(-1)
                   for b, ((k, v), (s, e)) in enumerate(zip(bufs, spans))]
    finally:
        torch.set_num_threads(before)
    assert got.shape == (len(spans), 9 * 64) and got.dtype == q_dtype
    for b, single in enumerate(singles):
        assert torch.equal(got[b], single), f"request {b}"
        want = attention.decode_attention_reference(q[:, b], bufs[b][0][1], bufs[b][1][1], *spans[b], 0.125)
        tol = dict(rtol=1e-5, atol=1e-5) if q_dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(got[b], want.reshape(-1), **tol)


@needs_kernel
def test_batched_call_refuses_mismatched_requests():
    q, kv = torch.randn(9, 2, 64), torch.randn(2, 3, 100, 64)
    with pytest.raises(RuntimeError, match="one buffer and key range per request"):
        attention.decode_attention_batch(q, [kv], [kv], 0, [0], [10], 0.125)
    with pytest.raises(RuntimeError, match="key range"):
        attention.decode_attention_batch(q, [kv, kv], [kv, kv], 0, [0, 5], [10, 5], 0.125)
    with pytest.raises(RuntimeError, match="layer"):
        attention.decode_attention_batch(q, [kv, kv], [kv, kv], 2, [0, 0], [10, 10], 0.125)
    with pytest.raises(RuntimeError, match="one K/V dtype"):
        attention.decode_attention_batch(q, [kv, kv.bfloat16()], [kv, kv.bfloat16()], 0, [0, 0], [10, 10], 0.125)


@needs_kernel
def test_kernel_refuses_bad_shapes():
    q, k = torch.randn(9, 64), torch.randn(3, 10, 64)
    with pytest.raises(RuntimeError, match="key range"):
        attention.decode_attention(q, k, k, 5, 5, 0.125)
    with pytest.raises(RuntimeError, match="contiguous"):
        attention.decode_attention(q, k.transpose(1, 2).contiguous().transpose(1, 2), k, 0, 5, 0.125)
    with pytest.raises(RuntimeError, match="heads"):
        attention.decode_attention(torch.randn(8, 64), k, k, 0, 5, 0.125)


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("overrides", [{}, {"hidden_size": 192, "num_attention_heads": 3, "num_key_value_heads": 1,
                                            "head_dim": 64}])
def test_decode_step_with_kernel_equals_sdpa(arch, overrides):
    """The decode step through the kernel equals the SDPA step to float rounding, past mistral's
    24-token sliding window too (the window's start row), on the runner's own dims (16) and on the
    AVX-512 path's (64, 3 query heads per KV head)."""
    tok = byte_tokenizer()
    runners = {}
    for choice in ("kernel", "sdpa"):
        model = tiny_model(arch, vocab_size=len(tok), **overrides)
        runners[choice] = ModelRunner(model, tok, decode_attention=choice)
    assert runners["kernel"].decode_attention == "kernel" and runners["sdpa"].decode_attention == "sdpa"
    ids = torch.arange(3, 33)  # [30]
    kvs = prefilled(runners, ids, 50)
    token = 5
    for step in range(12):
        got = runners["kernel"].decode_step(token, 30 + step, kvs["kernel"])
        want = runners["sdpa"].decode_step(token, 30 + step, kvs["sdpa"])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
        token = int(want.argmax())


@needs_kernel
@pytest.mark.parametrize("weights", ["int8", "int8-dynamic"])
def test_low_precision_step_with_kernel_is_close_to_sdpa(weights):
    """bf16 K/V: the kernel reads them in float32 arithmetic (int8-dynamic: against the float32 q as
    it is); SDPA rounds through bf16. Close relative to the logits' spread."""
    from cachedrag.model.weights import vnni_available

    if weights == "int8-dynamic" and not vnni_available():
        pytest.skip("int8-dynamic needs VNNI")
    tok = byte_tokenizer()
    runners = {c: ModelRunner(tiny_model("llama", vocab_size=len(tok)), tok, weights=weights, decode_attention=c)
               for c in ("kernel", "sdpa")}
    kvs = prefilled(runners, torch.arange(3, 30), 40)
    for step in range(6):
        got = runners["kernel"].decode_step(9 + step, 27 + step, kvs["kernel"])
        want = runners["sdpa"].decode_step(9 + step, 27 + step, kvs["sdpa"])
        assert (got - want).abs().max() < 0.05 * (want.max() - want.min())


def test_runner_falls_back_to_sdpa_without_the_kernel(monkeypatch):
    monkeypatch.setattr(native, "kernel", lambda: None)
    monkeypatch.setattr(native, "kernel_status", lambda: "unavailable: RuntimeError: no C++ compiler (c++) on PATH")
    runner = tiny_runner()
    assert runner.decode_attention == "sdpa" and "no C++ compiler" in runner.decode_attention_note
    assert runner.decode_step_kind == "torch" and "no C++ compiler" in runner.decode_step_note  # nor the fused step
    kv = runner.new_kv(20)
    runner.prefill(torch.arange(3, 13), kv=kv)
    assert torch.isfinite(runner.decode_step(4, 10, kv)).all()
    with pytest.raises(ConfigError, match="no C\\+\\+ compiler"):
        tiny_runner(decode_attention="kernel")
    with pytest.raises(ConfigError, match="no C\\+\\+ compiler"):
        tiny_runner(decode_step="fused")
    with pytest.raises(ConfigError, match="decode_attention must be"):
        tiny_runner(decode_attention="flash")
    assert tiny_runner(fast=False).decode_attention == "sdpa"


@needs_kernel
def test_cached_library_loads_and_a_changed_one_is_rebuilt_not_loaded(tmp_path, monkeypatch):
    """The library is cached beside its SHA-256: an intact copy loads without building; one flipped
    byte makes it a miss that is rebuilt (the build here is stubbed to fail, so nothing is loaded)."""
    from torch.utils import cpp_extension

    built = native.library_dir()
    name = built.name
    intact, changed = tmp_path / "intact", tmp_path / "changed"
    for cache in (intact, changed):
        shutil.copytree(built, cache / name)
    builds = []

    def no_build(**kwargs):
        builds.append(kwargs["name"])
        raise RuntimeError("build stubbed out")

    monkeypatch.setattr(cpp_extension, "load_inline", no_build)
    module = native._load(intact)
    assert builds == [] and module.decode_attention(torch.ones(2, 16), torch.ones(1, 4, 16), torch.ones(1, 4, 16),
                                                   0, 4, 0.25, 0).shape == (2, 16)
    # the flipped byte goes into the other copy: a library this process has mapped is never written
    # (its code pages would change under it)
    so = changed / name / f"{name}.so"
    data = bytearray(so.read_bytes())
    data[len(data) // 2] ^= 0x01
    so.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="build stubbed out"):
        native._load(changed)
    assert builds == [name] and not so.exists()


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_a_build_leaves_the_library_key_unchanged(tmp_path, monkeypatch):
    """torch's load_inline inserts an #include into the source list it is given; the build hands it a
    new list, so the key (the library's name) stays the same for the rest of the process (it did not,
    and a process that had built the library looked for it under another name after). The sources
    come from the package's csrc/ files, with that folder on the include path."""
    from torch.utils import cpp_extension

    key = native._key()
    calls = []

    def build_as_torch_does(name, cpp_sources, build_directory, **kwargs):
        calls.append((list(cpp_sources), kwargs))
        cpp_sources.insert(0, "#include <torch/extension.h>")
        (tmp_path / name / f"{name}.so").write_bytes(b"a library")
        return "module"

    monkeypatch.setattr(cpp_extension, "load_inline", build_as_torch_does)
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    monkeypatch.setattr(native, "_state", {})
    assert native._load(tmp_path) == "module"
    assert native._key() == key
    (sources, kwargs), = calls
    assert sources == [(native.CSRC / name).read_text() for name in native.SOURCES]
    assert kwargs["extra_include_paths"] == [str(native.CSRC)]


def test_the_sources_are_package_files_and_every_one_includes_the_shared_header():
    """The C++ lives in csrc/ beside the module (package data), not in Python strings: every source
    includes native.h, which holds what two of them share (no helper is defined twice)."""
    files = sorted(p.name for p in native.CSRC.iterdir())
    assert files == sorted([*native.SOURCES, *native.HEADERS])
    for name, text in zip(native.SOURCES, native.sources()):
        assert '#include "native.h"' in text, name
    header = (native.CSRC / "native.h").read_text()
    for helper in ("inline float float_of(", "inline uint16_t bf16_of(", "inline float exp_neg(", "inline __m512 load16(",
                   "inline __m512 exp16_neg(", "inline void check_kv("):
        assert helper in header and not any(helper in text for text in native.sources()), helper


@pytest.mark.slow  # compiles the native library twice more (~30 s)
@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_native_source_compiles_for_cpus_without_avx512_or_its_bf16(tmp_path):
    """The library is built with -march=native, so CI compiles only this CPU's branches of the source;
    the branches for CPUs without AVX-512 (plain loops) or without AVX512-BF16 (bf16 widened to float32)
    must compile too. Both checks run side by side (each parses torch's headers, ~25 s on one core).
    The checked file is the build's translation unit: the sources in order, csrc/ on the include path."""
    import subprocess
    import sysconfig

    from torch.utils import cpp_extension

    src = tmp_path / "native.cpp"
    src.write_text("\n".join(native.sources()))
    includes = [f"-I{p}" for p in [*cpp_extension.include_paths(), sysconfig.get_paths()["include"], native.CSRC]]
    targets = {"avx2": ["-march=x86-64-v3"], "avx512-without-bf16": ["-march=x86-64-v4", "-mno-avx512bf16"]}
    checks = {name: subprocess.Popen(["g++", "-std=c++17", "-fsyntax-only", "-fopenmp", *flags,
                                      "-DTORCH_EXTENSION_NAME=check", *includes, str(src)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for name, flags in targets.items()}
    for name, check in checks.items():
        _, err = check.communicate(timeout=300)
        assert check.returncode == 0, f"{name}: {err[-3000:]}"


# ---------------------------------------------------------------- the prefill kernel
needs_prefill_kernel = pytest.mark.skipif(attention.prefill_module() is None,
                                          reason=f"prefill attention kernel: {attention.kernel_status()} (AVX-512 only)")


def _position_sets(n: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    scattered = torch.nonzero(torch.rand(n, generator=g) < 0.3).flatten()  # [T] sorted
    return {
        "leading": torch.arange(0, n),  # a full prefill
        "tail": torch.arange(37, n),  # prefix caching: a cached system prompt, then every row
        "scattered": torch.cat([scattered[scattered < n - 9], torch.arange(n - 9, n)]),  # recompute rows + question
        "sparse": torch.arange(3, n, 19),  # a 16-row block spans ~300 positions: tiles skip its early rows
        "one": torch.tensor([n // 2]),
        "seventeen": torch.arange(n - 17, n),  # a partial last task and tile
    }


@needs_prefill_kernel
@pytest.mark.parametrize("heads,dim", [((9, 3), 64), ((8, 2), 128), ((4, 4), 64), ((16, 2), 64)])
@pytest.mark.parametrize("kv_dtype,q_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("hidden", [False, True])
def test_prefill_kernel_equals_reference(heads, dim, kv_dtype, q_dtype, hidden):
    """Every kind of query-position set a prefill passes, GQA 1-8 query heads per KV head, head dims
    64 / 128, float32 or bf16 K/V and queries, with and without hidden keys; rows past ``kv_len``
    hold NaN (never read)."""
    h_q, h_kv = heads
    g = torch.Generator().manual_seed(h_q * dim + hidden)
    n, capacity = 301, 340
    k = torch.randn(h_kv, capacity, dim, generator=g).to(kv_dtype)  # [H_kv, C, D]
    v = torch.randn(h_kv, capacity, dim, generator=g).to(kv_dtype)  # [H_kv, C, D]
    k[:, n:] = float("nan")
    v[:, n:] = float("nan")
    for name, pos in _position_sets(n, g).items():
        q = (torch.randn(len(pos), h_q, dim, generator=g) * 3).to(q_dtype).transpose(0, 1)  # [H_q, T, D] view
        hide = None
        if hidden:
            hide = torch.rand(n, generator=g) < 0.2  # [T_k]
            hide[pos] = False  # a computed row's own key is never hidden
        got = attention.prefill_attention(q, k, v, pos, n, dim ** -0.5, hide)
        want = attention.prefill_attention_reference(q, k, v, pos, n, dim ** -0.5, hide)
        assert got.dtype == q_dtype and got.shape == (len(pos), h_q * dim), name
        tol = dict(rtol=1e-5, atol=1e-5) if q_dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{name}: {m}")


BF16_PAIRS = attention.prefill_module() is not None and "avx512_bf16" in cpu_flags()  # pairs really run


@needs_prefill_kernel
@pytest.mark.parametrize("heads,dim", [((9, 3), 64), ((8, 2), 128)])
def test_prefill_kernel_bf16_pairs_equal_the_widened_path(heads, dim):
    """bf16 queries and K/V multiply bf16 pairs (AVX512-BF16): the scores alone (``"scores"``, the
    default) at the widened path's accuracy, the value products too (``"scores+values"``, the
    probabilities rounded to bf16) within bf16 rounding of it; either bit for bit the same at
    either thread count, and really another arithmetic where the CPU has the instructions
    (``"none"`` is the widened path everywhere)."""
    h_q, h_kv = heads
    g = torch.Generator().manual_seed(dim)
    n = 301
    k = torch.randn(h_kv, 340, dim, generator=g).to(torch.bfloat16)  # [H_kv, C, D]
    v = torch.randn(h_kv, 340, dim, generator=g).to(torch.bfloat16)  # [H_kv, C, D]
    k[:, n:] = float("nan")  # past kv_len: never read, not even by the pair layouts' padding
    v[:, n:] = float("nan")
    before = torch.get_num_threads()
    differs = {"scores": False, "scores+values": False}  # bf16 outputs: a different order of sums can round alike
    for name, pos in _position_sets(n, g).items():
        q = (torch.randn(len(pos), h_q, dim, generator=g) * 3).to(torch.bfloat16).transpose(0, 1)  # [H_q, T, D]
        hide = torch.rand(n, generator=g) < 0.2  # [T_k]
        hide[pos] = False
        widened = attention.prefill_attention(q, k, v, pos, n, dim ** -0.5, hide, pairs="none")  # [T, H_q*D]
        ref = attention.prefill_attention_reference(q.float(), k.float(), v.float(), pos, n, dim ** -0.5, hide)
        err_widened = (widened.float() - ref).abs().mean()
        for mode, slack in (("scores", 1.05), ("scores+values", 1.5)):
            got = attention.prefill_attention(q, k, v, pos, n, dim ** -0.5, hide, pairs=mode)  # [T, H_q*D]
            assert not got.isnan().any(), (name, mode)
            torch.testing.assert_close(got.float(), widened.float(), rtol=1.6e-2, atol=1e-2,
                                       msg=lambda m: f"{name} {mode}: {m}")
            err = (got.float() - ref).abs().mean()
            assert err <= slack * err_widened + 1e-6, f"{name} {mode}: mean error {err:.2e} vs widened {err_widened:.2e}"
            differs[mode] = differs[mode] or not torch.equal(got, widened)
            torch.set_num_threads(1 if before > 1 else 2)
            try:
                assert torch.equal(got, attention.prefill_attention(q, k, v, pos, n, dim ** -0.5, hide, pairs=mode))
            finally:
                torch.set_num_threads(before)
        assert torch.equal(attention.prefill_attention(q, k, v, pos, n, dim ** -0.5, hide),
                           attention.prefill_attention(q, k, v, pos, n, dim ** -0.5, hide, pairs="scores"))
    assert not BF16_PAIRS or all(differs.values()), f"a pairs path did not run: {differs}"
    with pytest.raises(ValueError, match="pairs must be one of"):
        attention.prefill_attention(q, k, v, pos, n, dim ** -0.5, hide, pairs="values")


@needs_prefill_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_kernel_reads_layer_views_at_any_thread_count(threads):
    """The runner hands a layer of its ``[L, H_kv, C, D]`` buffer; the thread count only changes who
    computes a task, never its value."""
    g = torch.Generator().manual_seed(7)
    buf = torch.randn(3, 3, 200, 64, generator=g)  # [L, H_kv, C, D]
    pos = torch.nonzero(torch.rand(180, generator=g) < 0.5).flatten()
    q = torch.randn(9, len(pos), 64, generator=g)  # [H_q, T, D]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = attention.prefill_attention(q, buf[1], buf[2], pos, 180, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, attention.prefill_attention(q, buf[1].clone(), buf[2].clone(), pos, 180, 0.125))
    torch.testing.assert_close(got, attention.prefill_attention_reference(q, buf[1], buf[2], pos, 180, 0.125),
                               rtol=1e-5, atol=2e-6)


@needs_prefill_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_segment_mass_through_the_kernel_equals_reference(dtype):
    """Segment masses (the chunk metadata's and early termination's) through the prefill kernel, on
    the AVX-512 path's dims: equal to the blockwise softmax and to the SDPA runner's, for a fresh-row
    subset, a question's rows (fewer than the float32 threshold: SDPA there) and a full prefill."""
    tok = byte_tokenizer()
    dims = {"hidden_size": 192, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 64}
    runners = {c: ModelRunner(tiny_model("llama", vocab_size=len(tok), **dims), tok, dtype=dtype, prefill_attention=c)
               for c in ("kernel", "sdpa")}
    assert runners["kernel"]._prefill_kernel is not None and runners["sdpa"]._prefill_kernel is None
    n = 200
    ids = torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(5))
    bounds = [0, 12, 70, 131, 180, n]
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == "float32" else dict(atol=1.5e-2, rtol=0)
    for rows in (torch.arange(70, 180), torch.arange(n - 20, n), torch.arange(n)):
        got = {}
        for choice, runner in runners.items():
            kv = runner.new_kv(n)
            runner.prefill(ids, kv=kv)
            raw = {}
            runner.forward_layer(1, runner.embed(ids), torch.arange(n), kv, n, raw_out=raw)
            got[choice] = runner.segment_attention_mass(1, raw["q"][:, rows], rows, kv, n, bounds)  # [R, S]
            ref = runner.segment_attention_mass(1, raw["q"][:, rows], rows, kv, n, bounds, reference=True)  # [R, S]
            torch.testing.assert_close(got[choice], ref, **tol)
        torch.testing.assert_close(got["kernel"], got["sdpa"], **tol)
        torch.testing.assert_close(got["kernel"].sum(-1), torch.ones(len(rows)), atol=2 * tol["atol"], rtol=0)


@needs_prefill_kernel
def test_prefill_kernel_refuses_bad_input():
    q, k = torch.randn(9, 4, 64), torch.randn(3, 50, 64)
    with pytest.raises(RuntimeError, match="ascend"):
        attention.prefill_attention(q, k, k, torch.tensor([3, 2, 5, 6]), 40, 0.125)
    with pytest.raises(RuntimeError, match="ascend"):
        attention.prefill_attention(q, k, k, torch.tensor([3, 4, 5, 40]), 40, 0.125)  # past kv_len
    with pytest.raises(RuntimeError, match="head dim"):
        attention.prefill_attention(torch.randn(9, 4, 32), torch.randn(3, 50, 32), torch.randn(3, 50, 32),
                                    torch.arange(4), 40, 0.125)
    with pytest.raises(RuntimeError, match="query heads"):
        attention.prefill_attention(torch.randn(18, 4, 64), torch.randn(2, 50, 64), torch.randn(2, 50, 64),
                                    torch.arange(4), 40, 0.125)


@needs_prefill_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_with_kernel_equals_sdpa(dtype):
    """A runner with the prefill kernel against one on SDPA (the same weights), on the AVX-512 path's
    dims: a full prefill, a prefix-cached one and a scattered partial one (the reuse path) give the
    same logits to float rounding."""
    tok = byte_tokenizer()
    dims = {"hidden_size": 192, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 64}
    runners = {c: ModelRunner(tiny_model("llama", vocab_size=len(tok), **dims), tok, dtype=dtype, prefill_attention=c)
               for c in ("kernel", "sdpa")}
    assert runners["kernel"].prefill_attention == "kernel" and runners["sdpa"].prefill_attention == "sdpa"
    n = 260
    ids = torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(4)
    scattered = torch.nonzero(torch.rand(n, generator=g) < 0.3).flatten()
    sets = [torch.arange(0, n), torch.arange(20, n), torch.cat([scattered[scattered < n - 8], torch.arange(n - 8, n)])]
    tol = dict(rtol=0, atol=2e-4) if dtype == "float32" else dict(rtol=0, atol=0.1)
    for pos in sets:
        out = {}
        for choice, runner in runners.items():
            kv = runner.new_kv(n)
            runner.prefill(ids, kv=kv)  # every row valid
            out[choice] = runner.prefill(ids[pos], pos, kv=kv, kv_len=n, all_logits=True).float()  # [T, V]
        torch.testing.assert_close(out["kernel"], out["sdpa"], **tol)
    if dtype == "bfloat16":  # the runner's option reaches the kernel: each arithmetic as close to SDPA
        assert runners["kernel"].prefill_pairs == "scores"
        for mode in ("none", "scores+values"):
            runner = ModelRunner(tiny_model("llama", vocab_size=len(tok), **dims), tok, dtype=dtype,
                                 prefill_attention="kernel", prefill_pairs=mode)
            kv = runner.new_kv(n)
            runner.prefill(ids, kv=kv)
            other = runner.prefill(ids[pos], pos, kv=kv, kv_len=n, all_logits=True).float()  # [T, V]
            torch.testing.assert_close(other, out["sdpa"], **tol)
            if mode == "scores+values":  # the probabilities' rounding shows in the logits
                assert not BF16_PAIRS or not torch.equal(other, out["kernel"])
        with pytest.raises(ConfigError, match="prefill_pairs must be one of"):
            ModelRunner(tiny_model("llama", vocab_size=len(tok), **dims), tok, dtype=dtype, prefill_pairs="all")
    # keys a pass leaves out (the question pre-pass): the kernel reads them from the block plan
    pos = sets[2]
    hidden = torch.zeros(n, dtype=torch.bool)
    hidden[torch.arange(1, n, 3)] = True
    hidden[pos] = False
    kv = runners["sdpa"].new_kv(n)
    runners["sdpa"].prefill(ids, kv=kv)
    q = torch.randn(3, len(pos), 64, generator=g).to(runners["sdpa"].dtype)  # [H_q, T, D]
    got, want = (r.attend(1, q, pos, kv, n, r.causal_blocks(pos, n, hidden)).float() for r in runners.values())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 if dtype == "float32" else 2e-2)
    ref = attention.prefill_attention_reference(q, kv.k[1], kv.v[1], pos, n, runners["sdpa"].scaling, hidden).float()
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5 if dtype == "float32" else 2e-2)


def test_runner_keeps_sdpa_for_the_prefill_where_the_kernel_does_not_apply(monkeypatch):
    runner = tiny_runner()  # head dim 16: not a kernel shape
    assert runner.prefill_attention == "sdpa" and "head dim 16" in runner.prefill_attention_note
    with pytest.raises(ConfigError, match="head dim 16"):
        tiny_runner(prefill_attention="kernel")
    with pytest.raises(ConfigError, match="prefill_attention must be"):
        tiny_runner(prefill_attention="flash")
    monkeypatch.setattr(native, "kernel", lambda: None)
    monkeypatch.setattr(native, "kernel_status", lambda: "unavailable: RuntimeError: no C++ compiler (c++) on PATH")
    tok = byte_tokenizer()
    model = tiny_model("llama", vocab_size=len(tok), hidden_size=192, num_attention_heads=3, num_key_value_heads=1,
                       head_dim=64)
    runner = ModelRunner(model, tok)
    assert runner.prefill_attention == "sdpa" and "no C++ compiler" in runner.prefill_attention_note
    kv = runner.new_kv(80)
    assert torch.isfinite(runner.prefill(torch.arange(3, 70), kv=kv)).all()
