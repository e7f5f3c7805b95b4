"""The full snapshot format: every table in full, plus offsets, seq state and meta.

A full snapshot is one directory::

    <dir>/manifest.json          format "deltastream-snapshot", version, offsets, seqs, meta,
                                 per table: name, sub-directory, size + checksum of its
                                 manifest;
                                 plus a checksum of the manifest itself
    <dir>/tables/0000/           one table directory per table (ServingTable.save layout):
        manifest.json, ids.npy, rows.npy   (CRC-32C of each in the table manifest)

Sub-directories are numbered, not named after tables, so any table name is safe on disk.

This module writes and reads such a directory in place; making it appear atomically is the
caller's job (:func:`consumers.storage.snapshot.write_snapshot` swaps a temp directory in,
:class:`consumers.storage.checkpoint.CheckpointStore` uses one as the base of a checkpoint).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from consumers.errors import SnapshotError
from consumers.files import (
    MANIFEST,
    check_format,
    fsync_dir,
    read_manifest,
    read_verified,
    write_chunks,
    write_manifest,
)
from consumers.serving.table import ServingTable
from consumers.serving.table_files import (
    TABLE_FORMAT,
    TableData,
    read_table_dir,
    write_table_dir,
    write_table_stream,
)

__all__ = ["Snapshot", "SNAPSHOT_FORMAT", "SNAPSHOT_FORMAT_VERSION", "check_contents",
           "write_full", "read_full", "read_saved", "load_table"]

log = logging.getLogger(__name__)

SNAPSHOT_FORMAT = "deltastream-snapshot"
SNAPSHOT_FORMAT_VERSION = 2  # 2: file entries carry a CRC-32C (1: a sha256, still read)
#: the dense versions' state in a snapshot directory (optional)
DENSE_FILE = "dense.bin"


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
        dense: the dense versions' state (``DenseAssembler.state()`` bytes) of a
            checkpoint that holds one, else None.
    """

    tables: dict[str, ServingTable]
    offsets: dict[int, int]
    seqs: dict
    meta: dict
    path: Path | None = field(default=None, compare=False)
    dense: bytes | None = field(default=None, compare=False)


# ----------------------------------------------------------------------------- checks


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


def check_contents(tables: Any, offsets: Any, seqs: Any, meta: Any) -> dict[str, int]:
    """Validate what a snapshot or checkpoint is asked to store; returns the offsets as
    stored in a manifest (``{"partition": next_offset}``).

    Raises ``TypeError``/``ValueError`` naming the bad argument.
    """
    _check_tables(tables)
    offs = _check_offsets(offsets)
    _check_json("seqs", seqs)
    _check_json("meta", meta)
    return offs


# ----------------------------------------------------------------------------- writing


def write_full(dir: Path, tables: dict[str, ServingTable], offs: dict[str, int],
               seqs: dict, meta: dict, exports: Optional[dict[str, Any]] = None,
               dense: Optional[bytes] = None) -> dict:
    """Write a full snapshot into the new directory ``dir`` (files and directories fsynced).

    ``offs``: as :func:`check_contents` returns them. ``exports``: name -> a frozen view
    (:meth:`ServingTable.frozen`, e.g. with change tracking restarted) or (ids, rows)
    already exported; tables missing there are frozen now. Rows are written chunk by chunk
    from the views (no second copy of a table in memory; the tables keep serving and
    applying meanwhile). ``dense``: the dense versions' state, written as ``dense.bin``
    (None: none). Returns the entry (size, checksum) of its manifest and the total
    bytes of its files as ``{"manifest": ..., "bytes": ...}``.
    """
    dir.mkdir()
    (dir / "tables").mkdir()
    entries = []
    total = 0
    for i, name in enumerate(sorted(tables)):
        sub = f"tables/{i:04d}"
        t = tables[name]
        got = (exports or {}).get(name)
        if got is None:
            with t.frozen() as view:
                entry = write_table_stream(dir / sub, view)
        elif isinstance(got, tuple):
            entry = write_table_dir(dir / sub, TableData(t.name, t.dtype, *got))
        else:
            entry = write_table_stream(dir / sub, got)
        total += entry["bytes"] + sum(
            f["bytes"] for f in read_manifest(dir / sub, entry)["files"].values())
        entries.append({"name": name, "dir": sub, "manifest": entry})
    fsync_dir(dir / "tables")
    body = {"format": SNAPSHOT_FORMAT, "version": SNAPSHOT_FORMAT_VERSION,
            "tables": entries, "offsets": offs, "seqs": seqs, "meta": meta}
    if dense is not None:
        body["dense"] = {"file": DENSE_FILE, **write_chunks(dir / DENSE_FILE, [dense])}
        total += body["dense"]["bytes"]
    entry = write_manifest(dir, body)
    fsync_dir(dir)
    return {"manifest": entry, "bytes": total + entry["bytes"]}


# ----------------------------------------------------------------------------- reading


def load_table(dir: Path, entry: Any = None, body: Optional[dict] = None) -> ServingTable:
    """The verified table directory ``dir`` as a :class:`ServingTable` (``entry``: expected
    size/checksum of its manifest; ``body``: the manifest already read and verified)."""
    data = read_table_dir(dir, entry, body)
    return ServingTable.restore(data.name, data.ids, data.rows, dtype=data.dtype)


def read_full(root: Path, body: dict) -> Snapshot:
    """The full snapshot in directory ``root`` whose verified manifest is ``body``."""
    where = root / MANIFEST
    check_format(where, body, SNAPSHOT_FORMAT, SNAPSHOT_FORMAT_VERSION)
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
        table = load_table(root / sub, e.get("manifest"))
        if table.name != e["name"]:
            raise SnapshotError(f"{root / sub}: holds table {table.name!r}, manifest says "
                                f"{e['name']!r}")
        if table.name in tables:
            raise SnapshotError(f"{where}: table {table.name!r} listed twice")
        tables[table.name] = table
    dense = body.get("dense")
    if dense is not None and (not isinstance(dense, dict) or dense.get("file") != DENSE_FILE):
        raise SnapshotError(f"{where}: malformed dense entry {dense!r:.200}")
    return Snapshot(tables=tables, offsets=offsets, seqs=seqs, meta=meta, path=root,
                    dense=None if dense is None else bytes(read_verified(root / DENSE_FILE,
                                                                         dense)))


def read_saved(root: Path, body: dict) -> Snapshot:
    """A directory holding a full snapshot or a single ``ServingTable.save`` table (empty
    offsets/seqs/meta), whose verified manifest is ``body``. Any other format (an
    incremental checkpoint included) is refused with :class:`SnapshotError`."""
    fmt = body.get("format")
    if fmt == TABLE_FORMAT:
        table = load_table(root, body=body)
        return Snapshot(tables={table.name: table}, offsets={}, seqs={}, meta={}, path=root)
    if fmt != SNAPSHOT_FORMAT:
        raise SnapshotError(f"{root / MANIFEST}: format is {fmt!r}, expected "
                            f"{SNAPSHOT_FORMAT!r} or 'deltastream-checkpoint'")
    return read_full(root, body)
