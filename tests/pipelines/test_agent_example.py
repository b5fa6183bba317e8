"""``examples/agent_rag.py --tiny`` runs: both agents search twice and answer, and each step after
the first is a prefix hit of the one before (the tiny model: seconds)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("langgraph.prebuilt")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agent_rag.py"


@pytest.mark.slow  # 23 s (make test-slow); the agent loop itself: tests/pipelines/test_agent.py
def test_agent_example_runs_on_the_tiny_model():
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--tiny"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "LangGraph create_react_agent over ChatCachedRAG:" in out and "LlamaIndex FunctionAgent" in out
    pattern = r"prompt (\d+) tokens, computed (\d+), prefix hit (\d+)"
    steps = [tuple(int(x) for x in m) for m in re.findall(pattern, out)]
    assert len(steps) == 3  # two searches and the answer
    for (prompt, _, _), (total, computed, hit) in zip(steps, steps[1:]):
        assert hit >= prompt and computed <= total - prompt  # the previous step's prompt and call came from the cache
    assert out.count("search_docs(") == 4  # two calls by each agent
