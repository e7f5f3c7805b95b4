"""Incremental index migration: a table's id index grows (or sheds DELETED markers) a
slice per apply, so no single apply or lookup pays for rehashing the whole table.

While the old index serves readers, a new, bigger one is built invisibly: every apply
copies the next slice of old buckets (:meth:`Growth.step`), and changes an apply makes to
old buckets *below the cursor* — already copied — are mirrored into the new index
(:meth:`Growth.mirror`); changes above the cursor are copied when the cursor gets there.
A live key sits in exactly one old bucket, so it is either mirrored or copied, never both.
When the cursor reaches the end the table swaps indexes in one publish
(:meth:`consumers.serving.core.TableCore`). The new index keeps both value copies equal
(it has no readers until the swap).

Pacing: a migration starts when the old index is 35% used and is paced to end by 55%
(lookups stay cheap: runs are short below that): each apply does its share of the work
left — backing the new index's memory first (page faults or tmpfs allocation, which would
otherwise hit one apply all at once, as the copy writes everywhere), then copying — in
proportion to the new ids it brings against the headroom left. At 70% the table finishes
a migration at once (a stall, logged: only a batch larger than about a tenth of the table
gets there).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from consumers.id_index import DELETED, IdIndex

__all__ = ["Growth", "START_LOAD", "END_LOAD", "HARD_LOAD", "MIN_STEP"]

log = logging.getLogger(__name__)

START_LOAD = 0.35  # used buckets / buckets that start a migration
END_LOAD = 0.55  # ... by which it is paced to end
HARD_LOAD = 0.7  # ... that force it to finish at once
MIN_STEP = 4096  # work units per apply at least (1 unit: a bucket copied or 64 bytes backed)
_BYTES_PER_UNIT = 64  # backing 64 bytes costs about as much as copying one bucket


class Growth:
    """A migration in progress from ``old`` to ``new`` (index generation ``gen``).

    ``back(start, stop)`` backs bytes ``[start, stop)`` of the new index with memory.
    Buckets ``[0, cursor)`` of ``old`` are copied.
    """

    def __init__(self, old: IdIndex, new: IdIndex, gen: int,
                 back: Callable[[int, int], None]) -> None:
        self.old, self.new, self.gen, self._back = old, new, gen, back
        self.backed = 0
        self.cursor = 0

    @property
    def done(self) -> bool:
        """True when every old bucket is copied."""
        return self.cursor >= self.old.buckets

    def mirror(self, upd: tuple[np.ndarray, np.ndarray, np.ndarray],
               gone: tuple[np.ndarray, np.ndarray],
               new: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        """Mirror one apply's changes to already copied old buckets.

        ``upd``: (keys, old buckets, new slots) of updated keys; ``gone``: (keys, old
        buckets) of deleted keys; ``new``: (keys, old buckets, slots) of inserted keys.
        """
        c = self.cursor
        if c == 0:
            return
        keys, pos, slots = upd
        m = pos < c
        if m.any():
            keys, slots = keys[m], slots[m]
            npos, _ = self.new.find(keys, 0)
            ok = npos >= 0  # always, as every key below the cursor was copied
            self.new.set(npos[ok], slots[ok], None)
            if not ok.all():
                self.new.insert(keys[~ok], slots[~ok], None)
        keys, pos = gone
        m = pos < c
        if m.any():
            npos, _ = self.new.find(keys[m], 0)
            self.new.set(npos[npos >= 0], DELETED, None)
        keys, pos, slots = new
        m = pos < c
        if m.any():
            self.new.insert(keys[m], slots[m], None)

    def step(self, rows: int, col: int) -> bool:
        """One apply's share of the work left, for an apply that brought ``rows`` new ids:
        back memory of the new index, then copy old buckets (live in value copy ``col``,
        the published one). True when the migration is complete."""
        headroom = END_LOAD * self.old.buckets - self.old.used
        left = (self.new.nbytes - self.backed) / _BYTES_PER_UNIT + \
            (self.old.buckets - self.cursor)
        budget = left if headroom <= rows else max(MIN_STEP, left * rows / headroom)
        return self._work(budget, col)

    def finish(self, col: int) -> None:
        """Do all the work left now."""
        self._work(float("inf"), col)

    def _work(self, budget: float, col: int) -> bool:
        if self.backed < self.new.nbytes:
            stop = int(min(self.new.nbytes, self.backed + budget * _BYTES_PER_UNIT))
            self._back(self.backed, stop)
            budget -= (stop - self.backed) / _BYTES_PER_UNIT
            self.backed = stop
            if self.backed < self.new.nbytes:
                return False
        if budget >= 1:
            stop = int(min(self.cursor + budget, self.old.buckets))
            keys, slots = self.old.live(col, self.cursor, stop)
            if keys.size:
                self.new.insert(keys, slots, None)
            self.cursor = stop
        return self.done
