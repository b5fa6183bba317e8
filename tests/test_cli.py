"""The console script: every command and suite has --help, errors exit 2 with a message."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cachedrag.cli import BENCH_SUITES, build_parser, main


def _help_paths():
    paths = [["--help"], ["demo", "--help"]]
    parser = build_parser()
    choices = parser._subparsers._group_actions[0].choices
    paths += [["serve", "--help"]] if "serve" in choices else []
    if "bench" in choices:  # the group's own help lists every suite's help line
        paths += [["bench", "--help"]]
        paths += [["bench", s, "--help"] for s in BENCH_SUITES if s in choices["bench"]._subparsers._group_actions[0].choices]
    if "index" in choices:
        paths += [["index", "--help"], ["index", "build", "--help"], ["index", "search", "--help"]]
    return paths


@pytest.mark.parametrize("argv", _help_paths(), ids=lambda a: " ".join(a))
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    assert "usage: cachedrag" in capsys.readouterr().out


def test_console_script_is_installed():
    out = subprocess.run([sys.executable, "-m", "cachedrag.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "demo" in out.stdout


def test_version(capsys):
    from cachedrag import __version__

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"cachedrag {__version__}"


def test_help_imports_no_subcommand():
    """`cachedrag --help` must not import torch/transformers (it took seconds when it did)."""
    code = ("import sys\nfrom cachedrag.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'transformers', 'faiss', 'cachedrag.demo', 'cachedrag.bench.ttft')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "[]", out.stderr


@pytest.mark.parametrize("argv, needle", [
    (["demo", "--max-questions", "0"], "--max-questions must be >= 1 (got 0)"),
    (["demo", "--top-k", "-1"], "--top-k must be >= 1"),
    (["demo", "--tiny", "--model", "x"], "drop --model"),
    (["demo", "--warmup", "-1"], "--warmup must be >= 0"),
])
def test_demo_bad_arguments_fail_before_loading(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"cachedrag: error: {err.removeprefix('cachedrag: error: ')}" and needle in err and err.count("\n") == 1
