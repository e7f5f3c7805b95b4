"""ServingTable: the predictor's in-memory id -> embedding row table (numpy, no torch).

Layout
------
* Rows live in one numpy array ``[row_capacity, dim]`` (float32 or float16). Row slot 0 is
  reserved and always zero: a lookup maps unknown ids to slot 0, so ``lookup`` is one probe
  plus one gather with no masking. Slots of deleted ids go on a free stack and are reused.
* The id -> slot index is a :class:`~consumers.id_index.IdIndex`: a numpy open-addressing
  hash of the int64 ids, O(batch) per apply and lookup (see that module for why not sorted
  keys). At 1M ids it costs 48 MB next to 256 MB of dim-64 rows.

Thread safety
-------------
One lock guards the index and the rows. ``apply`` validates, dequantizes and checks the
batch *outside* the lock, then holds it only for the index update and the row scatter
(deletes and upserts of one batch together); ``lookup`` holds it for the probe and the
gather. A reader in another thread therefore sees every batch either entirely or not at
all, and never a half-written row. Capacity is reserved before anything changes, so a
batch that fails (e.g. ``MemoryError`` while growing) leaves the table as it was.

Snapshots
---------
``save(dir)`` writes ``ids.npy`` and ``rows.npy`` (``allow_pickle=False``) and a
``manifest.json`` with the format version, shapes and sha256 of each file (and a checksum
of the manifest itself) into a temporary directory next to ``dir``, fsyncs files and
directories, then swaps it in with renames (see :mod:`consumers.storage.files`). ``load``
verifies everything and raises :class:`SnapshotError` naming the file and the problem.
Snapshots and checkpoints (:mod:`consumers.storage`) use the public persistence surface:
:meth:`ServingTable.export`, :meth:`ServingTable.restore`, the change tracking methods
(:meth:`~ServingTable.start_tracking`, :meth:`~ServingTable.export_tracked`,
:meth:`~ServingTable.take_changes`) and :meth:`ServingTable.apply_changes`.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from consumers.columns import Columns, batch_columns, scatter_columns
from consumers.errors import ApplyError, SnapshotError
from consumers.id_index import IdIndex
from consumers.storage.files import (
    STORAGE_DTYPES,
    PathLike,
    TableData,
    read_table_dir,
    resolve_dir,
    write_dir_atomic,
    write_table_dir,
)
from deltastream.wire import MAX_DIM, DeltaBatch

__all__ = ["ServingTable", "ApplyResult", "ApplyError", "SnapshotError", "STORAGE_DTYPES"]

log = logging.getLogger(__name__)

_F16_MAX = 65504.0
_DELETED_COMPACT_MIN = 1 << 16  # deleted-id list entries before the first dedup


@dataclass
class ApplyResult:
    """What one :meth:`ServingTable.apply` changed: rows upserted, ids deleted (present ones)."""

    upserted: int
    deleted: int


# ----------------------------------------------------------------------------- helpers


def _as_ids(ids: Any, what: str = "ids") -> np.ndarray:
    """``ids`` as a contiguous 1-D int64 array, or ``TypeError``/``ValueError``."""
    arr = np.asarray(ids)
    if arr.ndim == 0 and arr.size == 1:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise ValueError(f"{what}: expected a 1-D array of int64 ids, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{what}: expected integer ids, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and bool(np.any(arr > np.iinfo(np.int64).max)):
        raise ValueError(f"{what}: ids must fit in int64")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _all_finite(x: np.ndarray) -> bool:
    """True when every element is finite; one pass in the common case.

    A sum is non-finite whenever any element is NaN or ±inf, so a finite sum proves the
    rows finite. A non-finite sum may also be a harmless overflow; check exactly then.
    """
    if x.size == 0:
        return True
    acc = np.float32 if x.dtype.itemsize <= 4 else np.float64
    with np.errstate(over="ignore", invalid="ignore"):
        s = np.add.reduce(x, axis=None, dtype=acc)
    return bool(np.isfinite(s)) or bool(np.isfinite(x).all())


# ----------------------------------------------------------------------------- the table


class ServingTable:
    """An id -> row table for serving: vectorized lookups, atomic batch applies.

    Args:
        name: table name (matches ``DeltaBatch.table``).
        dim: row width, 1 ≤ dim ≤ 65536.
        dtype: storage dtype, ``"f32"`` (exact) or ``"f16"`` (half the memory; values are
            rounded to nearest and rows with |x| > 65504 are refused).
        capacity: initial number of rows to reserve (grows by doubling).
    """

    def __init__(self, name: str, dim: int, *, dtype: str = "f32", capacity: int = 1024):
        if not isinstance(name, str) or not name:
            raise ValueError(f"name: expected a non-empty str, got {name!r}")
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) \
                or not 1 <= int(dim) <= MAX_DIM:
            raise ValueError(f"dim: expected an int in [1, {MAX_DIM}], got {dim!r}")
        if dtype not in STORAGE_DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(STORAGE_DTYPES)}, got {dtype!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) \
                or capacity < 1:
            raise ValueError(f"capacity: expected a positive int, got {capacity!r}")
        self.name = name
        self.dim = int(dim)
        self.dtype = dtype
        self._np_dtype = STORAGE_DTYPES[dtype]
        self._lock = threading.Lock()
        # rows: slot 0 is the shared zero row for unknown ids
        self._rows = np.zeros((int(capacity) + 1, self.dim), self._np_dtype)
        self._hwm = 1  # first never-used slot
        self._free = np.zeros(int(capacity) + 1, np.int32)  # stack of reusable slots
        self._nfree = 0
        self._live = 0
        # id held by each row slot (valid for live slots): lets change tracking name the
        # ids of dirty slots without scanning the hash index
        self._slot_ids = np.zeros(int(capacity) + 1, np.int64)
        # change tracking for incremental checkpoints (off until a checkpoint store starts
        # it): a dirty mark per row slot, plus the ids deleted since the last take
        self._tracking = False
        self._dirty = np.zeros(0, np.bool_)
        self._deleted: list[np.ndarray] = []
        self._deleted_n = 0
        self._deleted_floor = _DELETED_COMPACT_MIN
        self._index = IdIndex(int(capacity), name)

    # ------------------------------------------------------------------ internals (lock held)

    def _reserve(self, new_keys: int) -> None:
        """Make room for ``new_keys`` more ids (buckets and rows) before anything changes."""
        need_rows = self._hwm + max(0, new_keys - self._nfree)
        if need_rows > self._rows.shape[0]:
            cap = max(need_rows, 2 * self._rows.shape[0])
            rows = np.zeros((cap, self.dim), self._np_dtype)
            rows[: self._hwm] = self._rows[: self._hwm]
            self._rows = rows
        if self._free.shape[0] < self._rows.shape[0]:
            free = np.zeros(self._rows.shape[0], np.int32)
            free[: self._nfree] = self._free[: self._nfree]
            self._free = free
        if self._slot_ids.shape[0] < self._rows.shape[0]:
            slot_ids = np.zeros(self._rows.shape[0], np.int64)
            slot_ids[: self._hwm] = self._slot_ids[: self._hwm]
            self._slot_ids = slot_ids
        if self._tracking and self._dirty.shape[0] < self._rows.shape[0]:
            dirty = np.zeros(self._rows.shape[0], np.bool_)
            dirty[: self._hwm] = self._dirty[: self._hwm]
            self._dirty = dirty
        self._index.reserve(new_keys, self._live)

    def _alloc(self, m: int) -> np.ndarray:
        """``m`` row slots (reused ones first). Capacity reserved by :meth:`_reserve`."""
        k = min(m, self._nfree)
        out = np.empty(m, np.int32)
        out[:k] = self._free[self._nfree - k: self._nfree]
        self._nfree -= k
        out[k:] = np.arange(self._hwm, self._hwm + (m - k), dtype=np.int32)
        self._hwm += m - k
        return out

    def _delete_locked(self, ids: np.ndarray) -> int:
        if ids.size == 0:
            return 0
        slots, keys = self._index.delete(ids)
        if slots.size == 0:
            return 0
        if self._tracking:
            self._dirty[slots] = False  # a freed slot holds no row to checkpoint
            self._note_deleted(keys)
        self._free[self._nfree: self._nfree + slots.size] = slots
        self._nfree += slots.size
        self._live -= slots.size
        return int(slots.size)

    def _upsert_locked(self, ids: np.ndarray, rows: np.ndarray,
                       cols: Optional[Columns] = None) -> None:
        """Write ``rows`` of ``ids``: whole rows, or only ``cols`` of each row (a column
        slice; rows first seen here read zeros in the other columns, see
        :mod:`consumers.columns`)."""
        slots = self._index.slots(ids)
        new = slots == 0
        fresh = np.zeros(0, np.int32)
        if new.any():
            fresh = self._alloc(int(np.count_nonzero(new)))
            slots[new] = fresh
            self._index.insert(ids[new], fresh)
            self._slot_ids[fresh] = ids[new]
            self._live += fresh.size
        if cols is None or cols.whole:
            _scatter_rows(self._rows, slots, rows)
        else:
            scatter_columns(self._rows, slots, rows, cols, fresh)
        if self._tracking:
            self._dirty[slots] = True

    def _slots(self, ids: np.ndarray) -> np.ndarray:
        """Row slot of each id, 0 (the zero row) for unknown ids. Caller holds the lock."""
        return self._index.slots(ids)

    # ------------------------------------------------------------------ validation

    def _prepare_rows(self, rows: Any, n: int, what: str, finite: bool = False,
                      width: Optional[int] = None) -> np.ndarray:
        """Float rows ``[n, width]`` (default ``dim``) checked finite (unless known
        ``finite``) and in range."""
        rows = np.asarray(rows)
        width = self.dim if width is None else width
        if rows.ndim != 2 or rows.shape != (n, width):
            raise ApplyError(f"{what}: expected shape [{n}, {width}] for table "
                             f"{self.name!r}, got {tuple(rows.shape)}")
        if rows.dtype.kind not in "fiu":
            raise ApplyError(f"{what}: expected float rows, got dtype {rows.dtype}")
        if not finite and not _all_finite(rows):
            bad = int(np.count_nonzero(~np.isfinite(rows).all(axis=1)))
            raise ApplyError(f"{what}: {bad} row(s) hold NaN or inf values; table "
                             f"{self.name!r} refuses non-finite rows")
        if self._np_dtype == np.float16 and rows.dtype != np.float16:
            if rows.size and float(np.abs(rows).max()) > _F16_MAX:
                raise ApplyError(f"{what}: a value exceeds the f16 storage range "
                                 f"(±{_F16_MAX:g}) of table {self.name!r}")
        return rows

    # ------------------------------------------------------------------ public API

    def __len__(self) -> int:
        return self._live

    def __repr__(self) -> str:
        return f"ServingTable(name={self.name!r}, dim={self.dim}, dtype={self.dtype!r}, " \
               f"len={self._live})"

    def lookup(self, ids: Any) -> np.ndarray:
        """Rows of ``ids`` (int64 ``[N]``) as float32 ``[N, dim]``; zeros for unknown ids."""
        keys = _as_ids(ids)
        with self._lock:
            out = np.take(self._rows, self._slots(keys), axis=0)
        return out if out.dtype == np.float32 else out.astype(np.float32)

    def apply(self, batch: DeltaBatch) -> ApplyResult:
        """Apply one decoded wire batch: delete ``batch.tombstones``, then upsert ``ids`` with
        ``batch.rows_f32()`` — atomically for readers.

        A column slice (wire v2 ``col``/``width``, from a column-wise trainer shard) writes
        only columns ``[col, col + batch.dim)`` of each row; its ``width`` must be this
        table's ``dim`` (:mod:`consumers.columns`).

        Raises :class:`ApplyError` (table untouched) on a table-name or dim mismatch, an
        unknown wire dtype, bad shapes, duplicate ids, or non-finite rows.
        """
        if not isinstance(batch, DeltaBatch):
            raise ApplyError(f"batch: expected a DeltaBatch, got {type(batch).__name__}")
        if batch.table != self.name:
            raise ApplyError(f"table: batch is for table {batch.table!r}, this table is "
                             f"{self.name!r}")
        cols = batch_columns(batch)
        rows_raw = np.asarray(batch.rows)
        if cols.width != self.dim:
            what = "dim" if cols.whole else f"width (columns [{cols.col}, {cols.col + cols.n}))"
            raise ApplyError(f"dim: batch for table {self.name!r} has {what} {cols.width}, "
                             f"the table has dim {self.dim}")
        if batch.dtype not in ("f32", "f16", "bf16", "i8"):
            raise ApplyError(f"dtype: unknown wire dtype {batch.dtype!r}")
        try:
            ids = _as_ids(batch.ids)
            tomb = None if batch.tombstones is None else _as_ids(batch.tombstones, "tombstones")
        except (TypeError, ValueError) as e:
            raise ApplyError(str(e)) from None
        n = ids.shape[0]
        if n > 1 and not bool((ids[1:] > ids[:-1]).all()):
            # decoded batches are strictly ascending; a hand-built one may not be
            order = np.argsort(ids, kind="stable")
            if bool((ids[order][1:] == ids[order][:-1]).any()):
                raise ApplyError("ids: duplicate ids in one batch")
        vals = self._batch_rows(batch, rows_raw, n, cols.n)
        with self._lock:
            self._reserve(n)
            deleted = self._delete_locked(tomb) if tomb is not None else 0
            if n:
                self._upsert_locked(ids, vals, cols)
        return ApplyResult(upserted=n, deleted=deleted)

    def _batch_rows(self, batch: DeltaBatch, wire: np.ndarray, n: int,
                    width: int) -> np.ndarray:
        """Dequantized, validated rows of ``batch`` in the storage dtype.

        For decoded f16/bf16/i8 batches finiteness is checked on the wire representation
        (exponent bits / scales), which is cheaper than checking the float32 rows.
        """
        finite = False
        if getattr(batch, "_decoded", False) and batch.dtype != "f32":
            if batch.dtype in ("f16", "bf16"):
                if wire.dtype.itemsize != 2:
                    raise ApplyError(f"rows: {batch.dtype} batch holds {wire.dtype} values")
                exp_all_ones = 0x7C00 if batch.dtype == "f16" else 0x7F80
                bits = np.bitwise_and(wire.view(np.uint16), 0x7FFF)
                if bits.size and int(bits.max()) >= exp_all_ones:
                    bad = int(np.count_nonzero((bits >= exp_all_ones).any(axis=1)))
                    raise ApplyError(f"rows: {bad} row(s) hold NaN or inf values; table "
                                     f"{self.name!r} refuses non-finite rows")
                if batch.dtype == "f16" and self._np_dtype == np.float16:
                    return wire  # same representation: no conversion, always in range
            else:  # i8: q is finite; scale was checked finite by decode, 127·scale may not be
                if batch.scale is None or np.shape(batch.scale) != (n,):
                    raise ApplyError("scale: an i8 batch needs one scale per row")
                if n and float(np.max(batch.scale)) * 127.0 > float(np.finfo(np.float32).max):
                    raise ApplyError("scale: dequantized values would overflow float32")
            finite = True
        try:
            vals = batch.rows_f32()
        except (TypeError, ValueError) as e:
            raise ApplyError(f"rows: cannot dequantize ({e})") from None
        vals = self._prepare_rows(vals, n, "rows", finite=finite, width=width)
        return vals if vals.dtype == self._np_dtype else vals.astype(self._np_dtype)

    def upsert(self, ids: Any, rows: Any) -> None:
        """Insert or overwrite ``ids`` (int64 ``[N]``) with ``rows`` (float ``[N, dim]``).

        A repeated id takes its last row. Raises :class:`ApplyError` on bad shapes or
        non-finite values (table untouched).
        """
        try:
            keys = _as_ids(ids)
        except (TypeError, ValueError) as e:
            raise ApplyError(str(e)) from None
        vals = self._prepare_rows(rows, keys.shape[0], "rows")
        if keys.size > 1 and not bool((keys[1:] > keys[:-1]).all()):
            # keep the last occurrence of each id
            rev_uniq, rev_idx = np.unique(keys[::-1], return_index=True)
            keep = keys.shape[0] - 1 - rev_idx
            keys, vals = rev_uniq, vals[keep]
        vals = np.ascontiguousarray(vals, dtype=self._np_dtype)
        with self._lock:
            self._reserve(keys.shape[0])
            if keys.size:
                self._upsert_locked(keys, vals)

    def delete(self, ids: Any) -> int:
        """Remove ``ids``; returns how many were present. Their slots are reused."""
        keys = _as_ids(ids)
        with self._lock:
            return self._delete_locked(keys)

    def contains(self, ids: Any) -> np.ndarray:
        """Bool ``[N]``: which ``ids`` are present."""
        keys = _as_ids(ids)
        with self._lock:
            return self._index.slots(keys) > 0

    @property
    def storage_dtype(self) -> np.dtype:
        """The numpy dtype rows are stored in (``STORAGE_DTYPES[self.dtype]``)."""
        return self._np_dtype

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids ascending int64 ``[n]``, rows ``[n, dim]`` in the storage dtype) — a
        consistent copy (what :meth:`save` and snapshots write)."""
        with self._lock:
            return self._export_locked()

    def _export_locked(self) -> tuple[np.ndarray, np.ndarray]:
        keys, slots = self._index.items()
        order = np.argsort(keys, kind="stable")
        keys, slots = keys[order], slots[order]
        rows = np.take(self._rows, slots, axis=0)
        return keys, rows

    # ------------------------------------------------------------------ change tracking

    def _note_deleted(self, keys: np.ndarray) -> None:
        """Remember deleted ``keys`` (lock held). Deduplicated when the list doubles, so
        it stays bounded by the distinct ids deleted since the last take."""
        self._deleted.append(keys.copy())
        self._deleted_n += keys.size
        if self._deleted_n > self._deleted_floor:
            uniq = np.unique(np.concatenate(self._deleted))
            self._deleted, self._deleted_n = [uniq], int(uniq.size)
            self._deleted_floor = max(_DELETED_COMPACT_MIN, 2 * int(uniq.size))

    def _reset_changes_locked(self) -> None:
        if self._dirty.shape[0] < self._rows.shape[0]:
            self._dirty = np.zeros(self._rows.shape[0], np.bool_)
        else:
            self._dirty[:] = False
        self._deleted, self._deleted_n = [], 0
        self._deleted_floor = _DELETED_COMPACT_MIN
        self._tracking = True

    def export_tracked(self) -> tuple[np.ndarray, np.ndarray]:
        """Like :meth:`export`, and (in the same critical section) start change tracking
        afresh: later changes are relative to exactly the state returned."""
        with self._lock:
            out = self._export_locked()
            self._reset_changes_locked()
        return out

    def start_tracking(self) -> None:
        """Start change tracking relative to the current contents (e.g. just loaded)."""
        with self._lock:
            self._reset_changes_locked()

    @property
    def tracking(self) -> bool:
        """True when changes are tracked for an incremental checkpoint."""
        return self._tracking

    def take_changes(self) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Changes since the last take / tracked export, and clear them, atomically.

        Returns ``(upserted ids ascending int64 [n], their rows [n, dim] in the storage
        dtype, deleted ids ascending int64 [m])`` — ids present now whose row was written,
        and ids absent now that were deleted (an id deleted then re-inserted is an
        upsert). None when the table does not track changes.
        """
        with self._lock:
            if not self._tracking:
                return None
            slots = np.flatnonzero(self._dirty[: self._hwm])
            up = self._slot_ids[slots]
            rows = np.take(self._rows, slots, axis=0)
            if self._deleted_n:
                gone = np.unique(np.concatenate(self._deleted))
                gone = gone[self._index.slots(gone) == 0]
            else:
                gone = np.zeros(0, np.int64)
            self._reset_changes_locked()
        order = np.argsort(up, kind="stable")
        return up[order], rows[order], gone

    def ids(self) -> np.ndarray:
        """Present ids, int64 ascending."""
        with self._lock:
            keys = self._index.keys()
        keys.sort()
        return keys

    def rows(self, ids: Any = None) -> np.ndarray:
        """Float32 rows: of ``ids()`` in that order (``ids=None``), else ``lookup(ids)``."""
        if ids is not None:
            return self.lookup(ids)
        _, rows = self.export()
        return rows if rows.dtype == np.float32 else rows.astype(np.float32)

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids ascending int64 ``[n]``, float32 rows ``[n, dim]``) from one consistent view."""
        keys, rows = self.export()
        return keys, (rows if rows.dtype == np.float32 else rows.astype(np.float32))

    def digest(self) -> str:
        """sha256 hex of (dim, storage dtype, ascending ids, their rows' stored bytes).

        Equal digests mean bit-identical contents (the name is not included).
        """
        keys, rows = self.export()
        h = hashlib.sha256()
        h.update(f"deltastream-table-digest-v1 dim={self.dim} dtype={self.dtype}\n".encode())
        h.update(keys.astype("<i8", copy=False).tobytes())
        h.update(np.ascontiguousarray(rows, dtype=self._np_dtype.newbyteorder("<")).data)
        return h.hexdigest()

    def stats(self) -> dict:
        """Sizes for monitoring: ids, row slots, free slots, buckets, bytes held."""
        with self._lock:
            return {"ids": self._live, "row_capacity": int(self._rows.shape[0]) - 1,
                    "free_slots": self._nfree, "buckets": self._index.buckets,
                    "bytes": int(self._rows.nbytes + self._index.nbytes + self._free.nbytes)}

    @classmethod
    def from_arrays(cls, name: str, ids: Any, rows: Any, *, dtype: str = "f32") -> ServingTable:
        """A table holding ``ids`` [N] with ``rows`` [N, dim]."""
        rows = np.asarray(rows)
        if rows.ndim != 2:
            raise ValueError(f"rows: expected shape [N, dim], got {rows.shape}")
        t = cls(name, rows.shape[1], dtype=dtype, capacity=max(1, rows.shape[0]))
        t.upsert(ids, rows)
        return t

    # ------------------------------------------------------------------ persistence

    @classmethod
    def restore(cls, name: str, ids: np.ndarray, rows: np.ndarray, *,
                dtype: str = "f32") -> ServingTable:
        """A table holding stored contents: ``ids`` strictly ascending int64 ``[n]``, ``rows``
        ``[n, dim]`` in the storage dtype of ``dtype``.

        For verified storage (sha256-checked files): unlike :meth:`from_arrays` the values
        are not checked again (finite, f16 range), and the ids are not sorted or deduplicated.
        """
        rows = np.asarray(rows)
        n = int(np.shape(ids)[0])
        if rows.ndim != 2 or rows.shape[0] != n:
            raise ValueError(f"rows: expected shape [{n}, dim], got {rows.shape}")
        table = cls(name, rows.shape[1], dtype=dtype, capacity=max(1, n))
        with table._lock:
            table._reserve(n)
            slots = table._alloc(n)
            _scatter_rows(table._rows, slots, rows)
            table._index.insert(np.asarray(ids, dtype=np.int64), slots)
            table._slot_ids[slots] = ids
            table._live = n
        return table

    def apply_changes(self, ids: np.ndarray, rows: np.ndarray, deleted: np.ndarray) -> None:
        """Delete ``deleted`` then upsert ``ids`` (unique int64 ``[n]``) with ``rows``
        (``[n, dim]``, storage dtype), atomically for readers.

        Replays stored changes (a checkpoint segment, as :meth:`take_changes` returned
        them); like :meth:`restore`, values are not checked again.
        """
        ids = np.ascontiguousarray(ids, np.int64)
        rows = np.ascontiguousarray(rows, self._np_dtype)
        if rows.shape != (ids.shape[0], self.dim):
            raise ValueError(f"rows: expected shape [{ids.shape[0]}, {self.dim}] for table "
                             f"{self.name!r}, got {rows.shape}")
        with self._lock:
            self._reserve(ids.shape[0])
            if deleted.size:
                self._delete_locked(np.ascontiguousarray(deleted, np.int64))
            if ids.size:
                self._upsert_locked(ids, rows)

    def save(self, dir: PathLike) -> None:
        """Write this table to directory ``dir`` atomically (replacing what is there)."""
        keys, rows = self.export()
        write_dir_atomic(Path(dir), lambda tmp: write_table_dir(
            tmp, TableData(self.name, self.dtype, keys, rows)))

    @classmethod
    def load(cls, dir: PathLike) -> ServingTable:
        """Read a table written by :meth:`save`. Raises :class:`SnapshotError` when ``dir``
        is missing, damaged, truncated or half-written."""
        data = read_table_dir(resolve_dir(Path(dir)))
        return cls.restore(data.name, data.ids, data.rows, dtype=data.dtype)


def _scatter_rows(dst: np.ndarray, slots: np.ndarray, rows: np.ndarray) -> None:
    """``dst[slots] = rows`` for C-contiguous ``dst`` [R, dim] and ``rows`` [n, dim] of the
    same dtype, moving each row as one opaque item (numpy's 1-D path for a void dtype is
    about twice as fast as its 2-D fancy assignment)."""
    rows = np.ascontiguousarray(rows, dtype=dst.dtype)
    item = np.dtype((np.void, dst.dtype.itemsize * dst.shape[1]))
    dst.view(item).reshape(-1)[slots] = rows.view(item).reshape(-1)
