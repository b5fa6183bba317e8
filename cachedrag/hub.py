"""Local lookups of Hugging Face models: a directory, or a hub id already in the local cache.

This module owns turning a model name into a directory on disk without any network. It exists
because transformers' and sentence-transformers' own hub helpers build request headers even with
``local_files_only=True``, and building them fetches a registry from huggingface.co when
``HF_HUB_OFFLINE`` is unset. Handing those libraries a directory keeps them off the hub entirely.
It does not download anything and never tries to.
"""

from __future__ import annotations

from pathlib import Path


def local_snapshot(name_or_path: str, marker: str = "config.json") -> str | None:
    """The directory holding ``name_or_path``, or ``None`` when it is not on disk.

    ``name_or_path`` is a directory (returned as is) or a hub id such as ``org/model`` whose
    snapshot, containing ``marker``, is in the local Hugging Face cache.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return str(path)
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id=name_or_path, filename=marker)  # reads the cache only
    except ValueError:  # not a valid hub id either (HFValidationError)
        return None
    return str(Path(found).parent) if isinstance(found, str) else None
