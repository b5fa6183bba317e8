"""The reuse path's fast paths beside their references: block-causal attention of a partial
prefill (``ModelRunner.causal_blocks`` + ``attend``) and in-place re-rotation (``Rotary.apply_into``)."""

from __future__ import annotations

import pytest
import torch

from cachedrag.config import EngineConfig
from cachedrag.engine import CachedEngine
from cachedrag.kvcache.config import CacheConfig
from cachedrag.model.generation import SamplingParams
from cachedrag.testing import TINY_ARCHITECTURES, tiny_runner


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g)


def _scattered(n: int, keep: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    pos = torch.nonzero(torch.rand(n, generator=g) < keep).flatten()  # [T] sorted
    return torch.cat([pos[pos < n - 8], torch.arange(n - 8, n)])  # scattered rows, then a "question" tail


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
@pytest.mark.parametrize("keep", [0.3, 0.5, 0.7])
def test_block_causal_attention_equals_one_masked_call(arch, keep):
    runner = tiny_runner(arch)
    n = 480
    ids = _ids(n)
    kv = runner.new_kv(n + 4)
    runner.prefill(ids, kv=kv)  # every row valid
    pos = _scattered(n, keep)
    blocks = runner.causal_blocks(pos, n)
    assert blocks is not None and blocks.bounds[0][2] < n  # it really cuts keys
    assert [b[1] - b[0] for b in blocks.bounds] == [m.shape[0] for m in blocks.masks]
    raw = {}
    runner.forward_layer(1, runner.embed(ids[pos]), pos, kv, n, raw_out=raw)
    for layer in range(runner.n_layers):
        got = runner.attend(layer, raw["q"], pos, kv, n, blocks)  # [T, H_q*D]
        expected = runner.attend(layer, raw["q"], pos, kv, n)  # the reference: one call, full mask
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_partial_prefill_with_blocks_equals_reference(arch):
    fast, ref = tiny_runner(arch), tiny_runner(arch, block_causal=False)
    n = 480
    ids = _ids(n, seed=2)
    pos = _scattered(n, 0.3, seed=3)
    out = []
    for runner in (fast, ref):
        kv = runner.new_kv(n)
        runner.prefill(ids, kv=kv)
        out.append(runner.prefill(ids[pos], pos, kv=kv, kv_len=n, all_logits=True))  # [T, V]
    assert fast.causal_blocks(pos, n) is not None and ref.causal_blocks(pos, n) is None
    torch.testing.assert_close(out[0], out[1], atol=1e-5, rtol=0)


def test_causal_blocks_only_where_they_save():
    runner = tiny_runner()
    assert runner.causal_blocks(torch.arange(280, 300), 300) is None  # a tail: every block sees ~every key
    assert runner.causal_blocks(torch.tensor([5]), 300) is None  # one row
    assert tiny_runner(block_causal=False).causal_blocks(_scattered(300, 0.3), 300) is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_apply_into_is_bitwise_apply(dtype):
    runner = tiny_runner(dtype=dtype)
    d = runner.head_dim
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(runner.n_layers, runner.n_kv_heads, 37, d, generator=g).to(runner.dtype)  # [L, H_kv, T, D]
    pos = torch.arange(100, 137)
    buf = torch.zeros(runner.n_layers, runner.n_kv_heads, 200, d, dtype=runner.dtype)  # strided target rows
    runner.rotary.apply_into(raw, pos, buf[:, :, 100:137])
    assert torch.equal(buf[:, :, 100:137], runner.rotary.apply(raw, pos))
    assert not buf[:, :, :100].any() and not buf[:, :, 137:].any()


def test_reuse_with_block_attention_equals_reference_engine():
    """The engine's partial prefill (question pre-pass, recompute rows) through block-causal
    attention gives the reference path's logits and the same recompute choice."""
    chunks = [f"Chunk {i}: " + "the quick brown fox jumps over the lazy dog. " * 2 for i in range(4)]
    out, planned = [], []
    fast = tiny_runner("qwen2", seed=3)
    plan = fast.causal_blocks
    fast.causal_blocks = lambda *a: planned.append(plan(*a)) or planned[-1]
    for runner in (fast, tiny_runner("qwen2", seed=3, block_causal=False)):
        engine = CachedEngine(runner, config=EngineConfig(cache=CacheConfig(recompute_ratio=0.27)))
        engine.generate(chunks[:3], "warm up", "sys", max_new_tokens=1)
        segs = engine.prompts.chat([chunks[2], chunks[3], chunks[0], chunks[1]], "which chunk?", "sys")
        r = engine.generate_segments(segs, SamplingParams(max_new_tokens=1))
        assert r.chunks_hit == 3 and r.chunks_missed == 1 and r.recomputed_tokens > 0
        out.append((engine.prefill_logits(segs), r.chunk_recompute))
    assert any(b is not None for b in planned)  # the fast engine did attend in blocks
    torch.testing.assert_close(out[0][0], out[1][0], atol=1e-5, rtol=0)
    assert out[0][1] == out[1][1]


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_last_row_only_layer_equals_full_layer(arch):
    """``out_rows``: every row's K/V still written, the wanted rows' output as computed with all rows."""
    runner = tiny_runner(arch)
    n = 120
    ids = _ids(n, seed=4)
    pos = _scattered(n, 0.4, seed=5)
    kvs, outs = [], []
    for rows in (None, slice(-1, None)):
        kv = runner.new_kv(n)
        runner.prefill(ids, kv=kv)
        hidden = runner.embed(ids[pos])
        outs.append(runner.forward_layer(1, hidden, pos, kv, n, out_rows=rows))
        kvs.append(kv)
    assert outs[1].shape[0] == 1
    torch.testing.assert_close(outs[1], outs[0][-1:], atol=1e-5, rtol=1e-5)
    assert torch.equal(kvs[0].k, kvs[1].k) and torch.equal(kvs[0].v, kvs[1].v)


def test_engine_last_layer_trim_equals_every_row():
    """The partial prefill's last layer computes only the last row's output; its logits equal the
    last row of a pass that computes every row (``all_logits``)."""
    runner = tiny_runner("qwen2", seed=3)
    engine = CachedEngine(runner, config=EngineConfig(cache=CacheConfig(recompute_ratio=0.27)))
    chunks = [f"Chunk {i}: " + "the quick brown fox jumps over the lazy dog. " * 2 for i in range(3)]
    engine.generate(chunks, "warm up", "sys", max_new_tokens=1)
    segs = engine.prompts.chat(chunks[::-1], "which chunk?", "sys")
    for mode in ("cachedrag", "full"):
        torch.testing.assert_close(engine.prefill_logits(segs, mode=mode),
                                   engine.prefill_logits(segs, mode=mode, all_logits=True)[-1], atol=1e-5, rtol=0)


def _compact(kv, keep: torch.Tensor, runner):
    """A buffer holding only rows ``keep`` (in order): the reference for hidden keys."""
    out = runner.new_kv(keep.shape[0])
    out.k.copy_(kv.k[:, :, keep])
    out.v.copy_(kv.v[:, :, keep])
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("with_lead", [False, True])
def test_hidden_keys_equal_rows_absent(arch, with_lead):
    """``causal_blocks(..., hidden_keys)`` + ``attend`` and ``segment_attention_mass(hidden_keys=)``
    equal attention over a buffer without those rows (attention is position-free once K is
    rotated): the question pre-pass can leave fresh rows out without computing them."""
    if arch not in TINY_ARCHITECTURES:
        pytest.skip(f"{arch} not a tiny architecture")
    runner = tiny_runner(arch)
    n = 200
    ids = _ids(n)
    kv = runner.new_kv(n)
    runner.prefill(ids, kv=kv)  # every row valid
    hidden = torch.zeros(n, dtype=torch.bool)
    hidden[90:150] = True  # a "fresh chunk after a reused one"
    kv.k[:, :, 90:150] = 7.0  # finite garbage: must not matter
    kv.v[:, :, 90:150] = -3.0
    pos = torch.cat([torch.arange(40, 60) if with_lead else torch.arange(0), torch.arange(n - 12, n)])  # [T]
    keep = torch.nonzero(~hidden).flatten()  # [T_k']
    compact_pos = torch.searchsorted(keep, pos)  # [T] rows of pos in the compact buffer
    ref_kv = _compact(kv, keep, runner)
    layer = 1
    q = torch.randn(runner.n_heads, pos.shape[0], runner.head_dim, generator=torch.Generator().manual_seed(3))
    blocks = runner.causal_blocks(pos, n, hidden)
    assert blocks is not None
    got = runner.attend(layer, q, pos, kv, n, blocks)  # [T, H_q*D]
    want = runner.attend(layer, q, compact_pos, ref_kv, keep.shape[0], None)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    every = list(range(n + 1))
    mass = runner.segment_attention_mass(layer, q, pos, kv, n, every, hidden_keys=hidden)  # [T, n]
    ref = runner.segment_attention_mass(layer, q, compact_pos, ref_kv, keep.shape[0], list(range(keep.shape[0] + 1)))
    assert float(mass[:, hidden].abs().max()) == 0.0
    torch.testing.assert_close(mass[:, keep], ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("choice", ["question+inter", "deviation"])
def test_reuse_requests_with_the_prefill_kernel_match_sdpa(choice):
    """The whole reuse path (question pre-pass with hidden keys, recompute choice, partial prefill)
    on a runner with the C++ prefill kernel against one on SDPA, same weights: the same plans, and
    logits equal to float rounding, request after request."""
    from cachedrag.model import attention
    from cachedrag.model.runner import ModelRunner
    from cachedrag.testing import byte_tokenizer, tiny_model

    if attention.prefill_module() is None:
        pytest.skip(f"prefill attention kernel: {attention.kernel_status()} (AVX-512 only)")
    tok = byte_tokenizer()
    dims = {"hidden_size": 192, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 64}
    engines = {}
    for c in ("kernel", "sdpa"):
        runner = ModelRunner(tiny_model("llama", vocab_size=len(tok), **dims), tok, prefill_attention=c)
        runner.model.generation_config.eos_token_id = tok.eos_token_id
        assert runner.prefill_attention == c
        engines[c] = CachedEngine(runner, config=EngineConfig(cache=CacheConfig(
            recompute_ratio=0.3, token_choice=choice, precision={"recompute": "float32"})))
    chunks = [f"Chunk {i}: the quick brown fox jumps over the lazy dog {i} times; pack my box." for i in range(5)]
    for order in [(0, 1, 2), (2, 0, 1), (3, 1, 0, 4), (4, 2, 3)]:
        segs = {c: e.prompts.chat([chunks[i] for i in order], "which chunk?", "sys") for c, e in engines.items()}
        got = {c: e.prefill_logits(segs[c], mode="cachedrag") for c, e in engines.items()}  # [V]
        torch.testing.assert_close(got["kernel"], got["sdpa"], rtol=0, atol=1e-4)
        for e in engines.values():
            e.generate([chunks[i] for i in order], "which chunk?", "sys", max_new_tokens=1)  # cache what it computed
