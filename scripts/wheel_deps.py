"""Expose exactly a wheel's declared dependencies, taken from an installed environment, to another venv.

``make wheel-check`` installs the built wheel with ``--no-deps`` into a throwaway venv outside the
checkout. Instead of downloading and installing torch and the rest a second time, it points that
venv at the packages ``.venv`` already holds (the locked set) through a ``.pth`` file. So that a
dependency the wheel forgot to declare still shows, the ``.pth`` names a folder of symlinks
holding only the wheel's requirements and theirs (for the ``--extras`` asked), resolved from the
wheel's own metadata: the distributions of that closure, each entry listed in its RECORD; a folder
a distribution outside the closure shares (a namespace package such as ``llama_index``) is made a
real folder whose entries are linked the same way, so that nothing outside the closure shows. The checkout's packages (editable installs) are
never linked. A requirement the environment lacks, or holds at a version outside the declared
range, is an error here (one line, exit 1); ``pip check`` in the throwaway venv then checks the
whole closure against every declared range once more.

    python scripts/wheel_deps.py WHEEL SITE_PACKAGES OUT_DIR [--extras llama-index,langchain]
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from email.parser import Parser
from importlib.metadata import Distribution, distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def wheel_requirements(wheel: Path) -> tuple[str, list[Requirement]]:
    """The wheel's project name and its Requires-Dist entries, from its METADATA."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(zf.read(meta).decode())
    return msg["Name"], [Requirement(r) for r in msg.get_all("Requires-Dist") or []]


def applies(req: Requirement, extras: set[str]) -> bool:
    """Whether ``req`` holds here for a distribution installed with ``extras``."""
    if req.marker is None:
        return True
    return any(req.marker.evaluate({"extra": e}) for e in (extras or {""}))


def closure(roots: list[Requirement], extras: set[str], installed: dict[str, Distribution]) -> list[Distribution]:
    """The installed distributions that ``roots`` (under ``extras``) need, transitively; each
    requirement's version is checked against its declared range."""
    todo = [(r, extras) for r in roots]
    seen: dict[str, set[str]] = {}
    while todo:
        req, for_extras = todo.pop()
        if not applies(req, for_extras):
            continue
        name = canonicalize_name(req.name)
        dist = installed.get(name)
        if dist is None:
            raise SystemExit(f"wheel_deps: {req} is required but not installed in the environment")
        if req.specifier and not req.specifier.contains(dist.version, prereleases=True):
            raise SystemExit(f"wheel_deps: {req} is required but the environment holds {name} {dist.version}")
        wanted = set(req.extras)
        if name in seen and wanted <= seen[name]:
            continue
        seen[name] = seen.get(name, set()) | wanted
        todo += [(Requirement(r), wanted) for r in dist.requires or []]
    return [installed[n] for n in sorted(seen)]


def owned_paths(dist: Distribution, required: bool) -> list[tuple[str, ...]]:
    """The paths (as parts, relative to site-packages) a distribution installed there; a required
    one without a RECORD is an error (its files are unknown)."""
    if not dist.files:
        if required:
            raise SystemExit(f"wheel_deps: {dist.metadata['Name']} has no RECORD: its files are unknown")
        return []
    out = []
    for f in dist.files:
        parts = Path(f).parts
        if not parts or parts[0] == ".." or parts[0] == "__pycache__" or parts[-1].endswith(".pth"):
            continue
        out.append(parts)
    return out


def link_tree(paths: dict[tuple[str, ...], set[str]], wanted: set[str], site: Path, out: Path, depth: int = 0) -> int:
    """Symlink into ``out`` each entry at ``depth`` that only ``wanted`` distributions own; make a
    real folder of one that others share, and recurse into it; skip what no wanted one owns."""
    by_entry: dict[str, dict[tuple[str, ...], set[str]]] = {}
    for parts, owners in paths.items():
        by_entry.setdefault(parts[depth], {})[parts] = owners
    links = 0
    for entry, sub in sorted(by_entry.items()):
        owners = set().union(*sub.values())
        if not owners & wanted:
            continue
        target = site.joinpath(*next(iter(sub))[:depth + 1])
        if owners <= wanted or not target.is_dir():
            (out / entry).symlink_to(target)
            links += 1
        else:
            (out / entry).mkdir()
            links += link_tree({p: o for p, o in sub.items() if len(p) > depth + 1}, wanted, site, out / entry, depth + 1)
    return links


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("site", type=Path, help="the site-packages folder to take the dependencies from")
    parser.add_argument("out", type=Path, help="the folder of symlinks to create (must not exist)")
    parser.add_argument("--extras", default="", help="comma-separated extras of the wheel")
    args = parser.parse_args(argv)
    name, roots = wheel_requirements(args.wheel)
    installed = {canonicalize_name(d.metadata["Name"]): d for d in distributions(path=[str(args.site)])}
    installed.pop(canonicalize_name(name), None)  # the checkout's own (editable) install is never exposed
    extras = {e.strip() for e in args.extras.split(",") if e.strip()}
    dists = closure(roots, extras, installed)
    wanted = {canonicalize_name(d.metadata["Name"]) for d in dists}
    paths: dict[tuple[str, ...], set[str]] = {}  # every installed distribution's, to see shared folders
    for owner, dist in installed.items():
        for parts in owned_paths(dist, owner in wanted):
            paths.setdefault(parts, set()).add(owner)
    args.out.mkdir(parents=True)
    links = link_tree(paths, wanted, args.site.resolve(), args.out)
    print(f"wheel_deps: {len(dists)} distributions ({links} links) for {name}"
          f"{'[' + ','.join(sorted(extras)) + ']' if extras else ''} in {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
