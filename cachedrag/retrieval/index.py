"""Index directories: build a corpus into chunks + IVF, save, load, search by text.

Owns: ``build_index`` (chunk -> embed -> train IVF-Flat), the on-disk layout and its
``IndexManifest`` (embedder name and dimension, metric, nlist, chunk settings, tokenizer
identity, per-file sha256, and its own sha256), ``load_index`` with its mismatch, checksum and structure checks, and
``RetrievalIndex``, which maps search results back to ``Chunk`` records. Does not own: the
search kernels (``ivf``) or the tiers and prefetching (``cluster_store``, ``lookahead``).

Saving and the directory's files (layout constants, checksums, the crash-safe swap): ``index_files``.

The manifest verifies itself: ``manifest_sha256`` is the sha256 of its other fields
(canonical JSON), and ``files`` must list every file of the layout, so emptying ``files``
or editing ``metric`` is detected. This is integrity against accidents and naive edits,
not authentication: whoever can write the directory can recompute every checksum.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

import cachedrag
from cachedrag.corpus import Document
from cachedrag.errors import ConfigError, CorruptCacheError, EmptyInputError, IndexMismatchError
from cachedrag.retrieval.chunker import Chunk, Tokenizer, chunk_documents, tokenizer_identity
from cachedrag.retrieval.cluster_store import DiskClusterStore
from cachedrag.retrieval.config import ChunkConfig, IndexConfig, Metric, RetrievalConfig
from cachedrag.retrieval.embedder import Embedder
from cachedrag.retrieval.index_files import (ARRAYS, FILES, FORMAT, FORMAT_VERSION, MANIFEST, file_sha256,
                                             save_index)
from cachedrag.retrieval.ivf import PAD_ID, IVFIndex, Stage, check_nprobe


class IndexManifest(BaseModel):
    """What an index directory holds and how it was made."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["cachedrag-ivf-index"] = FORMAT
    format_version: int = FORMAT_VERSION
    cachedrag_version: str = cachedrag.__version__
    embedder: str
    dim: int
    metric: Metric
    nlist: int
    nlist_requested: int
    n_chunks: int
    n_docs: int
    chunk: ChunkConfig
    index: IndexConfig
    tokenizer: dict
    files: dict[str, str] = {}  # file name -> sha256
    manifest_sha256: str = ""  # sha256 of the canonical JSON of every other field

    def digest(self) -> str:
        """The sha256 this manifest should carry in ``manifest_sha256``."""
        fields = self.model_dump(mode="json", exclude={"manifest_sha256"})
        return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def sealed(self) -> "IndexManifest":
        """A copy carrying its own checksum."""
        return self.model_copy(update={"manifest_sha256": self.digest()})


@dataclass(frozen=True)
class Hit:
    """One ranked search result."""

    rank: int
    score: float
    row: int
    chunk: Chunk


class RetrievalIndex:
    """Chunks + their IVF index + the manifest; searches by text or vector.

    >>> index = load_index("my-index")                       # doctest: +SKIP
    >>> [h.chunk.id for h in index.search("heapq push", k=3)[0]]  # doctest: +SKIP
    """

    def __init__(self, manifest: IndexManifest, chunks: list[Chunk], ivf: IVFIndex, path: Path | None = None):
        assert len(chunks) == manifest.n_chunks == ivf.ntotal, (len(chunks), manifest.n_chunks, ivf.ntotal)
        self.manifest = manifest
        self.chunks = chunks
        self.ivf = ivf
        self.path = path
        self._embedder: Embedder | None = None

    @property
    def chunk_ids(self) -> list[str]:
        return [c.id for c in self.chunks]

    @property
    def embedder(self) -> Embedder:
        """The attached embedder, else the manifest's model (loaded once, offline)."""
        if self._embedder is None:
            self._embedder = Embedder(model=self.manifest.embedder)
            self._embedder.check_compatible(self.manifest.embedder, self.manifest.dim)
        return self._embedder

    def attach_embedder(self, embedder: Embedder) -> None:
        """Use ``embedder`` for queries; ``IndexMismatchError`` unless it is the index's model."""
        embedder.check_compatible(self.manifest.embedder, self.manifest.dim)
        self._embedder = embedder

    def check_tokenizer(self, tokenizer: Tokenizer) -> None:
        """``IndexMismatchError`` unless ``tokenizer`` is the one the chunks' token ids came from."""
        identity = tokenizer_identity(tokenizer)
        if identity["fingerprint"] != self.manifest.tokenizer.get("fingerprint"):
            raise IndexMismatchError(
                f"the index's chunks were tokenized by {self.manifest.tokenizer.get('name')!r}, "
                f"not by {identity['name']!r}; their token ids (and chunk KV caches) do not apply"
            )

    def embed(self, queries: str | Sequence[str] | torch.Tensor | np.ndarray) -> torch.Tensor:
        """Queries as vectors ``[B, d]`` (texts go through the embedder)."""
        if isinstance(queries, str):
            queries = [queries]
        if isinstance(queries, (torch.Tensor, np.ndarray)):
            q = torch.as_tensor(queries, dtype=torch.float32)
            q = q[None, :] if q.dim() == 1 else q  # [B, d]
        else:
            q = torch.from_numpy(self.embedder.encode(list(queries)))  # [B, d]
        if q.shape[1] != self.manifest.dim:
            raise IndexMismatchError(f"query vectors have dimension {q.shape[1]}, the index {self.manifest.dim}")
        return q

    def search(self, queries, k: int = 10, nprobe: int = 8) -> list[list[Hit]]:
        """IVF search (all clusters in memory) -> ranked hits per query."""
        check_nprobe(nprobe, self.ivf.nlist)
        scores, ids = self.ivf.search(self.embed(queries), k, nprobe)  # [B, k], [B, k]
        return self.hits(scores, ids)

    def search_stages(self, queries, k: int = 10, nprobe: int = 8, n_stages: int = 2) -> Iterator[tuple[Stage, list[list[Hit]]]]:
        """Staged search (speculative pipelining): ``(stage, hits)`` after each group of clusters."""
        check_nprobe(nprobe, self.ivf.nlist)
        for stage in self.ivf.search_stages(self.embed(queries), k, nprobe, n_stages):
            yield stage, self.hits(stage.scores, stage.ids)

    def hits(self, scores: torch.Tensor, ids: torch.Tensor) -> list[list[Hit]]:
        """Map ``(scores [B, k], ids [B, k])`` to ranked ``Hit`` lists (padding dropped)."""
        out = []
        for row_scores, row_ids in zip(scores.tolist(), ids.tolist()):
            hits = [
                Hit(rank=r, score=s, row=i, chunk=self.chunks[i])
                for r, (s, i) in enumerate(zip(row_scores, row_ids))
                if i != PAD_ID
            ]
            out.append(hits)
        return out

    def disk_store(self) -> DiskClusterStore:
        """The slow tier over this directory's cluster files."""
        if self.path is None:
            raise ConfigError("this index is not saved to a directory; save() it first")
        return DiskClusterStore(self.path / "vectors.npy", self.path / "ids.npy", self.ivf.offsets.tolist())

    def save(self, out: str | Path) -> Path:
        """Write the index directory atomically (temp dir + rename); returns its path."""
        self.path = save_index(self, Path(out))
        self.manifest = _read_manifest(self.path)
        return self.path


def build_index(
    docs: Iterable[Document],
    tokenizer: Tokenizer,
    embedder: Embedder,
    config: RetrievalConfig | None = None,
    out: str | Path | None = None,
    progress: bool | None = None,
) -> RetrievalIndex:
    """Chunk ``docs`` in ``tokenizer``'s tokens, embed, train IVF-Flat; save to ``out`` if given.

    ``nlist`` larger than the number of chunks is clamped to it with a warning (the manifest
    records both). Raises ``EmptyInputError`` for an empty corpus.
    """
    config = config or RetrievalConfig()
    docs = list(docs)
    if not docs:
        raise EmptyInputError("cannot build an index from an empty corpus")
    chunks = chunk_documents(docs, tokenizer, config.chunk, progress=progress)
    show = len(docs) >= config.chunk.progress_min_docs if progress is None else progress
    vectors = embedder.encode([c.text for c in chunks], progress=show)  # [N, d]
    ivf = IVFIndex.train(vectors, config.index)
    manifest = IndexManifest(
        embedder=embedder.name,
        dim=embedder.dim,
        metric=config.index.metric,
        nlist=ivf.nlist,
        nlist_requested=config.index.nlist,
        n_chunks=len(chunks),
        n_docs=len(docs),
        chunk=config.chunk,
        index=config.index,
        tokenizer=tokenizer_identity(tokenizer),
    )
    index = RetrievalIndex(manifest, chunks, ivf)
    index._embedder = embedder
    if out is not None:
        index.save(out)
    return index


def load_index(path: str | Path, embedder: Embedder | None = None, verify: bool = True) -> RetrievalIndex:
    """Load an index directory; check ``embedder`` (if given) and file checksums (if ``verify``).

    Raises ``IndexMismatchError`` when ``embedder`` is another model or dimension than the
    index's, ``CorruptCacheError`` when a file fails its checksum or shape checks.
    """
    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise FileNotFoundError(f"{path} is not a cachedrag index directory (no {MANIFEST})")
    manifest = _read_manifest(path)
    if embedder is not None:
        embedder.check_compatible(manifest.embedder, manifest.dim)
    if verify:
        for name, digest in manifest.files.items():
            if file_sha256(path / name) != digest:
                raise CorruptCacheError(f"index file {path / name} fails its checksum; rebuild the index")
    try:
        arrays = {name: np.load(path / f"{name}.npy", allow_pickle=False) for name in ARRAYS}
        with (path / "chunks.jsonl").open(encoding="utf-8") as fh:
            records = [json.loads(line) for line in fh if line.strip()]
    except (ValueError, OSError, EOFError) as exc:  # numpy format errors, bad JSON, missing files
        raise CorruptCacheError(f"{path}: index files cannot be read ({exc}); rebuild the index") from exc
    tok_off = arrays["token_offsets"]
    if len(records) != manifest.n_chunks or len(tok_off) != manifest.n_chunks + 1:
        raise CorruptCacheError(f"{path}: chunk files disagree with the manifest ({len(records)} records)")
    _check_structure(path, arrays, manifest)
    chunks = [Chunk.from_record(r, arrays["token_ids"][tok_off[i] : tok_off[i + 1]]) for i, r in enumerate(records)]
    ivf = IVFIndex(
        torch.from_numpy(arrays["centroids"]),
        torch.from_numpy(arrays["vectors"]),
        torch.from_numpy(arrays["ids"]),
        torch.from_numpy(arrays["offsets"]),
        manifest.metric,
    )
    if ivf.dim != manifest.dim or ivf.nlist != manifest.nlist:
        raise CorruptCacheError(f"{path}: arrays (dim {ivf.dim}, nlist {ivf.nlist}) disagree with the manifest")
    index = RetrievalIndex(manifest, chunks, ivf, path)
    if embedder is not None:
        index._embedder = embedder
    return index


def _read_manifest(path: Path) -> IndexManifest:
    """The manifest, checked: its own checksum (format 2), and a ``files`` table naming every
    file of the layout. A format-1 manifest (no checksum) loads with a warning to rebuild."""
    try:
        manifest = IndexManifest.model_validate_json((path / MANIFEST).read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:
        raise CorruptCacheError(f"{path / MANIFEST} is not a valid index manifest: {exc}") from exc
    if manifest.format_version == 1:
        warnings.warn(f"{path}: index format 1 has no manifest checksum; rebuild it to get a self-verifying one",
                      RuntimeWarning, stacklevel=3)
    elif manifest.format_version != FORMAT_VERSION:
        raise IndexMismatchError(f"{path}: index format {manifest.format_version}, this cachedrag reads "
                                 f"{FORMAT_VERSION}; rebuild the index")
    elif manifest.manifest_sha256 != manifest.digest():
        raise CorruptCacheError(f"{path / MANIFEST} fails its own checksum (edited or damaged); rebuild the index")
    if set(manifest.files) != FILES:
        raise CorruptCacheError(f"{path / MANIFEST}: its file table lists {sorted(manifest.files)}, "
                                f"not the index's files {sorted(FILES)}; rebuild the index")
    return manifest


def _check_structure(path: Path, arrays: dict[str, np.ndarray], manifest: IndexManifest) -> None:
    """Array invariants a search relies on (so a bad index raises here, not mid-search): ids
    are a permutation of the chunk rows, offsets are monotone and cover every vector."""
    n = manifest.n_chunks
    ids, offsets, tok = arrays["ids"], arrays["offsets"], arrays["token_offsets"]
    problems = []
    if ids.shape != (n,) or not np.array_equal(np.sort(ids), np.arange(n)):
        problems.append("ids are not a permutation of the chunk rows")
    if offsets.shape != (manifest.nlist + 1,) or offsets[0] != 0 or offsets[-1] != n or np.any(np.diff(offsets) < 0):
        problems.append("cluster offsets do not cover the vectors")
    if arrays["vectors"].shape != (n, manifest.dim):
        problems.append(f"vectors have shape {arrays['vectors'].shape}")
    if tok[0] != 0 or tok[-1] != len(arrays["token_ids"]) or np.any(np.diff(tok) < 0):
        problems.append("token offsets do not cover the token ids")
    if problems:
        raise CorruptCacheError(f"{path}: {'; '.join(problems)}; rebuild the index")
