"""What may stand at a checkpoint path, and how a checkpoint is removed to start over.

A :class:`~consumers.storage.checkpoint.CheckpointStore` creates its directory only with a
committed ``manifest.json`` (its first checkpoint is renamed into place whole), so:

* nothing at the path, an empty directory, or only leftovers of an interrupted write
  (``*.tmp-<pid>-<hex>`` names) — a fresh start;
* a directory with ``manifest.json`` — a checkpoint (verified when it is read);
* anything else — refused by :func:`check_checkpoint_dir` with
  :class:`~consumers.errors.SnapshotError` naming the path: a file at the path, checkpoint
  files without a manifest (damaged), files deltastream does not write.

:func:`remove_checkpoint_dir` (``deltastream-sync --reset-state``) removes a checkpoint,
damaged or not, but only when everything there is something deltastream writes; it never
deletes or moves anything else.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from consumers.errors import SnapshotError
from consumers.files import (
    MANIFEST,
    foreign_entries,
    fsync_dir,
    is_deltastream_dir,
    is_tmp_name,
    old_path,
)

__all__ = ["check_checkpoint_dir", "remove_checkpoint_dir"]

log = logging.getLogger(__name__)


def _shown(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f", … ({len(names)} in all)" if len(names) > 5 else "")


def check_checkpoint_dir(path: Path) -> None:
    """Refuse (:class:`SnapshotError`) a ``path`` that is not a checkpoint directory, or
    one whose manifest is missing while checkpoint files are there (damaged). Files
    deltastream does not write next to a manifest are only warned about (left alone)."""
    if not os.path.lexists(path):
        return
    if not path.is_dir():
        raise SnapshotError(f"{path}: is a file, not a checkpoint directory; expected a "
                            "directory written by deltastream (move the file away: a reset "
                            "never removes what deltastream did not write)")
    names = sorted(p.name for p in path.iterdir())
    foreign = foreign_entries(path)
    if MANIFEST in names:
        if foreign:
            log.warning("checkpoint %s holds files deltastream does not write: %s (left "
                        "alone)", path, _shown(foreign))
        return
    if foreign:
        raise SnapshotError(f"{path}: holds files deltastream does not write "
                            f"({_shown(foreign)}) and no {MANIFEST}; expected a checkpoint "
                            "directory written by deltastream")
    committed = [n for n in names if not is_tmp_name(n)]
    if committed:
        raise SnapshotError(f"{path}: {MANIFEST} is missing but checkpoint files are there "
                            f"({_shown(committed)}): the checkpoint is damaged")


def remove_checkpoint_dir(path: Path) -> list[str]:
    """Remove the checkpoint directory ``path`` (and a ``<path>.old`` deltastream wrote);
    returns the names removed. A ``path`` that is a file, or a directory holding anything
    deltastream does not write, is refused with :class:`SnapshotError` and left as is."""
    removed: list[str] = []
    if os.path.lexists(path):
        if path.is_symlink() or not path.is_dir():
            raise SnapshotError(f"{path}: is a file, not a checkpoint directory; deltastream "
                                "did not write it and will not remove it (move it away)")
        foreign = foreign_entries(path)
        if foreign:
            raise SnapshotError(f"{path}: holds files deltastream does not write "
                                f"({_shown(foreign)}); not removing it (move them away)")
        removed = sorted(p.name for p in path.iterdir())
        shutil.rmtree(path)
        fsync_dir(path.parent)
    old = old_path(path)
    if is_deltastream_dir(old):
        shutil.rmtree(old)
        removed.append(old.name)
    return removed
