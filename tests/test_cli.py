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
            "print(sorted(m for m in ('torch', 'transformers', 'faiss', 'cachedrag.demo', 'cachedrag_bench.ttft')"
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


# A finder ahead of every other that refuses cachedrag_bench: as where cachedrag-bench is not installed.
_BLOCK_BENCH = '''
import importlib.abc, sys
class _NoBench(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "cachedrag_bench":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _NoBench())
'''


def test_bench_suites_are_the_benchmark_distributions():
    assert all(module.startswith("cachedrag_bench.") for module, _ in BENCH_SUITES.values())
    assert "faults" not in BENCH_SUITES  # the fault campaign is a test harness (tests/faults/campaign.py)


@pytest.mark.parametrize("argv", [["bench", "ttft", "--json", "x.json"], ["bench", "--help"], ["bench"]],
                         ids=lambda a: " ".join(a))
def test_bench_without_the_distribution_says_how_to_install_it(argv, tmp_path):
    code = _BLOCK_BENCH + "from cachedrag.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("cachedrag: error: cachedrag bench needs the cachedrag-bench distribution: "
                                 "pip install -e benchmarks/")
    assert out.stdout == "" and not (tmp_path / "x.json").exists()


def test_help_lists_bench_without_the_distribution():
    code = _BLOCK_BENCH + "from cachedrag.cli import main\nmain(['--help'])\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "bench" in out.stdout and "cachedrag-bench" in out.stdout


def test_bench_without_the_distribution_in_process(monkeypatch, capsys):
    namespace: dict = {}
    exec(_BLOCK_BENCH.replace("sys.meta_path.insert(0, _NoBench())", ""), namespace)
    monkeypatch.setattr(sys, "meta_path", [namespace["_NoBench"](), *sys.meta_path])
    for name in [m for m in sys.modules if m.split(".")[0] == "cachedrag_bench"]:
        monkeypatch.delitem(sys.modules, name)
    assert main(["bench", "tiers"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs the cachedrag-bench distribution" in err


def test_bench_help_lists_every_suite(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in BENCH_SUITES)
