"""Offline by construction: the integrations, the CLI and the pipelines never touch the network.

A fresh interpreter installs a socket guard before importing anything (every connect to a
non-loopback address and every DNS lookup of a non-local name is recorded and refused), then
runs the LangChain and LlamaIndex classes (token counting included: LangChain's fallback would
fetch a GPT-2 tokenizer), structured output, the CLI (index build/search, an unknown model) and
a pipeline on the tiny default model. The test fails if anything tried to reach the network,
with and without ``HF_HUB_OFFLINE=1`` (without it, a hub call would be attempted and caught).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import json, socket, sys, tempfile
    attempts = []
    LOCAL = ("localhost", "127.0.0.1", "::1", "0.0.0.0", "")

    def _host(address):
        return address[0] if isinstance(address, tuple) else None

    _connect = socket.socket.connect
    def connect(self, address):
        host = _host(address)
        if self.family != socket.AF_UNIX and host not in LOCAL:
            attempts.append(f"connect {address}")
            raise OSError("network disabled by the offline test")
        return _connect(self, address)
    socket.socket.connect = connect
    _getaddrinfo = socket.getaddrinfo
    def getaddrinfo(host, *a, **k):
        if host not in LOCAL and host is not None:
            attempts.append(f"dns {host}")
            raise socket.gaierror("network disabled by the offline test")
        return _getaddrinfo(host, *a, **k)
    socket.getaddrinfo = getaddrinfo

    from pathlib import Path
    from pydantic import BaseModel, Field
    from cachedrag.cli import main
    from cachedrag.testing import TINY_DOCS, tiny_default_model

    class Verdict(BaseModel):
        ok: bool
        score: int = Field(ge=0, le=9)

    tmp = Path(tempfile.mkdtemp())
    codes = {}
    with tiny_default_model(tmp / "tiny"):
        corpus = tmp / "corpus"
        corpus.mkdir()
        for d in TINY_DOCS:
            (corpus / f"{d.id}.md").write_text(d.text)
        codes["build"] = main(["index", "build", "--corpus", str(corpus), "--out", str(tmp / "idx"), "--quiet",
                               "--chunk-tokens", "96", "--nlist", "2"])
        codes["search"] = main(["index", "search", str(tmp / "idx"), "pretty-print JSON", "-k", "1"])
        codes["unknown_model"] = main(["demo", "--model", "no-such-org/no-such-model", "--max-questions", "1"])

        from cachedrag.integrations.langchain import CachedRAGRetriever, ChatCachedRAG
        from cachedrag.integrations.llama_index import CachedRAGLLM
        chat = ChatCachedRAG(max_tokens=8)
        from langchain_core.messages import HumanMessage
        counts = [chat.get_num_tokens("hello"), chat.get_num_tokens_from_messages([HumanMessage("hello")])]
        chat.invoke("hi")
        ChatCachedRAG(max_tokens=64).with_structured_output(Verdict).invoke("ok?")
        CachedRAGRetriever(index_dir=str(tmp / "idx"), k=2).invoke("heap")
        CachedRAGLLM(max_new_tokens=8).complete("hi")

        from cachedrag.engine import CachedEngine
        from cachedrag.pipelines import HyDE
        from cachedrag.retrieval import load_index
        HyDE(CachedEngine(), load_index(tmp / "idx")).run("How do I pretty-print JSON?")
    print("RESULT " + json.dumps({"attempts": attempts, "codes": codes, "counts": counts}))
''')


@pytest.fixture(scope="module")
def compiled_kernels(tmp_path_factory):
    """The native attention library, as this test process has it (built once per home; the rest of
    the suite loads it too): each run below starts from a fresh home holding a copy of it, so
    neither run compiles it (compiling is local work; what the runs check is the network)."""
    from cachedrag.model import attention

    ext = tmp_path_factory.mktemp("kernels-home") / "ext"
    if attention.kernel() is not None:  # None where no compiler is: then each run finds none either
        built = attention.library_dir()
        shutil.copytree(built, ext / built.name, ignore=shutil.ignore_patterns("*.o", "*.ninja*", "*.cpp"))
    return ext


@pytest.mark.parametrize("hf_offline", [pytest.param(True, marks=pytest.mark.slow), False],
                         ids=["HF_HUB_OFFLINE=1", "no-offline-env"])  # no offline env is the stricter case
def test_nothing_reaches_the_network(tmp_path, hf_offline, compiled_kernels):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["CACHEDRAG_HOME"] = str(tmp_path / "home")
    if compiled_kernels.is_dir():  # absent where no compiler is: then each run finds none either
        shutil.copytree(compiled_kernels, tmp_path / "home" / "ext")
    if hf_offline:
        env["HF_HUB_OFFLINE"] = "1"
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    assert result["attempts"] == [], result["attempts"]
    assert result["codes"] == {"build": 0, "search": 0, "unknown_model": 2}
    assert result["counts"][0] == 5 and result["counts"][1] > 5  # the model's own (byte) tokenizer
