"""The few-row ``W @ x^T`` linear layout agrees with ``F.linear`` (its reference path)."""

from __future__ import annotations

import pytest
import torch

from cachedrag.model.linear import SKINNY_ROWS, gated_mlp, linear, reference_linear
from cachedrag.model.runner import ModelRunner
from cachedrag.testing import byte_tokenizer, TINY_ARCHITECTURES, tiny_runner


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (2, 48), (SKINNY_ROWS, 48), (SKINNY_ROWS + 1, 48), (3, 1, 48), (0, 48)])
def test_linear_equals_reference(shape, bias):
    torch.manual_seed(0)
    module = torch.nn.Linear(48, 80, bias=bias)
    x = torch.randn(*shape)
    got = linear(module, x)
    assert got.shape == (*shape[:-1], 80)
    torch.testing.assert_close(got, reference_linear(module, x), atol=1e-5, rtol=1e-5)


def test_single_row_takes_the_padded_path_and_matches_row_zero_of_two():
    """One row is computed as column 0 of a two-column product, so it equals that row of a
    two-row call bit for bit (decode steps and verification see the same numbers)."""
    torch.manual_seed(1)
    module = torch.nn.Linear(32, 64)
    x = torch.randn(1, 32)
    pair = torch.cat([x, torch.zeros(1, 32)])
    assert torch.equal(linear(module, x)[0], linear(module, pair)[0])


def test_non_linear_module_is_called_as_is():
    class Doubler(torch.nn.Module):
        weight = None

        def forward(self, x):
            return 2 * x

    x = torch.randn(1, 4)
    assert torch.equal(linear(Doubler(), x), 2 * x)


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_gated_mlp_equals_the_hf_mlp(arch):
    runner = tiny_runner(arch)
    mlp = runner.layers[0].mlp
    x = torch.randn(3, runner.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(gated_mlp(mlp, x), mlp(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_runner_decode_equals_reference_layout(arch):
    """Prefill, then decode steps: the skinny runner's logits match a runner on F.linear."""
    fast = ModelRunner(tiny_runner(arch).model, byte_tokenizer(), fast=False)  # the unfused path: layout alone
    ref = ModelRunner(fast.model, fast.tokenizer, skinny_linear=False, fast=False)
    assert fast.project is linear and ref.project is reference_linear
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(3))
    kv_fast, kv_ref = fast.new_kv(24), ref.new_kv(24)
    torch.testing.assert_close(fast.prefill(ids, kv=kv_fast), ref.prefill(ids, kv=kv_ref), atol=1e-4, rtol=0)
    for step, token in enumerate([5, 17, 99, 3]):
        got = fast.decode_step(token, 20 + step, kv_fast)  # [V]
        want = ref.decode_step(token, 20 + step, kv_ref)  # [V]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
