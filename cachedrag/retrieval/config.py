"""Settings of the retrieval stack, validated once.

Owns: every number the chunker, embedder, IVF index, search and lookahead prefetcher use
(chunk size and overlap, nlist, nprobe, metric, k, byte budgets, k-means settings, batch
sizes) as frozen pydantic models. Does not own: the checks that need a built index (nprobe
against the index's nlist is checked at search time, see ``ivf.check_nprobe``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cachedrag.errors import ConfigError, describe_validation_error

Metric = Literal["ip", "l2"]

DEFAULT_EMBEDDER = "sentence-transformers/all-MiniLM-L6-v2"

MIB = 1 << 20


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ChunkConfig(_Frozen):
    """How documents are cut into chunks of LLM tokens."""

    chunk_tokens: int = Field(256, ge=1, description="tokens per chunk (LLM tokenizer)")
    overlap: int = Field(32, ge=0, description="tokens shared by consecutive chunks of one document")
    progress_min_docs: int = Field(
        32, ge=0, description="show a progress bar when a corpus has at least this many documents"
    )

    @model_validator(mode="after")
    def _overlap_below_size(self) -> "ChunkConfig":
        if self.overlap >= self.chunk_tokens:
            raise ConfigError(f"overlap ({self.overlap}) must be smaller than chunk_tokens ({self.chunk_tokens})")
        return self

    @property
    def stride(self) -> int:
        """Tokens between the starts of consecutive chunks."""
        return self.chunk_tokens - self.overlap


class EmbedderConfig(_Frozen):
    """Which sentence-transformers model embeds chunks and queries, and how."""

    model: str = Field(
        DEFAULT_EMBEDDER,
        description="sentence-transformers name or local path; the default resolves to the embedded MiniLM copy",
    )
    batch_size: int = Field(32, ge=1, description="texts per encode batch")
    device: str = Field("cpu", description="torch device the embedder runs on")
    local_files_only: bool = Field(True, description="never download from a model hub")


class IndexConfig(_Frozen):
    """How the IVF-Flat index is trained."""

    nlist: int = Field(32, ge=1, description="number of IVF clusters (clamped to the number of chunks, with a warning)")
    metric: Metric = Field("ip", description="'ip' (inner product of normalised vectors = cosine) or 'l2'")
    kmeans_iters: int = Field(20, ge=1, description="k-means iterations when training the centroids")
    seed: int = Field(1234, description="k-means seed (the same vectors give the same index)")


class SearchConfig(_Frozen):
    """Defaults of one search call."""

    k: int = Field(10, ge=1, description="results per query")
    nprobe: int = Field(16, ge=1, description="clusters probed per query (must not exceed the index's nlist)")


class LookaheadConfig(_Frozen):
    """The lookahead prefetcher (TeleRAG): budget, candidate hook, cancellation."""

    budget_bytes: int = Field(
        64 * MIB,
        ge=0,
        description="fast-tier bytes one prefetch may fill; profile it with policy.prefetch_budget(bandwidth, llm_times)",
    )
    candidate_chunks: int = Field(
        4, ge=0, description="top-m chunks of the prefetched clusters passed to on_candidates (0 disables the hook)"
    )
    cancel_prefetch_on_search: bool = Field(
        True, description="stop copying clusters once the transformed query's search starts"
    )
    bandwidth_sample_clusters: int = Field(8, ge=1, description="clusters read per bandwidth measurement")


class DiskIndexConfig(_Frozen):
    """How an on-disk IVF index (``disk_ivf``) is trained, written and optionally compressed."""

    nlist: int = Field(1024, ge=1, description="IVF clusters (about sqrt(N) to 4 sqrt(N))")
    metric: Metric = Field("ip", description="'ip' (normalised vectors: cosine) or 'l2'")
    kmeans_iters: int = Field(10, ge=1, description="k-means iterations of the coarse quantizer")
    seed: int = Field(1234, description="k-means seed")
    train_size: int = Field(65_536, ge=1, description="vectors (the source's first rows) the k-means sees")
    block_rows: int = Field(65_536, ge=1, description="rows per build step (the unit of progress and of resuming)")
    pq_m: int = Field(0, ge=0, description="product-quantizer sub-vectors (0: no IVF-PQ); must divide the dimension")
    pq_bits: int = Field(8, ge=1, le=16, description="bits per PQ code")


class PipeliningConfig(_Frozen):
    """RAGCache's dynamic speculative pipelining (``cachedrag.pipelining``)."""

    max_stages: int = Field(4, ge=1, description="search stages of an idle engine (1: no speculation)")
    busy_requests: int = Field(2, ge=1, description="other requests in flight at which speculation stops")
    prompt_chunks: int = Field(4, ge=1, description="top chunks that go into the prompt")
    min_search_s: float = Field(
        0.1, ge=0.0, description="speculate only when recent searches took at least this long (0: always)"
    )
    search_ema: float = Field(0.3, gt=0.0, le=1.0, description="weight of the newest search in the expected search time")


class RetrievalConfig(_Frozen):
    """Everything of the retrieval stack in one object."""

    chunk: ChunkConfig = Field(default_factory=ChunkConfig)
    embedder: EmbedderConfig = Field(default_factory=EmbedderConfig)
    index: IndexConfig = Field(default_factory=IndexConfig)
    search: SearchConfig = Field(default_factory=SearchConfig)
    lookahead: LookaheadConfig = Field(default_factory=LookaheadConfig)


def make_config(model_cls: type[BaseModel], **values) -> BaseModel:
    """``model_cls(**values)`` with ``None`` values left at their defaults; bad values -> ``ConfigError``."""
    try:
        return model_cls(**{key: value for key, value in values.items() if value is not None})
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from exc
