"""Random-weight models of the sizes CPU users run, and the same weights as llama.cpp GGUFs.

Owns: the Hugging Face configs of ``qwen2.5-0.5b``, ``qwen2.5-1.5b`` and ``llama-3.2-3b`` written
out as dicts (the published ``config.json`` fields; no download), building a random-weight model of
one of them directly in bfloat16 (no float32 copy of the model: a 3B float32 state dict is 12 GiB),
saving it once as a Hugging Face directory (safetensors shards, the default model's tokenizer), and
converting that directory to GGUF with llama.cpp's own ``convert_hf_to_gguf.py`` (F16), then
quantising it with ``llama_cpp.llama_model_quantize`` (Q8_0, Q4_K_M). Everything is cached under
``cache_home()/bench-shapes/<shape>/``, so later runs only load.

The conversion script ships in llama-cpp-python's source distribution (``vendor/llama.cpp``), not in
its wheel: :func:`llama_cpp_source` unpacks the sdist of the installed version, fetched with pip into
``cache_home()/llama-cpp-src`` once (the registry, as ``make anchor`` uses it).

Does not own: timing (``speed_shapes.py``) or loading a user's GGUF (``cachedrag.model``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

from cachedrag.errors import ConfigError
from cachedrag.paths import cache_home

#: published config fields per shape (model_type, fields); random weights, so only shapes matter
CPU_SHAPES: dict[str, tuple[str, dict]] = {
    "qwen2.5-0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                   max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                   tie_word_embeddings=True, use_sliding_window=False, hidden_act="silu")),
    "qwen2.5-1.5b": ("qwen2", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                   max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                   tie_word_embeddings=True, use_sliding_window=False, hidden_act="silu")),
    "llama-3.2-3b": ("llama", dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                                   num_attention_heads=24, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                                   max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                   hidden_act="silu", attention_bias=False, mlp_bias=False,
                                   rope_scaling={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                 "original_max_position_embeddings": 8192})),
}
#: GGUF files made per shape: name -> llama.cpp file type (``LLAMA_FTYPE_*``; None: the converted F16)
GGUF_TYPES = {"F16": None, "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}


def shape_dir(shape: str) -> Path:
    """Where ``shape``'s artifacts live (``hf/``, ``<TYPE>.gguf``)."""
    if shape not in CPU_SHAPES:
        raise ConfigError(f"unknown shape {shape!r}; choose one of {', '.join(CPU_SHAPES)}")
    return cache_home() / "bench-shapes" / shape


def make_config(shape: str):
    """The transformers config of ``shape`` (``architectures`` set, so the converter finds its class)."""
    from transformers import AutoConfig

    model_type, fields = CPU_SHAPES[shape]
    fields = dict(fields)
    if model_type == "llama":  # transformers >= 5 keeps rope_theta inside rope_parameters
        fields["rope_parameters"] = fields.pop("rope_scaling")
    else:
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": fields.pop("rope_theta")}
    config = AutoConfig.for_model(model_type, **fields)
    config.architectures = ["Qwen2ForCausalLM" if model_type == "qwen2" else "LlamaForCausalLM"]
    return config


def hf_dir(shape: str, seed: int = 0) -> Path:
    """The random-weight model of ``shape`` as a Hugging Face directory (made once: built in bfloat16
    tensor by tensor, saved in 1 GB safetensors shards with the default model's tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM

    from cachedrag.model.loader import load_default_tokenizer

    target = shape_dir(shape) / "hf"
    if (target / "config.json").is_file():
        return target
    tmp = target.with_name(f".hf.{os.getpid()}.tmp")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(shape), dtype=torch.bfloat16)  # initialised in bf16
    tokenizer = load_default_tokenizer()
    model.config.bos_token_id, model.config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    model.save_pretrained(tmp, max_shard_size="1GB")
    tokenizer.save_pretrained(tmp)
    del model
    os.replace(tmp, target)
    return target


def load_hf(shape: str):
    """(model in bfloat16, tokenizer) of ``shape``'s random weights (made first when missing)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = hf_dir(shape)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None  # random weights: never stop early
    return model, AutoTokenizer.from_pretrained(path)


def load_tokenizer(shape: str):
    """The tokenizer saved with ``shape``'s random weights (the model made first when missing)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_dir(shape))


def llama_cpp_source() -> Path:
    """llama.cpp's source tree of the installed llama-cpp-python (``convert_hf_to_gguf.py`` and its
    ``gguf-py``), unpacked from the version's sdist (fetched with pip once)."""
    from importlib.metadata import version

    ver = version("llama-cpp-python")
    root = cache_home() / "llama-cpp-src"
    tree = root / f"llama_cpp_python-{ver}" / "vendor" / "llama.cpp"
    if (tree / "convert_hf_to_gguf.py").is_file():
        return tree
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / f"llama_cpp_python-{ver}.tar.gz"
    if not sdist.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={ver}", "-d", str(root)], check=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(root, filter="data")
    return tree


# llama.cpp's converter names a BPE tokenizer's pre-tokenizer by a checksum of how it splits a probe
# text; the default model's tokenizer as transformers rebuilds it from its GGUF does not match
# SmolLM's reference checksum, though it is SmolLM2's, so the converter is told its name ("smollm")
_CONVERT = """
import sys
import convert_hf_to_gguf
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
sys.argv[0] = convert_hf_to_gguf.__file__
convert_hf_to_gguf.main()
"""


def gguf_path(shape: str, kind: str, threads: int = 2) -> Path:
    """``shape``'s weights as a GGUF of ``kind`` (``GGUF_TYPES``): F16 from llama.cpp's converter,
    the others quantised from it by llama.cpp (each made once, written atomically)."""
    if kind not in GGUF_TYPES:
        raise ConfigError(f"unknown GGUF type {kind!r}; choose one of {', '.join(GGUF_TYPES)}")
    target = shape_dir(shape) / f"{kind}.gguf"
    if target.is_file():
        return target
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    if GGUF_TYPES[kind] is None:
        src = llama_cpp_source()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), str(src / "gguf-py")]))
        subprocess.run([sys.executable, "-c", _CONVERT, str(hf_dir(shape)), "--outfile", str(tmp), "--outtype", "f16"],
                       check=True, env=env, cwd=src)
    else:
        import llama_cpp

        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, GGUF_TYPES[kind])
        params.nthread = threads
        rc = llama_cpp.llama_model_quantize(str(gguf_path(shape, "F16")).encode(), str(tmp).encode(), params)
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize to {kind} failed ({rc})")
    os.replace(tmp, target)
    return target


def prepare(shape: str, kinds=tuple(GGUF_TYPES)) -> dict[str, Path]:
    """Every artifact of ``shape`` (random weights, the GGUFs of ``kinds``), made where missing."""
    out = {"hf": hf_dir(shape)}
    for kind in kinds:
        out[kind] = gguf_path(shape, kind)
    return out
