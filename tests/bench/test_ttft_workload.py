"""``bench ttft --device``, ``--workload-out`` and ``--workload``: a workload built once (with the
embedder), saved, and replayed elsewhere (without it) gives the same requests."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from cachedrag_bench.workload import Workload, build_workload, load_workload, save_workload
from cachedrag.cli import main
from cachedrag.errors import ConfigError
from cachedrag.fingerprint import tokenizer_fingerprint
from cachedrag.model.loader import load_tokenizer
from cachedrag.prompt import PromptBuilder

SMALL = ["--max-new-tokens", "2", "--warmup", "1", "--planning-chunks", "50", "--skip-simulation"]


class _NoEmbedder:
    def __init__(self, *args, **kwargs):
        raise AssertionError("the embedder was constructed on the --workload path")


@pytest.fixture
def record_requests(monkeypatch):
    """Every (retrieved chunks, question) the bench builds a prompt from, in order."""
    seen: list[tuple[list[str], str]] = []
    chat = PromptBuilder.chat

    def recording(self, chunks, question, system_prompt=None):
        seen.append((list(chunks), question))
        return chat(self, chunks, question, system_prompt)

    monkeypatch.setattr(PromptBuilder, "chat", recording)
    return seen


@pytest.mark.parametrize("from_file", [True, False], ids=["questions-file", "zipf-stream"])
def test_a_saved_workload_loads_back_field_for_field(tiny_model_dir, tiny_corpus, tmp_path, from_file):
    corpus, questions = tiny_corpus
    tok = load_tokenizer(tiny_model_dir)
    work = build_workload(tok, corpus, questions if from_file else None, top_k=2, chunk_tokens=48, n_requests=7,
                          zipf_s=1.3, seed=3)
    path = tmp_path / "w.json"
    identity = {"model": tiny_model_dir, "fingerprint": tokenizer_fingerprint(tok)}
    save_workload(work, path, tokenizer=identity)
    back, tokenizer_id = load_workload(path)
    assert back.chunks == work.chunks and back.questions == work.questions and back.retrieved == work.retrieved
    assert (back.corpus_name, back.question_source, back.params) == (work.corpus_name, work.question_source,
                                                                     work.params)
    assert tokenizer_id == identity
    assert back.params["top_k"] == 2 and back.params["chunk_tokens"] == 48
    assert back.params["embedder"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert back.params["seed"] == (None if from_file else 3)
    assert len(back.questions) == (6 if from_file else 7) and all(len(r) == 2 for r in back.retrieved)
    raw = json.loads(path.read_text())
    assert raw["format"] == "cachedrag-bench-workload" and raw["n_chunks"] == len(work.chunks)
    assert all(type(i) is int for r in raw["retrieved"] for i in r)  # each chunk text stored once


def test_bench_ttft_replays_a_saved_workload_without_the_embedder(tiny_model_dir, tiny_corpus, tmp_path, monkeypatch,
                                                                  record_requests):
    corpus, questions = tiny_corpus
    wl, built_json, replay_json = tmp_path / "w.json", tmp_path / "built.json", tmp_path / "replay.json"
    assert main(["bench", "ttft", "--corpus", corpus, "--questions", questions, "--model", tiny_model_dir,
                 "--top-k", "2", "--chunk-tokens", "48", "--modes", "full,prefix", "--workload-out", str(wl),
                 "--json", str(built_json), *SMALL]) == 0
    built_requests = list(record_requests)
    record_requests.clear()
    monkeypatch.setattr("cachedrag.retrieval.embedder.Embedder", _NoEmbedder)
    assert main(["bench", "ttft", "--workload", str(wl), "--model", tiny_model_dir, "--modes", "full,prefix",
                 "--device", "auto", "--json", str(replay_json), *SMALL]) == 0
    assert record_requests == built_requests and len(built_requests) == 6  # one prompt per request, every mode's
    work, _ = load_workload(wl)
    assert built_requests == list(zip(work.retrieved, work.questions))
    built, replay = json.loads(built_json.read_text()), json.loads(replay_json.read_text())
    for key in ("corpus", "questions", "n_chunks", "top_k", "chunk_tokens", "warmup"):
        assert replay["config"][key] == built["config"][key], key
    assert replay["config"]["top_k"] == 2 and replay["config"]["chunk_tokens"] == 48
    assert replay["config"]["workload"]["file"] == str(wl) and replay["config"]["workload"]["tokenizer_match"] is True
    assert replay["config"]["workload"]["params"] == built["config"]["workload"]["params"]
    assert built["config"]["workload"]["file"] is None and built["config"]["device"] == "cpu"
    assert built["config"]["gpu"] is None
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert replay["config"]["device"].startswith(expected)
    assert replay["n_requests"] == built["n_requests"] == 5
    for mode in ("full", "prefix"):  # the same requests: the same prompts and the same reuse
        for key in ("prompt_tokens_mean", "chunk_hit_rate", "computed_token_fraction"):
            assert replay["modes"][mode][key] == built["modes"][mode][key], (mode, key)


def test_workload_only_writes_the_file_and_loads_no_model(tiny_model_dir, tiny_corpus, tmp_path, monkeypatch, capsys):
    corpus, _ = tiny_corpus
    wl = tmp_path / "w.json"

    def no_model(*args, **kwargs):
        raise AssertionError("--workload-only loaded the model")

    monkeypatch.setattr("cachedrag.model.loader.load_model", no_model)
    assert main(["bench", "ttft", "--corpus", corpus, "--model", tiny_model_dir, "--requests", "9", "--zipf", "1.5",
                 "--seed", "2", "--top-k", "3", "--chunk-tokens", "40", "--workload-out", str(wl),
                 "--workload-only"]) == 0
    work, tokenizer_id = load_workload(wl)
    assert len(work.questions) == 9 and all(len(r) == 3 for r in work.retrieved)
    assert work.params == {"top_k": 3, "chunk_tokens": 40, "overlap": 0, "n_requests": 9, "zipf_s": 1.5, "seed": 2,
                           "embedder": "sentence-transformers/all-MiniLM-L6-v2"}
    assert tokenizer_id == {"model": tiny_model_dir, "fingerprint": tokenizer_fingerprint(load_tokenizer(tiny_model_dir))}
    assert "wrote workload" in capsys.readouterr().err


@pytest.mark.slow  # make test's time budget; make test-slow runs it
def test_the_workload_path_imports_no_sentence_transformers(tiny_model_dir, tiny_corpus, tmp_path):
    """In a fresh process, a --workload run never imports sentence-transformers (absent on the GPU machine)."""
    corpus, questions = tiny_corpus
    wl = tmp_path / "w.json"
    work = build_workload(load_tokenizer(tiny_model_dir), corpus, questions, top_k=2, chunk_tokens=48)
    save_workload(work, wl, tokenizer={"model": tiny_model_dir, "fingerprint": "unknown"})
    script = textwrap.dedent(f"""
        import sys
        from cachedrag.cli import main
        rc = main(["bench", "ttft", "--workload", {str(wl)!r}, "--model", {tiny_model_dir!r}, "--modes", "full",
                   "--no-teacher-forced", *{SMALL!r}])
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "sentence_transformers"
                        or m == "cachedrag.retrieval.embedder")
        print("RESULT", rc, loaded)
    """)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=170, env=env)
    assert "RESULT 0 []" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    assert "was cut in the tokenizer of" in out.stderr  # a mismatched identity is said, not fatal


def _write(path, data) -> str:
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_bad_workload_files_fail_in_one_line_before_any_model_loads(tiny_model_dir, tiny_corpus, tmp_path, capsys,
                                                                   monkeypatch):
    corpus, questions = tiny_corpus
    good = tmp_path / "good.json"
    work = build_workload(load_tokenizer(tiny_model_dir), corpus, questions, top_k=2, chunk_tokens=48)
    data = save_workload(work, good, tokenizer={"model": "m", "fingerprint": "f"})

    def no_model(*args, **kwargs):
        raise AssertionError("a bad workload file got as far as loading the model")

    monkeypatch.setattr("cachedrag.model.loader.load_model", no_model)
    cases = {
        "no such file": str(tmp_path / "absent.json"),
        "not JSON": _write(tmp_path / "a.json", "{not json"),
        "not a bench workload": _write(tmp_path / "b.json", {"questions": ["q"]}),
        "version 9": _write(tmp_path / "c.json", {**data, "version": 9}),
        "'questions' must be a non-empty list of strings": _write(tmp_path / "d.json", {**data, "questions": []}),
        "'retrieved' must hold": _write(tmp_path / "e.json", {**data, "retrieved": [[len(work.chunks)]] * 6}),
        "'retrieved' must hold, per question": _write(tmp_path / "f.json", {**data, "retrieved": data["retrieved"][:-1]}),
        "do not match their recorded count and digest": _write(
            tmp_path / "g.json", {**data, "chunks": [c + "!" for c in data["chunks"]]}),
    }
    for needle, path in cases.items():
        with pytest.raises(ConfigError, match="workload file"):
            load_workload(path)
        assert main(["bench", "ttft", "--workload", path, "--model", tiny_model_dir]) == 2, needle
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("cachedrag: error: workload file") and needle in err, err
    # options the file fixes (a value equal to the file's passes that check), and --workload-only without a file
    assert main(["bench", "ttft", "--workload", str(good), "--top-k", "3", "--chunk-tokens", "48"]) == 2
    assert "--top-k come from the workload file" in capsys.readouterr().err
    assert main(["bench", "ttft", "--workload", str(good), "--corpus", corpus, "--zipf", "1.1"]) == 2
    assert "--corpus, --zipf come from the workload file" in capsys.readouterr().err  # a questions file: no zipf
    with pytest.raises(AssertionError, match="got as far as loading the model"):  # the file's own values pass
        main(["bench", "ttft", "--workload", str(good), "--top-k", "2", "--chunk-tokens", "48", "--model",
              tiny_model_dir])
    assert main(["bench", "ttft", "--workload-only"]) == 2
    assert "--workload-only needs --workload-out" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_device_cuda_without_cuda_is_one_clear_line(capsys, tmp_path):
    assert main(["bench", "ttft", "--device", "cuda", "--workload", str(tmp_path / "absent.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--device" in err and "'cuda'" in err and "CUDA" in err


_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("device, dtype", [pytest.param("cpu", "bfloat16", id="cpu-bfloat16"),
                                           pytest.param("cuda", "float32", marks=_CUDA, id="cuda-float32"),
                                           pytest.param("cuda", "bfloat16", marks=_CUDA, id="cuda-bfloat16")])
def test_bench_ttft_replays_a_hand_made_workload(tiny_model_dir, tiny_corpus, tmp_path, device, dtype):
    """The GPU run's path at tiny size (--device cuda on a saved workload, both dtypes; on CPU too). The
    workload is made by hand, so neither run needs the embedder (the GPU machine may not have it)."""
    corpus, questions = tiny_corpus
    wl, out = tmp_path / "w.json", tmp_path / "ttft.json"
    docs = [path.read_text() for path in sorted(Path(corpus).glob("*.txt"))]
    asked = Path(questions).read_text().splitlines()
    topics = sorted(set(asked))
    retrieved = [[docs[topics.index(q) % 4], docs[(topics.index(q) + 1) % 4]] for q in asked]
    tok = load_tokenizer(tiny_model_dir)
    save_workload(Workload(docs, asked, retrieved, "tiny docs", "hand-made", {"top_k": 2, "chunk_tokens": 48}), wl,
                  tokenizer={"model": tiny_model_dir, "fingerprint": tokenizer_fingerprint(tok)})
    assert main(["bench", "ttft", "--workload", str(wl), "--model", tiny_model_dir, "--device", device,
                 "--dtype", dtype, "--ratios", "0.3", "--json", str(out), *SMALL]) == 0
    data = json.loads(out.read_text())
    assert data["config"]["device"].startswith(device) and bool(data["config"]["gpu"]) == (device == "cuda")
    assert data["config"]["dtype"] == dtype and data["n_requests"] == 5 and data["config"]["questions"] == "hand-made"
    assert set(data["modes"]) == {"full", "prefix", "naive", "random", "cachedrag", "cachedrag@0.3"}
    assert data["modes"]["prefix"]["chunk_hit_rate"] > 0 and data["modes"]["full"]["teacher_forced_top1"] == 1.0
    for row in data["modes"].values():
        assert row["ttft_median_s"] > 0 and 0.0 <= row["teacher_forced_top1"] <= 1.0



def test_the_system_prompt_follows_the_workloads_corpus(tiny_model_dir, tiny_corpus, tmp_path):
    """Without --system-prompt, a workload of the embedded info corpus is asked under the GNU manuals'
    prompt (any other corpus under the Python docs' one); a given --system-prompt wins."""
    from cachedrag_bench.workload import EMBEDDED_CORPORA

    prompts = {name: corpus.system_prompt for name, corpus in EMBEDDED_CORPORA.items()}

    corpus, _ = tiny_corpus
    docs = [path.read_text() for path in sorted(Path(corpus).glob("*.txt"))]
    tok = load_tokenizer(tiny_model_dir)
    for name, given, expected in (("GNU info manuals", None, prompts["info"]),
                                  ("tiny docs", None, prompts["stdlib"]),
                                  ("GNU info manuals", "Answer in one word.", "Answer in one word.")):
        wl, out = tmp_path / "w.json", tmp_path / "ttft.json"
        save_workload(Workload(docs, ["q1", "q2"], [docs[:2], docs[1:3]], name, "hand-made", {"top_k": 2}), wl,
                      tokenizer={"model": tiny_model_dir, "fingerprint": tokenizer_fingerprint(tok)})
        extra = [] if given is None else ["--system-prompt", given]
        assert main(["bench", "ttft", "--workload", str(wl), "--model", tiny_model_dir, "--modes", "full",
                     "--no-teacher-forced", "--json", str(out), *SMALL, *extra]) == 0
        assert json.loads(out.read_text())["config"]["system_prompt"] == expected, name


_INFO = pytest.mark.skipif(not list(Path("/usr/share/info").glob("grep.info*")),
                           reason="needs the GNU info manuals under /usr/share/info")


@pytest.mark.slow  # embeds the whole info-manual corpus (~70 s)
@_INFO
def test_the_info_stream_is_built_from_the_info_manuals_and_its_topics(tiny_model_dir, tmp_path, monkeypatch):
    from cachedrag.corpus import INFO_TOPICS

    def no_model(*args, **kwargs):
        raise AssertionError("--workload-only loaded the model")

    monkeypatch.setattr("cachedrag.model.loader.load_model", no_model)
    wl = tmp_path / "info.json"
    assert main(["bench", "ttft", "--embedded-corpus", "info", "--model", tiny_model_dir, "--requests", "12",
                 "--seed", "1", "--top-k", "3", "--chunk-tokens", "256", "--workload-out", str(wl),
                 "--workload-only"]) == 0
    work, _ = load_workload(wl)
    phrasings = {q for topic in INFO_TOPICS for q in topic}
    assert work.corpus_name == "GNU info manuals" and len(work.questions) == 12
    assert set(work.questions) <= phrasings and "18 info topics x 3 phrasings" in work.question_source
    # the chunks are the manuals' text, and a question naming a program retrieves that program's manual
    named = 0
    for q, r in zip(work.questions, work.retrieved):
        for program in re.findall(r"\b(grep|sed|gzip|bc|diff|patch|cmp)\b", q):
            named += 1
            assert any(program in t for t in r), (q, r)
    assert named >= 3


def test_embedded_corpus_conflicts_are_one_line(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    corpus, questions = tiny_corpus
    assert main(["bench", "ttft", "--corpus", corpus, "--embedded-corpus", "info", "--model", tiny_model_dir]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--corpus and --embedded-corpus name the corpus twice" in err
    wl = tmp_path / "w.json"
    save_workload(build_workload(load_tokenizer(tiny_model_dir), corpus, questions, top_k=2, chunk_tokens=48), wl,
                  tokenizer={"model": "m", "fingerprint": "f"})
    assert main(["bench", "ttft", "--workload", str(wl), "--embedded-corpus", "stdlib"]) == 2
    assert "--embedded-corpus come from the workload file" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="unknown embedded corpus 'man'"):
        build_workload(load_tokenizer(tiny_model_dir), top_k=2, embedded="man")
