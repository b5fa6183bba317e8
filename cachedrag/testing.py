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
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {TINY_ARCHITECTURES}")
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
