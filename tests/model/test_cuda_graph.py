"""The CUDA-graph decode step (``model/cuda_graph.py``): its static-shape step equals the eager
step on CPU; on CUDA (marked gpu) the replayed graph equals the eager CUDA step and the CPU runner."""

from __future__ import annotations

import pytest
import torch

from cachedrag.kernels import triton_available
from cachedrag.model.cuda_graph import static_step
from cachedrag.model.generation import SamplingParams
from cachedrag.model.runner import GRAPH_ROWS, ModelRunner
from cachedrag.model.textgen import TextGenerator
from cachedrag.testing import TINY_ARCHITECTURES, tiny_runner


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g)


def _steps_match(eager_runner, runner, eager, static, cap: int, check_v: bool = False) -> None:
    """Four decode steps from position 20: ``static_step`` of ``runner`` over ``static`` gives the eager
    step's logits and K (and V) row of ``eager_runner`` over ``eager``."""
    cos, sin = runner.rotary.cos_sin(torch.arange(cap), runner.dtype, runner.device)  # [C, D] each
    for step, token in enumerate([5, 77, 3, 250]):
        pos = 20 + step
        want = eager_runner.decode_step(token, pos, eager)
        got = static_step(runner, static.k, static.v, torch.tensor([token]), torch.tensor([pos]), cos, sin)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        torch.testing.assert_close(static.k[:, :, pos], eager.k[:, :, pos], atol=1e-5, rtol=0)
        if check_v:
            torch.testing.assert_close(static.v[:, :, pos], eager.v[:, :, pos], atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_static_step_equals_the_eager_step(arch):
    """The step a graph captures (attention over the whole buffer under the position's mask, rows
    past the position zero) gives the eager step's logits and K/V row, step after step."""
    runner = tiny_runner(arch, decode_step="torch")
    ids = _ids(20)
    cap = 32
    eager, static = runner.new_kv(cap), runner.new_kv(cap)
    runner.prefill(ids, kv=eager)
    runner.prefill(ids, kv=static)
    _steps_match(runner, runner, eager, static, cap)


@pytest.mark.skipif(not triton_available(), reason="triton does not import here")
@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_fused_static_step_equals_the_eager_step(arch, monkeypatch):
    """The step as the Triton backend captures it (RMSNorm with the residual add, RoPE with the K/V
    write: ``write_row`` / ``finish_row`` / ``logits_row``, run here by Triton's interpreter on CPU)
    gives the eager step's logits and K/V row, step after step (float32: equal to float rounding)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    eager_runner = tiny_runner(arch, decode_step="torch")
    runner = tiny_runner(arch, decode_step="torch", kernel_backend="triton")
    assert runner.row_kernels and not eager_runner.row_kernels
    ids = _ids(20)
    cap = 32
    eager, static = eager_runner.new_kv(cap), runner.new_kv(cap)
    eager_runner.prefill(ids, kv=eager)
    static.k[:, :, :20], static.v[:, :, :20] = eager.k[:, :, :20], eager.v[:, :, :20]  # the same rows to attend to
    _steps_match(eager_runner, runner, eager, static, cap, check_v=True)


def test_row_kernels_only_for_plain_rms_norms():
    """A norm of another form (here Gemma's ``1 + weight``) keeps the unfused step."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    from cachedrag.model.runner import plain_rms_norm

    runner = tiny_runner("llama", decode_step="torch", kernel_backend="triton")
    assert plain_rms_norm(runner.layers[0].input_layernorm) is not None
    assert plain_rms_norm(GemmaRMSNorm(64)) is None
    runner.layers[1].post_attention_layernorm = GemmaRMSNorm(64)
    runner._row_norms = False  # looked up again
    assert runner.row_norms() is None and not runner.row_kernels
    assert not tiny_runner("llama", decode_step="torch").row_kernels  # torch kernels: the unfused step


def test_one_mask_serves_every_layer_without_windows():
    from cachedrag.model.cuda_graph import step_masks

    llama, mistral = tiny_runner("llama", decode_step="torch"), tiny_runner("mistral", decode_step="torch")
    masks = step_masks(llama, torch.tensor([5]), 32)  # [1, C] each
    assert all(m is masks[0] for m in masks)
    assert torch.equal(masks[0][0, :6], torch.zeros(6)) and torch.isinf(masks[0][0, 6:]).all()
    windowed = step_masks(mistral, torch.tensor([30]), 32)  # sliding window 24
    assert torch.isinf(windowed[0][0, :7]).all() and torch.equal(windowed[0][0, 7:31], torch.zeros(24))


def test_cuda_graph_step_is_refused_on_cpu():
    from cachedrag.errors import ConfigError

    with pytest.raises(ConfigError, match="needs a CUDA runner"):
        tiny_runner("llama", decode_step="cuda-graph")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _cuda_runner(arch: str, dtype: str = "float32", **kw) -> ModelRunner:
    """``tiny_runner(arch, seed=2)`` on CUDA."""
    return tiny_runner(arch, seed=2, device="cuda", dtype=dtype, **kw)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_graph_decode_equals_eager_cuda_and_cpu(arch):
    graph = _cuda_runner(arch)
    eager = _cuda_runner(arch, decode_step="torch")
    cpu = tiny_runner(arch, seed=2, decode_step="torch")
    assert graph.decode_step_kind == "cuda-graph" and eager.decode_step_kind == "torch"
    prompt = _ids(40, seed=4).tolist()
    params = SamplingParams(max_new_tokens=24)
    texts = [TextGenerator(r).generate(prompt, params).token_ids for r in (graph, eager, cpu)]
    assert texts[0] == texts[1] == texts[2]
    # logits of one step, and the buffer capacity rounded for graph reuse
    kv_g, kv_e = graph.new_kv(60), eager.new_kv(60)
    assert kv_g.capacity == GRAPH_ROWS and kv_e.capacity == 60
    ids = _ids(30, seed=5)
    graph.prefill(ids, kv=kv_g)
    eager.prefill(ids, kv=kv_e)
    for step in range(3):
        torch.testing.assert_close(graph.decode_step(7 + step, 30 + step, kv_g),
                                   eager.decode_step(7 + step, 30 + step, kv_e), atol=1e-4, rtol=0)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_fused_graph_decode_in_bfloat16_equals_the_unfused_graph(arch):
    """The graph of the fused rows (Triton backend, the CUDA default) against the graph of the unfused
    ops, bf16: the same K/V rows and logits up to bf16 rounding, and the same greedy tokens."""
    fused = _cuda_runner(arch, dtype="bfloat16")
    plain = _cuda_runner(arch, dtype="bfloat16")
    plain._row_norms = None  # the unfused ops of write_layer / finish_layer, also captured
    assert fused.row_kernels and not plain.row_kernels
    ids = _ids(30, seed=5)
    kv_f, kv_p = fused.new_kv(60), plain.new_kv(60)
    fused.prefill(ids, kv=kv_f)
    plain.prefill(ids, kv=kv_p)
    for step in range(3):
        got, want = fused.decode_step(7 + step, 30 + step, kv_f), plain.decode_step(7 + step, 30 + step, kv_p)
        torch.testing.assert_close(got, want, atol=5e-2, rtol=0)
        torch.testing.assert_close(kv_f.k[:, :, 30 + step], kv_p.k[:, :, 30 + step], atol=3e-2, rtol=2 ** -7)
    prompt = _ids(40, seed=4).tolist()
    params = SamplingParams(max_new_tokens=8)
    tokens = [TextGenerator(r).generate(prompt, params).token_ids for r in (fused, plain)]
    assert tokens[0] == tokens[1]


@pytest.mark.gpu
@cuda
def test_graph_is_reused_for_a_buffer_of_the_same_capacity_and_survives_garbage():
    runner = _cuda_runner("llama", dtype="bfloat16")
    ids = _ids(50, seed=6)
    outs = []
    for _ in range(3):
        kv = runner.new_kv(70)
        kv.k.fill_(float("nan"))  # uninitialised memory past the prompt must not leak into attention
        kv.v.fill_(float("nan"))
        runner.prefill(ids, kv=kv)
        outs.append(runner.decode_step(9, 50, kv))
        del kv
    assert runner.cuda_graphs.captures == 1
    assert all(torch.isfinite(o).all() for o in outs)
    torch.testing.assert_close(outs[0], outs[2], atol=0, rtol=0)


def test_device_auto_resolves_to_what_this_machine_has_and_bad_devices_are_refused():
    from cachedrag.errors import ConfigError
    from cachedrag.model.runner import resolve_device

    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="unknown device"):
        resolve_device("tpu7")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="is_available"):
            resolve_device("cuda:0")
