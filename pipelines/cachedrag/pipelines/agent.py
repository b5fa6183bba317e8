"""Agentic RAG: a prebuilt agent whose tool is cachedrag's retriever, on LangGraph and on LlamaIndex.

Owns: ``ToolScript`` (the ``tool_choice`` of an agent's next step from how many tool results its
history holds: calls ``required`` until ``min_calls``, ``none`` (answer now) from ``max_calls``,
``auto`` between: a small model that would not call tools on its own still searches, and every
agent stops), ``langgraph_agent`` (LangGraph's ``create_react_agent`` over any LangChain chat
model with tool calling, ``ChatCachedRAG`` or ``ChatOpenAI(base_url=<cachedrag serve>)``, with a
``search_docs`` tool over a LangChain ``CachedRAGRetriever``) and ``ScriptedFunctionAgent`` /
``function_agent`` (LlamaIndex's ``FunctionAgent`` following a ``ToolScript``, over any
function-calling LLM, ``CachedRAGLLM`` included, with a ``search_docs`` tool over a LlamaIndex
retriever).

Each step's prompt is the previous step's prompt, its call and the tool's result: the engine keeps
the previous prompt and answer as an exact tree path (``cachedrag.engine.continuation``), so a
step computes only the new tool result, whose passages are the chunk-reuse candidates.

Does not own: the chat models and retrievers (``cachedrag.integrations``), tool calling itself
(``cachedrag.prompt``: tools, formats, grammars, parsers). LangGraph and LlamaIndex import
lazily (extras ``langgraph`` and ``llama-index``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SEARCH_TOOL = "search_docs"
SEARCH_DESCRIPTION = "Search the documentation. Input: a short search query. Returns the most relevant passages."
AGENT_PROMPT = ("You answer questions about the documentation. Call search_docs to find passages, then answer "
                "from them in a few sentences.")


@dataclass(frozen=True)
class ToolScript:
    """``tool_choice`` per step from the tool results so far: ``required`` below ``min_calls``,
    ``none`` at ``max_calls`` and beyond (None: no cap), ``auto`` between."""

    min_calls: int = 0
    max_calls: int | None = None

    def __post_init__(self):
        if self.min_calls < 0 or (self.max_calls is not None and self.max_calls < self.min_calls):
            raise ValueError(f"ToolScript needs 0 <= min_calls <= max_calls, got {self.min_calls}, {self.max_calls}")

    def choice(self, tool_results: int) -> str:
        if self.max_calls is not None and tool_results >= self.max_calls:
            return "none"
        return "required" if tool_results < self.min_calls else "auto"


def _format(docs) -> str:
    return "\n\n".join(getattr(d, "page_content", None) or getattr(d, "text", "") for d in docs)


# ---------------------------------------------------------------------------------------------- LangGraph
def search_tool(retriever, name: str = SEARCH_TOOL, description: str = SEARCH_DESCRIPTION):
    """A LangChain tool ``name(query) -> passages`` over a LangChain retriever (``CachedRAGRetriever``:
    the passages it returns are registered chunks, reused from the chunk cache in the next step)."""
    from langchain_core.tools import StructuredTool

    def search(query: str) -> str:
        return _format(retriever.invoke(query))

    return StructuredTool.from_function(search, name=name, description=description)


def langgraph_agent(model, retriever, *, script: ToolScript | None = None, prompt: str = AGENT_PROMPT,
                    tools: Sequence[Any] = ()):
    """LangGraph's prebuilt ReAct agent (``create_react_agent``) over ``model`` (a LangChain chat
    model that binds tools) with ``search_docs`` over ``retriever`` (and any further ``tools``).

    ``script``: each step binds the tools with the ``ToolScript``'s choice for the tool results so
    far (one call per step); None: the model decides (``tool_choice`` auto, as LangGraph binds).

    >>> agent = langgraph_agent(ChatCachedRAG(max_tokens=96),                      # doctest: +SKIP
    ...                         CachedRAGRetriever(index_dir="idx", k=4), script=ToolScript(2, 3))
    >>> agent.invoke({"messages": [("user", "How do I pretty-print JSON?")]})      # doctest: +SKIP
    """
    from langgraph.prebuilt import create_react_agent

    tool_list = [search_tool(retriever), *tools]
    if script is None:
        return create_react_agent(model, tool_list, prompt=prompt)

    def step_model(state, runtime):  # LangGraph's dynamic model: tools bound per step
        messages = state["messages"] if isinstance(state, dict) else state.messages
        done = sum(getattr(m, "type", None) == "tool" for m in messages)
        return model.bind_tools(tool_list, tool_choice=script.choice(done), parallel_tool_calls=False)

    return create_react_agent(step_model, tool_list, prompt=prompt)


# ---------------------------------------------------------------------------------------------- LlamaIndex
def llama_index_search_tool(retriever, name: str = SEARCH_TOOL, description: str = SEARCH_DESCRIPTION):
    """A LlamaIndex ``FunctionTool`` ``name(query) -> passages`` over a LlamaIndex retriever."""
    from llama_index.core.tools import FunctionTool

    def search(query: str) -> str:
        return _format(n.node for n in retriever.retrieve(query))

    return FunctionTool.from_defaults(fn=search, name=name, description=description)


def _scripted_agent_class():
    from llama_index.core.agent.workflow import FunctionAgent
    from llama_index.core.agent.workflow.workflow_events import AgentStream
    from pydantic import Field

    class ScriptedFunctionAgent(FunctionAgent):
        """LlamaIndex's ``FunctionAgent`` whose every LLM call takes the ``tool_choice`` of a
        ``ToolScript`` (``min_tool_calls``, ``max_tool_calls``) for the tool results so far."""

        min_tool_calls: int = Field(default=0, ge=0, description="tool calls required before an answer")
        max_tool_calls: int | None = Field(default=None, ge=0, description="tool calls after which it must answer")

        def _kwargs(self, history, tools) -> dict:
            done = sum(m.role.value == "tool" for m in history)
            choice = ToolScript(self.min_tool_calls, self.max_tool_calls).choice(done)
            return {"chat_history": history, "tools": tools, "tool_choice": choice,
                    "allow_parallel_tool_calls": self.allow_parallel_tool_calls}

        async def _get_response(self, current_llm_input, tools):
            return await self.llm.achat_with_tools(**self._kwargs(current_llm_input, tools))

        async def _get_streaming_response(self, ctx, current_llm_input, tools):
            response = await self._get_response(current_llm_input, tools)
            calls = self.llm.get_tool_calls_from_response(response, error_on_no_tool_call=False)
            ctx.write_event_to_stream(AgentStream(delta=response.message.content or "",
                                                  response=response.message.content or "", tool_calls=calls or [],
                                                  raw=response.raw, current_agent_name=self.name))
            return response

    return ScriptedFunctionAgent


def __getattr__(name: str):
    if name == "ScriptedFunctionAgent":  # built on first use: LlamaIndex imports lazily
        cls = _scripted_agent_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def function_agent(llm, retriever, *, script: ToolScript | None = None, prompt: str = AGENT_PROMPT,
                   tools: Sequence[Any] = ()):
    """LlamaIndex's ``FunctionAgent`` over ``llm`` (``CachedRAGLLM`` or any function-calling LLM)
    with ``search_docs`` over ``retriever`` (a LlamaIndex retriever: ``CachedRAGRetriever``).
    ``script``: calls per ``ToolScript`` (``ScriptedFunctionAgent``); None: the stock agent.

    >>> agent = function_agent(CachedRAGLLM(max_new_tokens=96),                     # doctest: +SKIP
    ...                        CachedRAGRetriever(index_dir="idx", k=4), script=ToolScript(2, 3))
    >>> await agent.run("How do I pretty-print JSON?")                              # doctest: +SKIP
    """
    tool_list = [llama_index_search_tool(retriever), *tools]
    if script is None:
        from llama_index.core.agent.workflow import FunctionAgent

        return FunctionAgent(tools=tool_list, llm=llm, system_prompt=prompt)
    cls = _scripted_agent_class()
    return cls(tools=tool_list, llm=llm, system_prompt=prompt, min_tool_calls=script.min_calls,
               max_tool_calls=script.max_calls, allow_parallel_tool_calls=False)
