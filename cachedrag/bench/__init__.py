"""The ``cachedrag bench`` suites (one module each) and what they share: ``write_json``."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(results: dict, path: str | Path) -> None:
    """Write a suite's results to ``path`` (non-JSON values as strings) and say where."""
    Path(path).write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {path}")
