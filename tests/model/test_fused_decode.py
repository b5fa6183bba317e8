"""The fused native decode step (``model/fused_decode.py``) against the op-by-op torch step (the reference)."""

import pytest
import torch

from cachedrag.errors import ConfigError
from cachedrag.model import attention
from cachedrag.model import weights as weights_module
from cachedrag.model.runner import ModelRunner
from cachedrag.model.weights import cpu_flags
from cachedrag.testing import byte_tokenizer, prefilled, tiny_model, tiny_runner

needs_kernel = pytest.mark.skipif(attention.kernel() is None, reason=f"native kernels {attention.kernel_status()}")

WIDE = {"hidden_size": 192, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 64}  # the AVX-512 dims
# widths that are no whole number of the dot kernel's block pairs: an odd last block and a ragged
# tail (88 = 5 x 16 + 8 float32 columns, 2 x 32 + 24 bf16 ones; 200 = 12 x 16 + 8; 32 = 1 x 32)
RAGGED = {"hidden_size": 88, "intermediate_size": 200, "num_attention_heads": 2, "num_key_value_heads": 1,
          "head_dim": 16}


def _pair(arch="llama", **kwargs):
    """Two runners over the same random weights: the fused step and the torch step (int4: kept in torch's
    layout and read by torch's int4 kernel, the reference of the native tiles)."""
    from cachedrag.model import int4

    tok = byte_tokenizer()
    overrides = kwargs.pop("overrides", {})
    runners = {}
    try:
        for c, storage in (("fused", None), ("torch", "torch")):
            int4.STORAGE = storage
            runners[c] = ModelRunner(tiny_model(arch, vocab_size=len(tok), **overrides), tok, decode_step=c, **kwargs)
    finally:
        int4.STORAGE = None
    return runners


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("overrides", [{}, WIDE, RAGGED])
def test_fused_step_equals_the_torch_step_in_float32(arch, overrides):
    """float32 logits to 1e-4 and the same greedy tokens, step after step, past mistral's 24-token
    sliding window (the window's start row), with qwen2's q/k/v biases; K/V rows written alike."""
    runners = _pair(arch, overrides=overrides)
    assert runners["fused"].decode_step_kind == "fused" and runners["torch"].decode_step_kind == "torch"
    ids = torch.arange(3, 33)  # [30]
    kvs = prefilled(runners, ids, 50)
    token = 5
    for step in range(12):
        got = runners["fused"].decode_step(token, 30 + step, kvs["fused"])  # [V]
        want = runners["torch"].decode_step(token, 30 + step, kvs["torch"])  # [V]
        assert got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
        assert int(got.argmax()) == int(want.argmax())
        token = int(want.argmax())
    assert kvs["fused"].length == kvs["torch"].length == 42
    torch.testing.assert_close(kvs["fused"].k[:, :, :42], kvs["torch"].k[:, :, :42], rtol=0, atol=1e-5)
    torch.testing.assert_close(kvs["fused"].v[:, :, :42], kvs["torch"].v[:, :, :42], rtol=0, atol=1e-5)


needs_int4 = pytest.mark.skipif(attention.kernel() is None or not attention.kernel().int4_available(),
                                reason="the fused step's int4 kernel needs the native kernels on an AVX512-BF16 CPU")
# the formats of a bfloat16 stream, with the shapes each takes (int4: input sizes divisible by 32)
BF16_CASES = [(w, o) for w in ("dense", "int8") for o in ({}, WIDE, RAGGED)] + [
    pytest.param("int4", o, marks=needs_int4) for o in ({}, WIDE)]


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("weights,overrides", BF16_CASES)
def test_fused_step_is_close_to_the_torch_step_in_bfloat16(weights, overrides, arch):
    """bfloat16 stream (dense bf16, int8 or int4 weights): every value rounded where the torch step
    rounds it, so the two differ by the dot products' summation order only (int4: the same levels,
    scales and zeros as torch's int4 kernel): close relative to the logits' spread, and the bf16 K/V
    rows within a couple of bf16 steps."""
    runners = _pair(arch, overrides=overrides, dtype="bfloat16", weights=weights)
    assert runners["fused"].decode_step_kind == "fused"
    kvs = prefilled(runners, torch.arange(3, 30), 40)
    for step in range(6):
        got = runners["fused"].decode_step(9 + step, 27 + step, kvs["fused"])  # [V]
        want = runners["torch"].decode_step(9 + step, 27 + step, kvs["torch"])  # [V]
        assert (got - want).abs().max() < 0.03 * (want.max() - want.min())
        assert torch.equal(got, got.bfloat16().float())  # the logits are bf16 values, as the torch step's
    k_f, k_t = kvs["fused"].k[:, :, :33].float(), kvs["torch"].k[:, :, :33].float()
    assert (k_f - k_t).abs().max() <= 0.02 * k_t.abs().max()


@needs_kernel
@pytest.mark.parametrize("dtype,weights,arch,overrides", [
    (d, w, a, o) for d, w in (("float32", "dense"), ("bfloat16", "dense"), ("bfloat16", "int8"))
    for a, o in (("llama", {}), ("mistral", {}), ("llama", RAGGED))] + [
    pytest.param("bfloat16", "int4", a, {}, marks=needs_int4) for a in ("llama", "mistral")])
def test_each_row_of_a_batch_is_its_single_step_bit_for_bit(dtype, weights, arch, overrides):
    """B requests of different lengths (mistral: some past the window) in one call: every row's
    logits and K/V rows equal the single call on that request, bit for bit (9 requests: the row-major dot
    kernel takes 4 inputs per weight row, then 4, then 1; the packed tiles 8, then 1)."""
    tok = byte_tokenizer()
    runner = ModelRunner(tiny_model(arch, vocab_size=len(tok), **overrides), tok, dtype=dtype, weights=weights)
    assert runner.decode_step_kind == "fused"
    lengths = (5, 31, 17, 40, 12, 8, 26, 19, 3)
    prompts = [torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
    batch, alone = [], []
    for p in prompts:
        for bufs in (batch, alone):
            kv = runner.new_kv(len(p) + 4)
            runner.prefill(p, kv=kv)
            bufs.append(kv)
    tokens, positions = list(range(7, 7 + len(prompts))), [len(p) for p in prompts]
    for _ in range(3):
        logits = runner.fused.step_batch(tokens, positions, batch)  # [B, V]
        for b in range(len(prompts)):
            assert torch.equal(logits[b], runner.fused.step(tokens[b], positions[b], alone[b]))
        tokens, positions = logits.argmax(-1).tolist(), [p + 1 for p in positions]
    for a, b in zip(batch, alone):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and a.length == b.length


# the packed tiles: float32 (and int8) ones on AVX-512 CPUs, bf16 ones on AVX512-BF16 CPUs
PACKS = {"float32": attention.kernel() is not None and "avx512f" in cpu_flags(),
         "bfloat16": attention.kernel() is not None and "avx512_bf16" in cpu_flags()}


@pytest.mark.parametrize("dtype,weights", [("float32", "dense"), ("bfloat16", "dense"), ("bfloat16", "int8")])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("overrides", [{}, RAGGED])
def test_packed_tiles_are_close_to_the_row_major_step(dtype, weights, arch, overrides, monkeypatch):
    """Projections from the packed tiles (32 rows interleaved by columns, bf16 by column pairs, int8
    widened with its row scales; row counts that are no multiple of 32, qwen2's biases) against the
    row-major dot products: the same values to the summation order (float32: to 1e-4; bf16 stream:
    close relative to the logits' spread, K/V rows within a bf16 step or two); every projection of
    the step packed. int8: the row-major levels (``INT8_TILES`` off), packed by the step."""
    if not PACKS["float32" if weights == "int8" else dtype]:
        pytest.skip(f"no packed {dtype} {weights} tiles on this CPU")
    from cachedrag.model.fused_decode import FusedDecode

    monkeypatch.setattr(weights_module, "INT8_TILES", False)
    tok = byte_tokenizer()
    runner = ModelRunner(tiny_model(arch, vocab_size=len(tok), **overrides), tok, dtype=dtype, weights=weights)
    steps = {"packed": FusedDecode(runner, packed=True), "row-major": FusedDecode(runner, packed=False)}
    layers = len(runner.layers)
    assert steps["packed"].packed_projections == 4 * layers + 1 and steps["row-major"].packed_projections == 0
    assert steps["packed"].packed_bytes >= sum(w.numel() * w.element_size() for lw in runner.fast_layers
                                               for w in (lw.qkv.qweight if weights == "int8" else lw.qkv.weight,
                                                         lw.down.qweight if weights == "int8" else lw.down.weight))
    kvs = prefilled({name: runner for name in steps}, torch.arange(3, 30), 40)
    for step in range(5):
        got = steps["packed"].step(9 + step, 27 + step, kvs["packed"])  # [V]
        want = steps["row-major"].step(9 + step, 27 + step, kvs["row-major"])  # [V]
        if dtype == "float32":
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
        else:
            assert (got - want).abs().max() < 0.03 * (want.max() - want.min())
    k_p, k_r = kvs["packed"].k[:, :, :32].float(), kvs["row-major"].k[:, :, :32].float()
    assert (k_p - k_r).abs().max() <= (1e-5 if dtype == "float32" else 0.02 * k_r.abs().max())


@needs_kernel
def test_packing_by_default_only_where_it_applies(monkeypatch):
    """``packed=None``: float32, bf16 and row-major int8 weights are packed (where the CPU has the
    instructions; int8's bf16 LM head with bf16's), none past ``PACK_LIMIT_BYTES`` (the copy doubles
    their memory); int8 weights stored as tiles are read as they are whatever the limit (no copy)."""
    from cachedrag.model import fused_decode

    bf16, fp32, int8 = tiny_runner(dtype="bfloat16"), tiny_runner(), tiny_runner(dtype="bfloat16", weights="int8")
    monkeypatch.setattr(weights_module, "INT8_TILES", False)
    int8_rows = tiny_runner(dtype="bfloat16", weights="int8")
    assert int8_rows.fast_head.qrows is not None
    every = 4 * len(bf16.layers) + 1
    assert bf16.fused.packed_projections == (every if PACKS["bfloat16"] else 0)
    assert fp32.fused.packed_projections == (every if PACKS["float32"] else 0)
    head_bf16 = int8.fast_head.kind != "int8"
    expected_int8 = (every - 1 if PACKS["float32"] else 0) + (1 if PACKS["bfloat16" if head_bf16 else "float32"] else 0)
    assert int8.fused.packed_projections == int8_rows.fused.packed_projections == expected_int8
    tiles = int8.fast_head.tiles is not None
    assert tiles == PACKS["float32"] and (int8.fused.packed_bytes == 0) == tiles
    monkeypatch.setattr(fused_decode, "PACK_LIMIT_BYTES", 0)
    for runner in (bf16, fp32, int8_rows):
        assert fused_decode.FusedDecode(runner).packed_projections == 0
    assert fused_decode.FusedDecode(int8).packed_projections == (every if tiles else 0)


@needs_kernel
@pytest.mark.parametrize("dtype,weights,overrides", [
    (d, w, o) for d, w in (("float32", "dense"), ("bfloat16", "dense"), ("bfloat16", "int8")) for o in ({}, RAGGED)] + [
    pytest.param("bfloat16", "int4", {}, marks=needs_int4)])
@pytest.mark.parametrize("packed", [None, False])
def test_speed_options_change_no_value(dtype, weights, overrides, packed):
    """The projections' software prefetch (4+ requests), rows handed to threads in chunks and the
    small ops in the projections' epilogues (rounding, residual adds, SiLU(gate) * up from gate/up
    tiles) against the step with none of them (the reference: one static row range per thread,
    serial passes after each projection), packed tiles or row-major: 9 requests (4 + 4 + 1 or
    8 + 1 inputs per weight row), logits and K/V rows bit for bit, on 2 threads (chunks taken in turn)."""
    from cachedrag.model.fused_decode import FusedDecode

    tok = byte_tokenizer()
    runner = ModelRunner(tiny_model("llama", vocab_size=len(tok), **overrides), tok, dtype=dtype, weights=weights)
    steps = {"prefetch": FusedDecode(runner, packed=packed),
             "reference": FusedDecode(runner, prefetch=False, dynamic_rows=False, epilogues=False, packed=packed)}
    prompts = [torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(n)) for n in range(5, 14)]
    kvs = {}
    for name in steps:
        kvs[name] = []
        for p in prompts:
            kv = runner.new_kv(len(p) + 4)
            runner.prefill(p, kv=kv)
            kvs[name].append(kv)
    tokens, positions = list(range(7, 16)), [len(p) for p in prompts]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for _ in range(3):
            got = steps["prefetch"].step_batch(tokens, positions, kvs["prefetch"])  # [B, V]
            want = steps["reference"].step_batch(tokens, positions, kvs["reference"])  # [B, V]
            assert torch.equal(got, want)
            tokens, positions = want.argmax(-1).tolist(), [p + 1 for p in positions]
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(kvs["prefetch"], kvs["reference"]):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


@pytest.mark.skipif(weights_module.int8_tiles() is None, reason="int8 levels stored as tiles need AVX-512")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("overrides", [{}, RAGGED])
def test_int8_tiles_step_is_the_packed_step_of_the_row_major_levels(arch, overrides, monkeypatch):
    """A runner whose int8 levels are stored as tiles hands them to the fused step as they are (no
    copy: ``packed_bytes`` 0, every projection read from tiles); the step computes what the step over
    the row-major levels packed into its own copy computes, bit for bit (the same tiles, gate/up ones
    holding 16 units' gate and up rows, and sums): 3 requests, logits and K/V rows."""
    from cachedrag.model.fused_decode import FusedDecode

    tok = byte_tokenizer()
    runners = {"tiles": ModelRunner(tiny_model(arch, vocab_size=len(tok), **overrides), tok, weights="int8")}
    monkeypatch.setattr(weights_module, "INT8_TILES", False)
    runners["rows"] = ModelRunner(tiny_model(arch, vocab_size=len(tok), **overrides), tok, weights="int8")
    assert runners["rows"].fast_layers[0].qkv.tiles is None and runners["tiles"].fast_layers[0].qkv.qrows is None
    steps = {"tiles": runners["tiles"].fused, "rows": FusedDecode(runners["rows"], packed=True)}
    assert steps["tiles"].packed_bytes == 0 and steps["rows"].packed_bytes > 0
    assert steps["tiles"].packed_projections == steps["rows"].packed_projections == 4 * len(runners["rows"].layers) + 1
    # prompts past INT8_KERNEL_ROWS: prefill dequantises (bit for bit the row-major levels' weight)
    prompts = [torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(n)) for n in (17, 20, 23)]
    kvs = {}
    for name, runner in runners.items():
        kvs[name] = []
        for p in prompts:
            kv = runner.new_kv(len(p) + 4)
            runner.prefill(p, kv=kv)
            kvs[name].append(kv)
    for a, b in zip(kvs["tiles"], kvs["rows"]):  # prefill over the tiles (dequantised) as over the rows
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    tokens, positions = [7, 8, 9], [len(p) for p in prompts]
    for _ in range(3):
        got = steps["tiles"].step_batch(tokens, positions, kvs["tiles"])  # [B, V]
        want = steps["rows"].step_batch(tokens, positions, kvs["rows"])  # [B, V]
        assert torch.equal(got, want)
        tokens, positions = want.argmax(-1).tolist(), [p + 1 for p in positions]
    for a, b in zip(kvs["tiles"], kvs["rows"]):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


def test_decode_step_choice():
    """``auto`` takes the fused step where it applies and says why not elsewhere; ``fused`` where it
    cannot apply is a ConfigError naming the reason; an unknown name is refused."""
    if attention.kernel() is not None:
        assert tiny_runner().decode_step_kind == "fused"
        assert tiny_runner(dtype="bfloat16", weights="int8").decode_step_kind == "fused"
    sdpa = tiny_runner(decode_attention="sdpa")
    assert sdpa.decode_step_kind == "torch" and sdpa.fused is None and "sdpa" in sdpa.decode_step_note
    int4 = tiny_runner(dtype="bfloat16", weights="int4")
    if attention.kernel() is not None and attention.kernel().int4_available():
        assert int4.decode_step_kind == "fused"
    else:
        assert int4.decode_step_kind == "torch" and "int4" in int4.decode_step_note
    reference = tiny_runner(fast=False)
    assert reference.decode_step_kind == "torch" and "fast CPU decode path" in reference.decode_step_note
    assert tiny_runner(decode_step="torch").decode_step_kind == "torch"
    with pytest.raises(ConfigError, match="decode_step='fused' needs"):
        tiny_runner(decode_attention="sdpa", decode_step="fused")
    with pytest.raises(ConfigError, match="decode_step must be"):
        tiny_runner(decode_step="native")



@needs_int4
@pytest.mark.parametrize("out_features", [64, 80, 144])
def test_int4_tiles_hold_the_packed_linear_levels(out_features):
    """The fused step reads the ``PackedLinear``'s own tiles (no copy): each row's scale and zero per group
    and each level where ``csrc/int4_decode.cpp`` reads them."""
    from cachedrag.model import int4
    from cachedrag.model.fused_decode import _parts
    from cachedrag.model.weights import Numerics, PackedLinear

    w = torch.randn(out_features, 96, generator=torch.Generator().manual_seed(out_features))  # [O, I]
    p = PackedLinear(w, None, Numerics(weights="int4"))
    assert p.int4.storage == "tiles" and _parts(p)[0].data_ptr() == p.int4.tiles.data_ptr()
    q, scale_zero = int4.quantize(w)  # [O', I], [G, O', 2]
    tiles = p.int4.tiles  # [T, G, 320]
    assert tiles.shape == (q.shape[0] // 16, 3, 320)
    assert torch.equal(tiles[1, 2, 256:288].view(torch.bfloat16), scale_zero[2, 16:32, 0])
    word = tiles[0, 1, :64].view(torch.int16).int() & 0xFFFF  # block c = 0 of group 1: 32 words
    assert int(word[2 * 3 + 1] >> 4 & 15) == int(q[3, 32 + 2 * 1 + 1])  # row 3, column 8c + 2j + e, j = e = 1