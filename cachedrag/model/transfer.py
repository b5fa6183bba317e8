"""Host-to-device copies of the small tensors a request builds from Python lists.

Owns: ``device_tensor``, a tensor of Python values on a device that does not make the host wait
for the GPU. ``torch.tensor(values, device="cuda")`` copies from pageable memory and so waits until
the GPU has run everything queued before it (a stream synchronisation per call). A reuse request
builds ~30 such tensors (token ids, compute positions, fresh rows, each reused chunk's scores), so
at an 8B shape on an H100 every one of them stalled the host behind the GPU and the GPU behind the
host (docs/notes/gpu.md). Here the values go into page-locked memory and the copy is queued behind the
GPU's work; PyTorch's caching host allocator keeps the page-locked block until that copy has run.
On the CPU it is ``torch.tensor``.

Does not own: the tensors' meaning (the engine's and runner's).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def device_tensor(values: Sequence[int] | Sequence[float], device: torch.device | str,
                  dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``values`` as a 1-D ``dtype`` tensor on ``device`` ``[N]``, queued without a host wait on CUDA."""
    device = torch.device(device)
    host = torch.tensor(values, dtype=dtype)  # [N]
    if device.type != "cuda":
        return host if device.type == "cpu" else host.to(device)
    return host.pin_memory().to(device, non_blocking=True)  # [N]
