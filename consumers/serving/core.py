"""TableCore: a single-writer table whose readers never lock, wait on I/O or on growth.

State and publishing
--------------------
Each apply publishes a new state ``S`` (a counter in the header, ``H_SEQ``). The id index
(:class:`~consumers.serving.id_index.IdIndex`) keeps two value copies per bucket: state ``S`` is
in copy ``S & 1``. Rows are copy-on-write: an apply writes every upserted row into a fresh
slot, so a slot a published state references never changes while that state can be read.
An apply that will publish ``S + 1``:

1. validates and probes (reads only), then announces itself: ``H_PREP = S + 1``;
2. reclaims retired slots nobody can read any more, writes the new rows into fresh slots;
3. brings copy ``(S + 1) & 1`` (still holding ``S - 1``) up to ``S`` by replaying the
   buckets the previous apply changed, then applies its own changes there (updates point at
   the new slots, deletes become DELETED_SLOT, new keys take free buckets);
4. publishes: ``H_SEQ = S + 1`` — one aligned 8-byte store; then retires the slots it
   replaced (reusable from the next apply on, see :mod:`consumers.serving.slots`).

A reader takes ``s = H_SEQ``, probes copy ``s & 1``, gathers the rows
(:func:`consumers.serving.lookup.read_rows`: C with prefetching, or numpy), and accepts the
result iff ``H_PREP <= s + 1`` afterwards: the writer has not started to rebuild copy
``s & 1`` or reuse a slot state ``s`` referenced. Otherwise it retries (rare: only a read
that spans a whole apply). A reader therefore never sees a torn row or half a batch, and
never waits: no lock, no I/O, no growth on its path. A writer killed at any instant (even
by SIGKILL) leaves ``H_SEQ`` naming a complete copy. Loads and stores happen in program
order in separate numpy calls; x86-64 keeps stores ordered and loads ordered (TSO), which
this scheme relies on.

Growth: rows live in memory reserved up front (:mod:`consumers.serving.memory`) and never
move; the index migrates a slice per apply (:mod:`consumers.serving.growth`) and is swapped
in one publish.

Writers serialize on :attr:`TableCore.lock` (held by the caller of every write method);
readers never take it.
"""

from __future__ import annotations

import logging
import threading
import time
from functools import partial
from typing import Any, NamedTuple, Optional

import numpy as np

from consumers.errors import ApplyError
from consumers.serving.columns import Columns, scatter_columns
from consumers.serving.growth import HARD_LOAD, START_LOAD, Growth
from consumers.serving.id_index import DELETED_SLOT, IdIndex, buckets_for
from consumers.serving.lookup import lookup_slots, read_rows
from consumers.serving.memory import (
    DTYPE_CODES,
    H_DIM,
    H_DTYPE,
    H_IDX_GEN,
    H_PREP,
    H_ROWCAP,
    H_SEQ,
    H_VERSION_BASE,
    M_APPLIED_NS,
    M_BATCHES,
    M_HWM,
    M_LIVE,
    M_SOURCE_NS,
    PrivateStorage,
    meta_word,
    reservation_slots,
)
from consumers.serving.slots import SlotPool
from consumers.serving.views import FrozenChanges, FrozenTable

__all__ = ["TableCore"]

log = logging.getLogger(__name__)

_TRIES = 64  # optimistic reads before a reader in the writer's process takes the lock
_EMPTY_POS = np.zeros(0, np.int64)


class View(NamedTuple):
    """What a reader needs: the header words, the current index buckets, the rows."""

    hdr: np.ndarray
    tab: np.ndarray
    rows: np.ndarray


def _scatter_rows(dst: np.ndarray, slots: np.ndarray, rows: np.ndarray) -> None:
    """``dst[slots] = rows`` for C-contiguous ``dst`` [R, dim] and ``rows`` [n, dim] of the
    same dtype, moving each row as one opaque item (numpy's 1-D path for a void dtype is
    about twice as fast as its 2-D fancy assignment)."""
    rows = np.ascontiguousarray(rows, dtype=dst.dtype)
    item = np.dtype((np.void, dst.dtype.itemsize * dst.shape[1]))
    dst.view(item).reshape(-1)[slots] = rows.view(item).reshape(-1)


class TableCore:
    """Rows + id index + slots of one table, published for lock-free readers.

    Args:
        name: table name (log lines). dim: row width. dtype: storage numpy dtype.
        capacity: rows to size the first index for (the rows region is reserved large).
    """

    def __init__(self, name: str, dim: int, dtype: np.dtype, capacity: int) -> None:
        self.name, self.dim, self.dtype = name, dim, np.dtype(dtype)
        self.lock = threading.Lock()
        row_bytes = dim * self.dtype.itemsize
        self.storage: Any = PrivateStorage(dim, self.dtype,
                                           reservation_slots(row_bytes, capacity), capacity + 1)
        self.slots = SlotPool(self.storage.cap)
        self.index = IdIndex(self.storage.new_index(0, buckets_for(capacity)), name)
        self.idx_gen = 0
        # never reused, not even after an abandoned migration: a reader may have mapped
        # that generation's file, and must never find another file under its name
        self._next_gen = 1
        self._grow_error = False  # a migration could not get memory (logged once)
        self.growth: Optional[Growth] = None
        self.forced = 0  # migrations an apply had to finish at once (batch too big)
        self.seq = 0
        self.live = 0
        self._batches = 0
        self._source_ns = 0
        self._last_pos = _EMPTY_POS  # buckets the last publish changed (replayed next)
        hdr = self.storage.hdr
        hdr[H_DIM], hdr[H_DTYPE], hdr[H_ROWCAP] = dim, DTYPE_CODES[_dtype_name(self.dtype)], \
            self.storage.cap
        self.view = View(hdr, self.index.tab, self.storage.rows)

    # ------------------------------------------------------------------ reading (no lock)

    def read(self, keys: np.ndarray, out: np.ndarray) -> int:
        """Rows of ``keys`` into float32 ``out`` [n, dim] (zeros for unknown ids), all from
        one published state; returns that state's number."""
        for _ in range(_TRIES):
            hdr = self.view.hdr
            s = int(hdr[H_SEQ])
            v = self.view  # set before H_SEQ is stored: at least as new as s
            if v.hdr is hdr and read_rows(hdr, v.tab, v.rows, s, keys, out):
                return s
        with self.lock:  # overtaken again and again: hold the writer off for one read
            v = self.view
            read_rows(v.hdr, v.tab, v.rows, self.seq, keys, out)
            return self.seq

    def contains(self, keys: np.ndarray) -> np.ndarray:
        """Bool [n]: which ``keys`` are present, from one published state."""
        for _ in range(_TRIES):
            hdr = self.view.hdr
            s = int(hdr[H_SEQ])
            v = self.view
            found = lookup_slots(v.tab, keys, s & 1) > 0
            if v.hdr is hdr and int(hdr[H_PREP]) <= s + 1:
                return found
        with self.lock:
            return lookup_slots(self.view.tab, keys, self.seq & 1) > 0

    # ------------------------------------------------------------------ writing (lock held)

    def apply(self, ids: np.ndarray, rows: np.ndarray, tomb: Optional[np.ndarray],
              source_ns: int = 0, cols: Optional[Columns] = None, add: bool = False,
              fresh: Optional[np.ndarray] = None) -> int:
        """Delete ``tomb`` then upsert ``ids`` (unique int64) with ``rows`` (storage dtype
        ``[n, dim]``) as one published state; returns how many ``tomb`` ids were present.
        ``cols``: ``rows`` are ``[n, cols.n]``, columns ``[cols.col, cols.col + cols.n)`` of
        each row (a column slice, :mod:`consumers.serving.columns`); the other columns keep their
        values (zeros for ids new here or deleted first).
        ``add``: ``rows`` are float32 residuals added to the rows held (zeros for ids not
        held, in ``tomb`` or ``fresh`` (bool ``[n]``)), in float32, then stored in the
        storage dtype.
        On an exception nothing was published and the table is as before."""
        n = ids.shape[0]
        while True:  # probe; once more if making room swapped the index or the storage
            s0 = self.seq
            cur, bld = s0 & 1, (s0 + 1) & 1
            index = self.index
            pos_u, old_u = index.find(ids, cur)
            upd = old_u > 0
            n_new = n - int(np.count_nonzero(upd))
            deleted = 0
            keys_d, pos_d, slot_d = _EMPTY_POS, _EMPTY_POS, np.zeros(0, np.int32)
            if tomb is not None and tomb.size:
                tomb = np.unique(tomb)
                pos_t, old_t = index.find(tomb, cur)
                present = old_t > 0
                deleted = int(np.count_nonzero(present))
                if deleted and n:
                    present &= ~np.isin(tomb, ids, assume_unique=True)  # re-upserted: updates
                keys_d, pos_d, slot_d = tomb[present], pos_t[present], old_t[present]
            if n == 0 and keys_d.size == 0:
                return deleted
            if not self._make_room(n, n_new):
                break
        slice_ = cols is not None and not cols.whole
        if n and (add or slice_):
            # the ids whose published row the new one builds on: held and not deleted first
            # (by the tombstones or, for residuals, ``fresh``); the others start from zeros
            held = upd if tomb is None or not tomb.size else upd & ~np.isin(ids, tomb)
            if add:
                held = held if fresh is None else held & ~fresh
                rows = self._added(rows, old_u, held, cols)
            if slice_:
                rows = self._widen(rows, old_u, held, cols)
        self.view.hdr[H_PREP] = s0 + 1  # readers of state s0 - 1 now retry
        self.slots.reclaim()
        new_slots = self.slots.alloc(n)
        try:
            self.storage.ensure_rows(self.slots.hwm)
            if n:
                _scatter_rows(self.storage.rows, new_slots, rows)
                self.slots.slot_ids[new_slots] = ids
            index.copy_values(self._last_pos, cur, bld)  # copy bld: state s0 - 1 -> s0
            pos_upd = pos_u[upd]
            index.set(pos_upd, new_slots[upd], bld)
            if pos_d.size:
                index.set(pos_d, DELETED_SLOT, bld)
            ins = ~upd
            keys_n, slots_n = ids[ins], new_slots[ins]
            pos_n = index.insert(keys_n, slots_n, bld, other=cur) if n_new else _EMPTY_POS
            if self.growth is not None:
                self.growth.mirror((ids[upd], pos_upd, new_slots[upd]), (keys_d, pos_d),
                                   (keys_n, pos_n, slots_n))
        except BaseException:
            index.sync_copies(cur)  # undo whatever reached copy bld; nothing was published
            self.slots.unalloc(new_slots)
            if self.growth is not None:  # it may hold part of this batch: start it over
                self.storage.drop_index(self.growth.gen)
                self.growth = None
            raise
        self.live += n_new - keys_d.size
        self._publish(s0 + 1, source_ns)
        self._last_pos = np.concatenate([pos_upd, pos_d, pos_n])
        self.slots.retire(np.concatenate([old_u[upd], slot_d]), s0 + 1)
        self.slots.written(new_slots)
        self.slots.deleted(keys_d)
        self._grow_step(n)
        return deleted

    def _added(self, deltas: np.ndarray, old: np.ndarray, held: np.ndarray,
               cols: Optional[Columns]) -> np.ndarray:
        """``deltas`` (float32 ``[n, k]``, whole rows or the columns ``cols``) plus the
        published rows of slots ``old`` where ``held`` (zeros elsewhere), in the storage
        dtype. Raises :class:`ApplyError` when a sum is not finite in it."""
        base = np.zeros(deltas.shape, np.float32)
        part = self.storage.rows[old[held]]
        if cols is not None and not cols.whole:
            part = part[:, cols.col:cols.col + cols.n]
        base[held] = part
        with np.errstate(over="ignore"):  # a sum past the storage range is inf: refused below
            out = (base + deltas).astype(self.dtype)
        bad = ~np.isfinite(out).all(axis=1) if out.size else np.zeros(0, bool)
        if bad.any():
            raise ApplyError(f"rows: adding the residuals leaves {int(bad.sum())} row(s) "
                             f"beyond the {np.dtype(self.dtype).name} storage range")
        return out

    def _widen(self, rows: np.ndarray, old: np.ndarray, upd: np.ndarray,
               cols: Columns) -> np.ndarray:
        """Whole rows ``[n, dim]`` for a column slice ``rows`` ``[n, cols.n]``: the published
        row (slot ``old``, where ``upd``) with ``cols`` replaced; zeros elsewhere: for new ids
        and for ids the batch deletes first (``upd`` is false for those).

        Copy-on-write holds for column slices too: the whole new row goes into a fresh slot
        (so a reused slot never shows its previous row) and readers switch to it with the
        publish, never seeing a row with only some of the slice's columns written. The
        slots read here belong to the published state, which the writer alone changes."""
        full = np.empty((rows.shape[0], self.dim), self.dtype)
        full[upd] = self.storage.rows[old[upd]]
        scatter_columns(full, np.arange(rows.shape[0]), rows, cols, np.flatnonzero(~upd))
        return full

    def load(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Fill an empty table with ``ids`` (unique int64 [n]) and ``rows`` (storage dtype):
        one contiguous copy into slots ``1 .. n``, one publish."""
        n = ids.shape[0]
        if self.live or self.slots.hwm != 1:
            raise RuntimeError("load: the table is not empty")
        self._make_room(n, n)  # an empty table: nothing to redo
        s0 = self.seq
        self.view.hdr[H_PREP] = s0 + 1
        self.storage.ensure_rows(n + 1)
        slots = self.slots.alloc(n)
        self.storage.rows[1: n + 1] = rows
        self.slots.slot_ids[1: n + 1] = ids
        self.index.insert(ids, slots, None)  # both copies: nothing to replay after
        self.live = n
        self._last_pos = _EMPTY_POS
        self._publish(s0 + 1, 0)
        self.slots.written(slots)

    def _publish(self, s: int, source_ns: int, batch: bool = True) -> None:
        hdr, c = self.view.hdr, s & 1
        self._batches += batch
        self._source_ns = max(self._source_ns, int(source_ns))
        hdr[meta_word(c, M_LIVE)] = self.live
        hdr[meta_word(c, M_APPLIED_NS)] = time.time_ns()
        hdr[meta_word(c, M_SOURCE_NS)] = self._source_ns
        hdr[meta_word(c, M_HWM)] = self.slots.hwm
        hdr[meta_word(c, M_BATCHES)] = self._batches
        hdr[H_SEQ] = s  # the commit point: one aligned 8-byte store
        self.seq = s

    # ------------------------------------------------------------------ growth

    def _make_room(self, n: int, n_new: int) -> bool:
        """Room for ``n`` new row slots and ``n_new`` new keys, before anything changes.
        True when it swapped the index or the storage (probes must be redone)."""
        changed = False
        if not self.slots.room(n):
            self._regrow_rows(n)
            changed = True
        index = self.index
        if index.used + n_new > HARD_LOAD * index.buckets:
            changed = True
            if self.growth is not None:
                self.forced += 1
                log.log(logging.WARNING if index.buckets >= 1 << 20 else logging.DEBUG,
                        "table %s: finishing an index migration at once (a batch of %d new "
                        "ids into %d buckets)", self.name, n_new, index.buckets)
                self._finish_growth()
            if self.index.used + n_new > HARD_LOAD * self.index.buckets:
                self._start_growth(self.live + n_new)
                self._finish_growth()
        return changed

    def _start_growth(self, expected: int) -> None:
        gen, self._next_gen = self._next_gen, self._next_gen + 1
        tab = self.storage.new_index(gen, buckets_for(max(1, expected)))
        self.growth = Growth(self.index, IdIndex(tab, self.name), gen,
                             partial(self.storage.back_index, gen))
        log.debug("table %s: index migration to %d buckets begins (%d ids)", self.name,
                  tab.shape[0], self.live)

    def _grow_step(self, rows: int) -> None:
        """After a publish: start or continue a migration by a slice; swap when done.

        The apply is published already, so a migration that cannot get memory now (a full
        tmpfs: OSError) is logged and tried again on the next apply, where the backer
        retries from where it stopped; a table that fills its index that far meanwhile
        finishes the migration before its next apply publishes, which then fails instead."""
        try:
            if self.growth is None:
                if self.index.used <= START_LOAD * self.index.buckets:
                    return
                self._start_growth(self.live)
            g = self.growth
            assert g is not None
            if g.step(rows, self.seq & 1):
                self._swap_index()
        except OSError as e:
            log.log(logging.DEBUG if self._grow_error else logging.WARNING,
                    "table %s: the index migration waits for memory: %s", self.name, e)
            self._grow_error = True

    def _finish_growth(self) -> None:
        g = self.growth
        assert g is not None
        g.finish(self.seq & 1)
        self._swap_index()

    def _swap_index(self) -> None:
        """Publish the migrated index (its two copies equal the current state)."""
        g = self.growth
        assert g is not None and g.done
        s0 = self.seq
        hdr, old, old_gen = self.view.hdr, self.index, self.idx_gen
        hdr[H_PREP] = s0 + 1
        # both old copies = state s0: a reader holding the old index reads s0 in either
        old.copy_values(self._last_pos, s0 & 1, (s0 + 1) & 1)
        self.index, self.idx_gen, self.growth = g.new, g.gen, None
        self.view = View(hdr, g.new.tab, self.storage.rows)
        hdr[H_IDX_GEN] = g.gen
        self._last_pos = _EMPTY_POS
        self._publish(s0 + 1, 0, batch=False)
        self.storage.drop_index(old_gen)
        self._grow_error = False
        log.debug("table %s: index of %d buckets in use (%d ids)", self.name, g.new.buckets,
                  self.live)

    def _regrow_rows(self, n: int) -> None:
        """The reserved rows are full (the host limited the reservation): copy into a
        bigger region once (a stall, logged)."""
        need = self.slots.hwm + n
        log.warning("table %s: %d row slots reserved are not enough for %d; copying the "
                    "rows into a bigger region", self.name, self.slots.cap, need)
        storage = self.storage.resized(max(need, 2 * self.slots.cap))
        self.restorage(storage)
        if storage.shared:
            storage.publish()

    def restorage(self, storage: Any) -> None:
        """Move every row, the index and the header state into ``storage`` (O(table)) and
        switch readers over in one step; the old memory is left to readers that still hold
        it (it never changes again)."""
        if self.growth is not None:
            self._finish_growth()
        old = self.view
        hwm = self.slots.hwm
        storage.ensure_rows(hwm)
        storage.rows[:hwm] = old.rows[:hwm]
        tab = storage.new_index(self.idx_gen, self.index.buckets, back=True)
        tab[...] = self.index.tab
        for w in (H_SEQ, H_PREP, H_IDX_GEN, *range(meta_word(0, 0), meta_word(2, 0))):
            storage.hdr[w] = old.hdr[w]
        # a regrown table keeps counting from its base; a private one (base 0) being
        # shared takes the new storage's
        storage.hdr[H_VERSION_BASE] = int(old.hdr[H_VERSION_BASE]) or int(
            storage.hdr[H_VERSION_BASE])
        storage.hdr[H_DIM], storage.hdr[H_DTYPE] = old.hdr[H_DIM], old.hdr[H_DTYPE]
        storage.hdr[H_ROWCAP] = storage.cap
        if storage.cap != self.slots.cap:
            self.slots = self.slots.resized(storage.cap)
        self.index = IdIndex(tab, self.name, self.index.used)
        previous, self.storage = self.storage, storage
        self.view = View(storage.hdr, tab, storage.rows)
        previous.drop_index(self.idx_gen)

    # ------------------------------------------------------------------ views

    @property
    def version(self) -> int:
        """The published state's version: its number plus the header's version base
        (``H_VERSION_BASE``), so it never goes back across daemon runs."""
        return int(self.view.hdr[H_VERSION_BASE]) + self.seq

    def freeze(self, *, track: bool = False) -> FrozenTable:
        """A consistent view of every row now; rows it needs are not reused until it is
        released. ``track``: also restart change tracking at exactly this state."""
        s = self.seq
        non_live = self.slots.non_live()
        self.slots.pin(s)
        if track:
            self.slots.reset_changes()
        return FrozenTable(self.name, self.dim, _dtype_name(self.dtype), self.storage.rows,
                           self.slots.slot_ids, self.slots.hwm, non_live, self.live,
                           partial(self.slots.unpin, s))

    def freeze_changes(self) -> Optional[FrozenChanges]:
        """The rows written and ids deleted since the last take (None when changes are not
        tracked), and start afresh."""
        if not self.slots.tracking:
            return None
        s = self.seq
        written, gone = self.slots.take_changes()
        non_live = self.slots.non_live()
        self.slots.pin(s)
        return FrozenChanges(self.name, self.dim, _dtype_name(self.dtype), self.storage.rows,
                             self.slots.slot_ids, self.slots.hwm, non_live, written, gone,
                             partial(self.slots.unpin, s))

    def stats(self) -> dict:
        """Sizes: slots, buckets, bytes held (rows and arrays as far as written)."""
        hwm = self.slots.hwm
        idx_bytes = self.index.nbytes + (self.growth.new.nbytes if self.growth else 0)
        return {"hwm": hwm, "free_slots": self.slots.nfree + self.slots.nretired,
                "buckets": self.index.buckets, "index_gen": self.idx_gen,
                "migrating": self.growth is not None, "forced": self.forced,
                "version": self.version,
                "bytes": int(hwm * (self.dim * self.dtype.itemsize + 8 + 4) + idx_bytes)}


def _dtype_name(dt: np.dtype) -> str:
    return "f16" if dt == np.float16 else "f32"
