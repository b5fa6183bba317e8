"""The native CPU library: building, caching and loading it.

Owns: ``kernel()`` (the compiled library's Python module, or None), ``kernel_status()``,
``library_dir()`` and the build. The library's C++ sources are package data in ``csrc/``
(``native.h`` shared by ``decode_attention.cpp``, ``prefill_attention.cpp``, ``int4_decode.cpp``,
``fused_decode.cpp``, ``int4_linear.cpp``, ``int8_tiles.cpp`` and ``bindings.cpp``); they are read at
build time and handed to torch's ``load_inline`` in that order as ONE translation unit, compiled
with the system's C++ compiler at first use
(``-O3 -march=native``) and cached on disk under ``cache_home()/ext``, keyed by the sources, the
flags, torch's version and the CPU's flags. The library's SHA-256 is written beside it after a
build: a library whose bytes changed since is rebuilt, never loaded. Concurrent processes build
once (a file lock).

Without a compiler or ninja (or when the build fails) ``kernel()`` returns None with the reason in
``kernel_status()``: callers keep their torch paths (a fallback, reported, never an error).

Does not own: what the kernels compute and their torch references (``attention.py``,
``fused_decode.py``), which path the runner takes (``runner.py``).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import threading
from pathlib import Path

import torch

from cachedrag.model.artifact import cpu_flags_digest, file_sha256, write_atomic

#: the C++ sources' folder (package data)
CSRC = Path(__file__).with_name("csrc")
#: included by every source (``#include "native.h"``: ``CSRC`` is on the include path)
HEADERS = ("native.h",)
#: the translation unit's parts, in order: the decode kernel, the prefill kernel, the int4 tiles' dot
#: product, the fused decode step that calls the first and the third, the int4 tiles' dequantisation and
#: few-row matmul (the fused step's int4 projection), the int8 tiles' entry points (they call the fused
#: step's tile kernel), the Python bindings
SOURCES = ("decode_attention.cpp", "prefill_attention.cpp", "int4_decode.cpp", "fused_decode.cpp", "int4_linear.cpp",
           "int8_tiles.cpp", "bindings.cpp")

_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-fno-trapping-math",
          "-fopenmp"]
_lock = threading.Lock()
_state: dict = {}


def sources() -> list[str]:
    """The translation unit's parts (``SOURCES``' texts, in order): a new list on every call."""
    return [(CSRC / name).read_text() for name in SOURCES]


def kernel():
    """The compiled library's module (``.decode_attention``, ``.prefill_attention``, ``.FusedStep``)
    or None when it cannot be built here (reason in ``kernel_status()``). Built once per process,
    loaded from the disk cache after."""
    with _lock:
        if "module" not in _state:
            try:
                _state["module"] = _load()
                _state["status"] = "built" if _state.get("built") else "loaded"
            except Exception as exc:  # no compiler, a failed build: callers keep torch  # noqa: BLE001
                _state["module"] = None
                _state["status"] = f"unavailable: {_reason(exc)}"
        return _state["module"]


def _reason(exc: Exception) -> str:
    """An exception as one short line: its type and the last line of its message."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[-1][:200] if text else ''}"


def kernel_status() -> str:
    """``"built"``, ``"loaded"`` (from the disk cache), ``"unavailable: <why>"`` or ``"not tried"``."""
    return _state.get("status", "not tried")


def _key() -> str:
    texts = [(CSRC / name).read_text() for name in HEADERS] + sources()
    blob = "\n".join([*texts, " ".join(_FLAGS), torch.__version__, cpu_flags_digest(), platform.machine()])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def library_dir(cache_dir: Path | None = None) -> Path:
    """The folder of this build of the library (sources, flags, torch, CPU) under ``cache_dir``
    (default ``cache_home()/ext``)."""
    return (cache_dir or _cache_dir()) / f"cachedrag_decode_attn_{_key()}"


def _load(cache_dir: Path | None = None):
    """Load the library from ``cache_dir`` (default ``cache_home()/ext``) when its digest matches,
    else build it there (under a file lock: concurrent processes build once)."""
    directory = library_dir(cache_dir)
    name = directory.name
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / f"{name}.lock", "w") as lock:
        try:
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)
        except ImportError:  # no POSIX locks (Windows): one process at a time is the caller's job
            pass
        return _load_locked(name, directory)


def _load_locked(name: str, directory: Path):
    so = directory / f"{name}.so"
    digest = directory / f"{name}.sha256"
    if so.exists() and digest.exists() and digest.read_text().strip() == file_sha256(so):
        spec = importlib.util.spec_from_file_location(name, so, loader=importlib.machinery.ExtensionFileLoader(name, str(so)))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    if so.exists() or digest.exists():  # bytes changed since the build (or a build cut short): rebuild
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True, exist_ok=True)
    module = _build(name, directory)
    write_atomic(digest, file_sha256(so))  # the digest last: a library without one is never loaded
    _state["built"] = True
    return module


def _build(name: str, directory: Path):
    """Compile the sources into ``directory/name.so`` and load it (torch's JIT build, ninja)."""
    from torch.utils import cpp_extension

    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise RuntimeError("no C++ compiler (c++) on PATH")
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja is not available")
    # sources() is a new list: load_inline inserts an #include into the list it is given
    return cpp_extension.load_inline(name=name, cpp_sources=sources(), extra_cflags=list(_FLAGS),
                                     extra_ldflags=["-fopenmp"], extra_include_paths=[str(CSRC)],
                                     build_directory=str(directory), verbose=False)


def _cache_dir() -> Path:
    from cachedrag.paths import cache_home

    return cache_home() / "ext"
