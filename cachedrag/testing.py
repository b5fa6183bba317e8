"""Tiny random-weight models and a byte-level tokenizer for fast tests.

Owns: ``tiny_model(arch)`` (random Llama / Llama-3-scaled / Mistral / Qwen2 / Qwen3 configs a
few hundred KB in size), ``byte_tokenizer()`` (a real ``PreTrainedTokenizerFast`` over the 256
bytes plus chat special tokens, with a ChatML template), ``tiny_runner``, and ``TINY_DOCS`` (six
short stdlib summaries: the retrieval and pipeline tests' corpus). Used by the test
suite and by examples that must run in seconds; never by production code paths.
"""

from __future__ import annotations

import torch

from cachedrag.corpus import Document

TINY_ARCHITECTURES: tuple[str, ...] = ("llama", "llama3", "mistral", "qwen2", "qwen3")

_CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges: 256 byte tokens + <|endoftext|>, <|im_start|>, <|im_end|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    fast.chat_template = _CHATML
    return fast


def tiny_config(arch: str = "llama", vocab_size: int = 260, **overrides):
    """A small random config of a supported architecture (2 layers, GQA 4/2 heads, head dim 16)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        eos_token_id=vocab_size - 2, bos_token_id=vocab_size - 3, pad_token_id=vocab_size - 3,
    )
    if arch == "llama":
        cfg = LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif arch == "llama3":
        cfg = LlamaConfig(**common, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    elif arch == "mistral":
        cfg = MistralConfig(**common, sliding_window=24, head_dim=16)
    elif arch == "qwen2":
        cfg = Qwen2Config(**common)
    elif arch == "qwen3":
        cfg = Qwen3Config(**common, head_dim=16)
    elif arch == "gemma3":  # sliding window 24 on 3 of every 4 layers, their own RoPE base; q/k norms, soft-cap
        from transformers import Gemma3TextConfig

        cfg = Gemma3TextConfig(**{**common, "num_hidden_layers": 4}, head_dim=16, sliding_window=24,
                               layer_types=["sliding_attention"] * 3 + ["full_attention"], query_pre_attn_scalar=16,
                               rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 100000.0},
                                                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                               final_logit_softcapping=30.0)
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {TINY_ARCHITECTURES} or gemma3")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def tiny_model(arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A random-weight causal LM of ``arch`` in eval mode (deterministic for a seed)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch, **overrides)
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def prefilled(runners: dict, ids, capacity: int) -> dict:
    """A fresh KV buffer of ``capacity`` positions per runner, each prefilled with ``ids`` (``[T]``):
    ``{name: KVBuffer}`` (side-by-side decode comparisons of runners)."""
    kvs = {name: r.new_kv(capacity) for name, r in runners.items()}
    for name, r in runners.items():
        r.prefill(ids, kv=kvs[name])
    return kvs


def tiny_runner(arch: str = "llama", seed: int = 0, device: str = "cpu", **runner_kwargs):
    """``ModelRunner`` over ``tiny_model(arch)`` with the byte tokenizer (vocab sizes match), the
    model moved to ``device`` first (the same weights on any device); ``runner_kwargs`` go to
    ``ModelRunner`` (e.g. ``dtype``, ``weights``, ``threads``)."""
    from cachedrag.model.runner import ModelRunner

    tok = byte_tokenizer()
    model = tiny_model(arch, seed=seed, vocab_size=len(tok)).to(device)
    model.generation_config.eos_token_id = tok.eos_token_id
    return ModelRunner(model, tok, **runner_kwargs)


TINY_DOCS = [
    Document("heapq", "The heapq module provides an implementation of the heap queue algorithm, also known as the "
             "priority queue algorithm. heappush pushes a value onto the heap, maintaining the heap invariant. "
             "heappop pops and returns the smallest item from the heap."),
    Document("json", "The json module encodes and decodes JSON documents. json.dumps serializes an object to a JSON "
             "formatted string; pass indent to pretty-print it. json.loads parses a string."),
    Document("bisect", "The bisect module finds insertion points in sorted lists. bisect_left returns the leftmost "
             "position where a value can be inserted while keeping the list sorted."),
    Document("textwrap", "The textwrap module wraps and fills paragraphs of text. textwrap.wrap splits a long "
             "paragraph into lines of at most width characters; fill joins them with newlines."),
    Document("hashlib", "The hashlib module implements secure hash and message digest algorithms such as SHA-256. "
             "Call hashlib.sha256(data).hexdigest() to get the hexadecimal digest of some bytes."),
    Document("uuid", "The uuid module generates universally unique identifiers. uuid.uuid4 makes a random UUID; "
             "uuid.uuid1 uses the host id and the current time."),
]


def save_tiny_model(path, arch: str = "llama", seed: int = 0, max_position_embeddings: int = 4096):
    """Write ``tiny_model(arch)`` + ``byte_tokenizer()`` as a local model directory (safetensors,
    config, tokenizer with its chat template) that ``load_model(path)`` loads like any model."""
    from pathlib import Path

    path = Path(path)
    tok = byte_tokenizer()
    model = tiny_model(arch, seed=seed, vocab_size=len(tok), max_position_embeddings=max_position_embeddings)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


class tiny_default_model:
    """Context manager: while active, the embedded default model (``None``/``"default"``/
    ``DEFAULT_MODEL`` everywhere: engines, integrations, CLI, tokenizers) is the tiny random
    model saved in ``path``. Used by the doc-snippet tests so documentation written for the
    real model runs in seconds. The process-wide shared engine of the default is dropped on
    entry and exit so no tiny engine outlives the block."""

    def __init__(self, path):
        self.path = path
        self._saved = None

    def __enter__(self):
        from pathlib import Path

        import cachedrag.model.loader as loader
        from cachedrag.integrations.engines import engine_registry

        if not (Path(self.path) / "config.json").is_file():
            save_tiny_model(self.path)
        self._saved = loader.default_model_dir
        loader.default_model_dir = lambda: Path(self.path)
        engine_registry().remove(loader.DEFAULT_MODEL)
        return self

    def __exit__(self, *exc):
        import cachedrag.model.loader as loader
        from cachedrag.integrations.engines import engine_registry

        loader.default_model_dir = self._saved
        engine_registry().remove(loader.DEFAULT_MODEL)
        return False


#: GGML types ``save_tiny_gguf`` can write (gguf-py quantises these itself; K-quants need llama.cpp)
TINY_GGUF_TYPES: tuple[str, ...] = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def save_tiny_gguf(path, arch: str = "llama", qtype: str = "F32", seed: int = 0, model=None, **overrides):
    """Write ``tiny_model(arch)`` (or ``model``, a Llama/Qwen2/Qwen3 causal LM) with ``byte_tokenizer()``
    as a GGUF file the way llama.cpp's converter lays it out: GGUF tensor names, Llama's q/k rows
    permuted, every 2-D weight in ``qtype`` (``TINY_GGUF_TYPES``; 1-D norms stay F32), the tokenizer
    and its chat template in the metadata. Returns ``(path, model)``; ``model`` keeps the float weights
    the file was quantised from; ``overrides`` go to ``tiny_config`` (e.g. ``max_position_embeddings``)."""
    import gguf

    tok = byte_tokenizer()
    model = model if model is not None else tiny_model(arch, seed=seed, vocab_size=len(tok), **overrides)
    cfg = model.config
    gguf_arch = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[cfg.model_type]
    writer = gguf.GGUFWriter(str(path), gguf_arch)
    _tiny_gguf_metadata(writer, cfg, tok)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[gguf_arch.upper()], cfg.num_hidden_layers)
    for hf_name, param in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, _, suffix = hf_name.rpartition(".")
        w = param.detach().float().numpy()
        if gguf_arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            heads = cfg.num_attention_heads if ".q_proj." in hf_name else cfg.num_key_value_heads
            w = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        kind = gguf.GGMLQuantizationType[qtype] if w.ndim == 2 else gguf.GGMLQuantizationType.F32
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", gguf.quants.quantize(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, model


def _tiny_gguf_metadata(writer, cfg, tok) -> None:
    """The hyperparameters and the byte tokenizer as GGUF metadata (a GPT-2 style BPE vocabulary)."""
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_vocab_size(cfg.vocab_size)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    special = set(tok.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([3 if t in special else 1 for t, _ in vocab])  # 3: control, 1: normal
    writer.add_token_scores([0.0] * len(vocab))  # no merges: transformers derives them from these (none here)
    writer.add_bos_token_id(tok.bos_token_id)
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_pad_token_id(tok.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tok.chat_template)


def serve_requests(engine, requests, max_batch: int | None = None, timeout_s: float = 60.0):
    """Run ``requests`` (``(segments, SamplingParams)`` pairs) through a fifo ``EngineLoop`` of
    ``engine`` at ``max_batch`` (default: all at once); returns each request's ``Finished`` in order
    and the stopped loop. Raises ``AssertionError`` when one fails or the loop does not finish."""
    import threading

    from cachedrag.server.config import SchedulerConfig
    from cachedrag.server.loop import EngineLoop, Failed, Finished, ServeRequest

    loop = EngineLoop(engine, SchedulerConfig(max_batch=max_batch or len(requests), order="fifo"))
    results, done = {}, threading.Event()

    def emitter(i):
        def emit(event):
            if isinstance(event, (Finished, Failed)):
                results[i] = event
                if len(results) == len(requests):
                    done.set()
        return emit

    for i, (segments, params) in enumerate(requests):
        loop.submit(ServeRequest(segments=segments, params=params, emit=emitter(i)))
    loop.start()
    assert done.wait(timeout_s), "the engine loop did not finish every request"
    loop.stop()
    assert all(isinstance(r, Finished) for r in results.values()), results
    return [results[i] for i in range(len(requests))], loop


def listening_url(proc, timeout_s: float) -> tuple[str | None, list[str]]:
    """Read a ``cachedrag serve`` child's stderr (``proc.stderr``, text) until its "listening on URL"
    line or ``timeout_s`` (checked between lines; a blocking read) or the stream ends: ``(URL or None,
    the lines read)``. Tests and benchmarks that start the server as a process use it."""
    import re
    import time

    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"listening on (http://[\w.:\[\]]+)", line)
        if m:
            return m.group(1), lines
    return None, lines

