"""Write a table directory from a frozen view, chunk by chunk.

Same layout and bytes as :func:`consumers.storage.files.write_table_dir` (``ids.npy``,
``rows.npy``, sealed ``manifest.json``), but the rows are gathered, hashed and written in
chunks of a :class:`~consumers.serving.views.FrozenTable`: a base of a 10M-row table never
needs a second in-memory copy of the table, and the table keeps serving and applying
meanwhile.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from consumers.storage.files import (
    TABLE_FORMAT,
    TABLE_FORMAT_VERSION,
    fsync_dir,
    write_manifest,
    write_npy,
    write_npy_chunks,
)

__all__ = ["write_table_stream"]

log = logging.getLogger(__name__)


def write_table_stream(dir: Path, view: Any) -> dict:
    """Write the frozen table ``view`` (name, dtype, dim, ``ids``, ``row_chunks()``) into
    the new directory ``dir`` (files and directory fsynced); returns the manifest file's
    entry (size, checksum)."""
    dir.mkdir(parents=True, exist_ok=False)
    ids = view.ids
    dt = np.dtype({"f32": "<f4", "f16": "<f2"}[view.dtype])
    files = {"ids.npy": write_npy(dir / "ids.npy", ids.astype("<i8", copy=False)),
             "rows.npy": write_npy_chunks(dir / "rows.npy", dt, (int(ids.shape[0]), view.dim),
                                           view.row_chunks())}
    body = {"format": TABLE_FORMAT, "version": TABLE_FORMAT_VERSION, "name": view.name,
            "dim": int(view.dim), "dtype": view.dtype, "n": int(ids.shape[0]), "files": files}
    entry = write_manifest(dir, body)
    fsync_dir(dir)
    return entry
