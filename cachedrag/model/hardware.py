"""Where a runner runs: the device and the CPU threads.

Owns: ``resolve_device`` (``"auto"`` -> CUDA where present, else the CPU; a CUDA device without
CUDA is a ConfigError), ``default_threads`` and ``set_threads`` (torch's intra-op threads, never
more than the cores this process may use).
"""

from __future__ import annotations

import os

import torch

from cachedrag.errors import ConfigError


def default_threads() -> int:
    """Cores this process may run on (its CPU affinity), at most torch's own default."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, torch.get_num_threads()))


def set_threads(threads: int | None) -> int:
    """Set torch's intra-op threads (``None``: ``default_threads()``) and return the count.

    Never more than the cores this process may use: more OpenMP threads than cores make every
    small op of a decode step wait on sleeping workers (``cachedrag/executor.py``).
    """
    if threads is not None and threads < 1:
        raise ConfigError(f"threads must be >= 1, got {threads}")
    n = default_threads() if threads is None else threads
    try:
        n = min(n, len(os.sched_getaffinity(0)))
    except AttributeError:
        pass
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"``: CUDA where present, else the CPU; a CUDA device without CUDA is a ConfigError."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"unknown device {device!r}: use auto, cpu or cuda") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device / device={str(device)!r}: no CUDA here (torch.cuda.is_available() is false)")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {str(device)!r}: cachedrag runs on cpu or cuda")
    return device
