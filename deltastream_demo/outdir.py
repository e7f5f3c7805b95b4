"""The demo's output directory: it holds what a demo wrote, or nothing else.

A run records every file and directory it leaves under ``--out`` in a manifest
(``.deltastream-demo``, JSON). Before it starts, the next run removes exactly those files,
then those of the directories that are empty; anything else found there — a user's file,
the remains of a run that crashed before writing its manifest — makes it refuse with
:class:`OutDirError` naming the path, before anything is deleted. A missing or empty
directory is always fine.
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


def _walk(out: Path) -> tuple[set[str], set[str]]:
    """Every file (and link) and every directory under ``out``, relative, the manifest
    aside (links not followed)."""
    files, dirs = set(), set()
    for root, subdirs, names in os.walk(out):
        rel = Path(root).relative_to(out)
        for d in subdirs:
            (files if (Path(root) / d).is_symlink() else dirs).add(str(rel / d))
        files.update(str(rel / name) for name in names)
    files.discard(MANIFEST)
    return files, dirs


def _listed(out: Path) -> tuple[set[str], set[str]]:
    """The files and directories the last run listed (a manifest of an older demo lists
    files only: its directories are then those files' parents)."""
    try:
        data = json.loads((out / MANIFEST).read_text())
    except FileNotFoundError:
        return set(), set()
    except (OSError, ValueError) as e:
        raise OutDirError(f"{out / MANIFEST}: unreadable demo manifest ({e}); remove the "
                          f"directory yourself or give another --out") from None
    if not isinstance(data, dict):
        return set(), set()
    files = set(data.get("files", []))
    dirs = set(data.get("dirs", [])) or {str(p) for f in files for p in Path(f).parents}
    return files, dirs - {"."}


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
    listed, listed_dirs = _listed(out)
    foreign = sorted(_walk(out)[0] - listed)
    if foreign:
        shown = ", ".join(str(out / f) for f in foreign[:3])
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise OutDirError(f"--out {out} holds files the demo did not write ({shown}{more}); "
                          f"it only reuses a directory it wrote: give an empty or new one")
    for rel in listed:
        path = out / rel
        if path.is_symlink() or path.is_file():
            path.unlink()
    for rel in sorted(listed_dirs, key=lambda p: len(Path(p).parts), reverse=True):
        d = out / rel
        if d.is_dir() and not d.is_symlink() and not any(d.iterdir()):
            d.rmdir()  # a directory a run made, emptied by the removals above
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
    files, dirs = _walk(out)
    tmp.write_text(json.dumps({"files": sorted(files - {MANIFEST + ".tmp"}),
                               "dirs": sorted(dirs)}))
    os.replace(tmp, out / MANIFEST)
