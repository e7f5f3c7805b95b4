"""Row slots of a serving table: allocation, delayed reuse, pins and change tracking.

Rows are copy-on-write: an upsert writes the new row into a fresh slot and the publish that
makes it visible retires the old slot. A retired slot may still be read — by a reader that
started before that publish, or by a frozen view (a checkpoint being written) — so it is
reused only

* by a later apply, after that apply has announced itself (``H_PREP``, which makes every
  reader of the state that still referenced the slot retry), and
* once no frozen view pinned at an earlier state is alive (:meth:`SlotPool.pin`).

Change tracking (for incremental checkpoints): the slots written and the ids deleted since
the last take, as the list of arrays the applies produced — a take only hands the lists
over (O(1) for the applying thread); the frozen view sorts them out in the thread that
writes the checkpoint (:class:`~consumers.serving.views.FrozenChanges`).

Writer side only (its owner's lock held), except :meth:`SlotPool.unpin`, which any thread
may call (a view released by a checkpoint thread, or by the garbage collector): it only
appends to a list the writer drains, so it takes no lock.
"""

from __future__ import annotations

import logging
from collections import deque

import numpy as np

from consumers.serving.memory import reserve_array

__all__ = ["SlotPool"]

log = logging.getLogger(__name__)

_DELETED_COMPACT_MIN = 1 << 16  # deleted-id list entries before the first dedup


class SlotPool:
    """Slots ``1 .. cap - 1`` of a table (slot 0 is the shared zero row of unknown ids).

    Args:
        cap: slots in the row region (reserved memory: untouched slots cost nothing).
    """

    def __init__(self, cap: int) -> None:
        self.cap = int(cap)
        self.slot_ids = reserve_array(self.cap, np.int64)  # id held by each live slot
        self._free = reserve_array(self.cap, np.int32)  # stack of reusable slots
        self.nfree = 0
        self.hwm = 1  # first never-used slot
        self._retired: deque[tuple[int, np.ndarray]] = deque()  # (publish, slots)
        self.nretired = 0
        self._pins: dict[int, int] = {}  # state -> frozen views alive (writer side)
        self._unpinned: list[int] = []  # states of views released since (any thread)
        self.tracking = False
        self._written: list[np.ndarray] = []
        self._deleted: list[np.ndarray] = []
        self._deleted_n = 0
        self._deleted_floor = _DELETED_COMPACT_MIN

    # ------------------------------------------------------------------ allocation

    def room(self, m: int) -> bool:
        """True when ``m`` more slots fit (reusable ones first)."""
        return self.hwm + max(0, m - self.nfree) <= self.cap

    def reclaim(self) -> None:
        """Make retired slots reusable where nothing can read them any more. Call at the
        start of an apply, after it announced itself (``H_PREP``)."""
        self._drain_unpinned()
        if not self._retired:
            return
        floor = min(self._pins, default=None)
        while self._retired and (floor is None or self._retired[0][0] <= floor):
            _, s = self._retired.popleft()
            self._free[self.nfree: self.nfree + s.size] = s
            self.nfree += s.size
            self.nretired -= s.size

    def alloc(self, m: int) -> np.ndarray:
        """``m`` slots (int32), reusable ones first; room checked with :meth:`room`."""
        k = min(m, self.nfree)
        out = np.empty(m, np.int32)
        out[:k] = self._free[self.nfree - k: self.nfree]
        self.nfree -= k
        out[k:] = np.arange(self.hwm, self.hwm + (m - k), dtype=np.int32)
        self.hwm += m - k
        return out

    def unalloc(self, slots: np.ndarray) -> None:
        """Give back slots of an apply that failed before its publish (never visible)."""
        self._free[self.nfree: self.nfree + slots.size] = slots
        self.nfree += slots.size

    def retire(self, slots: np.ndarray, publish: int) -> None:
        """Slots that publish ``publish`` stopped referencing (replaced or deleted rows)."""
        if slots.size == 0:
            return
        self._retired.append((publish, np.array(slots, np.int32)))
        self.nretired += slots.size

    def non_live(self) -> np.ndarray:
        """Slots below :attr:`hwm` that hold no live row now (free or retired), int64."""
        parts = [self._free[: self.nfree].astype(np.int64)]
        parts += [s.astype(np.int64) for _, s in self._retired]
        return np.concatenate(parts)

    def live_count(self) -> int:
        """Slots in use now (live rows)."""
        return self.hwm - 1 - self.nfree - self.nretired

    # ------------------------------------------------------------------ pins

    def pin(self, state: int) -> None:
        """A frozen view of published ``state`` reads its slots: retire, do not reuse."""
        self._pins[state] = self._pins.get(state, 0) + 1

    def unpin(self, state: int) -> None:
        """The view pinned at ``state`` is done (any thread; list.append is atomic)."""
        self._unpinned.append(state)

    def _drain_unpinned(self) -> None:
        while self._unpinned:
            state = self._unpinned.pop()
            left = self._pins.get(state, 0) - 1
            if left > 0:
                self._pins[state] = left
            else:
                self._pins.pop(state, None)

    @property
    def pinned(self) -> int:
        """Frozen views alive (any thread: copies under the GIL, mutates nothing)."""
        return sum(list(self._pins.values())) - len(self._unpinned)

    # ------------------------------------------------------------------ change tracking

    def written(self, slots: np.ndarray) -> None:
        """Slots that now hold rows written since the last take."""
        if self.tracking and slots.size:
            self._written.append(slots)

    def deleted(self, keys: np.ndarray) -> None:
        """Ids deleted now. Deduplicated when the list doubles, so it stays bounded by the
        distinct ids deleted since the last take."""
        if not self.tracking or keys.size == 0:
            return
        self._deleted.append(np.array(keys, np.int64))
        self._deleted_n += keys.size
        if self._deleted_n > self._deleted_floor:
            uniq = np.unique(np.concatenate(self._deleted))
            self._deleted, self._deleted_n = [uniq], int(uniq.size)
            self._deleted_floor = max(_DELETED_COMPACT_MIN, 2 * int(uniq.size))

    def reset_changes(self) -> None:
        """Start tracking afresh."""
        self._written = []
        self._deleted, self._deleted_n = [], 0
        self._deleted_floor = _DELETED_COMPACT_MIN
        self.tracking = True

    def take_changes(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """(the slot arrays written since the last take — some of those slots may hold no
        live row any more, or repeat —, the id arrays deleted meanwhile), and start afresh.
        O(1): nothing is copied."""
        out = (self._written, self._deleted)
        self.reset_changes()
        return out

    def resized(self, cap: int) -> SlotPool:
        """A pool of ``cap`` slots with this pool's state (a table regrowing its rows)."""
        out = SlotPool(cap)
        out.slot_ids[: self.hwm] = self.slot_ids[: self.hwm]
        out._free[: self.nfree] = self._free[: self.nfree]
        out.nfree, out.hwm = self.nfree, self.hwm
        out._retired, out.nretired = self._retired, self.nretired
        out._pins, out._unpinned = self._pins, self._unpinned
        out.tracking, out._written = self.tracking, self._written
        out._deleted, out._deleted_n = self._deleted, self._deleted_n
        out._deleted_floor = self._deleted_floor
        return out
