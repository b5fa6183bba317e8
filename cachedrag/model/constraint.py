"""Grammar-constrained decoding: output that is valid JSON for a JSON schema, token by token.

Owns: ``JsonConstraint``, the per-request logits constraint that ``SamplingParams.constraint``
carries into the decode loop (``mask(logits)`` before each choice, ``advance(token)`` after it,
``done`` once the grammar is complete), and the one-time conversion of a model's tokenizer for
it. Only tokens that keep the output a valid prefix of a schema-conforming JSON document are
ever allowed, so validity does not depend on the model's size (the 135M default model included);
the model still chooses among the allowed tokens.

The grammar work is llguidance's (Microsoft's maintained constrained-decoding engine, used by
vLLM, SGLang and llama.cpp): it compiles the schema and computes the allowed-token mask over the
model's own vocabulary from the tokenizer object in memory, so nothing is downloaded. JSON is
compact (no free whitespace), which keeps small models from wandering in whitespace.
Does not own: sampling (``generation``) or the framework adapters that build a constraint.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from cachedrag.errors import ConfigError

_COMPILE_OPTIONS = {"whitespace_flexible": False}
_converted: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError as exc:  # a base dependency; only a broken install lands here
        raise ConfigError("structured output needs llguidance: run `pip install llguidance`") from exc
    return llguidance


def ll_tokenizer(tokenizer, eos_ids: Iterable[int]):
    """The llguidance view of ``tokenizer`` (converted once per tokenizer object: ~1 s for 49k tokens)."""
    llg = _llguidance()
    key = (tuple(sorted(eos_ids)),)
    with _lock:
        per_tok = _converted.setdefault(tokenizer, {})
        if key not in per_tok:
            per_tok[key] = llg.hf.from_tokenizer(tokenizer, eos_token=list(key[0]) or None)
        return per_tok[key]


def closed_objects(schema):
    """``schema`` with ``additionalProperties: false`` on every object that lists its properties
    and says nothing about others (OpenAI's strict structured outputs do the same): a pydantic
    model's JSON then holds exactly its fields, instead of any extra keys a model may invent."""
    if isinstance(schema, list):
        return [closed_objects(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class JsonConstraint:
    """Allow only tokens that continue a JSON document valid for ``schema`` (any JSON object when
    ``schema`` is None: LangChain's ``json_mode``). One instance serves one generation."""

    def __init__(self, schema: dict[str, Any] | None, tokenizer, eos_ids: Iterable[int]):
        llg = _llguidance()
        self.schema = closed_objects(schema) if schema is not None else {"type": "object"}
        self.eos_ids = sorted(set(int(i) for i in eos_ids))
        self._tok = ll_tokenizer(tokenizer, self.eos_ids)
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(self.schema), defaults=_COMPILE_OPTIONS)
            self._matcher = llg.LLMatcher(self._tok, grammar)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise ConfigError(f"unsupported JSON schema for structured output: {exc}") from exc
        if self._matcher.is_error():
            raise ConfigError(f"unsupported JSON schema for structured output: {self._matcher.get_error()}")

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[V]`` with every token the grammar forbids at -inf (EOS only once complete)."""
        allowed = torch.from_numpy(np.frombuffer(self._matcher.compute_logit_bias(), dtype=np.uint8) > 0)  # [V_tok]
        n = min(logits.shape[-1], allowed.shape[0])
        out = torch.full(logits.shape, float("-inf"), dtype=torch.float32, device=logits.device)  # [V]
        keep = allowed[:n].to(logits.device)  # [n]
        out[:n] = torch.where(keep, logits[:n].float(), out[:n])
        if not bool(keep.any()):
            raise RuntimeError(f"structured output: the grammar allows no token ({self._matcher.get_error()})")
        return out

    def advance(self, token: int) -> None:
        if token in self.eos_ids:
            return
        if not self._matcher.consume_token(int(token)):
            raise RuntimeError(f"structured output: token {token} rejected ({self._matcher.get_error()})")

    @property
    def done(self) -> bool:
        """The document is complete and nothing may follow it."""
        return self._matcher.is_stopped()

    @property
    def complete(self) -> bool:
        """The output so far is a whole valid document (it may stop here)."""
        return self._matcher.is_accepting() or self._matcher.is_stopped()
