"""Multi-table checkpoints: serving tables + next Kafka offset per partition + seq state.

A checkpoint is one directory written as one atomic unit::

    <path>/manifest.json          format "deltastream-snapshot", version, offsets, seqs, meta,
                                  per table: name, sub-directory, size + sha256 of its manifest;
                                  plus a checksum of the manifest itself
    <path>/tables/0000/           one ServingTable.save layout per table:
        manifest.json, ids.npy, rows.npy   (sha256 of each in the table manifest)

Sub-directories are numbered, not named after tables, so any table name is safe on disk.

Atomicity: everything is written into ``<path>.tmp-<pid>-<rand>`` next to ``path``, every
file and directory is fsynced, then the directory is swapped in by renames (``path`` ->
``path.old``, tmp -> ``path``, remove ``path.old``; see ``serving_table._replace_dir``). A
crash at any instant leaves either ``path`` complete (old or new) or, between the two
renames, no ``path`` and the previous snapshot at ``path.old``, which :func:`read_snapshot`
then reads. One writer per ``path`` at a time (the daemon's own process); leftover temp
directories are removed by the next write.

:func:`read_snapshot` also accepts a single-table directory written by
``ServingTable.save`` (empty offsets/seqs/meta), so either can serve as a base snapshot.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from consumers.serving_table import (
    MANIFEST,
    TABLE_FORMAT,
    PathLike,
    ServingTable,
    SnapshotError,
    _check_format,
    _fsync_dir,
    _new_tmp,
    _read_manifest,
    _read_table_dir,
    _replace_dir,
    _resolve_dir,
    _write_manifest,
    _write_table_dir,
)

__all__ = ["Snapshot", "SnapshotError", "write_snapshot", "read_snapshot", "snapshot_exists",
           "SNAPSHOT_FORMAT", "SNAPSHOT_FORMAT_VERSION"]

log = logging.getLogger(__name__)

SNAPSHOT_FORMAT = "deltastream-snapshot"
SNAPSHOT_FORMAT_VERSION = 1


@dataclass
class Snapshot:
    """A checkpoint as read back.

    Attributes:
        tables: table name -> :class:`ServingTable`.
        offsets: Kafka partition -> NEXT offset to read.
        seqs: ``SeqTracker.state()`` at the time of the checkpoint.
        meta: free JSON-able metadata (topic, model, created_ns, ...).
        path: the directory actually read (``path`` or, after an interrupted write,
            ``path.old``); None for a snapshot built in memory.
    """

    tables: dict[str, ServingTable]
    offsets: dict[int, int]
    seqs: dict
    meta: dict
    path: Path | None = field(default=None, compare=False)


def _check_json(what: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise TypeError(f"{what}: expected a dict, got {type(value).__name__}")
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what}: must be JSON-serializable ({e})") from None


def _check_offsets(offsets: Any) -> dict[str, int]:
    if not isinstance(offsets, dict):
        raise TypeError(f"offsets: expected a dict partition -> next offset, got "
                        f"{type(offsets).__name__}")
    out = {}
    for p, o in offsets.items():
        if isinstance(p, bool) or not isinstance(p, int) or p < 0 \
                or isinstance(o, bool) or not isinstance(o, int) or o < 0:
            raise ValueError(f"offsets: expected non-negative int partition -> non-negative "
                             f"int offset, got {p!r} -> {o!r}")
        out[str(int(p))] = int(o)
    return out


def _check_tables(tables: Any) -> None:
    if not isinstance(tables, dict):
        raise TypeError(f"tables: expected a dict name -> ServingTable, got "
                        f"{type(tables).__name__}")
    for name, t in tables.items():
        if not isinstance(t, ServingTable):
            raise TypeError(f"tables[{name!r}]: expected a ServingTable, got "
                            f"{type(t).__name__}")
        if t.name != name:
            raise ValueError(f"tables: key {name!r} holds table named {t.name!r}")


def _write_snapshot_dir(dir: Path, tables: dict[str, ServingTable], offs: dict[str, int],
                        seqs: dict, meta: dict,
                        exports: Optional[dict[str, tuple[np.ndarray, np.ndarray]]] = None
                        ) -> dict:
    """Write a full snapshot into the new directory ``dir`` (files and directories fsynced).

    ``exports``: name -> (ids, rows) already exported (e.g. with change tracking reset);
    tables missing there are exported now. Returns the entry (size, sha256) of its
    manifest and the total bytes of its files as ``{"manifest": ..., "bytes": ...}``.
    """
    dir.mkdir()
    (dir / "tables").mkdir()
    entries = []
    total = 0
    for i, name in enumerate(sorted(tables)):
        sub = f"tables/{i:04d}"
        entry = _write_table_dir(dir / sub, tables[name], (exports or {}).get(name))
        total += entry["bytes"] + sum(
            f["bytes"] for f in _read_manifest(dir / sub, entry)["files"].values())
        entries.append({"name": name, "dir": sub, "manifest": entry})
    _fsync_dir(dir / "tables")
    body = {"format": SNAPSHOT_FORMAT, "version": SNAPSHOT_FORMAT_VERSION,
            "tables": entries, "offsets": offs, "seqs": seqs, "meta": meta}
    entry = _write_manifest(dir, body)
    _fsync_dir(dir)
    return {"manifest": entry, "bytes": total + entry["bytes"]}


def write_snapshot(path: PathLike, *, tables: dict[str, ServingTable], offsets: dict[int, int],
                   seqs: dict, meta: dict) -> None:
    """Write tables + offsets + seq state + meta to directory ``path`` as one atomic unit.

    After a crash at any instant, :func:`read_snapshot` returns either the previous or this
    snapshot, complete. Each table is exported under its own lock (consistent per table);
    callers that apply and checkpoint in one thread get a consistent whole.
    """
    path = Path(path)
    _check_tables(tables)
    offs = _check_offsets(offsets)
    _check_json("seqs", seqs)
    _check_json("meta", meta)
    tmp = _new_tmp(path)
    try:
        _write_snapshot_dir(tmp, tables, offs, seqs, meta)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _replace_dir(tmp, path)
    log.debug("snapshot written to %s: %d tables, offsets %s", path, len(tables), offs)


def read_snapshot(path: PathLike) -> Snapshot:
    """Read and verify the snapshot at ``path`` (or a single ``ServingTable.save`` dir).

    Raises :class:`SnapshotError` naming the file and the problem (missing, bad checksum,
    truncated, malformed manifest).
    """
    root = _resolve_dir(Path(path))
    body = _read_manifest(root)
    where = root / MANIFEST
    fmt = body.get("format")
    if fmt == TABLE_FORMAT:
        table = _read_table_dir(root, body=body)
        return Snapshot(tables={table.name: table}, offsets={}, seqs={}, meta={}, path=root)
    if fmt == "deltastream-checkpoint":
        # an incremental checkpoint (base + delta segments); imported here because
        # consumers.storage.checkpoint builds on this module
        from consumers.storage.checkpoint import read_checkpoint

        return read_checkpoint(root, body)
    if fmt != SNAPSHOT_FORMAT:
        raise SnapshotError(f"{where}: format is {fmt!r}, expected {SNAPSHOT_FORMAT!r} "
                            "or 'deltastream-checkpoint'")
    return _read_full(root, body)


def _read_full(root: Path, body: dict) -> Snapshot:
    """The full snapshot in directory ``root`` whose verified manifest is ``body``."""
    where = root / MANIFEST
    _check_format(where, body, SNAPSHOT_FORMAT, SNAPSHOT_FORMAT_VERSION)
    entries, offs = body.get("tables"), body.get("offsets")
    seqs, meta = body.get("seqs"), body.get("meta")
    if not isinstance(entries, list) or not isinstance(offs, dict) \
            or not isinstance(seqs, dict) or not isinstance(meta, dict):
        raise SnapshotError(f"{where}: malformed manifest (tables/offsets/seqs/meta)")
    try:
        offsets = {int(p): int(o) for p, o in offs.items()}
    except (TypeError, ValueError):
        raise SnapshotError(f"{where}: malformed offsets {offs!r}") from None
    tables: dict[str, ServingTable] = {}
    for e in entries:
        if not isinstance(e, dict) or not isinstance(e.get("name"), str) \
                or not isinstance(e.get("dir"), str):
            raise SnapshotError(f"{where}: malformed table entry {e!r}")
        sub = e["dir"]
        parts = sub.split("/")
        if len(parts) != 2 or parts[0] != "tables" or not parts[1].isdigit():
            raise SnapshotError(f"{where}: table directory {sub!r} is not tables/NNNN")
        table = _read_table_dir(root / sub, e.get("manifest"))
        if table.name != e["name"]:
            raise SnapshotError(f"{root / sub}: holds table {table.name!r}, manifest says "
                                f"{e['name']!r}")
        if table.name in tables:
            raise SnapshotError(f"{where}: table {table.name!r} listed twice")
        tables[table.name] = table
    return Snapshot(tables=tables, offsets=offsets, seqs=seqs, meta=meta, path=root)


def snapshot_exists(path: PathLike) -> bool:
    """True when ``path`` (or, after an interrupted write, ``path.old``) holds a manifest.

    Existence only: :func:`read_snapshot` still verifies checksums.
    """
    path = Path(path)
    try:
        root = _resolve_dir(path)
    except SnapshotError:
        return False
    return (root / MANIFEST).is_file()
