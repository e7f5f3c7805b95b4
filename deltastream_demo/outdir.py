"""The demo's output directory: it holds what a demo wrote, or nothing else.

A run records every file it leaves under ``--out`` in a manifest (``.deltastream-demo``,
JSON). The next run removes exactly those files (and the directories they leave empty)
before it starts; anything else found there — a user's file, the remains of a run that
crashed before writing its manifest — makes it refuse with :class:`OutDirError` naming the
path, before anything is deleted. A missing or empty directory is always fine.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

__all__ = ["MANIFEST", "OutDirError", "prepare", "record"]

log = logging.getLogger(__name__)

#: the manifest's name under ``--out``
MANIFEST = ".deltastream-demo"
#: the sub-directories a run writes (``paths`` keys of :func:`prepare`)
SUBDIRS = {"work": "work", "state": "predictor-state", "snapshots": "snapshots"}


class OutDirError(ValueError):
    """``--out`` holds something the demo did not write; the text names it."""


def _files(out: Path) -> set[str]:
    """Every file (and link) under ``out``, relative, the manifest aside (links not followed)."""
    found = set()
    for root, dirs, files in os.walk(out):
        rel = Path(root).relative_to(out)
        for name in files + [d for d in dirs if (Path(root) / d).is_symlink()]:
            found.add(str(rel / name))
    found.discard(MANIFEST)
    return found


def _listed(out: Path) -> set[str]:
    try:
        data = json.loads((out / MANIFEST).read_text())
    except FileNotFoundError:
        return set()
    except (OSError, ValueError) as e:
        raise OutDirError(f"{out / MANIFEST}: unreadable demo manifest ({e}); remove the "
                          f"directory yourself or give another --out") from None
    return set(data.get("files", [])) if isinstance(data, dict) else set()


def prepare(out: Path) -> dict[str, Path]:
    """Make ``out`` ready for a run: remove what the last run listed, create the
    sub-directories; return ``{"work", "state", "snapshots"}`` paths.

    Raises:
        OutDirError: ``out`` is not a directory, or holds a file no demo run listed
            (nothing is deleted then).
    """
    if out.exists() and not out.is_dir():
        raise OutDirError(f"--out {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    listed = _listed(out)
    foreign = sorted(_files(out) - listed)
    if foreign:
        shown = ", ".join(str(out / f) for f in foreign[:3])
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise OutDirError(f"--out {out} holds files the demo did not write ({shown}{more}); "
                          f"it only reuses a directory it wrote: give an empty or new one")
    parents = set()
    for rel in listed:
        path = out / rel
        if path.is_symlink() or path.is_file():
            path.unlink()
        parents.update(Path(rel).parents)
    for rel in sorted(parents, key=lambda p: len(p.parts), reverse=True):
        d = out / rel
        if rel != Path(".") and d.is_dir() and not d.is_symlink() and not any(d.iterdir()):
            d.rmdir()  # emptied by the removals above: a directory a run made
    (out / MANIFEST).unlink(missing_ok=True)
    paths = {key: out / name for key, name in SUBDIRS.items()}
    for p in paths.values():
        p.mkdir(parents=True, exist_ok=True)
    record(out)
    return paths


def record(out: Path) -> None:
    """List every file under ``out`` as this run's: call when the run stops, however it
    stops (a run killed before it lists its files leaves them unlisted: the next refuses)."""
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"files": sorted(_files(out) - {MANIFEST + ".tmp"})}))
    os.replace(tmp, out / MANIFEST)
