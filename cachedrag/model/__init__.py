"""The model layer: loading HF Llama-family models and driving their layers ourselves.

Owns: ``loader`` (architectures, default model), ``rope`` (rotation at any position),
``runner`` (layer-wise forward with a working KV buffer; its methods by technique in
``runner_attention``, ``runner_decode``, ``runner_cached``, ``runner_rows``), ``native`` (the C++
kernels of ``csrc/``, built at first use), ``generation`` (sampling, stop strings) and ``textgen``
(full-prefill text generation).
"""

from cachedrag.model.generation import SamplingParams
from cachedrag.model.loader import DEFAULT_MODEL, SUPPORTED_ARCHITECTURES, load_model, load_tokenizer
from cachedrag.model.runner import KVBuffer, ModelRunner
from cachedrag.model.textgen import GenerationResult, TextGenerator

__all__ = [
    "DEFAULT_MODEL", "SUPPORTED_ARCHITECTURES", "GenerationResult", "KVBuffer", "ModelRunner",
    "SamplingParams", "TextGenerator", "load_model", "load_tokenizer",
]
