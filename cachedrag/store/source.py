"""Layer-by-layer readers of one stored entry (what the layer-wise loader pulls from).

Owns: ``LayerSource`` and its two kinds: ``TensorSource`` (an entry already in memory:
layers are views) and ``BlobSource`` (a serialized entry read through ``read_at``: each
layer's bytes are read and verified on demand, so layer 0 is ready before the rest of a
disk file or Redis value has been read). Does not own: threads, devices, deadlines
(``preload``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from cachedrag.errors import CorruptCacheError
from cachedrag.store.codec import CODE_TO_DTYPE, EntryHeader, ReadAt, decode_extras, decode_layer
from cachedrag.store.entry import KVEntry


class LayerSource(ABC):
    """Reads one entry a layer at a time. ``load_*`` may raise ``CorruptCacheError``."""

    tier_name: str
    n_layers: int
    layered: tuple[str, ...]
    meta: dict[str, str]
    kv_shape: tuple[int, int, int, int]  # the real shape of k (and v): [L, H_kv, T, D]
    kv_dtype: torch.dtype

    @abstractmethod
    def load_layer(self, layer: int) -> dict[str, torch.Tensor]:
        """Every layered tensor's slice at ``layer``: ``[H_kv, T, D]`` each."""

    @abstractmethod
    def load_extras(self) -> dict[str, torch.Tensor]:
        """The non-layered tensors (e.g. ``token_inter`` ``[T]``)."""

    def close(self) -> None:
        """Release the underlying file or connection."""


class TensorSource(LayerSource):
    """An entry held in memory (CPU or GPU tier): layers are views, nothing to verify."""

    def __init__(self, entry: KVEntry, tier_name: str) -> None:
        self._entry = entry
        self.tier_name = tier_name
        self.n_layers = entry.n_layers
        self.layered = entry.layered_names()
        self.meta = dict(entry.meta)
        self.kv_shape = tuple(entry.k.shape)  # [L, H_kv, T, D]
        self.kv_dtype = entry.k.dtype

    @property
    def device(self) -> torch.device:
        return self._entry.device

    @property
    def pinned(self) -> bool:
        """Held in page-locked host memory (a CPU tier with ``pin_memory``): a GPU copies it asynchronously."""
        return self._entry.device.type == "cpu" and all(t.is_pinned() for t in self._entry.tensors.values())

    def load_layer(self, layer: int) -> dict[str, torch.Tensor]:
        return {n: self._entry.tensors[n][layer] for n in self.layered}  # [H_kv, T, D] views

    def load_extras(self) -> dict[str, torch.Tensor]:
        return {n: self._entry.tensors[n] for n in self._entry.extra_names()}

    def load_layers(self, start: int, stop: int) -> dict[str, torch.Tensor]:
        """Every layered tensor's layers ``start..stop-1``: ``[stop - start, H_kv, T, D]`` views, one block each."""
        return {n: self._entry.tensors[n][start:stop] for n in self.layered}


class BlobSource(LayerSource):
    """A serialized entry: header parsed up front, each layer read and checked on demand."""

    def __init__(
        self,
        header: EntryHeader,
        read_at: ReadAt,
        tier_name: str,
        *,
        on_close: Callable[[], None] | None = None,
        on_corrupt: Callable[[CorruptCacheError], None] | None = None,
    ) -> None:
        self._header = header
        self._read_at = read_at
        self._on_close = on_close
        self._on_corrupt = on_corrupt
        self.tier_name = tier_name
        self.n_layers = header.n_layers
        self.layered = header.layered
        self.meta = dict(header.meta)
        spec = header.specs["k"]  # the codec checked that v has the same shape and dtype
        self.kv_shape = spec.shape  # [L, H_kv, T, D]
        self.kv_dtype = CODE_TO_DTYPE[spec.dtype]

    def load_layer(self, layer: int) -> dict[str, torch.Tensor]:
        return self._checked(lambda: decode_layer(self._header, layer, self._read_at))

    def load_extras(self) -> dict[str, torch.Tensor]:
        return self._checked(lambda: decode_extras(self._header, self._read_at))

    def _checked(self, fn: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        try:
            return fn()
        except CorruptCacheError as exc:
            if self._on_corrupt is not None:
                self._on_corrupt(exc)
            raise

    def close(self) -> None:
        if self._on_close is not None:
            self._on_close()
            self._on_close = None
