"""Grammar-constrained decoding: output that is valid JSON for a JSON schema, token by token.

Owns: ``JsonConstraint``, the per-request logits constraint that ``SamplingParams.constraint``
carries into the decode loop (``mask(logits)`` before each choice, ``advance(token)`` after it,
``done`` once the grammar is complete), ``GrammarConstraint``, the same over an llguidance Lark
grammar (tool calls: ``prompt.toolgrammar``), lazy when the grammar waits for a trigger text
(EOS is allowed until the trigger appears, so the answer may stay plain text), and the one-time
conversion of a model's tokenizer for them. Only tokens that keep the output a valid prefix of a
schema-conforming JSON document are ever allowed, so validity does not depend on the model's size (the 135M default model included);
the model still chooses among the allowed tokens.

The grammar work is llguidance's (Microsoft's maintained constrained-decoding engine, used by
vLLM, SGLang and llama.cpp): it compiles the schema and computes the allowed-token mask over the
model's own vocabulary from the tokenizer object in memory, so nothing is downloaded. JSON is
compact (no free whitespace), which keeps small models from wandering in whitespace.
Under a constraint the decode loop goes one token per step: prompt-lookup drafts are off
(``generation.uses_history``: the grammar state would have to be rolled back past rejected draft
tokens, which is not wired), and the tie guard during decoding may still move an answer onto an
exact prefill's KV (the grammar state is the tokens', which stay) but never rewinds it
(``generation.rewind_allowed``).
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


class _MatcherConstraint:
    """The mask / advance / done of one llguidance matcher over one generation."""

    _matcher: Any
    eos_ids: list[int]

    def _compile(self, tokenizer, eos_ids: Iterable[int], grammar: str, what: str) -> None:
        llg = _llguidance()
        self.eos_ids = sorted(set(int(i) for i in eos_ids))
        self._tok = ll_tokenizer(tokenizer, self.eos_ids)
        try:
            self._matcher = llg.LLMatcher(self._tok, grammar)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise ConfigError(f"unsupported {what}: {exc}") from exc
        if self._matcher.is_error():
            raise ConfigError(f"unsupported {what}: {self._matcher.get_error()}")

    def _allowed(self) -> torch.Tensor:
        return torch.from_numpy(np.frombuffer(self._matcher.compute_logit_bias(), dtype=np.uint8) > 0)  # [V_tok]

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[V]`` with every token the grammar forbids at -inf (EOS only once complete)."""
        allowed = self._allowed()  # [V_tok]
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


class JsonConstraint(_MatcherConstraint):
    """Allow only tokens that continue a JSON document valid for ``schema`` (any JSON object when
    ``schema`` is None: LangChain's ``json_mode``). One instance serves one generation."""

    def __init__(self, schema: dict[str, Any] | None, tokenizer, eos_ids: Iterable[int]):
        llg = _llguidance()
        self.schema = closed_objects(schema) if schema is not None else {"type": "object"}
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(self.schema), defaults=_COMPILE_OPTIONS)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise ConfigError(f"unsupported JSON schema for structured output: {exc}") from exc
        self._compile(tokenizer, eos_ids, grammar, "JSON schema for structured output")


class GrammarConstraint(_MatcherConstraint):
    """Allow only tokens that continue a sentence of the Lark grammar ``lark`` (llguidance's
    dialect, ``%json`` included). With ``lazy_trigger``, the grammar begins with free text up to
    that text (``prompt.toolgrammar``): until it appears EOS is allowed too and the output is
    ``complete``, so the answer may end as plain text; after it the grammar alone decides."""

    def __init__(self, lark: str, tokenizer, eos_ids: Iterable[int], lazy_trigger: str | None = None,
                 watch: "RepeatWatch | None" = None):
        llg = _llguidance()
        self.lark = lark
        self.lazy_trigger = lazy_trigger
        self.watch = watch
        self._tokenizer = tokenizer
        self._tail = ""
        self.triggered = lazy_trigger is None
        try:
            grammar = llg.LLMatcher.grammar_from_lark(lark)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise ConfigError(f"unsupported tool-call grammar: {exc}") from exc
        self._compile(tokenizer, eos_ids, grammar, "tool-call grammar")

    def _allowed(self) -> torch.Tensor:
        allowed = super()._allowed()  # [V_tok]
        if not self.triggered:
            allowed = allowed.clone()
            allowed[[i for i in self.eos_ids if i < allowed.shape[0]]] = True
        return allowed

    def advance(self, token: int) -> None:
        if token in self.eos_ids:
            return
        super().advance(token)
        if self.watch is not None:
            self.watch.add(int(token))
        if not self.triggered:
            self._tail += self._tokenizer.decode([int(token)], skip_special_tokens=False)
            if self.lazy_trigger in self._tail:
                self.triggered = True
            self._tail = self._tail[-(len(self.lazy_trigger) + 16):]

    @property
    def complete(self) -> bool:
        return not self.triggered or super().complete

    @property
    def done(self) -> bool:
        """Complete, or (parallel calls) the last call repeated an earlier one: nothing follows."""
        return super().done or (self.watch is not None and self.watch.repeated)


class RepeatWatch:
    """Watches a parallel tool-calling answer for a call that repeats an earlier one (same name and
    arguments): a small model repeats its call until ``max_tokens``; the answer stops there
    (``GrammarConstraint.done``) and the parsers drop the repeat (``toolparse``)."""

    def __init__(self, tokenizer, fmt):
        from cachedrag.prompt.toolparse import parser_for

        self._tokenizer = tokenizer
        self._parser = parser_for(fmt, id_factory=lambda: "")
        self._ids: list[int] = []
        self._text = ""
        self.repeated = False

    def add(self, token: int) -> None:
        self._ids.append(token)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=False)
        if text.endswith("\ufffd"):  # a character split across tokens: wait for its end
            return
        delta, self._text = text[len(self._text):], text
        self._parser.feed(delta)
        self.repeated = self.repeated or self._parser.repeats > 0


def tool_constraint(tokenizer, eos_ids: Iterable[int], tools, choice, fmt=None) -> GrammarConstraint | None:
    """The constraint of a tool-calling answer: ``tools`` (``prompt.tools.ToolSpec``s) under
    ``choice`` (``ToolChoice``) in ``fmt`` (default: the template's, ``prompt.toolformat.detect_format``);
    None when the answer is free text (``none``, or no callable tool)."""
    from cachedrag.prompt.toolformat import detect_format
    from cachedrag.prompt.toolgrammar import tool_grammar

    fmt = fmt or detect_format(tokenizer)
    trigger_id = tokenizer.convert_tokens_to_ids(fmt.trigger) if fmt.trigger_token else None
    grammar = tool_grammar(fmt, list(tools), choice, trigger_id)
    if grammar is None:
        return None
    watch = RepeatWatch(tokenizer, fmt) if choice.parallel else None
    return GrammarConstraint(grammar.lark, tokenizer, eos_ids, grammar.lazy_trigger, watch)
