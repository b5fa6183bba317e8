"""Prompt layout: a request as ordered segments of token ids.

Owns: ``Segment`` (a run of token ids that is either fixed text or a cacheable retrieved
chunk, with its identity key), ``PromptBuilder`` (tokenises segments for one tokenizer and
model namespace) and the chat layout the engine uses:
``[system prefix text] [chunk 1] ... [chunk n] [question text]``, built around
``template.template_split``. In the engine's own layout each segment is tokenised on its own, so
a chunk has the same token ids (and the same key) wherever it appears; chunks are held stripped
(``chunk_part``) and a segment's trailing whitespace is tokenised as before a word
(``running_ids``), so the segments' ids are also the whole prompt's ids (what
``apply_chat_template`` gives). A prompt that arrives as text (a server request, a framework's
formatted prompt) can instead be tokenised whole, as a server without cachedrag would tokenise
it, and cut at its parts' boundaries (``text_segments(..., tokenization="whole")``): then full
prefill of the segments is full prefill of the very token ids a plain server computes.

Does not own: rendering chat messages (``template``), finding chunks in a prompt string
(``registry``, ``splitter``), what to reuse (``cachedrag.kvcache``) or tensors.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from cachedrag.errors import EmptyInputError
from cachedrag.kvcache.keys import Namespace, chunk_key
from cachedrag.prompt.template import template_split

CHUNK_SEPARATOR = "\n\n"
QUESTION_PREFIX = "Question: "


def chunk_part(text: str) -> str:
    """A retrieved text as the engine's layouts hold it: without surrounding whitespace, then
    ``CHUNK_SEPARATOR``. Stripped, every boundary of a layout is a clean cut for a byte-level BPE
    (``"...x\n\nY"``, non-space on both sides), so the segments' ids are the whole prompt's ids
    (``PromptBuilder.running_ids``); a token window decoded from a corpus starts with the space
    of its first word, which the whole text would otherwise join to the separator before it."""
    return text.strip() + CHUNK_SEPARATOR


@dataclass(frozen=True)
class Segment:
    """One run of prompt tokens. ``kind="chunk"`` segments may be served from chunk caches."""

    kind: Literal["text", "chunk"]
    ids: tuple[int, ...]
    key: str
    text: str = ""

    def __len__(self) -> int:
        return len(self.ids)


def running_ids(tokenizer, text: str) -> tuple[int, ...]:
    """The ids of ``text`` as they are inside running text where a word follows it.

    A byte-level BPE tokenises trailing whitespace by what comes next: ``"x.\n\n"`` alone
    ends with the one token ``"\n\n"``, but followed by a word the same characters are two
    ``"\n"`` tokens (the pre-tokenizer keeps the whitespace run's last character apart from the
    word), and that is all the model ever saw before a word in training. Every part of the
    engine's layouts is followed by a word (the next chunk, held stripped, or the question), so
    a part ending in whitespace is tokenised with a letter after it and cut there: the segments' ids then
    concatenate to the ids of the whole prompt (what ``apply_chat_template`` gives), while a
    chunk's ids still do not depend on its neighbours. Where a token would span the cut (a
    trailing space joins the next word), or without character offsets (slow tokenizers), the
    text's own ids."""
    if text[-1:].isspace() and getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text + "a", add_special_tokens=False, return_offsets_mapping=True)
        inside = [hi <= len(text) for _, hi in enc["offset_mapping"]]  # [T] token ends within the text
        first_out = inside.index(False) if False in inside else None
        if (first_out and not any(inside[first_out:])  # the text's tokens, then the letter's
                and enc["offset_mapping"][first_out][0] == len(text)):  # which holds none of the text
            return tuple(int(x) for x in enc["input_ids"][:first_out])
    return tuple(int(x) for x in tokenizer.encode(text, add_special_tokens=False))  # the text's own ids


class PromptBuilder:
    """Tokenises segments for one tokenizer + namespace, caching chunk tokenisations."""

    def __init__(self, tokenizer, namespace: Namespace, cache_size: int = 50_000):
        self.tokenizer = tokenizer
        self.namespace = namespace
        self._cache: OrderedDict[tuple[str, str], Segment] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._template: dict[str | None, tuple[str, str]] = {}

    def segment(self, kind: Literal["text", "chunk"], text: str) -> Segment:
        """Tokenise ``text`` alone (no special tokens added) into a keyed segment, its trailing
        whitespace as it tokenises when a word follows (``running_ids``)."""
        with self._lock:
            hit = self._cache.get((kind, text))
            if hit is not None:
                self._cache.move_to_end((kind, text))
                return hit
        ids = self.running_ids(text)
        if not ids:
            raise EmptyInputError(f"a {kind} segment tokenises to no tokens: {text[:40]!r}")
        seg = Segment(kind=kind, ids=ids, key=chunk_key(ids, self.namespace), text=text)
        with self._lock:
            self._cache[(kind, text)] = seg
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return seg

    def chunk_segment(self, text: str) -> Segment:
        """A retrieved text's segment in the engine's layouts (``chunk_part``): its key is the
        cache key of that chunk wherever the engine places it."""
        return self.segment("chunk", chunk_part(text))

    def running_ids(self, text: str) -> tuple[int, ...]:
        """``running_ids(self.tokenizer, text)``: the ids of ``text`` inside running text."""
        return running_ids(self.tokenizer, text)

    def template_split(self, system_prompt: str | None) -> tuple[str, str]:
        """Chat-template text before and after the user message (with the generation prompt), cached."""
        if system_prompt not in self._template:
            self._template[system_prompt] = template_split(self.tokenizer, system_prompt)
        return self._template[system_prompt]

    def chat(self, chunks: Sequence[str], question: str, system_prompt: str | None = None) -> list[Segment]:
        """The chat layout: system prefix, one segment per chunk, then the question."""
        if not question or not question.strip():
            raise EmptyInputError("the question is empty")
        before, after = self.template_split(system_prompt)
        segments = [self.segment("text", before)] if before else []
        segments += [self.chunk_segment(c) for c in chunks if c and c.strip()]
        segments.append(self.segment("text", QUESTION_PREFIX + question + after))
        return segments

    def text_segments(self, parts: Sequence[tuple[Literal["text", "chunk"], str]],
                      tokenization: Literal["parts", "whole"] = "parts") -> list[Segment]:
        """Arbitrary ordered parts (e.g. a framework's formatted prompt split around known chunks).

        ``tokenization="parts"``: each part on its own (a chunk's ids do not depend on its
        neighbours). ``"whole"``: the concatenated text is tokenised once, as a plain server
        tokenises it, and the ids are cut at the parts' boundaries, a token that crosses one going
        to the part that holds its last character (so a chunk after ``"\n\n "`` starts with the
        space-prefixed token the tokenizer forms there); a part left with no token is dropped.
        The segments' ids then concatenate to exactly the whole text's ids, and a chunk keeps one
        key wherever the characters around it tokenise alike (the usual blank-line separators).
        Tokenizers without character offsets (no fast tokenizer) fall back to ``"parts"``.
        """
        if tokenization not in ("parts", "whole"):
            raise ValueError(f"tokenization must be 'parts' or 'whole', got {tokenization!r}")
        parts = [(kind, text) for kind, text in parts if text]
        if not parts:
            raise EmptyInputError("the prompt is empty")
        if tokenization == "whole" and getattr(self.tokenizer, "is_fast", False):
            return self._whole_segments(parts)
        return [self.segment(kind, text) for kind, text in parts]

    def _whole_segments(self, parts: list[tuple[Literal["text", "chunk"], str]]) -> list[Segment]:
        whole = "".join(text for _, text in parts)
        enc = self.tokenizer(whole, add_special_tokens=False, return_offsets_mapping=True)
        ends = []  # [P] character offset where each part ends
        for _, text in parts:
            ends.append((ends[-1] if ends else 0) + len(text))
        runs: list[list] = []  # [part, ids, first char, end char] per run of tokens
        for tok, (lo, hi) in zip(enc["input_ids"], enc["offset_mapping"]):
            part = min(bisect.bisect_right(ends, max(hi - 1, lo)), len(parts) - 1)  # the part of its last character
            if runs and runs[-1][0] >= part:  # (a byte-split character repeats its span: never a step back)
                runs[-1][1].append(int(tok))
                runs[-1][3] = max(runs[-1][3], hi)
            else:
                runs.append([part, [int(tok)], lo, hi])
        if not runs:
            raise EmptyInputError("the prompt tokenises to no tokens")
        return [Segment(kind=parts[part][0], ids=tuple(ids), key=chunk_key(ids, self.namespace), text=whole[lo:hi])
                for part, ids, lo, hi in runs]  # the last run is the last part's: it holds the text's last character
