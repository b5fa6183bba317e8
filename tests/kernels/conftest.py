"""Fixtures of the kernel tests: Triton's interpreter for CPU tests, compiled Triton for GPU ones.

Triton (3.x) reads ``TRITON_INTERPRET`` when ``triton.jit`` wraps a function, not when triton is
imported, and ``cachedrag.kernels`` wraps its kernels lazily once per mode
(``cachedrag.kernels._dispatch.jit``). So the variable is set per test here, with
``monkeypatch``, and undone after each test: it never leaks into tests outside this directory
(a GPU run of other suites keeps compiled Triton), and import order does not matter.

* tests not marked ``gpu``: ``TRITON_INTERPRET=1``; ``backend="triton"`` runs the kernels under
  the interpreter on CPU tensors.
* tests marked ``gpu``: skipped without CUDA; with CUDA the variable is removed so the kernels
  compile for the device.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _triton_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("gpu") is not None:
        if not torch.cuda.is_available():
            pytest.skip("needs CUDA (torch.cuda.is_available() is false)")
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
