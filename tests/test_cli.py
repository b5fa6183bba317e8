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
    if "bench" in choices:
        paths += [["bench", s, "--help"] for s in BENCH_SUITES if s in choices["bench"]._subparsers._group_actions[0].choices]
    if "index" in choices:
        paths += [["index", "build", "--help"], ["index", "search", "--help"]]
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
