"""Checkpoint segment files: the rows changed after a base, in one checksummed file.

Segment file: ``b"DSCKSEG1"``, u32 little-endian header length, JSON header (base
generation, index, per table name/dim/dtype/n/m), zero padding to 8 bytes, then per table
``n`` int64 ids, ``n × dim`` rows (storage dtype), ``m`` int64 deleted ids (little-endian).
The chain of a base and its segments is :mod:`consumers.storage.checkpoint`'s.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from consumers.errors import SnapshotError
from consumers.serving.dtypes import STORAGE_DTYPES
from consumers.serving.table import ServingTable
from consumers.serving.views import FrozenChanges
from deltastream.wire import MAX_DIM

__all__ = ["encode_segment", "parse_segment", "apply_segment"]

log = logging.getLogger(__name__)

_SEG_MAGIC = b"DSCKSEG1"
_MAX_HEADER = 16 << 20


def encode_segment(gen: int, index: int, changes: dict[str, FrozenChanges]) -> Iterator[Any]:
    """Chunks (bytes / arrays) of a segment file for ``changes``: name -> frozen changes
    of that table (rows gathered chunk by chunk as the file is written)."""
    head = {"base": gen, "index": index, "tables": [
        {"name": name, "dim": v.dim, "dtype": v.dtype, "n": v.n, "m": int(v.deleted.shape[0])}
        for name, v in changes.items()]}
    raw = json.dumps(head, sort_keys=True, separators=(",", ":")).encode()
    pad = (-(len(_SEG_MAGIC) + 4 + len(raw))) % 8
    yield from (_SEG_MAGIC, struct.pack("<I", len(raw) + pad), raw, b" " * pad)
    for v in changes.values():
        dt = STORAGE_DTYPES[v.dtype].newbyteorder("<")
        yield np.ascontiguousarray(v.ids, dtype="<i8")
        for rows in v.row_chunks():
            yield np.ascontiguousarray(rows, dtype=dt)
        yield np.ascontiguousarray(v.deleted, dtype="<i8")


def parse_segment(data: bytearray, path: Path, gen: int, index: int
                   ) -> list[tuple[str, int, str, np.ndarray, np.ndarray, np.ndarray]]:
    """[(name, dim, dtype, ids, rows, deleted)] of a verified segment file."""
    mv = memoryview(data)
    if len(data) < 12 or bytes(mv[:8]) != _SEG_MAGIC:
        raise SnapshotError(f"{path}: not a deltastream checkpoint segment (bad magic)")
    (hlen,) = struct.unpack("<I", mv[8:12])
    if hlen > min(_MAX_HEADER, len(data) - 12):
        raise SnapshotError(f"{path}: segment header length {hlen} is out of range")
    try:
        head = json.loads(bytes(mv[12: 12 + hlen]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SnapshotError(f"{path}: segment header is not valid JSON ({e})") from None
    if not isinstance(head, dict) or head.get("base") != gen or head.get("index") != index \
            or not isinstance(head.get("tables"), list):
        raise SnapshotError(f"{path}: segment header {head!r} does not match base {gen}, "
                            f"segment {index}")
    pos = 12 + hlen
    out = []
    for e in head["tables"]:
        if not isinstance(e, dict):
            raise SnapshotError(f"{path}: malformed table entry {e!r}")
        name, dim, dtype, n, m = (e.get(k) for k in ("name", "dim", "dtype", "n", "m"))
        if not isinstance(name, str) or not isinstance(dim, int) or not 1 <= dim <= MAX_DIM \
                or dtype not in STORAGE_DTYPES or not isinstance(n, int) or n < 0 \
                or not isinstance(m, int) or m < 0:
            raise SnapshotError(f"{path}: malformed table entry {e!r}")
        sizes = (n * 8, n * dim * STORAGE_DTYPES[dtype].itemsize, m * 8)
        if pos + sum(sizes) > len(data):
            raise SnapshotError(f"{path}: table {name!r} needs {sum(sizes)} bytes at "
                                f"{pos}, the file has {len(data)} (truncated)")
        ids = np.frombuffer(data, "<i8", n, pos)
        rows = np.frombuffer(data, STORAGE_DTYPES[dtype], n * dim, pos + sizes[0]
                             ).reshape(n, dim)
        gone = np.frombuffer(data, "<i8", m, pos + sizes[0] + sizes[1])
        pos += sum(sizes)
        for what, a in (("ids", ids), ("deleted ids", gone)):
            if a.size > 1 and not bool((a[1:] > a[:-1]).all()):
                raise SnapshotError(f"{path}: {what} of table {name!r} are not strictly "
                                    "ascending")
        out.append((name, dim, dtype, ids, rows, gone))
    if pos != len(data):
        raise SnapshotError(f"{path}: {len(data) - pos} unexpected bytes after the data")
    return out


def apply_segment(tables: dict[str, ServingTable], parts: list, path: Path) -> None:
    """Replay parsed segment ``parts`` onto ``tables`` (each must be in the base, with the
    same dim and dtype)."""
    for name, dim, dtype, ids, rows, gone in parts:
        t = tables.get(name)
        if t is None:
            raise SnapshotError(f"{path}: segment holds table {name!r}, absent from the base")
        if t.dim != dim or t.dtype != dtype:
            raise SnapshotError(f"{path}: table {name!r} is dim {dim} {dtype} in the segment, "
                                f"dim {t.dim} {t.dtype} in the base")
        t.apply_changes(ids, rows, gone)
