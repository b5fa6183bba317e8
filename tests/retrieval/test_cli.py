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
    assert capsys.readouterr().err == "cachedrag: error: --nprobe 9 exceeds the index's 3 clusters\n"


def test_search_default_nprobe_fits_a_small_index(built, capsys):
    assert main(["index", "search", str(built), "heap", "-k", "1"]) == 0  # default 16 > nlist 3: clamped
    assert "heapq" in capsys.readouterr().out


def test_build_empty_corpus_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "blank.txt").write_text("   \n")
    code = main(["index", "build", "--corpus", str(tmp_path / "corpus"), "--out", str(tmp_path / "out"),
                 "--tokenizer", default_embedder_path()])
    assert code == 2 and "no non-empty documents" in capsys.readouterr().err


def _one_line_error(capsys, *needles):
    err = capsys.readouterr().err
    assert err.startswith("cachedrag: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


@pytest.fixture
def no_models(monkeypatch):
    """Fail the test if a command loads the embedder or a tokenizer: argument errors come first."""
    import cachedrag.retrieval.chunker as chunker
    import cachedrag.retrieval.embedder as embedder

    def boom(*a, **k):
        raise AssertionError("loaded a model before checking the arguments")

    monkeypatch.setattr(embedder.Embedder, "__init__", boom)
    monkeypatch.setattr(chunker, "load_tokenizer", boom)


@pytest.mark.parametrize("extra, needles", [
    (["--nlist", "0"], ["nlist", "greater than or equal to 1", "(got 0)"]),
    (["--chunk-tokens", "-5"], ["chunk_tokens"]),
    (["--overlap", "999"], ["overlap"]),
])
def test_build_bad_numbers_are_one_line_errors(tmp_path, capsys, no_models, extra, needles):
    (tmp_path / "c.txt").write_text("some text")
    assert main(["index", "build", "--corpus", str(tmp_path / "c.txt"), "--out", str(tmp_path / "o"), *extra]) == 2
    assert "https://" not in _one_line_error(capsys, *needles)


def test_build_missing_corpus(tmp_path, capsys, no_models):
    assert main(["index", "build", "--corpus", "/nonexistent/corpus", "--out", str(tmp_path / "o")]) == 2
    _one_line_error(capsys, "/nonexistent/corpus", "no such file or directory")


def test_build_refuses_a_non_index_out_dir_before_any_work(tmp_path, capsys, no_models):
    (tmp_path / "c.txt").write_text("some text")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "precious.txt").write_text("keep me")
    assert main(["index", "build", "--corpus", str(tmp_path / "c.txt"), "--out", str(tmp_path / "mine")]) == 2
    _one_line_error(capsys, "not a cachedrag index")
    assert (tmp_path / "mine" / "precious.txt").read_text() == "keep me"


def test_build_non_utf8_and_bad_jsonl_are_one_line_errors(tmp_path, capsys):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    assert main(["index", "build", "--corpus", str(tmp_path / "latin1.txt"), "--out", str(tmp_path / "o"),
                 "--tokenizer", default_embedder_path()]) == 2
    _one_line_error(capsys, "latin1.txt", "not UTF-8")
    (tmp_path / "notes.jsonl").write_text("just some words\n")
    assert main(["index", "build", "--corpus", str(tmp_path / "notes.jsonl"), "--out", str(tmp_path / "o"),
                 "--tokenizer", default_embedder_path()]) == 2
    _one_line_error(capsys, "notes.jsonl:1", "JSONL")


def test_search_on_a_folder_that_is_not_an_index(tmp_path, capsys, no_models):
    assert main(["index", "search", str(tmp_path), "heap"]) == 2
    _one_line_error(capsys, "not a cachedrag index directory")
    assert main(["index", "search", str(tmp_path / "nope"), "heap"]) == 2
    _one_line_error(capsys, "no such index directory")
    assert main(["index", "search", str(tmp_path), "heap", "-k", "0"]) == 2
    _one_line_error(capsys, "-k must be >= 1")


def test_single_text_file_is_one_document(tmp_path):
    from cachedrag.corpus import load_corpus

    (tmp_path / "notes.txt").write_text('{"not": "json lines"} but plain text')
    (doc,) = load_corpus(tmp_path / "notes.txt")
    assert doc.id == "notes.txt" and doc.text.startswith('{"not"')


def test_failed_build_keeps_its_embeddings_and_the_retry_resumes(tmp_path, capsys, monkeypatch):
    """The build dies after embedding (here: in IVF training); the retry embeds nothing again."""
    import cachedrag.retrieval.index as index_mod

    monkeypatch.setenv("CACHEDRAG_HOME", str(tmp_path / "home"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for doc in TINY_DOCS:
        (corpus / f"{doc.id}.txt").write_text(doc.text)
    argv = ["index", "build", "--corpus", str(corpus), "--out", str(tmp_path / "idx"), "--nlist", "2",
            "--chunk-tokens", "24", "--overlap", "4", "--tokenizer", default_embedder_path(), "--quiet"]
    train = index_mod.IVFIndex.train
    with monkeypatch.context() as m:
        m.setattr(index_mod.IVFIndex, "train", classmethod(lambda cls, *a, **k: (_ for _ in ()).throw(
            RuntimeError("killed mid-build"))))
        with pytest.raises(RuntimeError, match="killed mid-build"):
            main(argv)
    assert not (tmp_path / "idx").exists()
    assert index_mod.IVFIndex.train == train
    assert main(argv) == 0
    out = capsys.readouterr().out
    n_chunks = json.loads((tmp_path / "idx" / "manifest.json").read_text())["n_chunks"]
    assert f"; {n_chunks} chunk embeddings reused from an earlier build" in out
