"""LlamaIndex adapter: a pipeline as a query engine.

Owns: ``PipelineQueryEngine`` (a ``CustomQueryEngine``): ``query(q)`` runs the pipeline and
returns a LlamaIndex ``Response`` whose source nodes are the chunks the run retrieved and
whose metadata holds the run record. Does not own: the pipelines, or LlamaIndex LLM /
retriever classes (``cachedrag.integrations``).
"""

from __future__ import annotations

from typing import Any

from llama_index.core.base.response.schema import Response
from llama_index.core.query_engine import CustomQueryEngine
from llama_index.core.schema import NodeWithScore, TextNode
from pydantic import Field, PrivateAttr


class PipelineQueryEngine(CustomQueryEngine):
    """A cachedrag pipeline behind LlamaIndex's query-engine interface.

    >>> from cachedrag.pipelines import HyDE                                   # doctest: +SKIP
    >>> qe = PipelineQueryEngine(HyDE(CachedEngine(), load_index("idx")))       # doctest: +SKIP
    >>> r = qe.query("How do I pretty-print JSON?")                             # doctest: +SKIP
    >>> r.response, [n.node.node_id for n in r.source_nodes], r.metadata["pipeline_run"]["breakdown"]  # doctest: +SKIP
    """

    include_run: bool = Field(True, description="put the run record (steps, timings) in Response.metadata['pipeline_run']")
    include_sources: bool = Field(True, description="return the retrieved chunks as source nodes")
    _pipeline: Any = PrivateAttr()

    def __init__(self, pipeline, **kwargs: Any):
        super().__init__(**kwargs)
        self._pipeline = pipeline

    @property
    def pipeline(self):
        return self._pipeline

    def custom_query(self, query_str: str) -> Response:
        run = self._pipeline.run(query_str)
        nodes = [NodeWithScore(node=TextNode(id_=cid, text=text)) for cid, text in run.documents] if self.include_sources else []
        metadata = {"pipeline_run": run.to_dict()} if self.include_run else None
        return Response(response=run.answer, source_nodes=nodes, metadata=metadata)
