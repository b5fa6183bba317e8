"""Backend choice for the kernels: Triton or the torch reference, and lazy Triton JIT.

Owns: the optional import of Triton (``triton``, ``tl``, ``libdevice`` are ``None`` when it is
missing, and the import error is kept to be reported), the rule that picks a backend for a call
(:func:`which_backend`), the :class:`Backend` record every public kernel returns, and
:func:`jit`, which wraps a kernel function with ``triton.jit`` when first launched.

Does not own: any kernel or reference arithmetic (``rerotate.py``, ``selective_attention.py``).

Why lazy JIT: ``triton.jit`` decides at decoration time whether a kernel runs compiled or under
the interpreter (``TRITON_INTERPRET=1``). Decorating at import would make the result depend on
import order (a test that imported ``cachedrag.kernels`` before the kernel tests set the variable
would get compiled kernels that cannot take CPU tensors). :func:`jit` instead decorates on first
launch, once per mode, so the variable can be set (or unset) per test.

Backend rule (``backend=`` of every public kernel):

* ``"torch"``: the reference, always available.
* ``"triton"``: the Triton kernel; tensors on CUDA, or on CPU when ``TRITON_INTERPRET=1``.
  Anything else raises; a forced backend never silently becomes another.
* ``"auto"``: Triton when the tensors are on CUDA and Triton imports, the reference otherwise.
  CUDA tensors without Triton are a fallback: reported in :attr:`Backend.reason` and logged once.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    TRITON_IMPORT_ERROR: str | None = None
except ImportError as exc:  # reported by which_backend(); the torch references still work
    triton = None
    tl = None
    libdevice = None
    TRITON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

logger = logging.getLogger(__name__)

# Kernels call only Triton builtins. tl.max / tl.sum / tl.zeros are themselves @triton.jit
# functions, wrapped (compiled or interpreted) once when triton is imported, so an interpreted
# kernel cannot call them if triton was imported before TRITON_INTERPRET=1 was set. Instead:
# tl.full for zeros, and tl.reduce with triton's standard combine functions for max / sum (the
# same thing tl.max / tl.sum do; the interpreter maps these two to numpy).
MAX_COMBINE = tl.standard._elementwise_max if tl is not None else None
SUM_COMBINE = tl.standard._sum_combine if tl is not None else None

BackendRequest = Literal["auto", "triton", "torch"]
_REQUESTS = ("auto", "triton", "torch")


@dataclass(frozen=True)
class Backend:
    """Which implementation ran a kernel call, and why.

    ``name`` is ``"triton"`` or ``"torch"``; ``interpreted`` is true when Triton ran under
    ``TRITON_INTERPRET=1``; ``reason`` says why this one was chosen (a fallback says so).
    """

    name: Literal["triton", "torch"]
    reason: str
    interpreted: bool = False

    @property
    def is_fallback(self) -> bool:
        return self.reason.startswith("fallback")

    def __str__(self) -> str:
        mode = " (interpreter)" if self.interpreted else ""
        return f"{self.name}{mode}: {self.reason}"


def triton_available() -> bool:
    """True when ``triton`` imported (it may still lack a GPU to run on)."""
    return TRITON_IMPORT_ERROR is None


def interpreting() -> bool:
    """True when Triton kernels would run under the interpreter (read live, not cached)."""
    if triton is not None:
        return bool(triton.knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


def _device_of(tensors: tuple[torch.Tensor, ...]) -> torch.device:
    devices = {t.device for t in tensors if t is not None}
    if not devices:
        raise ValueError("which_backend needs at least one tensor")
    if len(devices) > 1:
        raise ValueError(f"all kernel tensors must be on one device, got {sorted(map(str, devices))}")
    return devices.pop()


_warned_fallback = False


def which_backend(*tensors: torch.Tensor | None, backend: BackendRequest = "auto") -> Backend:
    """The backend a kernel call on ``tensors`` runs with (launches nothing).

    Raises ``ValueError`` for an unknown request or mixed devices, ``RuntimeError`` when
    ``backend="triton"`` cannot run here (no Triton, or CPU tensors without the interpreter).
    """
    if backend not in _REQUESTS:
        raise ValueError(f"backend must be one of {_REQUESTS}, got {backend!r}")
    return _choose(_device_of(tensors).type, backend)


def _choose(device_type: str, backend: BackendRequest) -> Backend:
    """The rule of :func:`which_backend` for tensors on ``device_type``."""
    global _warned_fallback
    if backend == "torch":
        return Backend("torch", "requested")
    if backend == "triton":
        if not triton_available():
            raise RuntimeError(f"backend='triton' requested but triton does not import ({TRITON_IMPORT_ERROR})")
        if device_type == "cuda":
            return Backend("triton", "requested", interpreted=interpreting())
        if interpreting():
            return Backend("triton", f"requested; {device_type} tensors under TRITON_INTERPRET=1", interpreted=True)
        raise RuntimeError(
            f"backend='triton' on {device_type} tensors needs TRITON_INTERPRET=1 (Triton's interpreter); "
            "compiled Triton kernels take CUDA tensors only"
        )
    # auto
    if device_type != "cuda":
        return Backend("torch", f"auto: tensors on {device_type}")
    if not triton_available():
        if not _warned_fallback:
            logger.warning("cachedrag.kernels: CUDA tensors but triton does not import (%s); "
                           "running the torch references", TRITON_IMPORT_ERROR)
            _warned_fallback = True
        return Backend("torch", f"fallback: triton does not import ({TRITON_IMPORT_ERROR})")
    return Backend("triton", "auto: tensors on cuda", interpreted=interpreting())


_JIT_CACHE: dict[tuple[Callable[..., Any], bool], Any] = {}


def jit(fn: Callable[..., Any]) -> Any:
    """``triton.jit(fn)`` for the current mode (compiled or interpreter), made once per mode."""
    if triton is None:
        raise RuntimeError(f"triton does not import ({TRITON_IMPORT_ERROR})")
    key = (fn, interpreting())
    kernel = _JIT_CACHE.get(key)
    if kernel is None:
        kernel = triton.jit(fn)
        _JIT_CACHE[key] = kernel
    return kernel


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (>= 1); Triton block shapes must be powers of two."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


_TL_DTYPES = {}
if tl is not None:
    _TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def tl_dtype(dtype: torch.dtype) -> Any:
    """The Triton dtype of a supported torch float dtype."""
    return _TL_DTYPES[dtype]


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check(cond: bool, message: str, exc: type[Exception] = ValueError) -> None:
    """Raise ``exc(message)`` unless ``cond``: boundary checks that survive ``python -O``."""
    if not cond:
        raise exc(message)
