"""``cachedrag serve``'s option surface: a short ``--help``, every option in ``--help-all``, and
``--config FILE`` (JSON or TOML, validated by the settings models; flags given win over it)."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest

from cachedrag.cli import build_parser, main

MAX_HELP_OPTIONS = 25


def _options(text: str) -> list[str]:
    """The option lines of an argparse help text (``  -h, --help``, ``  --port PORT ...``)."""
    return [line.split()[0].rstrip(",") for line in text.splitlines() if re.match(r"^  -", line)]


def _serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser(["serve"])._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def _help(capsys, flag: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["serve", flag])
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_help_shows_at_most_25_options_and_help_all_shows_every_one(capsys):
    short = _options(_help(capsys, "--help"))
    assert len(short) <= MAX_HELP_OPTIONS, short
    assert {"--config", "--help-all", "--model", "--port", "--fidelity", "--max-batch", "--cache-gb",
            "--replicas"} <= set(short)
    every = _options(_help(capsys, "--help-all"))
    flags = {a.option_strings[0] for a in _serve_parser()._actions if a.option_strings}
    assert set(every) == flags and len(every) > len(short)
    assert {"--tie-guard", "--prefill-chunk-tokens", "--router", "--tiny"} <= set(every) - set(short)


def _write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_json_config_file_fills_what_the_flags_leave_out(tmp_path):
    path = _write(tmp_path, "serve.json", json.dumps({
        "server": {"port": 9123, "model_name": "house-model", "default_max_tokens": 64,
                   "scheduler": {"max_batch": 3, "max_delay_s": None},
                   "passages": {"enabled": False, "min_chars": 80, "capacity": 500}},
        "engine": {"fidelity": "guarded", "cache_gb": 0.5, "exact": {"tie_guard_decode": 1.5}}}))
    args = build_parser().parse_args(["serve", "--config", path, "--max-batch", "5"])
    assert (args.port, args.served_model_name, args.max_tokens) == (9123, "house-model", 64)
    assert args.max_batch == 5  # the flag wins over the file
    assert args.max_delay_s == float("inf") and args.no_auto_chunks is True
    assert (args.passage_chars, args.passage_capacity) == (80, 500)
    assert (args.fidelity, args.cache_gb, args.tie_guard_decode) == ("guarded", 0.5, 1.5)
    assert args.order == "cache_aware"  # not in the file: the flag's default
    from cachedrag.server.config import engine_settings, server_config

    config = server_config(args, engine_settings(args))
    assert config.model_name == "house-model" and config.scheduler.max_delay_s is None
    assert (config.passages.enabled, config.passages.capacity) == (False, 500)


def test_a_flag_repeating_its_default_still_wins_over_the_file(tmp_path):
    path = _write(tmp_path, "serve.json", json.dumps({"server": {"scheduler": {"max_batch": 3}}}))
    assert build_parser().parse_args(["serve", "--max-batch", "8", "--config", path]).max_batch == 8
    assert build_parser().parse_args(["serve", "--config", path]).max_batch == 3


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib: Python 3.11+")
def test_a_toml_config_file(tmp_path):
    path = _write(tmp_path, "serve.toml", '[engine]\nfidelity = "fast"\n\n[engine.exact]\ntie_guard = 0.3\n'
                                          'repeats = 0\n\n[server.scheduler]\norder = "fifo"\n')
    args = build_parser().parse_args(["serve", "--config", path])
    assert (args.fidelity, args.order, args.tie_guard, args.exact_repeats) == ("fast", "fifo", 0.3, 0)
    from cachedrag.server.config import engine_settings

    exact = engine_settings(args).engine_config().cache.exact
    assert (exact.tie_guard, exact.repeats, exact.repeats_when) == (0.3, 0, "after_response_else_inline")


@pytest.mark.parametrize("name, text, says", [
    ("bad.json", "{not json", "not valid JSON"),
    ("typo.json", json.dumps({"engine": {"cache_gbs": 1}}), "engine.cache_gbs"),
    ("range.json", json.dumps({"server": {"scheduler": {"max_batch": 0}}}), "server.scheduler.max_batch"),
    ("mode.json", json.dumps({"server": {"mode": "prefix"}}), "server.mode"),
    ("list.json", "[1, 2]", "a table of settings"),
    ("flat.json", json.dumps({"engine": {"tie_guard": 0.25}}), "engine: tie_guard is now exact.tie_guard"),
    ("flat2.json", json.dumps({"engine": {"exact_repeats_when": "inline"}}), "exact_repeats_when is now exact.repeats_when"),
    ("nested.json", json.dumps({"engine": {"exact": {"repeats_when": "idle"}}}), "engine.exact.repeats_when"),
    ("missing.json", None, "missing.json"),
])
def test_a_bad_config_file_is_one_line_and_exit_2(tmp_path, name, text, says):
    path = str(tmp_path / name) if text is None else _write(tmp_path, name, text)
    proc = subprocess.run([sys.executable, "-m", "cachedrag.cli", "serve", "--config", path],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert err.startswith("cachedrag: error: config file") and says in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def _imports(path) -> set[str]:
    """Every module ``path`` imports, at module level or inside a function."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_the_cluster_package_does_not_import_the_servers_command_line():
    """``server/cli`` adds the cluster's arguments and hands it the parsed ones; the cluster reads
    the settings models of ``server/config``, never ``server/cli`` (no cycle, lazy imports counted)."""
    from pathlib import Path

    import cachedrag.cluster

    for path in Path(cachedrag.cluster.__file__).parent.glob("*.py"):
        assert "cachedrag.server.cli" not in _imports(path), path.name
