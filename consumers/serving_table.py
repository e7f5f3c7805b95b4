"""ServingTable: the predictor's in-memory id -> embedding row table (numpy, no torch).

Layout
------
* Rows live in one numpy array ``[row_capacity, dim]`` (float32 or float16). Row slot 0 is
  reserved and always zero: a lookup maps unknown ids to slot 0, so ``lookup`` is one probe
  plus one gather with no masking. Slots of deleted ids go on a free stack and are reused.
* The id -> slot index is an open-addressing hash table with linear probing (Fibonacci
  hashing of the int64 id) held in two numpy arrays (``int64`` keys, ``int32`` slot or
  EMPTY/DELETED marker), probed vectorized: each round handles every id still unresolved
  (one bucket per round, then windows of 16 buckets for the last few ids in long runs),
  until every id hit its key or an EMPTY bucket. The load factor (live + deleted markers)
  is kept in [0.2, 0.4] by rebuilding, so ~80-90% of ids resolve in the first round.
  At 1M ids the index costs 48 MB (4M buckets × 12 bytes) next to 256 MB of dim-64 rows.

  Why a hash and not sorted keys + ``searchsorted``: a sorted index answers lookups in
  O(log n) but every batch that brings new ids must merge them in, an O(resident) copy
  (16 MB of keys and slots at 1M ids) per batch; a trainer that keeps discovering ids would
  make every apply cost milliseconds regardless of batch size. The hash costs O(batch) per
  apply and lookup, with an amortized O(resident) rebuild only when it grows (or when delete
  markers pile up).

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
directories, then swaps it in with renames (see :func:`_replace_dir`). ``load`` verifies
everything and raises :class:`SnapshotError` naming the file and the problem.
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import logging
import os
import shutil
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from consumers.errors import ApplyError, SnapshotError
from deltastream.wire import MAX_DIM, DeltaBatch

__all__ = ["ServingTable", "ApplyResult", "ApplyError", "SnapshotError", "STORAGE_DTYPES"]

log = logging.getLogger(__name__)

#: storage dtype name -> numpy dtype
STORAGE_DTYPES = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2")}
_F16_MAX = 65504.0

_EMPTY = np.int32(-1)
_DELETED = np.int32(-2)
_MULT = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: 2^64 / golden ratio, odd
_FEW = 64  # probe rounds switch from 1 bucket to a window when fewer keys remain
_WINDOW = 16
_WIN_OFFSETS = np.arange(_WINDOW, dtype=np.int64)[None, :]
_MAX_LOAD = 0.4  # rebuild when (live + deleted markers) would exceed this fraction
_REBUILD_SLACK = 3  # after a rebuild: buckets ≥ 3 × ids (power of 2: load in [0.19, 1/3])
_DELETED_COMPACT_MIN = 1 << 16  # deleted-id list entries before the first dedup

TABLE_FORMAT = "deltastream-table"
TABLE_FORMAT_VERSION = 1
MANIFEST = "manifest.json"

PathLike = Union[str, os.PathLike]


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


def _hash(keys: np.ndarray, shift: np.uint64) -> np.ndarray:
    """Bucket of each int64 key: the top bits of key × golden-ratio constant (mod 2^64)."""
    # the result is < 2^(64-shift), so viewing it as int64 is exact and free
    return ((keys.view(np.uint64) * _MULT) >> shift).view(np.int64)


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
        self._init_index(_pow2_at_least(_REBUILD_SLACK * int(capacity)))

    # ------------------------------------------------------------------ index internals

    def _init_index(self, buckets: int) -> None:
        self._hkeys = np.zeros(buckets, np.int64)
        self._hvals = np.full(buckets, _EMPTY, np.int32)
        self._mask = buckets - 1
        self._shift = np.uint64(64 - (buckets.bit_length() - 1))
        self._used = 0  # buckets not EMPTY (live + DELETED markers)

    def _probe(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(bucket holding each key or -1, its row slot or 0) for int64 contiguous ``keys``.

        Round 1 checks every key's home bucket with 1-D gathers (resolves most keys); the
        rest go on in :meth:`_probe_rest`. A key is always placed
        before the first EMPTY bucket of its probe path, so the first bucket that holds
        the key or is EMPTY decides.
        """
        n = keys.shape[0]
        if n == 0:
            return np.full(0, -1, np.int64), np.zeros(0, np.int32)
        hk, hv = self._hkeys, self._hvals
        pos = _hash(keys, self._shift)
        v = hv[pos]
        hit = (hk[pos] == keys) & (v >= 0)
        out_pos = np.where(hit, pos, -1)
        out_slot = np.where(hit, v, np.int32(0))
        rest = np.flatnonzero(~(hit | (v == _EMPTY)))
        if rest.size:
            p, s = self._probe_rest(keys[rest], (pos[rest] + 1) & self._mask)
            out_pos[rest] = p
            out_slot[rest] = s
        return out_pos, out_slot

    def _probe_rest(self, keys: np.ndarray, start: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
        """Continue probing ``keys`` from buckets ``start``.

        While many keys remain, one bucket per round (1-D gathers, cheapest per key). The
        last few keys sit in the longest runs of occupied buckets, and a round costs a
        dozen numpy calls whatever its size, so they go ``_WINDOW`` buckets per round.
        """
        hk, hv, mask = self._hkeys, self._hvals, self._mask
        out_pos = np.full(keys.shape[0], -1, np.int64)
        out_slot = np.zeros(keys.shape[0], np.int32)
        active = np.arange(keys.shape[0])
        pos, k = start, keys
        while active.size > _FEW:
            v = hv[pos]
            hit = (hk[pos] == k) & (v >= 0)
            if hit.any():
                out_pos[active[hit]] = pos[hit]
                out_slot[active[hit]] = v[hit]
            keep = ~(hit | (v == _EMPTY))
            active, pos, k = active[keep], (pos[keep] + 1) & mask, k[keep]
        while active.size:
            idx = (pos[:, None] + _WIN_OFFSETS) & mask
            v = hv[idx]
            hit = (hk[idx] == k[:, None]) & (v >= 0)
            stop = hit | (v == _EMPTY)
            first = stop.argmax(axis=1)
            rows = np.arange(active.shape[0])
            found = hit[rows, first]
            out_pos[active[found]] = idx[rows, first][found]
            out_slot[active[found]] = v[rows, first][found]
            more = ~stop[rows, first]  # nothing decisive in this window: the next one
            active, pos, k = active[more], (pos[more] + _WINDOW) & mask, k[more]
        return out_pos, out_slot

    def _insert(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Insert ``keys`` (unique, all absent) pointing at row ``slots``. Capacity reserved.

        Each round, every unplaced key claims its current bucket if free (EMPTY, or DELETED:
        safe to reuse since the keys are known absent), else moves one bucket on. Several
        keys may claim one bucket: all write their key, the one whose key reads back won
        (keys are unique, so exactly one did), and only winners write their slot — this
        never relies on the order of a fancy assignment. Losers move on.
        """
        hk, hv, mask = self._hkeys, self._hvals, self._mask
        pos = _hash(keys, self._shift)
        active = np.arange(keys.shape[0])
        while active.size:
            free = hv[pos] < 0
            fa, fp = active[free], pos[free]
            keep = ~free
            if fa.size:
                hk[fp] = keys[fa]
                won = hk[fp] == keys[fa]
                wa, wp = fa[won], fp[won]
                self._used += int(np.count_nonzero(hv[wp] == _EMPTY))
                hv[wp] = slots[wa]
                keep[np.flatnonzero(free)[~won]] = True  # losers go on probing
            active, pos = active[keep], (pos[keep] + 1) & mask

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
        if self._used + new_keys > _MAX_LOAD * (self._mask + 1):
            self._rebuild(self._live + new_keys)

    def _rebuild(self, expected: int) -> None:
        """Rehash live ids into fresh buckets sized for ``expected`` ids (drops markers)."""
        live = self._hvals >= 0
        keys, slots = self._hkeys[live], self._hvals[live]
        old = (self._hkeys, self._hvals, self._mask, self._shift, self._used)
        try:
            self._init_index(_pow2_at_least(_REBUILD_SLACK * max(expected, 1)))
            self._insert(keys, slots)
        except BaseException:
            self._hkeys, self._hvals, self._mask, self._shift, self._used = old
            raise
        log.debug("table %s: index rebuilt with %d buckets for %d ids", self.name,
                  self._mask + 1, keys.shape[0])

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
        pos, _ = self._probe(ids)
        pos = pos[pos >= 0]
        if pos.size == 0:
            return 0
        pos = np.unique(pos)  # a tombstone list may repeat an id
        slots = self._hvals[pos]
        self._hvals[pos] = _DELETED
        if self._tracking:
            self._dirty[slots] = False  # a freed slot holds no row to checkpoint
            self._note_deleted(self._hkeys[pos])
        self._free[self._nfree: self._nfree + slots.size] = slots
        self._nfree += slots.size
        self._live -= slots.size
        return int(slots.size)

    def _upsert_locked(self, ids: np.ndarray, rows: np.ndarray) -> None:
        _, slots = self._probe(ids)
        new = slots == 0
        if new.any():
            fresh = self._alloc(int(np.count_nonzero(new)))
            slots[new] = fresh
            self._insert(ids[new], fresh)
            self._slot_ids[fresh] = ids[new]
            self._live += fresh.size
        _scatter_rows(self._rows, slots, rows)
        if self._tracking:
            self._dirty[slots] = True

    def _slots(self, ids: np.ndarray) -> np.ndarray:
        """Row slot of each id, 0 (the zero row) for unknown ids. Caller holds the lock."""
        return self._probe(ids)[1]

    # ------------------------------------------------------------------ validation

    def _prepare_rows(self, rows: Any, n: int, what: str, finite: bool = False) -> np.ndarray:
        """Float rows ``[n, dim]`` checked finite (unless known ``finite``) and in range."""
        rows = np.asarray(rows)
        if rows.ndim != 2 or rows.shape != (n, self.dim):
            raise ApplyError(f"{what}: expected shape [{n}, {self.dim}] for table "
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

        Raises :class:`ApplyError` (table untouched) on a table-name or dim mismatch, an
        unknown wire dtype, bad shapes, duplicate ids, or non-finite rows.
        """
        if not isinstance(batch, DeltaBatch):
            raise ApplyError(f"batch: expected a DeltaBatch, got {type(batch).__name__}")
        if batch.table != self.name:
            raise ApplyError(f"table: batch is for table {batch.table!r}, this table is "
                             f"{self.name!r}")
        rows_raw = np.asarray(batch.rows)
        if rows_raw.ndim != 2 or rows_raw.shape[1] != self.dim:
            got = rows_raw.shape[1] if rows_raw.ndim == 2 else f"shape {rows_raw.shape}"
            raise ApplyError(f"dim: batch for table {self.name!r} has dim {got}, the table "
                             f"has dim {self.dim}")
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
        vals = self._batch_rows(batch, rows_raw, n)
        with self._lock:
            self._reserve(n)
            deleted = self._delete_locked(tomb) if tomb is not None else 0
            if n:
                self._upsert_locked(ids, vals)
        return ApplyResult(upserted=n, deleted=deleted)

    def _batch_rows(self, batch: DeltaBatch, wire: np.ndarray, n: int) -> np.ndarray:
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
        vals = self._prepare_rows(vals, n, "rows", finite=finite)
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
            return self._probe(keys)[1] > 0

    def _export(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids ascending, rows in storage dtype) — a consistent copy."""
        with self._lock:
            return self._export_locked()

    def _export_locked(self) -> tuple[np.ndarray, np.ndarray]:
        live = self._hvals >= 0
        keys, slots = self._hkeys[live], self._hvals[live]
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

    def _export_tracked(self) -> tuple[np.ndarray, np.ndarray]:
        """Like :meth:`_export`, and (in the same critical section) start change tracking
        afresh: later changes are relative to exactly the state returned."""
        with self._lock:
            out = self._export_locked()
            self._reset_changes_locked()
        return out

    def _start_tracking(self) -> None:
        """Start change tracking relative to the current contents (e.g. just loaded)."""
        with self._lock:
            self._reset_changes_locked()

    @property
    def tracking(self) -> bool:
        """True when changes are tracked for an incremental checkpoint."""
        return self._tracking

    def _take_changes(self) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
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
                gone = gone[self._probe(gone)[1] == 0]
            else:
                gone = np.zeros(0, np.int64)
            self._reset_changes_locked()
        order = np.argsort(up, kind="stable")
        return up[order], rows[order], gone

    def ids(self) -> np.ndarray:
        """Present ids, int64 ascending."""
        with self._lock:
            keys = self._hkeys[self._hvals >= 0]
        keys.sort()
        return keys

    def rows(self, ids: Any = None) -> np.ndarray:
        """Float32 rows: of ``ids()`` in that order (``ids=None``), else ``lookup(ids)``."""
        if ids is not None:
            return self.lookup(ids)
        _, rows = self._export()
        return rows if rows.dtype == np.float32 else rows.astype(np.float32)

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids ascending int64 ``[n]``, float32 rows ``[n, dim]``) from one consistent view."""
        keys, rows = self._export()
        return keys, (rows if rows.dtype == np.float32 else rows.astype(np.float32))

    def digest(self) -> str:
        """sha256 hex of (dim, storage dtype, ascending ids, their rows' stored bytes).

        Equal digests mean bit-identical contents (the name is not included).
        """
        keys, rows = self._export()
        h = hashlib.sha256()
        h.update(f"deltastream-table-digest-v1 dim={self.dim} dtype={self.dtype}\n".encode())
        h.update(keys.astype("<i8", copy=False).tobytes())
        h.update(np.ascontiguousarray(rows, dtype=self._np_dtype.newbyteorder("<")).data)
        return h.hexdigest()

    def stats(self) -> dict:
        """Sizes for monitoring: ids, row slots, free slots, buckets, bytes held."""
        with self._lock:
            return {"ids": self._live, "row_capacity": int(self._rows.shape[0]) - 1,
                    "free_slots": self._nfree, "buckets": self._mask + 1,
                    "bytes": int(self._rows.nbytes + self._hkeys.nbytes + self._hvals.nbytes
                                 + self._free.nbytes)}

    @classmethod
    def from_arrays(cls, name: str, ids: Any, rows: Any, *, dtype: str = "f32") -> ServingTable:
        """A table holding ``ids`` [N] with ``rows`` [N, dim]."""
        rows = np.asarray(rows)
        if rows.ndim != 2:
            raise ValueError(f"rows: expected shape [N, dim], got {rows.shape}")
        t = cls(name, rows.shape[1], dtype=dtype, capacity=max(1, rows.shape[0]))
        t.upsert(ids, rows)
        return t

    # ------------------------------------------------------------------ snapshots

    def save(self, dir: PathLike) -> None:
        """Write this table to directory ``dir`` atomically (replacing what is there)."""
        path = Path(dir)
        tmp = _new_tmp(path)
        try:
            _write_table_dir(tmp, self)  # fsyncs its files and the directory
        except Exception:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _replace_dir(tmp, path)

    @classmethod
    def load(cls, dir: PathLike) -> ServingTable:
        """Read a table written by :meth:`save`. Raises :class:`SnapshotError` when ``dir``
        is missing, damaged, truncated or half-written."""
        return _read_table_dir(_resolve_dir(Path(dir)))


def _scatter_rows(dst: np.ndarray, slots: np.ndarray, rows: np.ndarray) -> None:
    """``dst[slots] = rows`` for C-contiguous ``dst`` [R, dim] and ``rows`` [n, dim] of the
    same dtype, moving each row as one opaque item (numpy's 1-D path for a void dtype is
    about twice as fast as its 2-D fancy assignment)."""
    rows = np.ascontiguousarray(rows, dtype=dst.dtype)
    item = np.dtype((np.void, dst.dtype.itemsize * dst.shape[1]))
    dst.view(item).reshape(-1)[slots] = rows.view(item).reshape(-1)


def _pow2_at_least(n: int) -> int:
    return max(16, 1 << (max(1, int(n)) - 1).bit_length())


# ----------------------------------------------------------------------------- files


class _HashingWriter:
    """File wrapper that sha256-hashes and counts what is written (np.save writes chunks)."""

    def __init__(self, f: Any) -> None:
        self.f, self.h, self.n = f, hashlib.sha256(), 0

    def write(self, b: Any) -> int:
        self.h.update(b)
        self.n += len(memoryview(b).cast("B"))
        return self.f.write(b)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> dict:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def _write_npy(path: Path, arr: np.ndarray) -> dict:
    """np.save ``arr`` to ``path`` with fsync; returns {"sha256", "bytes"} of the file."""
    with open(path, "wb") as f:
        w = _HashingWriter(f)
        np.save(w, arr, allow_pickle=False)  # type: ignore[arg-type]
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": w.h.hexdigest(), "bytes": w.n}


def _seal(body: dict) -> dict:
    """``body`` plus "checksum": sha256 of its canonical JSON (catches any edited byte)."""
    canon = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return {**body, "checksum": hashlib.sha256(canon).hexdigest()}


def _unseal(raw: bytes, where: Path) -> dict:
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SnapshotError(f"{where}: manifest is not valid JSON ({e})") from None
    if not isinstance(doc, dict) or "checksum" not in doc:
        raise SnapshotError(f"{where}: manifest has no checksum (not a deltastream snapshot?)")
    body = {k: v for k, v in doc.items() if k != "checksum"}
    if _seal(body)["checksum"] != doc["checksum"]:
        raise SnapshotError(f"{where}: manifest checksum mismatch (the manifest was altered "
                            "or damaged)")
    return body


def _write_manifest(dir: Path, body: dict) -> dict:
    data = json.dumps(_seal(body), indent=1, sort_keys=True).encode()
    return _write_file(dir / MANIFEST, data)


def _write_table_dir(dir: Path, table: ServingTable,
                     arrays: Optional[tuple[np.ndarray, np.ndarray]] = None) -> dict:
    """Write ``table`` into the (new) directory ``dir``; returns the manifest file's entry.

    ``arrays``: (ids ascending, rows) already exported from ``table``; None exports now.
    """
    dir.mkdir(parents=True, exist_ok=False)
    keys, rows = table._export() if arrays is None else arrays
    files = {"ids.npy": _write_npy(dir / "ids.npy", keys.astype("<i8", copy=False)),
             "rows.npy": _write_npy(dir / "rows.npy",
                                    rows.astype(rows.dtype.newbyteorder("<"), copy=False))}
    body = {"format": TABLE_FORMAT, "version": TABLE_FORMAT_VERSION, "name": table.name,
            "dim": table.dim, "dtype": table.dtype, "n": int(keys.shape[0]), "files": files}
    entry = _write_manifest(dir, body)
    _fsync_dir(dir)
    return entry


def _read_verified(path: Path, entry: Any) -> bytearray:
    """Bytes of ``path`` after checking size and sha256 against the manifest ``entry``."""
    if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str) \
            or not isinstance(entry.get("bytes"), int):
        raise SnapshotError(f"{path}: manifest entry is malformed: {entry!r}")
    try:
        size = os.path.getsize(path)
        if size != entry["bytes"]:
            raise SnapshotError(f"{path}: {size} bytes, manifest says {entry['bytes']} "
                                "(truncated or half-written)")
        data = bytearray(size)
        with open(path, "rb") as f:
            got = f.readinto(data)
    except FileNotFoundError:
        raise SnapshotError(f"{path}: file missing") from None
    except OSError as e:
        raise SnapshotError(f"{path}: cannot read ({e})") from None
    if got != size:
        raise SnapshotError(f"{path}: short read ({got} of {size} bytes)")
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise SnapshotError(f"{path}: sha256 checksum mismatch (file damaged)")
    return data


def _parse_npy(data: bytearray, path: Path, dtype: np.dtype, shape: tuple) -> np.ndarray:
    """Array from verified .npy bytes (no copy); refuses object dtypes and wrong shapes."""
    try:
        head = io.BytesIO(bytes(data[: min(len(data), 1 << 16)]))
        version = np.lib.format.read_magic(head)
        reader = {(1, 0): np.lib.format.read_array_header_1_0,
                  (2, 0): np.lib.format.read_array_header_2_0}.get(version)
        if reader is None:
            raise ValueError(f"unsupported .npy version {version}")
        fshape, fortran, fdtype = reader(head)
    except ValueError as e:
        raise SnapshotError(f"{path}: not a valid .npy file ({e})") from None
    if fdtype != dtype or fortran or tuple(fshape) != tuple(shape):
        raise SnapshotError(f"{path}: holds {fdtype} {tuple(fshape)} (fortran={fortran}), "
                            f"expected {dtype} {tuple(shape)}")
    offset = head.tell()
    count = int(np.prod(shape, dtype=np.int64))
    if len(data) - offset != count * dtype.itemsize:
        raise SnapshotError(f"{path}: {len(data) - offset} data bytes, expected "
                            f"{count * dtype.itemsize}")
    return np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape)


def _read_manifest(dir: Path, entry: Any = None) -> dict:
    path = dir / MANIFEST
    if entry is not None:
        raw = bytes(_read_verified(path, entry))
    else:
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise SnapshotError(f"{path}: manifest missing (half-written or not a "
                                "snapshot)") from None
        except OSError as e:
            raise SnapshotError(f"{path}: cannot read ({e})") from None
    return _unseal(raw, path)


def _check_format(where: Path, body: dict, fmt: str, version: int) -> None:
    """Refuse a manifest ``body`` (read from ``where``) of another format or version."""
    if body.get("format") != fmt:
        raise SnapshotError(f"{where}: format is {body.get('format')!r}, expected {fmt!r}")
    if body.get("version") != version:
        raise SnapshotError(f"{where}: format version {body.get('version')!r} is not "
                            f"supported (this reader knows {version})")


def _read_table_dir(dir: Path, entry: Any = None, body: Optional[dict] = None) -> ServingTable:
    """Load and verify a table directory (``entry``: expected manifest size/sha256)."""
    if body is None:
        body = _read_manifest(dir, entry)
    where = dir / MANIFEST
    _check_format(where, body, TABLE_FORMAT, TABLE_FORMAT_VERSION)
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
    ids = _parse_npy(_read_verified(dir / "ids.npy", files["ids.npy"]), dir / "ids.npy",
                     np.dtype("<i8"), (n,))
    rows = _parse_npy(_read_verified(dir / "rows.npy", files["rows.npy"]), dir / "rows.npy",
                      STORAGE_DTYPES[dtype], (n, dim))
    if n > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise SnapshotError(f"{dir / 'ids.npy'}: ids are not strictly ascending")
    table = ServingTable(name, dim, dtype=dtype, capacity=max(1, n))
    with table._lock:
        table._reserve(n)
        slots = table._alloc(n)
        _scatter_rows(table._rows, slots, rows)
        table._insert(ids.astype(np.int64), slots)
        table._slot_ids[slots] = ids
        table._live = n
    return table


# ----------------------------------------------------------------------------- atomic dirs


def _old_path(path: Path) -> Path:
    return path.with_name(path.name + ".old")


def _new_tmp(path: Path) -> Path:
    """A fresh temp dir name next to ``path`` (same filesystem, so renames are atomic)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(glob.escape(path.name) + ".tmp-*"):
        # left by a writer that crashed; single writer per path is a documented rule
        shutil.rmtree(stale, ignore_errors=True)
    return path.with_name(f"{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _replace_dir(tmp: Path, path: Path) -> None:
    """Make the complete, fsynced directory ``tmp`` become ``path``.

    Steps (each a rename or removal; the parent is fsynced after each rename):
      1. ``path`` and ``path.old`` both exist (an earlier crash after step 3): ``path`` is
         the newer complete one, remove ``path.old``.
      2. rename ``path`` -> ``path.old`` (skipped when there is no ``path``).
      3. rename ``tmp`` -> ``path``.
      4. remove ``path.old``.
    At every instant either ``path`` is complete, or it is absent and ``path.old`` is the
    previous complete one; :func:`_resolve_dir` reads whichever applies.
    """
    parent = path.parent
    old = _old_path(path)
    if path.exists() and old.exists():
        shutil.rmtree(old)
    if path.exists():
        os.rename(path, old)
        _fsync_dir(parent)
    os.rename(tmp, path)
    _fsync_dir(parent)
    if old.exists():
        shutil.rmtree(old)


def _resolve_dir(path: Path) -> Path:
    """The directory holding the latest complete snapshot written at ``path``."""
    if path.exists():
        return path
    old = _old_path(path)
    if old.exists():
        log.warning("snapshot %s missing but %s exists (a write was interrupted); "
                    "reading the previous snapshot", path, old)
        return old
    raise SnapshotError(f"{path}: no snapshot there")
