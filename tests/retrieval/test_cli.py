"""`cachedrag index build|search` on a tiny corpus (real CLI path, real offline models)."""

from __future__ import annotations

import json

import pytest

from cachedrag.cli import main
from cachedrag.retrieval.embedder import default_embedder_path

from .conftest import TINY_DOCS


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    corpus = root / "corpus"
    corpus.mkdir()
    for doc in TINY_DOCS:
        (corpus / f"{doc.id}.txt").write_text(doc.text)
    out = root / "index"
    code = main(["index", "build", "--corpus", str(corpus), "--out", str(out), "--nlist", "3",
                 "--chunk-tokens", "24", "--overlap", "4", "--tokenizer", default_embedder_path(), "--quiet"])
    assert code == 0
    return out


def test_build_writes_an_index(built, capsys):
    manifest = json.loads((built / "manifest.json").read_text())
    assert manifest["nlist"] == 3 and manifest["chunk"]["chunk_tokens"] == 24
    assert manifest["tokenizer"]["class"] == "BertTokenizer"


def test_search_prints_ranked_chunks(built, capsys):
    assert main(["index", "search", str(built), "How do I compute a SHA-256 hash?", "-k", "2", "--nprobe", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[0] == "1" and "hashlib.txt#" in lines[0]
    assert float(lines[0].split()[1]) >= float(lines[2].split()[1])  # scores descend
    assert len(lines) == 4  # two hits, each a header and a text line


def test_search_json_output(built, capsys):
    assert main(["index", "search", str(built), "random UUID", "-k", "1", "--nprobe", "1", "--json"]) == 0
    hit = json.loads(capsys.readouterr().out)
    assert hit["rank"] == 1 and {"id", "doc_id", "score", "text", "token_start", "char_start"} <= set(hit)


def test_search_nprobe_above_nlist_is_a_clear_error(built, capsys):
    assert main(["index", "search", str(built), "heap", "--nprobe", "9"]) == 2
    assert "nprobe (9) must be between 1 and the index's nlist (3)" in capsys.readouterr().err


def test_build_empty_corpus_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "blank.txt").write_text("   \n")
    code = main(["index", "build", "--corpus", str(tmp_path / "corpus"), "--out", str(tmp_path / "out"),
                 "--tokenizer", default_embedder_path()])
    assert code == 2 and "no non-empty documents" in capsys.readouterr().err
