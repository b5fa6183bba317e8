"""Writes docs/cli.md, the CLI reference, from the argparse parsers themselves.

    python scripts/gen_cli_reference.py            # rewrite docs/cli.md
    python scripts/gen_cli_reference.py --check    # exit 1 when docs/cli.md is stale

``tests/test_docs.py`` runs the check, so the committed page always matches ``--help``. The
benchmark suites belong to the separate cachedrag-bench distribution: the page lists them by name
(from ``cachedrag.cli.BENCH_SUITES``) and points at ``cachedrag bench SUITE --help``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
COMMANDS = (("demo",), ("serve",), ("index", "build"), ("index", "search"))
HEADER = """# CLI reference

Generated from the parsers by `python scripts/gen_cli_reference.py` (the docs tests fail when this
page is stale). `cachedrag COMMAND --help` prints the same text.
"""


def _subparser(parser: argparse.ArgumentParser, words: tuple[str, ...]) -> argparse.ArgumentParser:
    for word in words:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[word]
    return parser


def _full_help(parser: argparse.ArgumentParser) -> str:
    """The ``--help-all`` text: advanced options keep their help in ``full_help``."""
    for action in parser._actions:
        if hasattr(action, "full_help"):
            action.help = action.full_help
    return parser.format_help()


def render() -> str:
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal: fix the width
    from cachedrag.cli import BENCH_SUITES, build_parser

    out = [HEADER, "## cachedrag\n", "```text\n" + build_parser([]).format_help().rstrip() + "\n```\n"]
    for words in COMMANDS:
        parser = _subparser(build_parser(list(words)), words)
        out.append(f"## cachedrag {' '.join(words)}\n")
        out.append("```text\n" + parser.format_help().rstrip() + "\n```\n")
        if any(hasattr(a, "full_help") for a in parser._actions):
            out.append("With `--help-all`, the advanced (tuning) options too:\n")
            out.append("```text\n" + _full_help(parser).rstrip() + "\n```\n")
    out.append("## cachedrag bench\n")
    out.append("The suites are the `cachedrag-bench` distribution (`pip install -e benchmarks/`, "
               "[install](install.md)); `cachedrag bench SUITE --help` lists a suite's options. "
               "Their figures are on [Benchmarks](benchmarks.md).\n")
    out.append("| suite | what it measures |\n|---|---|")
    out.extend(f"| `{name}` | {text} |" for name, (_, text) in BENCH_SUITES.items())
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    from cachedrag.docblocks import generated_page

    return generated_page(PAGE, render(), "gen_cli_reference.py", argv)


if __name__ == "__main__":
    sys.exit(main())
