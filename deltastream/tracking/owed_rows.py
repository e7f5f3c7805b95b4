"""A hand-off's current rows, copied over the next ticks instead of all at its own.

A budget publisher's hand-off needs every changed row's value at the step boundary it was
taken at. Gathered at once, that is tens of thousands of cache misses in one tick of the
training thread. Deferred, the read says which rows it **owes**; each owed row is copied
later by whichever comes first:

* the next lookup of its position (the tracker's hook, in the forward, before the
  optimizer can write it: the row is the boundary's value, and hot from the forward's own
  read);
* a walk of the owed positions: queued whole on the C code's lane thread at the
  publisher's next tick where torch leaves a core spare, so it runs while training goes
  on; else a bounded slice at each of the next ticks (:meth:`OwedRows.capture`). On the
  lane the walk and a lookup may reach a row at once: the walk *claims* an owed entry
  (an atomic compare-and-swap to ``CLAIMED``) before it copies the storage row and clears
  the entry after; a lookup writes its row to ``early`` and then negates the entry with a
  compare-and-swap, and waits if the walk holds the claim. Either way the row is copied
  once, before the optimizer (which runs after the lookup) can write it;
* anything else about to change rows or reuse their positions: the tracker completes the
  capture first (a flush, an eviction, a reload, a switch to the scan, the next read).

That is exact under the lookups path's contract — a row changes only in a step that looked
it up — so every copied row is its value at the boundary, however late it is copied.

The read does not even drain the marks: the interval's marks (``slot``, ``bits``,
``words`` of :class:`~deltastream.tracking.fresh_rows.FreshRows`) are handed over whole,
and the next lookups mark a clear set. The handed-over ``slot`` is ``owed`` here: 1 + the
arena row ``r`` of a position whose current row is owed, its negation once a lookup copied
the row (to row ``r`` of ``early``), 0 for a position not marked. The slices walk the set
bits in position order, as a drain would, and write the reader's arrays in that order —
each position, its arena row (``at``), the id it holds (a hash table's ``keys``) and its
current row (from the storage, or from ``early``) — and clear the marks: the read's own
work is a swap of arrays, and the walk reads and writes memory in order, its cache misses
spread over the ticks. Once walked, the set is clear and the next read marks it again
(:meth:`free_marks`). The C code is
``deltastream.tracking.native.capture_owed`` / ``walk_owed``; numpy does the same without
it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import numpy as np
import torch

from deltastream.tensor_views import as_buffer, head_rows
from deltastream.tracking.spare_rows import SpareRows

__all__ = ["KEEP_BYTES", "OwedRows"]

Marks = tuple[np.ndarray, np.ndarray, np.ndarray]

#: a buffer over 4x what it was last used for and this many bytes is released (the
#: tracker's arena and order, an ``early`` buffer)
KEEP_BYTES = 64 << 20


class OwedRows:
    """The rows one hand-off still owes of one table (at most one hand-off at a time)."""

    __slots__ = ("owed", "bits", "words", "keys", "offset", "ids", "positions", "at", "out",
                 "base", "early", "storage", "next", "entry", "left", "walking",
                 "_out_bytes", "_early_bytes", "_early_all", "_early_key", "_row_width",
                 "_free", "_lane", "_when_walked")

    def __init__(self) -> None:
        self.owed = np.zeros(0, dtype=np.int32)  # the handed-over slot while walking
        #: the handed-over set's bits and words (cleared as they are walked)
        self.bits: Optional[np.ndarray] = None
        self.words: Optional[np.ndarray] = None
        #: the id held at each position (int64 ``[>= capacity]``; None: position +
        #: ``offset``)
        self.keys: Optional[np.ndarray] = None
        self.offset = 0
        #: the reader's ids, positions and arena rows (int64 ``[n]`` each) and current
        #: rows (``[n, dim]``, the first rows of ``base``), written in walk order
        self.ids = self.positions = self.at = np.empty(0, dtype=np.int64)
        self.out: Optional[torch.Tensor] = None
        self.base: Optional[torch.Tensor] = None
        #: ``[>= n, dim]``: rows a lookup copied before the walk reached them (by arena
        #: row); kept from one hand-off to the next (nobody else reads it)
        self.early: Optional[torch.Tensor] = None
        self.storage: Optional[torch.Tensor] = None
        self._out_bytes: Optional[np.ndarray] = None
        self._early_bytes: Optional[np.ndarray] = None
        #: ``early``'s memory (:func:`as_buffer`) and ``(rows, dim, dtype)``: plain values
        #: a hand-off compares, not tensor attributes (each a cold read, per table)
        self._early_all: Optional[np.ndarray] = None
        self._early_key: tuple = (0, 0, None)
        self._row_width = 0  # bytes of a row of ``out`` (and of ``early``)
        self._free: Optional[Marks] = None
        self.next = 0  # the 64-bit word of ``bits`` the walk goes on from
        self.entry = 0  # entries of the reader's arrays written
        self.left = 0  # rows still owed
        self.walking = False  # bits are left to walk (ids and positions not all written)
        #: the walk queued on the C code's lane thread (``walk_owed_later``), if any
        self._lane: Optional[object] = None
        self._when_walked: list[Callable[[], None]] = []  # see when_walked

    def when_walked(self, done: Callable[[], None]) -> None:
        """Call ``done()`` (on the thread that completes the walk) as soon as this
        hand-off's ids, positions and arena rows are all written — before its reader can
        read them, let alone give them back (now when nothing is being walked)."""
        if self.walking:
            self._when_walked.append(done)
        else:
            done()

    def grow(self, capacity: int) -> None:
        """Cover ``capacity`` positions while walking: the set is extended (the new
        positions are not marked; a walk on the lane thread is finished first)."""
        if not self.walking or capacity <= self.owed.size:
            return
        self._finish_lane()  # it walks the arrays being replaced (and walks them all)
        if self.walking:
            self.owed = _extended(self.owed, capacity)
            self.bits = _extended(self.bits, (capacity + 7) // 8)
            self.words = _extended(self.words, ((self.bits.size + 7) // 8 + 7) // 8)

    def free_marks(self) -> Optional[Marks]:
        """``(slot, bits, words)`` of the last hand-off, clear once walked (None while
        walking, or when there is none to give): the next set to mark."""
        if self.walking:
            return None
        free, self._free = self._free, None
        return free

    def start(self, marks: Marks, n: int, storage: torch.Tensor, spares: SpareRows,
              out: tuple[np.ndarray, np.ndarray, np.ndarray],
              keys: Optional[np.ndarray] = None, offset: int = 0,
              arena_rows: Optional[int] = None) -> torch.Tensor:
        """Owe the current rows of the ``n`` positions marked in ``marks`` (the interval's
        ``(slot, bits, words)``, handed over: ``slot[p] - 1`` is position ``p``'s arena
        row, below ``arena_rows``: ``n`` when None; more where marks were forgotten) as
        they are in ``storage`` (the table's ``[capacity, dim]`` rows) now.
        ``out``: ``(ids, positions, at)`` (int64 ``[n]`` each), written as the walk goes:
        the id held at each position (``keys[p]``, keys int64 ``[capacity]``; without keys
        ``p + offset``: a position holds its id until a row is freed, and anything that
        frees one completes the walk first), the position and its arena row. Returns the
        tensor ``[n, dim]`` of their current rows (aligned with ``out``; all complete once
        :attr:`walking` is False; the first rows of :attr:`base`, a buffer of ``spares``).
        The last hand-off must have been walked (:meth:`capture` with no limit) first."""
        assert not self.walking, "the previous hand-off is still being walked"
        self.owed, self.bits, self.words = marks
        self._free = None
        self.keys, self.offset = keys, int(offset)
        self.ids, self.positions, self.at = out
        dim, dtype = storage.shape[1], storage.dtype
        self._row_width = dim * storage.element_size()  # out's and early's rows alike
        self.base, base_view = spares.take_viewed(n, dim, dtype)
        need = n if arena_rows is None else max(n, arena_rows)  # early: a row per arena row
        rows, edim, edtype = self._early_key
        if edim != dim or edtype is not dtype or rows < need \
                or (rows > 4 * need and rows * self._row_width > KEEP_BYTES):
            self.early = torch.empty((1 << max(0, need - 1).bit_length(), dim), dtype=dtype)
            self._early_all = as_buffer(self.early)
            self._early_key = (self.early.shape[0], dim, dtype)
        self.out = self.base[:n]
        self._out_bytes = head_rows(base_view, n, self._row_width)
        self._early_bytes = head_rows(self._early_all, need, self._row_width)
        self.storage = storage
        self.next, self.entry, self.left, self.walking = 0, 0, n, True
        return self.out

    def on_lookup(self, native: object, ids: np.ndarray, src: torch.Tensor,
                  by_occurrence: bool) -> None:
        """A lookup of positions ``ids`` (int32/int64 ``[n]``, checked by the marking) whose
        rows are ``src`` (the table's, or with ``by_occurrence`` the lookup's ``[n, dim]``
        output; None: the storage's), before any update: copy the owed ones."""
        if self._lane is not None and self._lane.done:
            return  # the lane's walk copied every row still owed (``left`` counts at its wait)
        if src is None or src.dtype != self.out.dtype or not src.is_contiguous():
            src, by_occurrence = self.storage, False  # the table's own rows, not yet updated
        if native is not None and src.is_contiguous():
            k = native.capture_owed(self.owed, ids, as_buffer(src), by_occurrence,
                                    self._early_bytes, self._row_width)
        else:
            self._finish_lane()  # numpy claims nothing: no walk may run beside it
            if not self.walking:
                return
            k = self._capture_numpy(ids, src, by_occurrence)
        self.left -= k

    def capture(self, native: object, max_positions: Optional[int], later: bool = False
                ) -> int:
        """Walk the marked positions (whole 64-bit words of the bits) until at least
        ``max_positions`` were walked (at most 63 more; None: all), copying the rows still
        owed from the storage; returns the positions walked.

        With ``later`` (and the C code) the whole walk is queued on the C code's lane
        thread instead, once, and runs while training goes on: a lookup meanwhile copies
        the owed rows it reads itself, and waits for a row the walk is copying
        (``capture_owed``), so a row is still copied before the optimizer can write it.
        Until the walk ran this returns 0 (``max_positions`` None: waits for it)."""
        if not self.walking:
            return 0
        src = self.storage
        native_ok = native is not None and src.is_contiguous()
        if self._lane is None and later and native_ok:
            self._lane = native.walk_owed_later(*self._walk_args(src, self.owed.size))
        if self._lane is not None:
            if max_positions is not None and not self._lane.done:
                return 0
            return self._finish_lane()
        if max_positions == 0:
            return 0
        limit = self.owed.size if max_positions is None else int(max_positions)
        if native_ok:
            return self._walk_done(*native.walk_owed(*self._walk_args(src, limit)))
        walked, copied = self._walk_numpy(limit)
        return self._walk_done(self.next, walked, copied)

    @property
    def queued(self) -> bool:
        """Whether a walk is queued on the lane thread (not yet waited for)."""
        return self._lane is not None

    def _walk_args(self, src: torch.Tensor, limit: int) -> tuple:
        return (self.owed, self.bits, self.words, self.next, limit, as_buffer(src),
                self._early_bytes, self._out_bytes, self._row_width, self.keys, self.ids,
                self.positions, self.at, self.offset, self.entry)

    def _finish_lane(self) -> int:
        """Wait for the walk queued on the lane thread, if any; the positions it walked."""
        lane, self._lane = self._lane, None
        return 0 if lane is None else self._walk_done(*lane.wait())

    def _walk_done(self, next_word: int, walked: int, copied: int) -> int:
        self.next = next_word
        self.entry += walked
        self.left -= copied
        if self.next * 8 >= self.bits.size:
            self._walked()
        return walked

    def _capture_numpy(self, ids: np.ndarray, src: torch.Tensor, by_occurrence: bool) -> int:
        q = ids.astype(np.int64, copy=False)
        r = self.owed[q].astype(np.int64) - 1
        hit = np.flatnonzero(r >= 0)
        if not hit.size:
            return 0
        at = torch.from_numpy(hit if by_occurrence else q[hit])
        self.early[torch.from_numpy(r[hit])] = src.index_select(0, at).to(self.out.dtype)
        first = np.unique(q[hit])  # a repeat of a position: the same row again, harmless
        self.owed[first] = -self.owed[first]
        return int(first.size)

    def _walk_numpy(self, limit: int) -> tuple[int, int]:
        """:meth:`capture`'s walk in numpy, whole 64-bit words like the C code's (a block
        of words at a time: at most 63 positions past ``limit``); returns ``(walked,
        copied)``."""
        walked = copied = 0
        while walked < limit and self.next * 8 < self.bits.size:
            b0 = self.next * 8
            b1 = min(self.bits.size, b0 + 8 * max(1, -(-(limit - walked) // 64)))
            p = np.flatnonzero(np.unpackbits(self.bits[b0:b1], bitorder="little")) + b0 * 8
            e = self.owed[p].astype(np.int64)
            r = np.abs(e) - 1
            j = self.entry + walked
            early_rows = self._early_bytes.nbytes // self._row_width
            if p.size and (int(r.min()) < 0 or int(r.max()) >= early_rows
                           or j + p.size > self.at.size):
                raise ValueError(f"owed: a marked position names no row of the "
                                 f"{early_rows}-row early, or no entry of the "
                                 f"{self.at.size}-entry out")
            own = e > 0
            rows = torch.where(torch.from_numpy(own)[:, None],
                               self.storage.index_select(0, torch.from_numpy(p)),
                               self.early.index_select(0, torch.from_numpy(r)))
            self.out[j:j + p.size] = rows.to(self.out.dtype)
            self.owed[p] = 0
            self.positions[j:j + p.size] = p
            self.at[j:j + p.size] = r
            self.ids[j:j + p.size] = p + self.offset if self.keys is None else self.keys[p]
            self.bits[b0:b1] = 0
            self.next = -(-b1 // 8)
            walked += int(p.size)
            copied += int(own.sum())
        return walked, copied

    def _walked(self) -> None:
        """Every bit was walked: the set is clear (its words too), the reader owns the
        rows, ids and positions."""
        done, self._when_walked = self._when_walked, []
        for fn in done:
            fn()
        self.words[:] = 0  # 1/512 of the slot
        self._free = (self.owed, self.bits, self.words)
        self.walking = False
        self.out, self.base, self._out_bytes, self.storage = None, None, None, None
        self._early_bytes = None
        self.keys, self.bits, self.words = None, None, None
        self.ids = self.positions = self.at = np.empty(0, dtype=np.int64)


def _extended(a: np.ndarray, size: int) -> np.ndarray:
    """``a`` followed by zeros up to ``size`` entries."""
    out = np.zeros(size, dtype=a.dtype)
    out[:a.size] = a
    return out
