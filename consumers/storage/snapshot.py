"""Multi-table snapshots: serving tables + next Kafka offset per partition + seq state.

:func:`write_snapshot` writes a full snapshot (layout in
:mod:`consumers.storage.full_format`) to ``<path>`` as one atomic unit;
:func:`read_snapshot` reads any stored predictor state: a full snapshot, an incremental
checkpoint (:mod:`consumers.storage.checkpoint`), or a single-table directory written by
``ServingTable.save`` (empty offsets/seqs/meta), so any of them can serve as a base.

Atomicity: everything is written into ``<path>.tmp-<pid>-<rand>`` next to ``path``, every
file and directory is fsynced, then the directory is swapped in by renames (``path`` ->
``path.old``, tmp -> ``path``, remove ``path.old``; see
:func:`consumers.files.replace_dir`). A crash at any instant leaves either ``path``
complete (old or new) or, between the two renames, no ``path`` and the previous snapshot at
``path.old``, which :func:`read_snapshot` then reads. One writer per ``path`` at a time (the
daemon's own process); leftover temp directories are removed by the next write.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from consumers.errors import SnapshotError
from consumers.files import MANIFEST, PathLike, read_manifest, resolve_dir, write_dir_atomic
from consumers.serving.table import ServingTable
from consumers.storage.checkpoint_read import CHECKPOINT_FORMAT, read_checkpoint
from consumers.storage.full_format import (
    SNAPSHOT_FORMAT,
    SNAPSHOT_FORMAT_VERSION,
    Snapshot,
    check_contents,
    read_saved,
    write_full,
)

__all__ = ["Snapshot", "SnapshotError", "write_snapshot", "read_snapshot", "snapshot_exists",
           "SNAPSHOT_FORMAT", "SNAPSHOT_FORMAT_VERSION"]

log = logging.getLogger(__name__)


def write_snapshot(path: PathLike, *, tables: dict[str, ServingTable], offsets: dict[int, int],
                   seqs: dict, meta: dict, dense: Optional[bytes] = None) -> None:
    """Write tables + offsets + seq state + meta to directory ``path`` as one atomic unit.

    After a crash at any instant, :func:`read_snapshot` returns either the previous or this
    snapshot, complete. Each table is exported under its own lock (consistent per table);
    callers that apply and checkpoint in one thread get a consistent whole. ``dense``:
    the dense versions' state (``DenseAssembler.state()``), or None.
    """
    path = Path(path)
    offs = check_contents(tables, offsets, seqs, meta)
    write_dir_atomic(path, lambda tmp: write_full(tmp, tables, offs, seqs, meta, dense=dense))
    log.debug("snapshot written to %s: %d tables, offsets %s", path, len(tables), offs)


def read_snapshot(path: PathLike) -> Snapshot:
    """Read and verify the snapshot at ``path`` (or a single ``ServingTable.save`` dir).

    Raises :class:`SnapshotError` naming the file and the problem (missing, bad checksum,
    truncated, malformed manifest).
    """
    root = resolve_dir(Path(path))
    body = read_manifest(root)
    if body.get("format") == CHECKPOINT_FORMAT:
        return read_checkpoint(root, body)  # an incremental checkpoint (base + segments)
    return read_saved(root, body)


def snapshot_exists(path: PathLike) -> bool:
    """True when ``path`` (or, after an interrupted write, ``path.old``) holds a manifest.

    Existence only: :func:`read_snapshot` still verifies checksums.
    """
    path = Path(path)
    try:
        root = resolve_dir(path)
    except SnapshotError:
        return False
    return (root / MANIFEST).is_file()
