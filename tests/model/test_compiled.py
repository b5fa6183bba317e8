"""``compile=True``: the AOTInductor decode segments equal the eager fast step (tiny models)."""

import pytest
import torch

from cachedrag.errors import ConfigError
from cachedrag.model.runner import ModelRunner
from cachedrag.testing import byte_tokenizer, tiny_model


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One package directory for the module: runners of the same shapes share builds (~10-30 s each)."""
    return tmp_path_factory.mktemp("aoti")


def _pair(tmp_path, arch="llama", **kwargs):
    tok = byte_tokenizer()
    eager = ModelRunner(tiny_model(arch, vocab_size=len(tok)), tok, **kwargs)
    compiled = ModelRunner(tiny_model(arch, vocab_size=len(tok)), tok, compile=True, compile_cache_dir=tmp_path,
                           **kwargs)
    return eager, compiled


def _steps(eager, compiled, n_prompt=30, tokens=(5, 17, 99, 3, 250, 41)):
    """Prefill the same prompt in both, then decode ``tokens``; yields both steps' logits and buffers."""
    ids = torch.randint(0, 256, (n_prompt,), generator=torch.Generator().manual_seed(3))
    kv_e, kv_c = eager.new_kv(n_prompt + len(tokens)), compiled.new_kv(n_prompt + len(tokens))
    eager.prefill(ids, kv=kv_e)
    compiled.prefill(ids, kv=kv_c)
    for step, token in enumerate(tokens):
        pos = n_prompt + step
        yield eager.decode_step(token, pos, kv_e), compiled.decode_step(token, pos, kv_c), kv_e, kv_c


@pytest.mark.slow  # AOTInductor builds (~20-45 s each); `make test-slow`
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])  # mistral: a sliding window shorter than the
def test_compiled_fp32_decode_equals_the_eager_step(cache, arch):  # context (llama's packages); qwen2: q/k/v biases
    eager, compiled = _pair(cache, arch)
    assert compiled.compiled is not None
    for want, got, kv_e, kv_c in _steps(eager, compiled):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    n = kv_e.length
    assert kv_c.length == n
    torch.testing.assert_close(kv_c.k[:, :, :n], kv_e.k[:, :, :n], atol=1e-5, rtol=0)
    torch.testing.assert_close(kv_c.v[:, :, :n], kv_e.v[:, :, :n], atol=1e-5, rtol=0)


@pytest.mark.slow  # AOTInductor builds (~20-45 s each); `make test-slow`
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_compiled_low_bit_decode_tracks_the_eager_step(cache, weights):
    """Same kernels on the same weights; norms and RoPE round once in float32 inside the fused kernels
    (eager rounds each op to bf16), so equal within bf16 tolerance, relative to the logits' spread."""
    eager, compiled = _pair(cache, dtype="bfloat16", weights=weights)
    for want, got, _, _ in _steps(eager, compiled):
        assert (got - want).abs().max() < 0.05 * want.std() + 0.02


@pytest.mark.slow  # AOTInductor builds (~20-45 s each); `make test-slow`
def test_packages_are_cached_and_a_damaged_one_is_rebuilt(cache, tmp_path):
    import shutil

    tok = byte_tokenizer()
    eager = ModelRunner(tiny_model("llama", vocab_size=len(tok)), tok)
    ModelRunner(tiny_model("llama", vocab_size=len(tok)), tok, compile=True, compile_cache_dir=cache)  # built once
    for package in [*cache.glob("*.pt2"), *cache.glob("*.sha256")]:
        shutil.copy(package, tmp_path)
    again = ModelRunner(tiny_model("llama", vocab_size=len(tok)), tok, compile=True, compile_cache_dir=tmp_path)
    assert again.compiled.built == []  # a second runner of the same shapes loads the packages
    first = tmp_path / f"decode-first-{again.compiled.key('first')}.pt2"
    assert first.exists()
    data = bytearray(first.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit inside the package
    first.write_bytes(bytes(data))
    rebuilt = ModelRunner(tiny_model("llama", vocab_size=len(tok)), tok, compile=True, compile_cache_dir=tmp_path)
    assert rebuilt.compiled.built == ["first"]  # a damaged package is a miss, never an error
    for want, got, _, _ in _steps(eager, rebuilt, tokens=(5, 17)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    before = torch.get_num_threads()
    try:  # kernels were built for one thread count: another one runs the eager step, counted
        torch.set_num_threads(before + 1)
        for want, got, _, _ in _steps(eager, rebuilt, tokens=(5,)):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        assert rebuilt.compiled.eager_steps == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kwargs", [dict(dtype="bfloat16"), dict(fast=False)])
def test_compile_refuses_formats_it_does_not_speed_up(tmp_path, kwargs):
    tok = byte_tokenizer()
    with pytest.raises(ConfigError, match="compile=True"):
        ModelRunner(tiny_model("llama", vocab_size=len(tok)), tok, compile=True, compile_cache_dir=tmp_path, **kwargs)
    assert not list(tmp_path.glob("*.pt2"))
