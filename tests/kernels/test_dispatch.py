"""Backend choice: auto/triton/torch rules, reported fallbacks, lazy per-mode JIT."""

from __future__ import annotations

import importlib
import logging

import pytest
import torch

from cachedrag.kernels import _dispatch, rerotate, triton_available, which_backend

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton does not import here")


def test_auto_on_cpu_is_torch():
    chosen = which_backend(torch.zeros(2), None, torch.zeros(3, dtype=torch.long))
    assert chosen.name == "torch" and chosen.reason == "auto: tensors on cpu" and not chosen.is_fallback


def test_torch_requested():
    assert which_backend(torch.zeros(1), backend="torch").reason == "requested"


def test_unknown_request_and_mixed_devices():
    with pytest.raises(ValueError, match="backend must be"):
        which_backend(torch.zeros(1), backend="gpu")
    with pytest.raises(ValueError, match="one device"):
        which_backend(torch.zeros(1), torch.zeros(1, device="meta"))
    with pytest.raises(ValueError, match="at least one"):
        which_backend(None)


@needs_triton
def test_triton_on_cpu_needs_interpreter(monkeypatch):
    assert which_backend(torch.zeros(1), backend="triton").interpreted  # conftest set TRITON_INTERPRET=1
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        which_backend(torch.zeros(1), backend="triton")


def test_cuda_without_triton_is_a_reported_fallback(monkeypatch, caplog):
    monkeypatch.setattr(_dispatch, "TRITON_IMPORT_ERROR", "ModuleNotFoundError: No module named 'triton'")
    monkeypatch.setattr(_dispatch, "_warned_fallback", False)
    with caplog.at_level(logging.WARNING, logger="cachedrag.kernels._dispatch"):
        chosen = _dispatch._choose("cuda", "auto")
        _dispatch._choose("cuda", "auto")
    assert chosen.name == "torch" and chosen.is_fallback and "No module named" in chosen.reason
    assert sum("triton does not import" in r.message for r in caplog.records) == 1  # logged once
    with pytest.raises(RuntimeError, match="does not import"):
        _dispatch._choose("cuda", "triton")


def test_auto_on_cuda_is_triton():
    if not triton_available():
        pytest.skip("triton does not import here")
    assert _dispatch._choose("cuda", "auto").name == "triton"


@needs_triton
def test_jit_is_made_per_mode(monkeypatch):
    """The same kernel function is interpreted or compiled by the mode at launch, not at import."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from cachedrag.kernels.rerotate import _rerotate_kernel

    interpreted = _dispatch.jit(_rerotate_kernel)
    assert isinstance(interpreted, InterpretedFunction) and _dispatch.jit(_rerotate_kernel) is interpreted
    monkeypatch.delenv("TRITON_INTERPRET")
    assert isinstance(_dispatch.jit(_rerotate_kernel), JITFunction)


@needs_triton
def test_triton_really_runs_under_interpreter(monkeypatch):
    """A forced Triton call goes through the interpreted kernel (spy on the launch)."""
    rerotate_module = importlib.import_module("cachedrag.kernels.rerotate")  # the module, not the function
    launched = []
    real_jit = rerotate_module.jit
    monkeypatch.setattr(rerotate_module, "jit", lambda fn: launched.append(fn) or real_jit(fn))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    got = rerotate(torch.randn(2, 3, 16), torch.arange(3), inv_freq, backend="triton")
    assert launched == [rerotate_module._rerotate_kernel]
    assert str(got.backend).startswith("triton (interpreter)")


def test_next_power_of_2():
    assert [_dispatch.next_power_of_2(n) for n in (0, 1, 2, 3, 12, 16, 17)] == [1, 1, 2, 4, 16, 16, 32]
