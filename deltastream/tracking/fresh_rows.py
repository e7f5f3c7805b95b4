"""The FIRST rows of a CPU table's lookups: mark each lookup's new positions and copy their
rows into an arena; at the read, the touched positions with their rows.

Two implementations with the same results: the C extension :mod:`deltastream.tracking.native`
(built from ``native.c`` at install when a C compiler is there; one pass over the ids per
lookup, one over the marked words of the marks per read, no temporaries) and numpy (a mask,
a compression and a scatter per lookup, a ``flatnonzero`` and a gather per read). Without
the extension (or with ``DELTASTREAM_NATIVE=0`` in the environment, or after
:func:`use_native(False) <use_native>`) numpy runs. Either path may follow the other inside
one interval: both keep the same state.

The state (a :class:`FreshRows` per table, held by
:class:`~deltastream.tracking.positions.UniqueLookups`): ``slot`` (int32 ``[capacity]``:
0 while position ``p`` was not looked up since the last drain, else 1 + the arena row holding
``p``'s row as it was at its first lookup: one array is both the mark and the map), ``order``
(the position of each arena row), ``arena`` (``[rows, dim]``, the rows' dtype) and ``used``
(arena rows written; at least the positions marked: numpy keeps a lookup's repeats of a new
position, the C code does not). The C code also keeps a bit per position (``bits``, set iff
``slot`` is not 0: a lookup tests 1/32 of the memory), brought up to date after numpy ran,
and a bit per 64-bit word of those (``words``, set when the word may hold a set bit), so a
read walks the words its lookups marked, not a large table's every bit.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from deltastream.cores import spare_cores
from deltastream.native_ext import NativeExtension
from deltastream.tensor_views import NUMPY_DTYPES, as_buffer, as_bytes
from deltastream.tracking.owed_rows import KEEP_BYTES, OwedRows
from deltastream.tracking.sorted_ids import sort_ids_with_perm
from deltastream.tracking.spare_rows import SpareRows

__all__ = ["NATIVE_AVAILABLE", "native_enabled", "use_native", "as_bytes", "FreshRows",
           "spare_core"]

_EXT = NativeExtension("deltastream.tracking.native", "native FIRST-row tracking",
                       "numpy runs")
#: the extension module, None when it is not built
native = _EXT.module
#: whether the C extension was built and imports
NATIVE_AVAILABLE = _EXT.available
#: whether the C code runs now
native_enabled = _EXT.enabled
#: switch to the C code (``RuntimeError`` when it is not built) or to numpy
use_native = _EXT.use


def spare_core() -> bool:
    """Whether :meth:`FreshRows.add` with ``later`` is worth it: the C code runs and torch's
    threads leave one of this process's cores free for the lane thread (else the copy
    would only take a core from training)."""
    return native_enabled() and spare_cores() > 0


def _check_range(q: np.ndarray, capacity: int) -> None:
    if q.size and (int(q.min()) < 0 or int(q.max()) >= capacity):
        at = int(np.flatnonzero((q < 0) | (q >= capacity))[0])
        raise IndexError(f"lookup id {int(q[at])} (at {at}) is outside the table's rows "
                         f"[0, {capacity})")


def _words_for(bits: np.ndarray) -> np.ndarray:
    """The ``words`` of ``bits``: a bit per 8 bytes, set where any of them is not 0."""
    padded = np.zeros(-(-bits.size // 8) * 8, dtype=np.uint8)
    padded[:bits.size] = bits
    return np.packbits(padded.view(np.uint64) != 0, bitorder="little")


class FreshRows:
    """The positions of one table looked up since the last drain, and the FIRST row of each.

    Args:
        capacity: positions ``[0, capacity)`` (:meth:`grow` extends them).
    """

    __slots__ = ("slot", "bits", "words", "bits_valid", "order", "arena", "used",
                 "numpy_rows", "owed", "overcount", "forgotten", "spares", "_late",
                 "_arena_bytes", "_arena_dtype", "_arena_numpy", "_src_key", "_src_bytes")

    def __init__(self, capacity: int) -> None:
        #: int32 ``[capacity]``: 0, or 1 + the arena row of a marked position (the marks)
        self.slot = np.zeros(capacity, dtype=np.int32)
        #: the C code's marks: bit ``p & 7`` of byte ``p >> 3`` set iff ``slot[p] != 0``
        #: (numpy does not keep them: ``bits_valid`` says whether they are up to date)
        self.bits = np.zeros((capacity + 7) // 8, dtype=np.uint8)
        #: bit ``w & 7`` of byte ``w >> 3`` set when word ``w`` (8 bytes) of ``bits`` may hold
        #: a set bit (every set bit's word has its bit; a cleared word may keep its own)
        self.words = _words_for(self.bits)
        self.bits_valid = True
        self.order = np.empty(0, dtype=np.int64)  # the position of each arena row
        self.arena: Optional[torch.Tensor] = None  # [>= used, dim], the rows' dtype
        self._arena_bytes: Optional[np.ndarray] = None  # the arena's bytes
        self._arena_dtype: Optional[torch.dtype] = None  # and its dtype
        self._arena_numpy = False  # whether numpy has that dtype (not bf16)
        self._src_key: Optional[tuple] = None  # (address, shape, dtype) of the table seen
        self._src_bytes: Optional[np.ndarray] = None  # its bytes (keeps that memory alive)
        self.used = 0  # arena rows written (>= the marked positions)
        self.numpy_rows = False  # numpy wrote arena rows since the drain (maybe repeats)
        #: the current rows a deferred :meth:`take_unordered` still owes
        self.owed: Optional[OwedRows] = None
        #: ids of markings run later minus their new positions (:meth:`sync` adds, the
        #: caller that counted a later marking as its ids takes it back)
        self.overcount = 0
        #: marked positions unmarked since the drain (:meth:`forget`): the C code's marked
        #: positions are ``used - forgotten``
        self.forgotten = 0
        #: (marking, ids) of an :meth:`add` running on the C extension's lane thread
        self._late: Optional[tuple] = None
        #: arenas and owed-row buffers a reader of :meth:`take_unordered` gave back
        self.spares = SpareRows()

    @property
    def marks(self) -> torch.Tensor:
        """``slot`` as a tensor (a view made on demand: a hand-off swaps ``slot`` for
        another set per table, and a tensor made there would cost each one ~3 µs cold)."""
        return torch.from_numpy(self.slot)

    def must_grow(self, capacity: int) -> bool:
        """Whether :meth:`grow` to ``capacity`` has work to do (asked at every lookup)."""
        return capacity > self.slot.size or (self.owed is not None and self.owed.walking)

    def grow(self, capacity: int) -> None:
        """Cover ``capacity`` positions, the marks of this interval kept (a table that grew
        between two drains)."""
        if not self.must_grow(capacity):
            return  # the common case: nothing to extend
        self.sync()
        old = self.slot.size
        if capacity > old:
            slot = np.zeros(capacity, dtype=np.int32)
            slot[:old] = self.slot
            bits = np.zeros((capacity + 7) // 8, dtype=np.uint8)
            bits[:self.bits.size] = self.bits  # positions past the old capacity: clear
            self.slot, self.bits = slot, bits
            self.words = _words_for(bits)
        if self.owed is not None:
            self.owed.grow(capacity)  # the set it owes from

    def clear(self) -> None:
        """Forget every lookup (the arena is kept for the next interval)."""
        self.settle()
        if self.used:  # something may be marked (a drain leaves nothing marked)
            self.slot[:] = 0
            self.bits[:] = 0
            self.words[:] = 0
            self.bits_valid = True
        self._reset_counts()

    def add(self, ids: torch.Tensor, src: Optional[torch.Tensor] = None,
            by_occurrence: bool = False, later: bool = False) -> Optional[int]:
        """Record a lookup of ``ids`` (int32/int64 CPU ``[n]``, repeats allowed; not kept:
        the caller may reuse the buffer); with ``src`` keep the row of each new position as
        it is now: ``src[id]`` (``src``: the table's ``[capacity, dim]`` weight, before the
        update) or, with ``by_occurrence``, ``src[i]`` for ``ids[i]`` (``src``: the lookup's
        output ``[n, dim]``). Returns how many positions were new. An id outside ``[0,
        capacity)`` is an ``IndexError`` naming it, raised before anything changes.

        With ``later`` (and ``src``; the C code only, else as without) the marking and the
        copy run on the C extension's lane thread while the caller goes on, and ``add``
        returns None: :meth:`sync` must run before any row of ``src`` changes (every other
        method syncs first); it adds the lookup's ids minus its new positions to
        :attr:`overcount`."""
        # sync and _valid_bits check their own state too; tested here first, because this
        # runs at every lookup and most lookups need neither call
        if self._late is not None:
            self.sync()
        n = ids.numel()
        if n == 0:
            return 0
        if self.used + n >= 2**31 - 1:  # slot is int32
            raise OverflowError(f"{self.used} + {n} rows since the last read: more than an "
                                f"int32 slot can name; read more often")
        rb = 0 if src is None else src.shape[1] * src.element_size()  # bytes per row
        self._reserve(self.used + n, src, rb)
        q = ids.numpy()
        if not q.flags.c_contiguous:
            q = np.ascontiguousarray(q)
        if native_enabled() and (src is None or src.is_contiguous()):
            if not self.bits_valid:
                self._valid_bits()
            args = (self.slot, self.bits, self.order, q,
                    None if src is None else
                    as_buffer(src) if by_occurrence else self._weight_bytes(src), by_occurrence,
                    rb, None if src is None else self._arena_bytes, self.used, self.words)
            if later and src is not None:  # used and new once it ran (sync)
                self._late = (native.mark_fresh_later(*args), n)
                used, new = self.used, None
            else:
                used = native.mark_fresh(*args)
                new = used - self.used  # the C code keeps no repeats
        else:
            used, new = _mark_numpy(self, ids, src, by_occurrence)
            self.bits_valid = self.bits_valid and new == 0
            self.numpy_rows = self.numpy_rows or used > self.used
        self.used = used
        if self.owed is not None and self.owed.left:  # before the update: the owed value
            self.owed.on_lookup(native if native_enabled() else None, q, src, by_occurrence)
        return new

    def add_output(self, ids: torch.Tensor, rows: torch.Tensor) -> Optional[int]:
        """:meth:`add` of a lookup's output (``ids`` int32/int64 CPU ``[n]``, ``rows`` its
        ``[n, dim]`` rows, no autograd) in one C call, or None (nothing done) where
        :meth:`add` must run: the C code off, a marking on the lane, owed rows, numpy's
        marks, no room reserved, rows of another dtype than the arena's or of one numpy
        lacks (bf16), or a position past the marks (a table that grew: ``add``
        grows first, and names a position that is out of range). The same state as
        ``add(ids, rows, by_occurrence=True)`` with fewer torch calls and frames: on a
        step's cold caches each costs ~1 µs (``BENCHMARKS.md``, stop 78)."""
        if self._late is not None or self.overcount or not self.bits_valid \
                or (self.owed is not None and (self.owed.left or self.owed.walking)) \
                or self._arena_bytes is None or not self._arena_numpy \
                or rows.dtype is not self._arena_dtype or not native_enabled():
            return None
        q, r = ids.numpy(), rows.numpy()
        used, n = self.used, q.size
        if r.ndim != 2 or not (q.flags.c_contiguous and r.flags.c_contiguous) \
                or used + n > self.order.size or used + n >= 2**31 - 1:
            return None
        rb = r.strides[0]
        if self._arena_bytes.size < (used + n) * rb:
            return None
        try:
            self.used = native.mark_fresh(self.slot, self.bits, self.order, q, r, True, rb,
                                          self._arena_bytes, used, self.words)
        except IndexError:  # raised before anything changed
            return None
        return self.used - used

    def forget(self, positions: np.ndarray) -> int:
        """Unmark ``positions`` (int64 ``[k]``: rows being freed, their ids evicted): their
        FIRST rows are void, and a later lookup of a position reused by
        another id marks it afresh with that id's row. The other marks stay: their
        positions keep their ids. Returns how many were marked. Work in ``k``, not in the
        marks: an eviction no longer turns the interval's marks into a sorted record."""
        self.sync()
        if not self.used or positions.size == 0:
            return 0
        p = positions[(positions >= 0) & (positions < self.slot.size)]
        hit = np.unique(p[self.slot[p] != 0])  # each counted once
        if hit.size:
            self.slot[hit] = 0
            if self.bits_valid:  # a word's bit may stay set (the drain skips it)
                np.bitwise_and.at(self.bits, hit >> 3,
                                  ~np.left_shift(1, hit & 7).astype(np.uint8))
            self.forgotten += int(hit.size)
        return int(hit.size)

    def sync(self) -> None:
        """Wait for the marking an :meth:`add` left on the lane thread, if any."""
        late, self._late = self._late, None
        if late is not None:
            used = late[0].wait()
            self.overcount += late[1] - (used - self.used)
            self.used = used

    def settle(self) -> None:
        """Copy every row a deferred :meth:`take_unordered` still owes (before anything
        other than a lookup may change a row or reuse a position)."""
        self.capture(None)

    @property
    def owes(self) -> int:
        """Rows a deferred :meth:`take_unordered` still owes (at least 1 until its marks are
        walked: positions and ids are written then)."""
        return 0 if self.owed is None else max(self.owed.left, int(self.owed.walking))

    @property
    def walk_queued(self) -> bool:
        """Whether the owed rows' walk is queued on the C code's lane thread (its positions
        are walked there, not on the thread that calls :meth:`capture`)."""
        return self.owed is not None and self.owed.queued

    def capture(self, max_positions: Optional[int], spare: Optional[bool] = None) -> int:
        """Walk the handed-over marks: at least ``max_positions`` positions (whole 64-bit
        words of bits; None: all), copying the rows still owed; returns the positions
        walked. A bounded call (a tick's) queues the whole walk on the C code's lane
        thread instead where torch leaves a core spare (:meth:`OwedRows.capture`), and
        returns 0 until it ran; None waits for it. ``spare``: :func:`spare_core`'s answer
        when the caller has it (asked once for many tables: ~2.5 µs a call)."""
        self.sync()
        if not self.owes:
            return 0
        o = self.owed
        later = max_positions is not None and not o.queued and (
            spare_core() if spare is None else spare)
        return o.capture(native if native_enabled() else None, max_positions, later)

    def _valid_bits(self) -> None:
        """Bring the bits up to date after numpy marked positions (a switch of path)."""
        if not self.bits_valid:
            self.bits[:] = np.packbits(self.slot != 0, bitorder="little")
            self.words = _words_for(self.bits)
            self.bits_valid = True

    def _weight_bytes(self, src: torch.Tensor) -> np.ndarray:
        """The bytes of a table's weight, viewed once while it stays the same tensor (a
        lookup's output is new every time: :func:`as_buffer` at the call)."""
        key = (src.data_ptr(), src.shape, src.dtype)
        if key != self._src_key:  # the address cannot be reused while the view holds it
            self._src_bytes, self._src_key = as_bytes(src), key
        return self._src_bytes

    def _reserve(self, need: int, src: Optional[torch.Tensor], rb: int) -> None:
        """Room for ``need`` rows in ``order`` and (with ``src``, rows of ``rb`` bytes) in
        an arena of ``src``'s dtype and width (rows in use moved over; at least doubled:
        amortized growth). The room is checked against the arena's cached bytes and dtype,
        not its torch attributes: this runs at every lookup."""
        if self.order.size < need:
            order = np.empty(max(need, 2 * self.order.size, 1024), dtype=np.int64)
            order[:self.used] = self.order[:self.used]
            self.order = order
        if src is None or (self._arena_bytes is not None and self._arena_bytes.size >= need * rb
                           and self._arena_dtype is src.dtype):
            return
        old = self.arena
        grown = self.spares.take(self.order.size, src.shape[1], src.dtype)
        if self.used and old is not None:
            grown[:self.used] = old[:self.used]
        if old is not None:  # outgrown (nobody else holds it): a later interval may fit it
            self.spares.give_back(old)
        self.arena, self._arena_bytes, self._arena_dtype = grown, as_bytes(grown), grown.dtype
        self._arena_numpy = grown.dtype in NUMPY_DTYPES

    def drain(self, with_rows: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The marked positions (int64 ``[k]``, ascending) and, with ``with_rows``, each
        one's FIRST row (``[k, dim]``); nothing is marked afterwards. One pass over the
        capacity: for a table whose ids are its positions (else :meth:`drain_unordered`)."""
        self.settle()
        arena = self.arena if with_rows else None
        used = self.used
        if used == 0:  # nothing marked
            return torch.empty(0, dtype=torch.int64), None if arena is None else arena[:0].clone()
        if not native_enabled():
            touched = np.flatnonzero(self.slot)
            rows = None if arena is None else self.rows(self.slot[touched].astype(np.int64) - 1)
            self._unmark(touched)
            self._drained(used)
            return torch.from_numpy(touched.astype(np.int64, copy=False)), rows
        self._valid_bits()
        ids = torch.empty(used, dtype=torch.int64)
        rows = None if arena is None else torch.empty((used, arena.shape[1]), dtype=arena.dtype)
        k = native.drain_marked(self.slot, self.bits,
                                None if arena is None else self._arena_bytes, ids.numpy(),
                                None if rows is None else as_bytes(rows), None, self.words)
        self._drained(used)
        return ids[:k], None if rows is None else rows[:k]

    def drain_by_key(self, keys: torch.Tensor, with_rows: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """``(ids, positions, rows)`` of the marked positions, ordered by ascending id:
        ``keys`` (int64 CPU ``[capacity]``) is the id held at each position (a hash table's);
        ``ids``/``positions`` int64 ``[k]``, ``rows`` ``[k, dim]`` their FIRST rows (None
        without ``with_rows``); nothing is marked afterwards. Work in the positions touched,
        not the capacity (the C code sorts the ids and copies the rows in one call)."""
        self.settle()
        arena = self.arena if with_rows else None
        if not native_enabled() or self.used == 0:
            used = self.used
            touched, src = self.drain_unordered()
            ids, order = sort_ids_with_perm(keys.index_select(0, torch.from_numpy(touched)))
            order = order.numpy()
            rows = None if arena is None else self.rows(src[order])
            self._drained(used)
            return ids, torch.from_numpy(touched[order]), rows
        self._valid_bits()
        used = self.used
        ids = torch.empty(used, dtype=torch.int64)
        pos = torch.empty(used, dtype=torch.int64)
        rows = None if arena is None else torch.empty((used, arena.shape[1]), dtype=arena.dtype)
        k = native.drain_by_key(self.slot, self.bits, self.order, used, keys.numpy(),
                                None if arena is None else self._arena_bytes, ids.numpy(),
                                pos.numpy(), None if rows is None else as_bytes(rows))
        self._drained(used)
        return ids[:k], pos[:k], None if rows is None else rows[:k]

    def take_unordered(self, storage: Optional[torch.Tensor] = None,
                       keys: Optional[np.ndarray] = None, offset: int = 0
                       ) -> Optional[tuple[Any, ...]]:
        """``(ids, positions, at, arena, current, give_back)``: the marked positions (int64
        ``[k]``), the id held at each (``keys[p]`` with ``keys``, int64 ``[>= capacity]``: a
        hash table's; else ``p + offset`` — or None when drained: the caller maps them),
        the arena row holding each one's FIRST row (int64 ``[k]``), the arena (``[k,
        dim]``, handed over: the next lookups fill another one) and, with ``storage``
        (the table's ``[capacity, dim]`` rows), the tensor ``[k, dim]`` their current rows
        are copied to as they are owed (else None); nothing is marked afterwards.
        ``give_back()`` (any thread, once nobody reads any of them any more) lets later
        intervals reuse their memory (:mod:`~deltastream.tracking.spare_rows`: a buffer
        reused is neither allocated nor faulted in, in a tick). None (nothing done) unless
        the C code did every marking of this interval, with rows (numpy keeps a lookup's
        repeats of a new position), or nothing is marked.

        With ``storage`` the marks are handed over, not drained
        (:mod:`~deltastream.tracking.owed_rows`): all but the arena are written as the
        marks are walked — complete once :attr:`owes` is 0; the work here is a swap of
        arrays. Either way the positions come ascending."""
        self.settle()
        used = self.used
        # numpy_rows False: the C code did every marking, so the bits are valid
        if not used or self.numpy_rows or not native_enabled() or self.arena is None:
            return None
        with_ids = keys is not None or storage is not None
        marked = used - self.forgotten  # the C code kept no repeats
        if not marked:
            storage = None  # every mark forgotten: nothing to owe
        # positions, ids and arena rows in one reused buffer (its column), sliced in numpy:
        # a torch slice costs ~10x a numpy one, and this runs per table in one tick. The
        # walk of owed rows writes one entry per mark; the drain wants room for an entry
        # per arena row
        n = used if storage is None else marked
        index, view = self.spares.take_viewed(3 * n, 1, torch.int64)
        flat = view.reshape(-1)
        pos, ids, at = flat[:n], flat[n:2 * n], flat[2 * n:3 * n]
        base, rows = self.arena, self.arena[:used]
        if storage is None:
            k = native.drain_marked(self.slot, self.bits, None, pos, None, at, self.words,
                                    keys, None if keys is None else ids)
            current, pos, at, ids = None, pos[:k], at[:k], ids[:k]
        else:
            if self.owed is None:
                self.owed = OwedRows()
            current = self.owed.start(self._hand_over_marks(), marked, storage, self.spares,
                                      (ids, pos, at), keys, offset, used)
        self.arena, self._arena_bytes = None, None
        self._drained(used)
        lent = (base, None if current is None else self.owed.base, index)
        return (torch.from_numpy(ids) if with_ids else None, torch.from_numpy(pos),
                torch.from_numpy(at), rows, current, lambda: self.spares.give_back(*lent))

    def marked_rows(self, keys: Optional[np.ndarray], offset: int = 0
                    ) -> Optional[tuple[torch.Tensor, torch.Tensor, bool]]:
        """``(ids, rows, borrowed)`` of this interval's marks, for readers other than the
        one :meth:`take_unordered` hands them to (call it first): ``ids`` int64 ``[k]``, each
        marked position's id (``keys[p]``, else ``p + offset``), in no id order; ``rows`` its
        FIRST row — with ``borrowed`` the arena's first rows themselves (a view: keep the
        arena from being written while they are held), else (marks were forgotten) a copy.
        None unless the C code did every marking of this interval (no repeats)."""
        self.sync()
        used = self.used
        if not used or self.numpy_rows or not native_enabled() or self.arena is None:
            return None
        order = self.order[:used]
        rows: torch.Tensor = self.arena[:used]
        if self.forgotten:  # only the arena rows their position still names
            kept = np.flatnonzero(self.slot[order] == np.arange(1, used + 1, dtype=np.int32))
            order = order[kept]
            rows = rows.index_select(0, torch.from_numpy(kept))
        ids = keys[order] if keys is not None else order + offset
        return (torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)), rows,
                not self.forgotten)

    def _hand_over_marks(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This interval's ``(slot, bits, words)``, replaced by a clear set (the last
        hand-off's, once worked off; else new): the next lookups mark that one."""
        old = (self.slot, self.bits, self.words)
        free = self.owed.free_marks()
        if free is None or free[0].size != self.slot.size:
            free = (np.zeros_like(self.slot), np.zeros_like(self.bits),
                    np.zeros_like(self.words))
        self.slot, self.bits, self.words = free
        return old

    def drain_unordered(self) -> tuple[np.ndarray, np.ndarray]:
        """``(positions, arena_rows)``: each marked position once, in lookup order, and the
        arena row holding its FIRST row (:meth:`rows` gathers them); nothing is marked
        afterwards. Work in the positions touched, not the capacity."""
        self.sync()
        allpos = self.order[:self.used]
        at = np.flatnonzero(self.slot[allpos] == np.arange(1, allpos.size + 1))  # one copy each
        touched = allpos[at]
        self._unmark(touched)
        return touched, at

    def rows(self, arena_rows: np.ndarray) -> torch.Tensor:
        """The arena's rows ``arena_rows`` (int64 ``[k]``) as ``[k, dim]``."""
        return self.arena.index_select(0, torch.from_numpy(arena_rows))

    def _unmark(self, touched: np.ndarray) -> None:
        s = self.slot
        if touched.size * 16 < s.size:  # few: clear them, else clear everything
            s[touched] = 0
        else:
            s[:] = 0
        self.bits[:] = 0  # 1/32 of slot: cheaper than finding the bytes
        self.words[:] = 0
        self.bits_valid = True
        self._reset_counts()

    def _reset_counts(self) -> None:
        """Nothing marked: no arena row written, none by numpy, nothing counted too many."""
        self.used = 0
        self.numpy_rows = False
        self.overcount = 0
        self.forgotten = 0

    def _drained(self, used: int) -> None:
        """After a drain of ``used`` arena rows: nothing is marked; an arena (and order)
        over 4x what this interval used and over :data:`KEEP_BYTES` is released (one
        interval of many lookups, a long pause between reads, must not hold its memory for
        the rest of the run; the next lookups reserve what they need)."""
        self._reset_counts()
        held = self.order.nbytes + (0 if self.arena is None
                                    else self.arena.numel() * self.arena.element_size())
        if held > KEEP_BYTES and self.order.size > 4 * max(used, 1):
            self.order = np.empty(0, dtype=np.int64)
            self.arena, self._arena_bytes = None, None


def _mark_numpy(f: FreshRows, ids: torch.Tensor, src: Optional[torch.Tensor],
                by_occurrence: bool) -> tuple[int, int]:
    """:meth:`FreshRows.add` in numpy: the new ``used`` and the new positions."""
    s, q, used = f.slot, ids.numpy(), f.used
    _check_range(q, s.size)
    fresh = np.flatnonzero(s[q] == 0)  # occurrences of positions new since the drain
    k = fresh.size
    if k == 0:
        return used, 0
    qf = q[fresh].astype(np.int64, copy=False)  # a copy: the caller may reuse its buffer
    rows = np.arange(used + 1, used + k + 1, dtype=np.int32)
    s[qf] = rows  # a repeat: its later copy, the same row
    f.order[used:used + k] = qf
    if src is not None:
        at = fresh if by_occurrence else qf
        torch.index_select(src, 0, torch.from_numpy(at), out=f.arena[used:used + k])
    return used + k, int(np.count_nonzero(s[qf] == rows))  # one per new position
