"""Which weight copies a runner keeps: int4 codes only (model/int4.py), HF modules reading the fused
weights once released (model/weight_views.py), and the checkpoint-dtype load of int4 runners."""

import pytest
import torch
import torch.nn.functional as F

from cachedrag.model import int4
from cachedrag.model.runner import ModelRunner
from cachedrag.model.weight_views import FusedRows, HeadRowsEmbedding, resident_bytes
from cachedrag.model.weights import Numerics, PackedLinear, int8_tiles
from cachedrag.testing import byte_tokenizer, tiny_model

needs_native_int4 = pytest.mark.skipif(int4.native_int4() is None,
                                       reason="int4 tiles need the native kernels on an AVX512-BF16 CPU")


@needs_native_int4
@pytest.mark.parametrize("rows,cols", [(16, 64), (40, 32), (80, 96), (700, 64)])
def test_int4_tiles_dequantise_and_multiply_as_the_reference(rows, cols):
    """Tiles: the native dequantisation equals ``(q - 8) * scale + zero`` bit for bit (into a reused buffer
    too), ``from_tiles`` gives back the codes and scales, and the native few-row matmul (+ bias) is the
    float32 product with the dequantised weight to its bf16 rounding; tiles and torch's layout hold the
    same weight."""
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)) * 0.1  # [O, I]
    codes, scale_zero = int4.quantize(w)  # [O', I], [G, O', 2]
    tiles = int4.Int4Weight([w[:rows // 3], w[rows // 3:]], storage="tiles")
    want = int4.reference_dequantized(codes, scale_zero)[:rows]  # [O, I]
    assert torch.equal(tiles.dequantized(), want)
    buf = torch.full((rows, cols), float("nan"), dtype=torch.bfloat16)
    assert tiles.dequantized(buf).data_ptr() == buf.data_ptr() and torch.equal(buf, want)
    back = int4.from_tiles(tiles.tiles)
    assert torch.equal(back[0], codes) and torch.equal(back[1], scale_zero)
    assert torch.equal(int4.Int4Weight(w, storage="torch").dequantized(), want)
    assert tiles.nbytes == int4.Int4Weight(w, storage="torch").nbytes  # the same bytes, rearranged
    sz = scale_zero.float().transpose(0, 1)  # [O', G, 2]
    exact = ((codes.float().view(codes.shape[0], -1, 32) - 8) * sz[..., :1] + sz[..., 1:])  # [O', G, 32] unrounded
    exact = exact.view(codes.shape)[:rows]  # [O, I]: the kernels' weight (dequantized() rounds it to bf16)
    bias = torch.randn(rows).bfloat16()
    for n in (1, 3, 16, 100):
        x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n)).bfloat16()  # [N, I]
        ref = x.float() @ exact.t() + bias.float()  # [N, O]
        got = tiles.matmul(x, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (n, rows)
        torch.testing.assert_close(got.float(), ref.bfloat16().float(), atol=1e-3, rtol=8e-3)


@needs_native_int4
def test_int4_storages_compute_alike_in_a_projection(monkeypatch):
    """A ``PackedLinear`` kept as native tiles and one kept in torch's layout: the same dequantised weight,
    and close outputs for decode rows (the two kernels) and prefill rows (the same oneDNN matmul on the
    same weight, bit for bit); the prefill's buffer is reused, never aliased by the output."""
    w = torch.randn(80, 96, generator=torch.Generator().manual_seed(3)) * 0.1  # [O, I]
    b = torch.randn(80) * 0.1
    monkeypatch.setattr(int4, "STORAGE", "torch")
    ref = PackedLinear(w, b, Numerics(weights="int4"))
    monkeypatch.setattr(int4, "STORAGE", "tiles")
    fast = PackedLinear(w, b, Numerics(weights="int4"))
    assert (ref.int4.storage, fast.int4.storage) == ("torch", "tiles")
    assert torch.equal(ref.dequantized(), fast.dequantized())
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(4)).bfloat16()
    torch.testing.assert_close(fast(x).float(), ref(x).float(), atol=2e-2, rtol=2e-2)
    rows = torch.randn(300, 96, generator=torch.Generator().manual_seed(5)).bfloat16()
    first = fast(rows)
    assert torch.equal(first, ref(rows)) and torch.equal(fast(rows), first)


@pytest.mark.parametrize("rows,cols", [(16, 64), (40, 32), (64, 96), (80, 64), (700, 64), (1000, 32)])
def test_int4_dequantized_from_packed_codes_equals_the_reference(rows, cols, monkeypatch):
    """The weight rebuilt from torch's packed codes (full 64-row blocks, tails, padded rows, several
    ``ROW_BLOCK`` steps) equals ``(q - 8) * scale + zero`` from the codes before packing, bit for bit;
    packed in row chunks it is torch's packing of the whole weight, and row blocks quantise as the whole."""
    monkeypatch.setattr(int4, "PACK_ROWS", 128)
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)) * 0.1  # [O, I]
    codes, scale_zero = int4.quantize(w)  # [O', I], [G, O', 2]
    weight = int4.Int4Weight([w[:rows // 3], w[rows // 3:]], storage="torch")  # two row blocks, as q/k/v arrive
    assert torch.equal(weight.dequantized(), int4.reference_dequantized(codes, scale_zero)[:rows])
    whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    assert torch.equal(weight.packed, whole) and torch.equal(weight.scale_zero, scale_zero)  # what the kernel reads


def test_int4_plain_layout_where_torch_layout_is_unknown(monkeypatch):
    """Without a known inverse of torch's packing the codes are kept once more in a plain layout and read
    from there: the same weight, 0.5 bytes a weight more."""
    w = torch.randn(80, 64, generator=torch.Generator().manual_seed(1)) * 0.1  # [O, I]
    known = int4.Int4Weight(w, storage="torch")
    monkeypatch.setattr(int4, "layout", lambda: None)
    plain = int4.Int4Weight(w, storage="torch")
    assert plain.plain is not None and known.plain is None
    assert torch.equal(plain.dequantized(), known.dequantized())
    assert plain.resident_bytes() == known.resident_bytes() + 80 * 64 // 2


@pytest.mark.parametrize("storage", ["torch", pytest.param("tiles", marks=needs_native_int4)])
def test_int4_projection_keeps_only_its_packed_codes(storage, monkeypatch):
    monkeypatch.setattr(int4, "STORAGE", storage)
    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(2)) * 0.1  # [O, I]
    p = PackedLinear(w, None, Numerics(weights="int4"))
    assert p.weight is None and getattr(p, "packed", None) is None and p.int4.storage == storage
    from cachedrag.model.weight_views import _tensors_of

    assert sum(t.numel() * t.element_size() for t in _tensors_of(p)) == p.resident_bytes  # what reports count
    assert p.resident_bytes <= 0.63 * w.numel() + (p.int4.plain.numel() if p.int4.plain is not None else 0)
    x = torch.randn(256, 128).bfloat16()  # prefill rows past the kernel's: one transient dequantised weight
    monkeypatch.setattr(int4._scratch, "buf", None, raising=False)
    with torch.inference_mode():  # the reused buffer made under inference mode stays writable outside it
        inside = p(x)
    torch.testing.assert_close(p(x).float(), F.linear(x, p.dequantized()).float(), atol=0, rtol=0)
    assert torch.equal(inside, p(x))


def _runners(weights: str, **config):
    tok = byte_tokenizer()
    kept = ModelRunner(tiny_model(vocab_size=len(tok), **config), tok, dtype="bfloat16", weights=weights)
    released = ModelRunner(tiny_model(vocab_size=len(tok), **config), tok, dtype="bfloat16", weights=weights,
                           release_weights=True)
    return kept, released


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_released_runner_computes_as_before(weights):
    """Releasing the HF weights changes no value the fast path computes (an untied head): prefill and
    decode bit for bit; the released modules read their rows of the fused weights."""
    kept, released = _runners(weights)
    ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(3))
    kv_k, kv_r = kept.new_kv(34), released.new_kv(34)
    assert torch.equal(kept.prefill(ids, kv=kv_k), released.prefill(ids, kv=kv_r))
    assert torch.equal(kept.decode_step(7, 30, kv_k), released.decode_step(7, 30, kv_r))
    attn, lw = released.layers[0].self_attn, released.fast_layers[0]
    assert isinstance(attn.k_proj, FusedRows) and not list(attn.k_proj.parameters())
    assert torch.equal(attn.k_proj.weight, lw.qkv.dequantized()[lw.q_out:lw.q_out + lw.kv_out])
    assert isinstance(released.model.lm_head, FusedRows) == (released.fast_head.kind in ("int8", "int4"))
    assert resident_bytes(released.model) < resident_bytes(kept.model)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_released_model_runs_as_a_reference_on_the_fused_weights(weights):
    """The HF modules of a released model compute with the weights the runner's kernels use: a reference
    runner (HF modules, F.linear) over that model tracks the fast runner's logits."""
    _, released = _runners(weights)
    ref = ModelRunner(released.model, released.tokenizer, fast=False, skinny_linear=False)
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(4))
    want, got = ref.prefill(ids, kv=ref.new_kv(24)), released.prefill(ids, kv=released.new_kv(24))
    assert (got - want).abs().max() < 0.02 * want.std() + 0.02
    with torch.no_grad():
        hf = released.model(ids[None]).logits[0, -1].float()  # [V] the model's own forward
    assert (hf - want).abs().max() < 0.05 * want.std() + 0.05


def test_tied_int8_head_serves_the_embedding():
    """A tied int8 head, released: the embedding gathers its rows and dequantises them (no bf16 table)."""
    kept, released = _runners("int8", tie_word_embeddings=True)
    emb = released.model.get_input_embeddings()
    assert isinstance(emb, HeadRowsEmbedding) and released.fast_head.kind == "int8"
    ids = torch.tensor([0, 5, 255, 5])
    assert torch.equal(emb(ids), released.fast_head.dequantized()[ids])
    assert torch.equal(released.embed(ids), emb(ids))
    x = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(5))
    want, got = kept.prefill(x, kv=kept.new_kv(20)), released.prefill(x, kv=released.new_kv(20))
    assert (got - want).abs().max() < 0.05 * want.std() + 0.05  # only the embedding's int8 rounding differs
    assert resident_bytes(released.model) < resident_bytes(kept.model)


@pytest.mark.skipif(int8_tiles() is None, reason="int8 tiles need the native library on an AVX-512 CPU")
def test_int8_runner_with_the_fused_step_keeps_one_copy():
    """An int8 runner (released, tied head serving the embedding) keeps each projection's levels once, as
    the fused step's tiles (1 byte a weight, the last tile's zero rows aside), and the fused step reads
    them as they are (``packed_bytes`` 0): the resident bytes are the tiles, scales, biases and norms."""
    tok = byte_tokenizer()
    runner = ModelRunner(tiny_model(vocab_size=len(tok), tie_word_embeddings=True), tok, dtype="bfloat16",
                         weights="int8", release_weights=True)
    assert runner.decode_step_kind == "fused" and runner.fused.packed_bytes == 0
    packed = [q for lw in runner.fast_layers for q in (lw.qkv, lw.o, lw.gate_up, lw.down)] + [runner.fast_head]
    assert all(p.tiles is not None and p.qrows is None for p in packed)
    assert isinstance(runner.model.get_input_embeddings(), HeadRowsEmbedding)
    levels = sum(p.out_features * p.in_features for p in packed)
    padding = sum(p.tiles.numel() - p.out_features * p.in_features for p in packed)  # the last tiles' zero rows
    assert all(p.tiles.numel() - p.out_features * p.in_features < 32 * p.in_features for p in packed)
    small = sum(p.scale.nbytes + (p.bias.nbytes if p.bias is not None else 0) for p in packed)
    params = sum(t.nbytes for t in list(runner.model.parameters()) + list(runner.model.buffers()))
    assert params < 0.05 * levels  # norms and rotary buffers: no weight matrix left in the model
    total = resident_bytes(runner.model, (runner.fast_layers, runner.fast_head))
    assert total == levels + padding + small + params
    x = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(6))
    kv = runner.new_kv(24)
    runner.prefill(x, kv=kv)
    assert runner.decode_step(7, 20, kv).isfinite().all()


def test_int4_from_a_bf16_checkpoint_loads_bf16_and_packs_the_same(tmp_path):
    """int4 quantises the checkpoint's own values: a bfloat16 directory loads in bfloat16 (half the bytes of
    the float32 load), and its int4 codes are those of the float32 load."""
    from cachedrag.model.loader import _checkpoint_dtype

    tok = byte_tokenizer()
    model = tiny_model(vocab_size=len(tok), dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    assert _checkpoint_dtype(str(tmp_path)) == torch.bfloat16
    runner = ModelRunner.from_pretrained(str(tmp_path), weights="int4", warmup=False)
    assert runner.load_report is None and isinstance(runner.layers[0].mlp.up_proj, FusedRows)
    ref = ModelRunner(tiny_model(vocab_size=len(tok), dtype=torch.bfloat16).float(), tok, weights="int4")
    for a, b in zip(runner.fast_layers, ref.fast_layers):
        for pa, pb in ((a.qkv, b.qkv), (a.gate_up, b.gate_up), (a.down, b.down)):
            assert all(torch.equal(a_, b_) for a_, b_ in zip(pa.int4.state(), pb.int4.state()))


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_gguf_load_keeps_one_copy_and_reports_it(tmp_path, weights):
    """A GGUF with a tied embedding loaded into int8/int4: the HF modules read the packed weights, an
    int8 head serves the embedding, and the load report's weight bytes are what the runner keeps;
    the logits track a runner packed from transformers' load of the same file (which keeps every copy)."""
    from transformers import AutoModelForCausalLM

    from cachedrag.testing import save_tiny_gguf

    path, _ = save_tiny_gguf(tmp_path / "tied.gguf", qtype="Q8_0", tie_word_embeddings=True)
    direct = ModelRunner.from_pretrained(str(path), dtype="bfloat16", weights=weights, warmup=False)
    assert isinstance(direct.layers[1].mlp.down_proj, FusedRows)
    assert isinstance(direct.model.get_input_embeddings(), HeadRowsEmbedding) == (direct.fast_head.kind == "int8")
    assert direct.load_report.weight_bytes == resident_bytes(direct.model, (direct.fast_layers, direct.fast_head))
    load_dtype = torch.float32 if weights == "int4" else torch.bfloat16
    ref_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=load_dtype).eval()
    ref = ModelRunner(ref_model, direct.tokenizer, dtype="bfloat16", weights=weights)
    ids = torch.arange(3, 60)  # [T]
    want, got = ref.prefill(ids, all_logits=True), direct.prefill(ids, all_logits=True)  # [T, V] each
    assert (got - want).abs().max() < 0.05 * want.std() + 0.05
