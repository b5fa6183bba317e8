"""Writes docs/config.md, the configuration reference, from the settings models themselves.

    python scripts/gen_config_reference.py            # rewrite docs/config.md
    python scripts/gen_config_reference.py --check    # exit 1 when docs/config.md is stale

Each pydantic model's fields become a table (name, type, default, description from ``Field``);
``CacheConfig`` and its settings groups (dataclasses whose docstrings document their fields) are
rendered by mkdocstrings.
``tests/test_docs.py`` runs the check.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "config.md"
SECTIONS = (
    ("Engine", ("cachedrag.config.EngineConfig",)),
    ("Store", ("cachedrag.store.config.StoreConfig",)),
    ("Retrieval", ("cachedrag.retrieval.config.RetrievalConfig", "cachedrag.retrieval.config.ChunkConfig",
                   "cachedrag.retrieval.config.EmbedderConfig", "cachedrag.retrieval.config.IndexConfig",
                   "cachedrag.retrieval.config.SearchConfig", "cachedrag.retrieval.config.LookaheadConfig",
                   "cachedrag.retrieval.config.PipeliningConfig")),
    ("Server (`cachedrag serve --config FILE`)", ("cachedrag.server.config.ServerConfig",
                                                  "cachedrag.server.config.SchedulerConfig",
                                                  "cachedrag.server.config.EngineSettings",
                                                  "cachedrag.server.config.ExactSettings")),
)
#: ``CacheConfig``'s settings groups (dataclasses rendered by mkdocstrings after it): class, field
CACHE_GROUPS = (("RowPrecision", "precision"), ("ExactFallback", "exact"), ("FocusConfig", "focus"))
HEADER = """# Configuration reference

Every setting is a validated field of one of these models: a bad value fails when the object is
built, naming the field. The server's `--config FILE` takes the `server` and `engine` tables below
([CLI reference](cli.md#cachedrag-serve)); which fields a fidelity level sets is in
[Choose a fidelity level](choose-fidelity.md). Generated from the models by
`python scripts/gen_config_reference.py` (the docs tests fail when this page is stale).
"""


def _load(path: str):
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(field) -> str:
    if field.default_factory is not None:
        factory = field.default_factory
        return f"`{getattr(factory, '__name__', 'factory')}()`"
    return f"`{field.default!r}`"


def _type(annotation) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    return _cell(text or repr(annotation).replace("typing.", "")).replace("NoneType", "None")


def _table(path: str) -> str:
    model = _load(path)
    doc = _cell((model.__doc__ or "").strip().split("\n\n")[0])
    rows = [f"### `{model.__name__}`\n", f"`{path}`: {doc}\n", "| field | type | default | meaning |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        rows.append(f"| `{name}` | `{_type(field.annotation)}` | {_default(field)} | {_cell(field.description or '')} |")
    return "\n".join(rows) + "\n"


def render() -> str:
    out = [HEADER]
    for title, paths in SECTIONS:
        out.append(f"## {title}\n")
        out.extend(_table(p) for p in paths)
        if title == "Engine":
            for name, field in (("CacheConfig", None), *CACHE_GROUPS):
                where = f" (`CacheConfig.{field}`)" if field else ""
                out.append(f"### `{name}`{where}\n\n::: cachedrag.kvcache.config.{name}\n    options:\n"
                           "      show_root_heading: false\n")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from cachedrag.docblocks import generated_page

    return generated_page(PAGE, render(), "gen_config_reference.py", argv)


if __name__ == "__main__":
    sys.exit(main())
