"""ServingTable: the predictor's in-memory id -> embedding row table (numpy, no torch).

Layout and concurrency (see :mod:`consumers.serving.core`)
---------------------------------------------------------
* Rows live in one region reserved up front (virtual address space; pages are committed as
  rows are written), so growth never copies rows. Row slot 0 is the shared zero row: an
  unknown id maps to it, so ``lookup`` is one probe plus one gather with no masking.
* Rows are copy-on-write: an apply writes new rows into fresh slots and publishes them in
  one store; replaced slots are reused only once no reader can still read them.
* The id -> slot index (:class:`~consumers.serving.id_index.IdIndex`) holds two value copies per
  bucket: readers read the published one while the writer builds the next. When it fills
  up it migrates to a bigger index a slice per apply.

Readers (:meth:`ServingTable.lookup`, :meth:`~ServingTable.contains`) take no lock: they
read one published state and retry in the rare case the writer overtook them. A reader
never sees a torn row or half a batch, and never waits for an apply, a checkpoint (which
reads frozen views off any lock, :meth:`~ServingTable.frozen`) or growth. Writers
(``apply``, ``upsert``, ``delete``, ...) serialize on a lock. A batch that fails leaves the
table as it was.

Sharing: :meth:`ServingTable.share` moves the table into shared memory (``/dev/shm``) where
model-server processes read it without a copy
(:class:`~consumers.serving.reader.TableReader`).

Snapshots
---------
``save(dir)`` writes ``ids.npy`` and ``rows.npy`` (``allow_pickle=False``) and a
``manifest.json`` with the format version, shapes and CRC-32C of each file (and a sha256
of the manifest itself) into a temporary directory next to ``dir``, fsyncs files and
directories, then swaps it in with renames (see :mod:`consumers.files`). ``load``
verifies everything and raises :class:`SnapshotError` naming the file and the problem.
Snapshots and checkpoints (:mod:`consumers.storage`) use the public persistence surface:
frozen views (:meth:`ServingTable.frozen`, :meth:`ServingTable.frozen_changes`),
:meth:`ServingTable.export`, :meth:`ServingTable.restore`, the change tracking methods
(:meth:`~ServingTable.start_tracking`, :meth:`~ServingTable.export_tracked`,
:meth:`~ServingTable.take_changes`) and :meth:`ServingTable.apply_changes`.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from consumers.errors import ApplyError, SnapshotError
from consumers.files import PathLike, resolve_dir, write_dir_atomic
from consumers.serving.columns import Columns, batch_columns
from consumers.serving.core import TableCore
from consumers.serving.dtypes import F16_MAX, STORAGE_DTYPES
from consumers.serving.id_index import as_ids
from consumers.serving.shm import SharedStorage
from consumers.serving.table_files import read_table_dir, write_table_stream
from consumers.serving.views import FrozenChanges, FrozenTable
from deltastream.wire import MAX_DIM, DecodedBatch, DeltaBatch

__all__ = ["ServingTable", "ApplyResult", "ApplyError", "SnapshotError", "STORAGE_DTYPES"]

log = logging.getLogger(__name__)

@dataclass
class ApplyResult:
    """What one :meth:`ServingTable.apply` changed: rows upserted, ids deleted (present ones)."""

    upserted: int
    deleted: int


# ----------------------------------------------------------------------------- helpers


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
    """An id -> row table for serving: lock-free vectorized lookups, atomic batch applies.

    Args:
        name: table name (matches ``DeltaBatch.table``).
        dim: row width, 1 ≤ dim ≤ 65536.
        dtype: storage dtype, ``"f32"`` (exact) or ``"f16"`` (half the memory; values are
            rounded to nearest and rows with |x| > 65504 are refused).
        capacity: ids to size the first index for (it grows incrementally; the rows
            region is reserved for far more and grows without copying).
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
        self._capacity = int(capacity)  # notional: doubles as rows are added (stats)
        self._warned_f16_sums = False
        self._core = TableCore(name, self.dim, self._np_dtype, int(capacity))

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
            if rows.size and float(np.abs(rows).max()) > F16_MAX:
                raise ApplyError(f"{what}: a value exceeds the f16 storage range "
                                 f"(±{F16_MAX:g}) of table {self.name!r}")
        return rows

    # ------------------------------------------------------------------ public API

    def __len__(self) -> int:
        return self._core.live

    def __repr__(self) -> str:
        return f"ServingTable(name={self.name!r}, dim={self.dim}, dtype={self.dtype!r}, " \
               f"len={self._core.live})"

    def lookup(self, ids: Any, out: Optional[np.ndarray] = None) -> np.ndarray:
        """Rows of ``ids`` (int64 ``[N]``) as float32 ``[N, dim]``; zeros for unknown ids.

        ``out``: a C-contiguous float32 ``[N, dim]`` array to fill (saves allocating and
        page-faulting a fresh one for bulk lookups). Lock-free: never waits for an apply, a
        checkpoint or growth; every row comes from one published state.
        """
        keys = as_ids(ids)
        out = _out_array(out, keys.shape[0], self.dim)
        self._core.read(keys, out)
        return out

    @property
    def version(self) -> int:
        """Version of the published state: grows by one per apply and never goes back,
        also across daemon runs of a shared table (see :class:`~consumers.serving.ReadInfo`)."""
        return self._core.version

    def apply(self, batch: DeltaBatch) -> ApplyResult:
        """Apply one wire batch: delete ``batch.tombstones``, then upsert ``ids`` with
        ``batch.rows_f32()`` — or, for a residual batch (``batch.additive``, wire dtype
        ``r1`` or ``r1e``), add them to the rows held (zeros for ids not held, tombstoned
        or flagged ``batch.fresh``) in float32 — atomically for readers.

        A :class:`~deltastream.wire.DecodedBatch` (what :func:`~deltastream.wire.decode`
        returns) is trusted as validated: only what the table adds is checked here (its
        name, its dim, finite values in its storage range). A batch built by hand is
        checked in full first (columns, dtype, ids).

        A column slice (wire v2 ``col``/``width``, from a column-wise trainer shard) writes
        only columns ``[col, col + batch.dim)`` of each row; its ``width`` must be this
        table's ``dim`` (:mod:`consumers.serving.columns`).

        Raises :class:`ApplyError` (table untouched) on a table-name or dim mismatch, an
        unknown wire dtype, bad shapes, duplicate ids, or non-finite rows.
        """
        if not isinstance(batch, DeltaBatch):
            raise ApplyError(f"batch: expected a DeltaBatch, got {type(batch).__name__}")
        if batch.table != self.name:
            raise ApplyError(f"table: batch is for table {batch.table!r}, this table is "
                             f"{self.name!r}")
        decoded = isinstance(batch, DecodedBatch)
        cols = Columns(batch.col, batch.dim, batch.width) if decoded else batch_columns(batch)
        if cols.width != self.dim:
            what = "dim" if cols.whole else f"width (columns [{cols.col}, {cols.col + cols.n}))"
            raise ApplyError(f"dim: batch for table {self.name!r} has {what} {cols.width}, "
                             f"the table has dim {self.dim}")
        if decoded:
            ids, tomb = batch.ids, batch.tombstones
            # residuals stay float32 deltas: the core adds them to the rows held in float32
            vals = _residual_rows(batch) if batch.additive else self._decoded_rows(batch)
            if batch.additive and self._np_dtype == np.float16 and not self._warned_f16_sums:
                self._warned_f16_sums = True
                log.warning("table %r stores f16: each residual's sum is rounded to f16, "
                            "which the trainer's mirror does not see (its whole rows bound "
                            "the drift); use f32 tables with residual publishers", self.name)
        else:
            ids, tomb = _built_ids(batch)
            vals = self._float_rows(batch.rows_f32, ids.shape[0], cols.n)
        vals = np.ascontiguousarray(vals, np.float32 if batch.additive else self._np_dtype)
        try:
            ts = max(0, int(batch.ts))
        except (TypeError, ValueError):
            ts = 0
        with self._core.lock:
            deleted = self._core.apply(ids, vals, tomb, ts, None if cols.whole else cols,
                                       add=batch.additive, fresh=batch.fresh)
        return ApplyResult(upserted=ids.shape[0], deleted=deleted)

    def _decoded_rows(self, batch: DecodedBatch) -> np.ndarray:
        """Rows of a decoded batch in the storage dtype, checked finite and in range.

        f16/bf16 rows are checked finite on the wire representation
        (:meth:`~deltastream.wire.DecodedBatch.nonfinite_rows`), cheaper than on float32.
        """
        n = batch.n
        if batch.dtype in ("f16", "bf16"):
            bad = batch.nonfinite_rows()
            if bad:
                raise ApplyError(f"rows: {bad} row(s) hold NaN or inf values; table "
                                 f"{self.name!r} refuses non-finite rows")
            if batch.dtype == "f16" and self._np_dtype == np.float16:
                return batch.rows  # same representation: no conversion, always in range
        elif batch.dtype == "i8":  # q is finite and so is scale (decode); 127·scale may not be
            _check_scale(batch)
            if n and float(np.max(batch.scale)) * 127.0 > float(np.finfo(np.float32).max):
                raise ApplyError("scale: dequantized values would overflow float32")
        return self._float_rows(batch.rows_f32, n, batch.dim, finite=batch.dtype != "f32")

    def _float_rows(self, rows_f32: Any, n: int, width: int, finite: bool = False) -> np.ndarray:
        """``rows_f32()`` dequantized and validated (shape, finite unless known ``finite``,
        storage range), in the storage dtype."""
        try:
            vals = rows_f32()
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
            keys = as_ids(ids)
        except (TypeError, ValueError) as e:
            raise ApplyError(str(e)) from None
        vals = self._prepare_rows(rows, keys.shape[0], "rows")
        if keys.size > 1 and not bool((keys[1:] > keys[:-1]).all()):
            # keep the last occurrence of each id
            rev_uniq, rev_idx = np.unique(keys[::-1], return_index=True)
            keep = keys.shape[0] - 1 - rev_idx
            keys, vals = rev_uniq, vals[keep]
        vals = np.ascontiguousarray(vals, dtype=self._np_dtype)
        with self._core.lock:
            self._core.apply(keys, vals, None)

    def delete(self, ids: Any) -> int:
        """Remove ``ids``; returns how many were present. Their slots are reused."""
        keys = as_ids(ids)
        with self._core.lock:
            return self._core.apply(np.zeros(0, np.int64),
                                    np.zeros((0, self.dim), self._np_dtype), keys)

    def contains(self, ids: Any) -> np.ndarray:
        """Bool ``[N]``: which ``ids`` are present (lock-free, one published state)."""
        return self._core.contains(as_ids(ids))

    @property
    def storage_dtype(self) -> np.dtype:
        """The numpy dtype rows are stored in (``STORAGE_DTYPES[self.dtype]``)."""
        return self._np_dtype

    # ------------------------------------------------------------------ frozen views

    def frozen(self, *, track: bool = False) -> FrozenTable:
        """A consistent view of every row now, read without blocking anyone: its ids
        (ascending) and rows in id order (``row_chunks()`` or ``rows()``). Rows it needs
        are kept until :meth:`~consumers.serving.views.FrozenTable.release` (use ``with``).
        ``track``: also restart change tracking at exactly this state (a checkpoint base).
        """
        with self._core.lock:
            return self._core.freeze(track=track)

    def frozen_changes(self) -> Optional[FrozenChanges]:
        """A view of the rows written and ids deleted since the last take or tracked view,
        and start afresh (a checkpoint segment); None when changes are not tracked."""
        with self._core.lock:
            return self._core.freeze_changes()

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids ascending int64 ``[n]``, rows ``[n, dim]`` in the storage dtype) — a
        consistent copy (what :meth:`save` and snapshots write)."""
        with self.frozen() as v:
            return v.ids, v.rows()

    # ------------------------------------------------------------------ change tracking

    def export_tracked(self) -> tuple[np.ndarray, np.ndarray]:
        """Like :meth:`export`, and (at the same state) start change tracking afresh:
        later changes are relative to exactly the state returned."""
        with self.frozen(track=True) as v:
            return v.ids, v.rows()

    def start_tracking(self) -> None:
        """Start change tracking relative to the current contents (e.g. just loaded)."""
        with self._core.lock:
            self._core.slots.reset_changes()

    @property
    def tracking(self) -> bool:
        """True when changes are tracked for an incremental checkpoint."""
        return self._core.slots.tracking

    def take_changes(self) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Changes since the last take / tracked export, and clear them, atomically.

        Returns ``(upserted ids ascending int64 [n], their rows [n, dim] in the storage
        dtype, deleted ids ascending int64 [m])`` — ids present now whose row was written,
        and ids absent now that were deleted (an id deleted then re-inserted is an
        upsert). None when the table does not track changes.
        """
        v = self.frozen_changes()
        if v is None:
            return None
        with v:
            return v.ids, v.rows(), v.deleted

    def ids(self) -> np.ndarray:
        """Present ids, int64 ascending."""
        with self.frozen() as v:
            return v.ids

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
        h = hashlib.sha256()
        h.update(f"deltastream-table-digest-v1 dim={self.dim} dtype={self.dtype}\n".encode())
        with self.frozen() as v:
            h.update(v.ids.astype("<i8", copy=False).tobytes())
            for chunk in v.row_chunks():
                h.update(np.ascontiguousarray(chunk,
                                              dtype=self._np_dtype.newbyteorder("<")).data)
        return h.hexdigest()

    def stats(self) -> dict:
        """Sizes for monitoring: ids, row capacity, row slots used so far and free ones,
        index buckets, bytes held, version (states published), index generation, whether
        an index migration runs and how many an apply had to finish at once, where the
        table is shared (None when private) and whether there in huge pages (None when
        private or unknown; see :mod:`consumers.serving.hugemap`)."""
        c = self._core.stats()
        while c["hwm"] - 1 > self._capacity:
            self._capacity *= 2
        return {"ids": self._core.live, "row_capacity": self._capacity,
                "slots_used": c["hwm"] - 1, "free_slots": c["free_slots"],
                "buckets": c["buckets"], "bytes": c["bytes"], "version": c["version"],
                "index_gen": c["index_gen"], "index_migrating": c["migrating"],
                "index_forced": c["forced"],
                "shared": None if self.shared is None else str(self.shared),
                "shared_huge_pages": None if self.shared is None else
                self._core.storage.huge_pages()}

    @classmethod
    def from_arrays(cls, name: str, ids: Any, rows: Any, *, dtype: str = "f32") -> ServingTable:
        """A table holding ``ids`` [N] with ``rows`` [N, dim]."""
        rows = np.asarray(rows)
        if rows.ndim != 2:
            raise ValueError(f"rows: expected shape [N, dim], got {rows.shape}")
        t = cls(name, rows.shape[1], dtype=dtype, capacity=max(1, rows.shape[0]))
        t.upsert(ids, rows)
        return t

    # ------------------------------------------------------------------ sharing

    def share(self, state_dir: PathLike, *, shm_dir: Optional[PathLike] = None) -> Path:
        """Make this table readable by other processes of this host: move it into shared
        memory (``shm_dir``, else ``$DELTASTREAM_SHM_DIR``, else ``/dev/shm``, else
        ``<state_dir>/shm``; see :mod:`consumers.serving.shm`) where
        :class:`~consumers.serving.reader.TableReader` ``.open(state_dir, name)`` (given the
        same ``shm_dir``) maps it without copying. This process stays its one writer.
        Returns the directory of its files. O(table) once; lookups go on meanwhile.
        Idempotent for one ``state_dir`` and ``shm_dir``.

        Raises :class:`~consumers.errors.ConsumerError` when another live process shares a
        table of this name for ``state_dir``.
        """
        with self._core.lock:
            cur = self._core.storage
            if cur.shared:
                if cur.matches(state_dir, shm_dir):
                    return cur.location
                raise ValueError(f"share: table {self.name!r} is shared at {cur.location} "
                                 f"(state dir {cur.state_dir}), not for state dir "
                                 f"{state_dir} and shm dir {shm_dir or 'default'}")
            storage = SharedStorage.create(state_dir, self.name, self.dim, self.dtype,
                                           cur.cap, self._core.slots.hwm, shm_dir=shm_dir)
            try:
                self._core.restorage(storage)
            except BaseException:
                storage.close()
                raise
            storage.publish()
            log.info("table %s shared at %s (%d rows, %s pages)", self.name,
                     storage.location, self._core.live,
                     {True: "huge", False: "4 KiB", None: "unknown"}[storage.huge_pages()])
            return storage.location

    def unshare(self) -> None:
        """Stop sharing: mark the shared table closed for its readers (they keep what they
        mapped) and remove its files. This process keeps using the memory. Idempotent."""
        with self._core.lock:
            if self._core.storage.shared:
                self._core.storage.close()

    @property
    def shared(self) -> Optional[Path]:
        """Directory of the shared table's files, or None when the table is private."""
        st = self._core.storage
        return st.location if st.shared and not st.closed else None

    # ------------------------------------------------------------------ persistence

    @classmethod
    def restore(cls, name: str, ids: np.ndarray, rows: np.ndarray, *,
                dtype: str = "f32") -> ServingTable:
        """A table holding stored contents: ``ids`` strictly ascending int64 ``[n]``, ``rows``
        ``[n, dim]`` in the storage dtype of ``dtype``.

        For verified storage (checksummed files): unlike :meth:`from_arrays` the values
        are not checked again (finite, f16 range), and the ids are not sorted or deduplicated.
        """
        rows = np.asarray(rows)
        n = int(np.shape(ids)[0])
        if rows.ndim != 2 or rows.shape[0] != n:
            raise ValueError(f"rows: expected shape [{n}, dim], got {rows.shape}")
        table = cls(name, rows.shape[1], dtype=dtype, capacity=max(1, n))
        with table._core.lock:
            table._core.load(np.ascontiguousarray(ids, np.int64),
                             np.ascontiguousarray(rows, table._np_dtype))
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
        with self._core.lock:
            self._core.apply(ids, rows, np.ascontiguousarray(deleted, np.int64))

    def save(self, dir: PathLike) -> None:
        """Write this table to directory ``dir`` atomically (replacing what is there)."""
        with self.frozen() as v:
            write_dir_atomic(Path(dir), lambda tmp: write_table_stream(tmp, v))

    @classmethod
    def load(cls, dir: PathLike) -> ServingTable:
        """Read a table written by :meth:`save`. Raises :class:`SnapshotError` when ``dir``
        is missing, damaged, truncated or half-written."""
        data = read_table_dir(resolve_dir(Path(dir)))
        return cls.restore(data.name, data.ids, data.rows, dtype=data.dtype)


def _check_scale(batch: DecodedBatch) -> None:
    """An i8, r1 or r1e batch's scale is one float per row (a DecodedBatch built by hand
    may lack it); :class:`ApplyError` naming ``scale`` if not."""
    if batch.scale is None or np.shape(batch.scale) != (batch.n,):
        raise ApplyError(f"scale: an {batch.dtype} batch needs one scale per row")


def _residual_rows(batch: DecodedBatch) -> np.ndarray:
    """The float32 values a decoded residual batch adds. Like an i8 batch's, its scale (and
    its ``fresh`` flags) are checked for shape: a DecodedBatch built by hand may lack them."""
    n = batch.n
    _check_scale(batch)
    fresh = batch.fresh
    if fresh is not None and (np.shape(fresh) != (n,) or np.asarray(fresh).dtype != np.bool_):
        raise ApplyError(f"fresh: an {batch.dtype} batch's fresh flags are bool [{n}]")
    return batch.rows_f32()


def _built_ids(batch: DeltaBatch) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """(ids, tombstones) of a batch built by hand, checked: a known wire dtype, int64 ids
    without duplicates (a built batch may be unsorted)."""
    if batch.additive:
        raise ApplyError(f"dtype: a residual batch ({batch.dtype}) is applied as decoded "
                         "from the wire (its float residuals are not what predictors add); "
                         "encode and decode it first")
    if batch.dtype not in ("f32", "f16", "bf16", "i8"):
        raise ApplyError(f"dtype: unknown wire dtype {batch.dtype!r}")
    try:
        ids = as_ids(batch.ids)
        tomb = None if batch.tombstones is None else as_ids(batch.tombstones, "tombstones")
    except (TypeError, ValueError) as e:
        raise ApplyError(str(e)) from None
    if ids.shape[0] > 1 and not bool((ids[1:] > ids[:-1]).all()):
        order = np.argsort(ids, kind="stable")
        if bool((ids[order][1:] == ids[order][:-1]).any()):
            raise ApplyError("ids: duplicate ids in one batch")
    return ids, tomb


def _out_array(out: Optional[np.ndarray], n: int, dim: int) -> np.ndarray:
    """``out`` checked as a writable C-contiguous float32 ``[n, dim]`` array, or a new one."""
    if out is None:
        return np.empty((n, dim), np.float32)
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != (n, dim) \
            or not out.flags.c_contiguous or not out.flags.writeable:
        got = f"{out.dtype} {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__
        raise ValueError(f"out: expected a writable C-contiguous float32 array of shape "
                         f"[{n}, {dim}], got {got}")
    return out
