"""Serialization of a ``KVEntry`` to safetensors bytes, with integrity checks.

Owns: the on-disk / in-Redis byte format, its checksums, the typed decode errors, and
reading single layers out of a blob (for layer-wise loading). Does not own: where the
bytes live (tiers) or what to do with a bad blob (tiers count it, remove it, return a miss).

Format (version 1) — a plain safetensors file, never pickle, so loading runs no code:

- tensors: the entry's tensors, contiguous, under their own names;
- ``__metadata__`` (all strings):
  ``cachedrag.format`` = "1", ``cachedrag.key``, ``cachedrag.namespace``,
  ``cachedrag.meta`` (JSON of the entry's meta), ``cachedrag.layered`` (comma list of
  tensors with a leading layer axis, sorted), ``cachedrag.layer_sha256`` (comma list: for
  each layer l, sha256 over the bytes of ``t[l]`` for each layered tensor in order),
  ``cachedrag.extras_sha256`` (sha256 over the other tensors' bytes, sorted by name) and
  ``cachedrag.sha256``: sha256 of a canonical JSON of everything above plus every tensor's
  dtype and shape. The payload digests cover every tensor byte; the top checksum covers
  the header, so a flipped bit anywhere is caught, and a single layer can be verified
  without reading the others.

Decode checks, in order: structure/length (``TruncatedEntryError``, ``FormatError``),
namespace (``ForeignEntryError``), key and version (``FormatError``), checksums
(``ChecksumError``). All subclass ``cachedrag.errors.CorruptCacheError``.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from cachedrag.errors import CorruptCacheError
from cachedrag.store.entry import NAMESPACE_KEY, KVEntry

FORMAT_VERSION = "1"
MAX_HEADER_BYTES = 16 * 1024 * 1024
_M = "cachedrag."

DTYPE_TO_CODE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
CODE_TO_DTYPE = {v: k for k, v in DTYPE_TO_CODE.items()}
_DTYPE_SIZE = {"F32": 4, "F16": 2, "BF16": 2}


class TruncatedEntryError(CorruptCacheError):
    """The blob is shorter than its header says (partial write, truncated file)."""


class FormatError(CorruptCacheError):
    """The blob is not a cachedrag safetensors entry of a supported version for this key."""


class ForeignEntryError(CorruptCacheError):
    """The blob belongs to another namespace (another model); never served."""


class ChecksumError(CorruptCacheError):
    """A payload or header checksum does not match (bit flip, tampering)."""


# ---- digests ---------------------------------------------------------------------------
def _raw(t: torch.Tensor) -> memoryview:
    """The tensor's bytes (CPU, contiguous) without a copy when already so."""
    flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # [numel * itemsize]
    return memoryview(flat.numpy())


def layer_digest(tensors: dict[str, torch.Tensor], names: tuple[str, ...]) -> str:
    """sha256 over ``tensors[n]`` bytes for n in ``names`` (per-layer slices or extras)."""
    h = hashlib.sha256()
    for name in names:
        h.update(_raw(tensors[name]))
    return h.hexdigest()


def _canonical(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _top_checksum(
    key: str,
    namespace: str,
    meta_json: str,
    specs: dict[str, tuple[str, tuple[int, ...]]],
    layered: tuple[str, ...],
    layer_sums: list[str],
    extras_sum: str,
) -> str:
    return _canonical(
        {
            "format": FORMAT_VERSION,
            "key": key,
            "namespace": namespace,
            "meta": meta_json,
            "tensors": {n: [d, list(s)] for n, (d, s) in sorted(specs.items())},
            "layered": list(layered),
            "layers": layer_sums,
            "extras": extras_sum,
        }
    )


# ---- encode ----------------------------------------------------------------------------
def encode(key: str, entry: KVEntry, namespace: str) -> bytes:
    """The entry as safetensors bytes with cachedrag integrity metadata."""
    if entry.namespace is not None and entry.namespace != namespace:
        raise ForeignEntryError(f"entry namespace {entry.namespace!r} != store namespace {namespace!r}")
    tensors = {n: t.detach().cpu().contiguous() for n, t in entry.tensors.items()}  # k, v: [L, H_kv, T, D]
    cpu_entry = KVEntry(tensors, entry.meta)
    layered = cpu_entry.layered_names()
    extras = cpu_entry.extra_names()
    layer_sums = [
        layer_digest({n: tensors[n][l] for n in layered}, layered)  # [H_kv, T, D] slices
        for l in range(cpu_entry.n_layers)
    ]
    extras_sum = layer_digest(tensors, extras)
    meta_json = json.dumps(entry.meta, sort_keys=True)
    specs = {n: (DTYPE_TO_CODE[t.dtype], tuple(t.shape)) for n, t in tensors.items()}
    metadata = {
        _M + "format": FORMAT_VERSION,
        _M + "key": key,
        _M + "namespace": namespace,
        _M + "meta": meta_json,
        _M + "layered": ",".join(layered),
        _M + "layer_sha256": ",".join(layer_sums),
        _M + "extras_sha256": extras_sum,
        _M + "sha256": _top_checksum(key, namespace, meta_json, specs, layered, layer_sums, extras_sum),
    }
    return st_save(tensors, metadata=metadata)


# ---- header ----------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # safetensors code: F32 / F16 / BF16
    shape: tuple[int, ...]
    begin: int  # offset of the first byte, relative to the data section
    end: int


@dataclass(frozen=True)
class EntryHeader:
    """A parsed and self-consistent (top checksum verified) entry header."""

    key: str
    namespace: str
    meta: dict[str, str]
    specs: dict[str, TensorSpec]
    layered: tuple[str, ...]
    layer_sums: tuple[str, ...]
    extras_sum: str
    data_start: int
    total_size: int

    @property
    def n_layers(self) -> int:
        return len(self.layer_sums)

    @property
    def n_tokens(self) -> int:
        return int(self.specs["k"].shape[2])

    @property
    def nbytes(self) -> int:
        """Tensor bytes of the entry (``KVEntry.nbytes``), from the header alone."""
        return sum(s.end - s.begin for s in self.specs.values())

    @property
    def extras(self) -> tuple[str, ...]:
        return tuple(sorted(n for n in self.specs if n not in self.layered))

    def layer_range(self, name: str, layer: int) -> tuple[int, int]:
        """Absolute ``(offset, length)`` of ``tensors[name][layer]`` in the blob."""
        spec = self.specs[name]
        per_layer = (spec.end - spec.begin) // spec.shape[0]
        return self.data_start + spec.begin + layer * per_layer, per_layer


ReadAt = Callable[[int, int], bytes]  # (offset, length) -> bytes (shorter when truncated)


def read_header(read_at: ReadAt, total_size: int, key: str, namespace: str) -> EntryHeader:
    """Parse and check a blob's header through ``read_at``; raises a ``CorruptCacheError``."""
    if total_size < 8:
        raise TruncatedEntryError(f"{total_size} bytes: too short for a safetensors header")
    (n,) = struct.unpack("<Q", _exact(read_at, 0, 8))
    if n > MAX_HEADER_BYTES:
        raise FormatError(f"header length {n} is implausible")
    if 8 + n > total_size:
        raise TruncatedEntryError(f"header needs {8 + n} bytes, blob has {total_size}")
    try:
        raw = json.loads(_exact(read_at, 8, n))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"header is not JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise FormatError("header is not a JSON object")
    md = raw.pop("__metadata__", None)
    if not isinstance(md, dict):
        raise FormatError("no cachedrag metadata")
    specs = _specs(raw)
    data_start = 8 + n
    need = data_start + max((s.end for s in specs.values()), default=0)
    if need > total_size:
        raise TruncatedEntryError(f"payload needs {need} bytes, blob has {total_size}")
    if need < total_size:
        raise FormatError(f"{total_size - need} trailing bytes after the payload")
    if md.get(_M + "format") != FORMAT_VERSION:
        raise FormatError(f"format version {md.get(_M + 'format')!r}, this build reads {FORMAT_VERSION!r}")
    if md.get(_M + "namespace") != namespace:
        raise ForeignEntryError(f"namespace {md.get(_M + 'namespace')!r} is not {namespace!r}")
    if md.get(_M + "key") != key:
        raise FormatError(f"blob is for key {md.get(_M + 'key')!r}, not {key!r}")
    try:
        meta_json = md[_M + "meta"]
        meta = json.loads(meta_json)
        layered = tuple(x for x in md[_M + "layered"].split(",") if x)
        layer_sums = tuple(x for x in md[_M + "layer_sha256"].split(",") if x)
        extras_sum = md[_M + "extras_sha256"]
        top = md[_M + "sha256"]
    except (KeyError, AttributeError, json.JSONDecodeError) as exc:
        raise FormatError(f"incomplete cachedrag metadata: {exc!r}") from exc
    want = _top_checksum(
        key, namespace, meta_json, {s.name: (s.dtype, s.shape) for s in specs.values()}, layered, list(layer_sums), extras_sum
    )
    if want != top:
        raise ChecksumError("header checksum mismatch")
    _check_layout(specs, layered, len(layer_sums), meta)
    return EntryHeader(key, namespace, meta, specs, layered, layer_sums, extras_sum, data_start, total_size)


def _exact(read_at: ReadAt, offset: int, length: int) -> bytes:
    data = read_at(offset, length)
    if len(data) != length:
        raise TruncatedEntryError(f"wanted {length} bytes at {offset}, got {len(data)}")
    return data


def _specs(raw: dict) -> dict[str, TensorSpec]:
    specs: dict[str, TensorSpec] = {}
    try:
        for name, info in raw.items():
            dtype, shape, (begin, end) = info["dtype"], tuple(int(x) for x in info["shape"]), info["data_offsets"]
            if dtype not in _DTYPE_SIZE:
                raise FormatError(f"tensor {name!r}: unsupported dtype {dtype}")
            numel = 1
            for d in shape:
                numel *= d
            if begin < 0 or end - begin != numel * _DTYPE_SIZE[dtype]:
                raise FormatError(f"tensor {name!r}: offsets {begin}..{end} do not match shape {shape}")
            specs[name] = TensorSpec(name, dtype, shape, int(begin), int(end))
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"bad tensor table: {exc!r}") from exc
    return specs


def _check_layout(specs: dict[str, TensorSpec], layered: tuple[str, ...], n_layers: int, meta: object) -> None:
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise FormatError("meta is not a str -> str map")
    if "k" not in layered or "v" not in layered:
        raise FormatError(f"layered tensors {layered} lack k/v")
    for name in layered:
        spec = specs.get(name)
        if spec is None or len(spec.shape) != 4 or spec.shape[0] != n_layers:
            raise FormatError(f"layered tensor {name!r} does not have {n_layers} layers")
    k, v = specs["k"], specs["v"]
    if (k.shape, k.dtype) != (v.shape, v.dtype):
        raise FormatError(f"k {k.dtype}{list(k.shape)} and v {v.dtype}{list(v.shape)} differ in shape or dtype")


# ---- decode ----------------------------------------------------------------------------
def decode(blob: bytes, key: str, namespace: str) -> KVEntry:
    """The entry in ``blob``, fully verified; raises a ``CorruptCacheError`` subclass."""
    view = memoryview(blob)
    header = read_header(lambda off, ln: bytes(view[off : off + ln]), len(blob), key, namespace)
    try:
        tensors = st_load(bytes(blob))
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise FormatError(f"safetensors could not load the blob: {exc}") from exc
    for name, spec in header.specs.items():
        t = tensors.get(name)
        if t is None or DTYPE_TO_CODE.get(t.dtype) != spec.dtype or tuple(t.shape) != spec.shape:
            raise FormatError(f"tensor {name!r} does not match its header")
    for l, want in enumerate(header.layer_sums):
        got = layer_digest({n: tensors[n][l] for n in header.layered}, header.layered)  # [H_kv, T, D] slices
        if got != want:
            raise ChecksumError(f"layer {l} checksum mismatch")
    if layer_digest(tensors, header.extras) != header.extras_sum:
        raise ChecksumError("extras checksum mismatch")
    return KVEntry(tensors, dict(header.meta))


def decode_layer(header: EntryHeader, layer: int, read_at: ReadAt) -> dict[str, torch.Tensor]:
    """Layer ``layer`` of every layered tensor (``[H_kv, T, D]`` each), verified."""
    out: dict[str, torch.Tensor] = {}
    for name in header.layered:
        spec = header.specs[name]
        offset, length = header.layer_range(name, layer)
        out[name] = _tensor(_exact(read_at, offset, length), spec.dtype, spec.shape[1:])  # [H_kv, T, D]
    if layer_digest(out, header.layered) != header.layer_sums[layer]:
        raise ChecksumError(f"layer {layer} checksum mismatch")
    return out


def decode_extras(header: EntryHeader, read_at: ReadAt) -> dict[str, torch.Tensor]:
    """The non-layered tensors (e.g. ``token_inter`` ``[T]``), verified."""
    out: dict[str, torch.Tensor] = {}
    for name in header.extras:
        spec = header.specs[name]
        data = _exact(read_at, header.data_start + spec.begin, spec.end - spec.begin)
        out[name] = _tensor(data, spec.dtype, spec.shape)  # any shape
    if layer_digest(out, header.extras) != header.extras_sum:
        raise ChecksumError("extras checksum mismatch")
    return out


def _tensor(data: bytes, code: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A writable tensor owning a copy of ``data``."""
    if not data:
        return torch.empty(shape, dtype=CODE_TO_DTYPE[code])
    return torch.frombuffer(bytearray(data), dtype=CODE_TO_DTYPE[code]).view(shape)


def check_namespace(entry: KVEntry, namespace: str) -> None:
    """Raise ``ForeignEntryError`` when ``entry`` carries another namespace."""
    ns = entry.meta.get(NAMESPACE_KEY)
    if ns is not None and ns != namespace:
        raise ForeignEntryError(f"entry namespace {ns!r} != store namespace {namespace!r}")
