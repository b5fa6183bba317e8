"""`cachedrag bench retrieval` end to end on a tiny corpus."""

from __future__ import annotations

import json

from cachedrag.cli import main
from cachedrag.retrieval.embedder import default_embedder_path

from .conftest import TINY_DOCS, TINY_QUESTIONS


def test_bench_end_to_end(tmp_path, embedder, monkeypatch, capsys):
    import cachedrag.retrieval.embedder as embedder_module

    monkeypatch.setattr(embedder_module, "Embedder", lambda *a, **kw: embedder)  # reuse the session's model
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in TINY_DOCS))
    questions = tmp_path / "questions.txt"
    questions.write_text("\n".join(TINY_QUESTIONS))
    out = tmp_path / "bench.json"
    code = main(["bench", "retrieval", "--corpus", str(corpus), "--questions", str(questions), "--nlist", "4",
                 "--nprobe", "2", "--nprobe-list", "1,2,4,8", "--chunk-tokens", "24", "--overlap", "4",
                 "--tokenizer", default_embedder_path(), "--repeats", "1", "--prefetch-window-ms", "2",
                 "--json", str(out), "--quiet"])
    assert code == 0
    r = json.loads(out.read_text())
    for key in ("recall_at_10", "cluster_overlap", "cold_search_ms", "lookahead_search_ms", "lookahead_speedup",
                "prefetch_window_ms", "faiss_search_ms", "prefetch_hit_rate", "recall_table", "config", "index"):
        assert key in r, key
    assert [row["nprobe"] for row in r["recall_table"]] == [1, 2, 4]  # nprobe above nlist dropped
    assert r["recall_table"][-1]["recall_original"] == 1.0  # nprobe == nlist is exhaustive
    assert all(row["ivf_equals_faiss"] for row in r["recall_table"])
    assert r["lookahead_equals_cold"] is True
    assert 0.0 <= r["cluster_overlap"] <= 1.0 and r["prefetch_window_ms"] == 2
    assert "first sentence" in r["transformation"]
    assert "transformed queries: question + first sentence" in capsys.readouterr().out


def test_bench_with_transformed_file(tmp_path, tiny_index, embedder, monkeypatch):
    import cachedrag.retrieval.embedder as embedder_module

    monkeypatch.setattr(embedder_module, "Embedder", lambda *a, **kw: embedder)
    questions = tmp_path / "q.txt"
    questions.write_text("\n".join(TINY_QUESTIONS))
    transformed = tmp_path / "t.txt"
    transformed.write_text("\n".join(q + " (rewritten)" for q in TINY_QUESTIONS))
    out = tmp_path / "bench.json"
    code = main(["bench", "retrieval", "--index", str(tiny_index.path), "--questions", str(questions),
                 "--transformed", str(transformed), "--nprobe", "2", "--repeats", "1",
                 "--prefetch-window-ms", "1", "--json", str(out)])
    assert code == 0
    r = json.loads(out.read_text())
    assert r["transformation"] == f"from {transformed}" and r["index"]["source"] == "loaded"
