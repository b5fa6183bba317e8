"""LlamaIndex retrieval adapters: ``CachedRAGRetriever`` and ``CachedRAGNodePostprocessor``.

Owns: ``CachedRAGRetriever`` (``BaseRetriever``) over an index directory (``cachedrag index
build``: embeds ``query_bundle.embedding_strs``, returns ``NodeWithScore`` with chunk ids,
registers the chunk texts, starts lookahead prefetch on LlamaIndex's ``QueryStartEvent`` with
``auto_prefetch``), ``CachedRAGNodePostprocessor`` (registers the texts of nodes from any other
retriever) and the event handler that starts the prefetch. Both are re-exported by
``cachedrag.integrations.llama_index``, where users import them.

Does not own: search or the registries (``search``, ``cachedrag.prompt.registry``), the LLM
(``llama_index``).
"""

from __future__ import annotations

import weakref
from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.callbacks import CallbackManager
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.query import QueryStartEvent
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import (
    MetadataMode,
    NodeRelationship,
    NodeWithScore,
    QueryBundle,
    RelatedNodeInfo,
    TextNode,
)
from pydantic import PrivateAttr

from cachedrag.integrations.search import SearchHit, shared_searcher
from cachedrag.integrations.speculation import pipelining_option
from cachedrag.integrations.worker import run_in_worker
from cachedrag.prompt.registry import ChunkRegistry
from cachedrag.prompt.registry import chunk_registry as _default_registry
from cachedrag.retrieval.config import PipeliningConfig

__all__ = ["CachedRAGRetriever", "CachedRAGNodePostprocessor"]


class CachedRAGRetriever(BaseRetriever):
    """Retrieve chunks from a cachedrag index directory; their texts become cacheable chunks.

    >>> retriever = CachedRAGRetriever(index_dir="my-index", similarity_top_k=4)   # doctest: +SKIP
    >>> [n.node.node_id for n in retriever.retrieve("How do I pretty-print JSON?")]  # doctest: +SKIP
    ['stdlib/json#0', ...]

    Several ``embedding_strs`` (HyDE with ``include_original=True``) are searched as the
    renormalised mean of their normalised embeddings. ``query_bundle.embedding`` is ignored:
    it comes from ``Settings.embed_model``, not necessarily the index's embedder.

    ``pipelining=True`` (or a ``PipeliningConfig``): speculative pipelining; the search runs in
    stages while the LLM's engine prefills the intermediate top-k in the shape of its previous
    prompt (``integrations.speculation``); same nodes and answers, ``last_speculation`` says
    what it did.
    """

    def __init__(self, index_dir: str, similarity_top_k: int = 4, nprobe: int | None = None,
                 auto_prefetch: bool = True, chunk_registry: ChunkRegistry | None = None,
                 callback_manager: CallbackManager | None = None, verbose: bool = False,
                 pipelining: bool | PipeliningConfig | dict = False):
        if similarity_top_k < 1:
            raise ValueError("similarity_top_k must be at least 1")
        super().__init__(callback_manager=callback_manager, verbose=verbose)
        self.index_dir = str(index_dir)
        self.similarity_top_k = similarity_top_k
        self.nprobe = nprobe
        self._searcher = shared_searcher(index_dir, chunk_registry)
        self._pipelining = pipelining_option(pipelining)
        self.last_speculation: dict | None = None  # what the latest pipelined retrieval speculated
        self._handler = None
        if auto_prefetch:
            self._handler = _PrefetchOnQueryStart()
            self._handler._retriever = weakref.ref(self)
            _add_handler(self._handler)
            weakref.finalize(self, _remove_handler, self._handler)

    def prefetch(self, original_query: str) -> bool:
        """Start moving the IVF clusters nearest ``original_query`` to the fast tier; returns at once."""
        return self._searcher.prefetch(original_query)

    def close(self) -> None:
        """Stop listening for query starts (the shared index stays loaded)."""
        if self._handler is not None:
            _remove_handler(self._handler)
            self._handler = None

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        if self._pipelining is None:
            hits = self._searcher.search(query_bundle.embedding_strs, k=self.similarity_top_k, nprobe=self.nprobe)
        else:
            hits, self.last_speculation = self._pipelining.search(self._searcher, query_bundle.embedding_strs,
                                                                  self.similarity_top_k, self.nprobe)
        return [NodeWithScore(node=_node(h), score=h.score) for h in hits]

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return await run_in_worker(self._retrieve, query_bundle)


class CachedRAGNodePostprocessor(BaseNodePostprocessor):
    """Register the texts of nodes from any retriever or vector store; nodes pass unchanged.

    >>> engine = RetrieverQueryEngine.from_args(my_vector_retriever, llm=CachedRAGLLM(),        # doctest: +SKIP
    ...                                         node_postprocessors=[CachedRAGNodePostprocessor()])
    """

    _registry: ChunkRegistry = PrivateAttr(default=None)

    def __init__(self, *, chunk_registry: ChunkRegistry | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self._registry = _default_registry() if chunk_registry is None else chunk_registry

    @classmethod
    def class_name(cls) -> str:
        return "CachedRAGNodePostprocessor"

    def _postprocess_nodes(self, nodes: list[NodeWithScore],
                           query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        self._registry.register(n.node.get_content(metadata_mode=MetadataMode.NONE) for n in nodes
                                if isinstance(n.node, TextNode))
        return nodes


def _node(hit: SearchHit) -> TextNode:
    metadata = hit.metadata()
    node = TextNode(id_=hit.chunk_id, text=hit.text, metadata=metadata,
                    excluded_llm_metadata_keys=list(metadata), excluded_embed_metadata_keys=list(metadata))
    node.relationships[NodeRelationship.SOURCE] = RelatedNodeInfo(node_id=hit.doc_id)
    return node


class _PrefetchOnQueryStart(BaseEventHandler):
    """Starts a retriever's lookahead prefetch when any query engine starts a query."""

    _retriever: Any = PrivateAttr(default=None)  # weakref to the CachedRAGRetriever

    @classmethod
    def class_name(cls) -> str:
        return "CachedRAGPrefetchOnQueryStart"

    def handle(self, event, **kwargs: Any) -> None:
        if not isinstance(event, QueryStartEvent):
            return
        retriever = self._retriever() if self._retriever is not None else None
        if retriever is None:
            return
        query = event.query.query_str if isinstance(event.query, QueryBundle) else str(event.query)
        retriever.prefetch(query)


def _add_handler(handler: BaseEventHandler) -> None:
    get_dispatcher().add_event_handler(handler)


def _remove_handler(handler: BaseEventHandler) -> None:
    root = get_dispatcher()
    root.event_handlers = [h for h in root.event_handlers if h is not handler]
