"""A serving table's own directory: ``ids.npy``, ``rows.npy`` and a sealed ``manifest.json``.

The layout of :meth:`ServingTable.save <consumers.serving.table.ServingTable.save>` and of
every table inside a snapshot (:mod:`consumers.storage`). Built from the durable-file
pieces of :mod:`consumers.files` (manifests, fsync, verified reads).

* :func:`write_table_dir` / :func:`read_table_dir` — a table from / to arrays;
* :func:`write_table_stream` — the same layout and bytes written chunk by chunk from a
  :class:`~consumers.serving.views.FrozenTable`: a base of a 10M-row table never needs a
  second in-memory copy of the table, and the table keeps serving and applying meanwhile.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, NamedTuple, Optional

import numpy as np

from consumers.errors import SnapshotError
from consumers.files import (
    MANIFEST,
    check_format,
    fsync_dir,
    parse_npy,
    read_manifest,
    read_verified,
    write_manifest,
    write_npy,
    write_npy_chunks,
)
from consumers.serving.dtypes import STORAGE_DTYPES
from deltastream.wire import MAX_DIM

__all__ = ["TABLE_FORMAT", "TABLE_FORMAT_VERSION", "TableData", "write_table_dir",
           "read_table_dir", "write_table_stream"]

log = logging.getLogger(__name__)

TABLE_FORMAT = "deltastream-table"
#: 2: file entries carry a CRC-32C (1: a sha256; still read)
TABLE_FORMAT_VERSION = 2


class TableData(NamedTuple):
    """One table as stored: name, storage dtype name, ids ascending int64 ``[n]``, rows
    ``[n, dim]`` in the storage dtype."""

    name: str
    dtype: str
    ids: np.ndarray
    rows: np.ndarray


def write_table_dir(dir: Path, table: TableData) -> dict:
    """Write ``table`` into the (new) directory ``dir`` (files and directory fsynced);
    returns the manifest file's entry (size, checksum)."""
    dir.mkdir(parents=True, exist_ok=False)
    keys, rows = table.ids, table.rows
    files = {"ids.npy": write_npy(dir / "ids.npy", keys.astype("<i8", copy=False)),
             "rows.npy": write_npy(dir / "rows.npy",
                                   rows.astype(rows.dtype.newbyteorder("<"), copy=False))}
    body = {"format": TABLE_FORMAT, "version": TABLE_FORMAT_VERSION, "name": table.name,
            "dim": int(rows.shape[1]), "dtype": table.dtype, "n": int(keys.shape[0]),
            "files": files}
    entry = write_manifest(dir, body)
    fsync_dir(dir)
    return entry


def read_table_dir(dir: Path, entry: Any = None, body: Optional[dict] = None) -> TableData:
    """Read and verify a table directory (``entry``: expected manifest size/checksum;
    ``body``: its already verified manifest). The arrays are read-only views."""
    if body is None:
        body = read_manifest(dir, entry)
    where = dir / MANIFEST
    check_format(where, body, TABLE_FORMAT, TABLE_FORMAT_VERSION)
    name, dim, dtype, n = body.get("name"), body.get("dim"), body.get("dtype"), body.get("n")
    files = body.get("files")
    if not isinstance(name, str) or not name or not isinstance(dim, int) \
            or not 1 <= dim <= MAX_DIM or dtype not in STORAGE_DTYPES \
            or not isinstance(n, int) or n < 0 or not isinstance(files, dict):
        raise SnapshotError(f"{where}: malformed fields (name={name!r}, dim={dim!r}, "
                            f"dtype={dtype!r}, n={n!r})")
    for fname in ("ids.npy", "rows.npy"):
        if fname not in files:
            raise SnapshotError(f"{where}: no entry for {fname}")
    ids = parse_npy(read_verified(dir / "ids.npy", files["ids.npy"]), dir / "ids.npy",
                    np.dtype("<i8"), (n,))
    rows = parse_npy(read_verified(dir / "rows.npy", files["rows.npy"]), dir / "rows.npy",
                     STORAGE_DTYPES[dtype], (n, dim))
    if n > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise SnapshotError(f"{dir / 'ids.npy'}: ids are not strictly ascending")
    return TableData(name, dtype, ids, rows)


def write_table_stream(dir: Path, view: Any) -> dict:
    """Write the frozen table ``view`` (name, dtype, dim, ``ids``, ``row_chunks()``) into
    the new directory ``dir`` (files and directory fsynced); returns the manifest file's
    entry (size, checksum)."""
    dir.mkdir(parents=True, exist_ok=False)
    ids = view.ids
    dt = STORAGE_DTYPES[view.dtype]
    files = {"ids.npy": write_npy(dir / "ids.npy", ids.astype("<i8", copy=False)),
             "rows.npy": write_npy_chunks(dir / "rows.npy", dt, (int(ids.shape[0]), view.dim),
                                           view.row_chunks())}
    body = {"format": TABLE_FORMAT, "version": TABLE_FORMAT_VERSION, "name": view.name,
            "dim": int(view.dim), "dtype": view.dtype, "n": int(ids.shape[0]), "files": files}
    entry = write_manifest(dir, body)
    fsync_dir(dir)
    return entry
