"""Loading a GGUF file straight into the runner's weight formats.

Owns: reading a user's ``.gguf`` (llama.cpp's format) tensor by tensor from a read-only memory map
(the metadata and tensor table through transformers' GGUF reader, which leaves the vocabulary's
strings unparsed); dequantising each tensor alone (``gguf.quants.dequantize``; large ones in
slices of rows), writing it into a Hugging Face model skeleton whose parameters start
empty, and packing each decoder layer into the runner's fused layout (``LayerWeights``) as soon
as its tensors are in, so no float32 copy of the whole model ever exists. The file's pages are
dropped from the process's resident set once a tensor is read (``madvise(MADV_DONTNEED)``),
so the peak stays near the packed model's size. The config, the tokenizer and its chat template
come from the file's metadata, through transformers' GGUF support (which also names the
tensors: ``get_gguf_hf_weights_map`` and its per-architecture tensor processors, e.g. the
reverse of llama.cpp's q/k row permutation, Gemma's ``norm - 1``).

Contracts: the values are exactly transformers' dequantisation of the same file (the same
``gguf`` routine), rounded once to the load dtype; an unsupported architecture or quantisation
type, a missing or damaged file is one ``CachedRAGError`` line. With quantised runner weights
(int8/int4) the Hugging Face linear modules read the runner's fused weights (``weight_views.py``,
dequantised on each read): those are the only copy.

Does not own: the forward pass (``runner.py``), the weight formats (``weights.py``), the
directory-of-safetensors path and the default model (``loader.py``).
"""

from __future__ import annotations

import logging
import mmap
import os
import resource
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from cachedrag.errors import InputError, ModelNotFoundError, UnsupportedModelError
from cachedrag.model.weight_views import resident_bytes, trim_heap

log = logging.getLogger(__name__)

#: llama.cpp architecture names the runner drives (``general.architecture``)
GGUF_ARCHITECTURES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
_SLICE_BYTES = 16 << 20  # tensors are dequantised this many float32 bytes at a time (gguf's numpy routines make
# several temporaries of a slice's size)
_WHOLE_TENSORS = (".attn_q.", ".attn_k.")  # a processor reorders their rows across heads (Llama's q/k un-permute):
# dequantised whole (at most a few tens of MB); every other tensor's processing is per element


def is_gguf(name_or_path) -> bool:
    """True when ``name_or_path`` names a ``.gguf`` file (existing or not: a missing one is an error later)."""
    return name_or_path is not None and str(name_or_path).lower().endswith(".gguf")


def supported_quant_types() -> tuple[str, ...]:
    """GGML tensor types this loader dequantises (whatever the installed ``gguf`` package can)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits

    return tuple(t.name for t in GGMLQuantizationType if t in _type_traits or t.name in ("F32", "F16"))


@dataclass
class LoadReport:
    """What one GGUF load did: sizes, time and the process's peak resident memory."""

    path: str
    file_bytes: int
    seconds: float = 0.0
    rss_before_bytes: int = 0
    peak_rss_bytes: int = 0  # the process's high-water mark after loading (ru_maxrss)
    weight_bytes: int = 0  # what the loaded weights keep resident (every copy, ``weight_views.resident_bytes``)
    tensor_types: dict[str, int] = field(default_factory=dict)

    def line(self) -> str:
        types = ", ".join(f"{n} {k}" for k, n in sorted(self.tensor_types.items()))
        return (f"loaded {Path(self.path).name} ({self.file_bytes / 1e9:.2f} GB; tensors: {types}) in "
                f"{self.seconds:.1f} s; weights {self.weight_bytes / 1e9:.2f} GB; peak RSS {self.peak_rss_bytes / 1e9:.2f} GB "
                f"(before loading {self.rss_before_bytes / 1e9:.2f} GB)")


def peak_rss_bytes() -> int:
    """The process's resident-set high-water mark (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    """The process's resident set now (``/proc/self/statm``; the peak where that cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the file: name, shape in torch order, GGML type, absolute byte offset and length."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        try:
            return GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"type {self.ggml_type}"


@dataclass
class GGUFFile:
    """A GGUF file's metadata (string arrays left as counts) and tensor table over a read-only map."""

    path: str
    metadata: dict
    tensors: list[TensorEntry]
    blob: np.ndarray  # the whole file, memory-mapped bytes

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture"))

    def raw(self, entry: TensorEntry) -> np.ndarray:
        """The tensor's bytes as ``[rows, bytes per row]`` (what ``gguf.quants.dequantize`` takes)."""
        rows = int(np.prod(entry.shape[:-1])) if len(entry.shape) > 1 else 1
        return self.blob[entry.offset:entry.offset + entry.nbytes].reshape(rows, -1)


def open_gguf(path) -> GGUFFile:
    """Parse ``path``'s metadata and tensor table (transformers' GGUF reader: it skips the vocabulary's
    strings, which ``gguf.GGUFReader`` turns into a Python object each); a missing, truncated or
    damaged file is one clear error, and so is a tensor type ``gguf`` cannot dequantise."""
    import struct

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from transformers.integrations.gguf.reader import _mapped, _read_metadata, _read_tensor_table

    p = Path(path)
    if not p.is_file():
        raise ModelNotFoundError(f"GGUF file {str(path)!r} not found")
    try:
        blob = _mapped(str(p))
        metadata, count, pos = _read_metadata(blob, str(p))
        table, pos = _read_tensor_table(blob, count, pos)
    except (ValueError, IndexError, struct.error, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: not a readable GGUF file ({_first_line(exc)})") from exc
    alignment = int(metadata.get("general.alignment", 32))
    data_start = (pos + alignment - 1) // alignment * alignment
    tensors = []
    for name, shape, ggml_type, offset in table:
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise UnsupportedModelError(f"{path}: tensor {name} has GGML type {ggml_type}, which cannot be "
                                        f"dequantised; supported: {', '.join(supported_quant_types())}") from None
        nbytes = int(np.prod(shape)) // block * type_size
        tensors.append(TensorEntry(name, tuple(int(d) for d in shape), ggml_type, data_start + offset, nbytes))
        if data_start + offset + nbytes > blob.shape[0]:
            raise InputError(f"{path}: damaged or truncated GGUF file (tensor {name} ends past the file's "
                             f"{blob.shape[0]} bytes)")
    return GGUFFile(str(p), metadata, tensors, blob)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def architecture_of(gf: GGUFFile) -> str:
    """``general.architecture`` of the file, checked against ``GGUF_ARCHITECTURES``."""
    if gf.architecture not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(f"GGUF architecture {gf.architecture!r} is not supported; cachedrag runs: "
                                    f"{', '.join(GGUF_ARCHITECTURES)}")
    return gf.architecture


def check_quant_types(gf: GGUFFile) -> Counter:
    """Counts of the file's tensor types; an unsupported one is a clear error."""
    types = Counter(t.type_name for t in gf.tensors)
    bad = sorted(set(types) - set(supported_quant_types()))
    if bad:
        raise UnsupportedModelError(f"{gf.path}: GGUF tensor type(s) {', '.join(bad)} cannot be dequantised; "
                                    f"supported: {', '.join(supported_quant_types())}")
    return types


def config_dict(gf: GGUFFile) -> dict:
    """The Hugging Face config dict of the file, as transformers' ``load_gguf_checkpoint`` derives it
    (its key mapping and defaults; tests compare the two), from metadata read without the vocabulary."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_TO_TRANSFORMERS_MAPPING

    arch = gf.architecture
    hf_arch = "mistral" if arch == "llama" and gf.metadata.get("general.name") == "mistral" else arch
    config: dict = {"tie_word_embeddings": all(t.name != "output.weight" for t in gf.tensors)}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(hf_arch, {}).items():
        config.setdefault(key, value)
    renames = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    for key, value in gf.metadata.items():
        prefix, _, rest = key.replace(arch, hf_arch).partition(".")
        target = renames.get(prefix, {}).get(rest)
        if target is not None and target != -1:
            config[target] = value.replace(arch, hf_arch) if isinstance(value, str) and arch in value else value
    head_dim = gf.metadata.get(f"{arch}.attention.key_length")
    if head_dim is not None and "head_dim" not in config:  # transformers' table misses it for qwen3 (0.6B: 128,
        config["head_dim"] = head_dim  # not hidden / heads = 64)
    if config.get("model_type") == "gemma3":
        config["model_type"] = "gemma3_text"  # the GGUF holds the text backbone only
    if "vocab_size" not in config and isinstance(gf.metadata.get("tokenizer.ggml.tokens"), int):
        config["vocab_size"] = gf.metadata["tokenizer.ggml.tokens"]  # the reader left the vocabulary as its size
    return config


def gguf_config(gf: GGUFFile):
    """The Hugging Face config of the file."""
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(**config_dict(gf))
    except (ValueError, KeyError, TypeError) as exc:
        raise UnsupportedModelError(f"{gf.path}: cannot build a model config from the GGUF metadata "
                                    f"({_first_line(exc)})") from exc


def gguf_tokenizer(path, model_type: str | None = None):
    """The tokenizer (with the chat template, where the file has one) from the file's metadata: the
    model type's tokenizer class built from the file (``AutoTokenizer`` would parse every metadata
    string again to find that class)."""
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    p = Path(path)
    name = TOKENIZER_MAPPING_NAMES.get(model_type or "")
    cls = tokenizer_class_from_name(name) if name else None
    try:
        return (cls or AutoTokenizer).from_pretrained(p.parent, gguf_file=p.name, local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise UnsupportedModelError(f"{path}: cannot build a tokenizer from the GGUF metadata "
                                    f"({_first_line(exc)})") from exc


def _skeleton(config, dtype: torch.dtype):
    """The causal LM with every parameter on ``meta`` (no memory) and real buffers (rotary tables)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _name_map(model, arch: str, config) -> tuple[dict[str, str], object]:
    """GGUF tensor name -> HF parameter name, and transformers' tensor processor for ``arch``."""
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                         get_gguf_hf_weights_map)

    config_dict = config.to_dict()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config_dict)
    return get_gguf_hf_weights_map(model, processor), processor


class _TensorSource:
    """Reads one GGUF tensor at a time as a torch tensor, and drops its file pages afterwards."""

    def __init__(self, gf: GGUFFile, processor):
        self.gf, self.processor = gf, processor
        self._mmap = getattr(gf.blob, "_mmap", None)

    def read(self, entry: TensorEntry, dtype: torch.dtype) -> torch.Tensor:
        """The dequantised, processed tensor in ``dtype`` (``[rows, cols]`` as HF stores it)."""
        data = self.gf.raw(entry)  # [rows, bytes per row], memory-mapped
        rows = data.shape[0]
        step = max(1, _SLICE_BYTES // (4 * entry.shape[-1]))
        if rows <= step or any(part in entry.name for part in _WHOLE_TENSORS):
            result = self._dequantize(data, entry, dtype)
        else:  # slices of rows: never the whole tensor in float32 (the processing of these is per element)
            result = torch.empty((rows, entry.shape[-1]), dtype=dtype)  # [rows, cols]
            for start in range(0, rows, step):
                result[start:start + step] = self._dequantize(data[start:start + step], entry, dtype)  # [r, cols]
        self._release(entry)
        return result.reshape(entry.shape)

    def _dequantize(self, data: np.ndarray, entry: TensorEntry, dtype: torch.dtype) -> torch.Tensor:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(data, GGMLQuantizationType(entry.ggml_type))  # [r, cols] float32
        out = np.asarray(self.processor.process(weights=values, name=entry.name).weights, dtype=np.float32)
        if not out.flags.writeable or not out.flags.c_contiguous or np.shares_memory(out, data):
            out = np.array(out, order="C")  # F32 tensors come back as views of the file: copy
        return torch.from_numpy(out).to(dtype)

    def _release(self, entry: TensorEntry) -> None:
        """Drop the tensor's pages from this process's resident set (they stay in the page cache)."""
        if self._mmap is None or not hasattr(self._mmap, "madvise"):
            return
        start = entry.offset // mmap.PAGESIZE * mmap.PAGESIZE  # the mapping starts at the file's first byte
        try:
            self._mmap.madvise(mmap.MADV_DONTNEED, start, entry.offset + entry.nbytes - start)
        except (OSError, ValueError):
            pass  # an advice, not a contract: the pages are then freed with the mapping


def _block_index(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit() else None


def _set_param(model, hf_name: str, value: torch.Tensor) -> None:
    module_name, _, attr = hf_name.rpartition(".")
    module = model.get_submodule(module_name)
    old = getattr(module, attr)
    if tuple(old.shape) != tuple(value.shape):
        raise UnsupportedModelError(f"GGUF tensor for {hf_name} has shape {tuple(value.shape)}, the model's config "
                                    f"says {tuple(old.shape)}")
    setattr(module, attr, torch.nn.Parameter(value, requires_grad=False))


@dataclass
class GGUFModel:
    """A loaded GGUF: the HF model (linear weights empty where ``packed``), tokenizer, the runner's
    fused layers and head (``packed``: None unless asked) and the load report."""

    model: object
    tokenizer: object
    packed: tuple | None
    report: LoadReport


def load_gguf(path, dtype: torch.dtype = torch.float32, numerics=None, linear_dtype: torch.dtype | None = None,
              with_tokenizer: bool = True) -> GGUFModel:
    """Load ``path`` tensor by tensor. ``dtype``: embedding and norms (and linears unless ``linear_dtype``);
    ``numerics`` (``weights.Numerics``): pack every layer into ``LayerWeights`` as it completes, and the
    LM head into a ``PackedLinear`` (its format: ``weights.head_numerics``, as ``ModelRunner._fast_weights``)."""
    report = LoadReport(path=str(path), file_bytes=Path(path).stat().st_size if Path(path).is_file() else 0,
                        rss_before_bytes=current_rss_bytes())
    start = time.perf_counter()
    gf = open_gguf(path)
    arch = architecture_of(gf)
    report.tensor_types = dict(check_quant_types(gf))
    config = gguf_config(gf)
    # the tokenizer first: its vocabulary's transient objects are freed before the weights arrive (a lower peak)
    tokenizer = gguf_tokenizer(path, config.model_type) if with_tokenizer else None
    model = _skeleton(config, dtype)
    name_map, processor = _name_map(model, arch, config)
    source = _TensorSource(gf, processor)
    blocks: dict[int | None, list] = defaultdict(list)
    for t in gf.tensors:
        if t.name in name_map:
            blocks[_block_index(t.name)].append(t)
    absent = sorted(set(range(len(model.model.layers))) - set(blocks) - {None})
    if absent:
        raise InputError(f"{path}: the GGUF file has no tensors for layer(s) {absent[:4]}")
    layers = []
    for t in blocks.pop(None, []):
        _set_param(model, name_map[t.name], source.read(t, dtype))
    _tie_or_check(model, path)
    head = _pack_head(model, numerics) if numerics is not None else None  # before the layers: a quantised head
    for i in sorted(blocks):  # (with a tied embedding read from it) frees its dense table while memory is low
        for t in blocks[i]:
            hf = name_map[t.name]
            _set_param(model, hf, source.read(t, linear_dtype if linear_dtype and _is_linear(model, hf) else dtype))
        _check_loaded(model.model.layers[i], f"model.layers.{i}", path)
        if numerics is not None:
            layers.append(_pack_layer(model.model.layers[i], numerics))
        trim_heap()
    packed = (layers, head) if numerics is not None else None
    report.seconds = time.perf_counter() - start
    report.weight_bytes = resident_bytes(model, packed)
    report.peak_rss_bytes = peak_rss_bytes()
    log.info(report.line())
    return GGUFModel(model, tokenizer, packed, report)


def _is_linear(model, hf_name: str) -> bool:
    module_name = hf_name.rpartition(".")[0]
    return isinstance(model.get_submodule(module_name), torch.nn.Linear) and ".layers." in hf_name


def _pack_layer(layer, numerics):
    from cachedrag.model.weight_views import pack_layers

    try:
        return pack_layers([layer], numerics, release=True)[0]  # quantised: the layer's modules read the packed weights
    except ValueError as exc:  # a shape the weight format cannot take (int4 groups)
        raise UnsupportedModelError(str(exc)) from exc


def _pack_head(model, numerics):
    from cachedrag.model.weight_views import release_head
    from cachedrag.model.weights import PackedLinear, head_numerics

    head = model.lm_head
    weight = head.weight if head.weight.dtype == numerics.torch_dtype else head.weight.to(numerics.torch_dtype)
    return release_head(model, PackedLinear(weight, getattr(head, "bias", None), head_numerics(numerics)))  # an
    # untied quantised head's packed copy is its only one


def _tie_or_check(model, path) -> None:
    """Tie the LM head to the embedding where the file has no ``output.weight``; then no parameter may
    still be empty (a file missing a tensor is an error, not random weights)."""
    if getattr(model.config, "tie_word_embeddings", False) or model.lm_head.weight.device.type == "meta":
        model.lm_head.weight = model.model.embed_tokens.weight
    _check_loaded(model, "", path, skip_layers=True)


def _check_loaded(module, prefix: str, path, skip_layers: bool = False) -> None:
    """No parameter of ``module`` may still be empty: a file missing a tensor is an error, not random weights."""
    missing = [f"{prefix}.{n}" if prefix else n for n, p in module.named_parameters()
               if p.device.type == "meta" and not (skip_layers and ".layers." in n)]
    if missing:
        raise InputError(f"{path}: the GGUF file lacks tensors for {', '.join(missing[:4])}"
                         f"{' ...' if len(missing) > 4 else ''}")


def load_gguf_packed(path, dtype: str, weights: str, kv_store_dtype, linear_dtype: torch.dtype, fast: bool):
    """``(model, tokenizer, prepacked layers and head or None, LoadReport)`` for ``ModelRunner``: each layer
    packed into the runner's layout (``dtype`` name, ``weights`` format) as it loads."""
    from pydantic import ValidationError

    from cachedrag.errors import ConfigError
    from cachedrag.model.weights import DTYPES, Numerics

    try:
        numerics = Numerics(dtype=dtype, weights=weights, kv_store_dtype=kv_store_dtype) if fast else None
    except ValidationError as exc:
        raise ConfigError("; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())) from exc
    loaded = load_gguf(path, dtype=DTYPES[dtype], numerics=numerics, linear_dtype=linear_dtype)
    return loaded.model, loaded.tokenizer, loaded.packed, loaded.report
