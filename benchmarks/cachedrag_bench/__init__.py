"""The ``cachedrag bench`` suites (one module each) and what they share: ``write_json``.

The ``cachedrag-bench`` distribution (``benchmarks/pyproject.toml``), apart from the runtime package:
``cachedrag.cli`` finds a suite here by its module name (``BENCH_SUITES``); nothing in ``cachedrag``
imports this package. Keep this module light: ``cachedrag --help`` imports it to list the suites.
"""

from __future__ import annotations

import json
from pathlib import Path


def write_json(results: dict, path: str | Path) -> None:
    """Write a suite's results to ``path`` (non-JSON values as strings) and say where."""
    Path(path).write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {path}")
