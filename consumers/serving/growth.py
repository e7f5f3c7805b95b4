"""Incremental index migration: a table's id index grows (or sheds DELETED_SLOT markers) a
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
left, in proportion to the new ids it brings against the headroom left. At 70% the table
finishes a migration at once (a stall, logged: only a batch larger than about a tenth of
the table gets there).

The work is backing the new index's memory (page faults, or tmpfs allocation and huge
pages: :meth:`SharedStorage.back_index`) and copying, in step. A key's home bucket is the
top bits of its hash, so old buckets copied in order land in the new index in order too:
copying the first ``f`` of the old buckets writes about the first ``f`` of the new ones.
Each slice backs just the new buckets its keys' probe runs can reach — from their home
buckets, known before they are written — so a 512 MiB index is backed across the
migration, not in its first applies (where a thread backing it ahead kept the apply
waiting: BENCHMARKS.md). Copying starts at an old bucket no probe run crosses
(:meth:`IdIndex.first_empty`) and wraps round to it, so the keys whose runs wrapped past
the end of the old index come last, when the new one is backed whole. A key an apply
puts in a bucket copied already, homed far beyond what is backed (its run wrapped round
during the migration), is set aside and inserted at the end instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from consumers.serving.id_index import DELETED_SLOT, IdIndex, bucket_of

__all__ = ["Growth", "START_LOAD", "END_LOAD", "HARD_LOAD", "MIN_STEP"]

log = logging.getLogger(__name__)

START_LOAD = 0.35  # used buckets / buckets that start a migration
END_LOAD = 0.55  # ... by which it is paced to end
HARD_LOAD = 0.7  # ... that force it to finish at once
MIN_STEP = 4096  # work units per apply at least (1 unit: a bucket copied or 64 bytes backed)
_BYTES_PER_UNIT = 64  # backing 64 bytes costs about as much as copying one bucket
_RUN_MARGIN = 1 << 10  # buckets backed past the last home bucket a slice writes from: probe
# runs in a new index (at most 1/3 used by the end of a migration) are a few buckets long
_FAR = 4 << 20  # bytes: a key homed further past what is backed waits for the backing


class Growth:
    """A migration in progress from ``old`` to ``new`` (index generation ``gen``).

    ``back(start, stop)`` backs bytes ``[start, stop)`` of the new index with memory.
    Old buckets are copied from :attr:`start` on, wrapping round: the first :attr:`cursor`
    of them are copied. Every key of a copied bucket is in the new index, or set aside
    (``_later``: key -> slot) when the bucket its probe run starts from is not backed yet.
    """

    def __init__(self, old: IdIndex, new: IdIndex, gen: int,
                 back: Callable[[int, int], None]) -> None:
        self.old, self.new, self.gen, self._back = old, new, gen, back
        self.backed = 0
        self.start = old.first_empty()
        self.cursor = 0
        self._later: dict[int, int] = {}

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
        if self.cursor == 0:
            return
        keys, pos, slots = upd
        m = self._copied(pos)
        if m.any():
            keys, slots = keys[m], slots[m]
            npos = self._find(keys)
            ok = npos >= 0
            self.new.set(npos[ok], slots[ok], None)
            keys, slots = keys[~ok], slots[~ok]  # set aside: set aside again, or placed now
            for k in keys.tolist():
                self._later.pop(k, None)
            self._place(keys, slots)
        keys, pos = gone
        m = self._copied(pos)
        if m.any():
            keys = keys[m]
            npos = self._find(keys)
            self.new.set(npos[npos >= 0], DELETED_SLOT, None)
            for k in keys[npos < 0].tolist():
                self._later.pop(k, None)
        keys, pos, slots = new
        m = self._copied(pos)
        if m.any():
            self._place(keys[m], slots[m])

    def step(self, rows: int, col: int) -> bool:
        """One apply's share of the work left, for an apply that brought ``rows`` new ids:
        copy old buckets (live in value copy ``col``, the published one), backing the
        memory of the new index they need first. True when the migration is complete."""
        headroom = END_LOAD * self.old.buckets - self.old.used
        left = (self.new.nbytes - self.backed) / _BYTES_PER_UNIT + \
            (self.old.buckets - self.cursor)
        budget = left if headroom <= rows else max(MIN_STEP, left * rows / headroom)
        return self._work(budget, col)

    def finish(self, col: int) -> None:
        """Do all the work left now."""
        self._work(float("inf"), col)

    def _copied(self, pos: np.ndarray) -> np.ndarray:
        """Which old buckets ``pos`` are copied already."""
        return ((pos - self.start) & (self.old.buckets - 1)) < self.cursor

    def _reach(self, keys: np.ndarray) -> np.ndarray:
        """Bytes of the new index that must be backed before each key is written."""
        bucket_bytes = self.new.nbytes // self.new.buckets
        reach = (bucket_of(keys, self.new.buckets) + _RUN_MARGIN) * bucket_bytes
        return np.minimum(reach, self.new.nbytes)

    def _find(self, keys: np.ndarray) -> np.ndarray:
        """Bucket of each key in the new index, or -1 (set aside, or absent). Only keys
        whose runs are backed are looked for: nothing reads memory not backed yet."""
        pos = np.full(keys.shape[0], -1, np.int64)
        placed = self._reach(keys) <= self.backed
        if placed.any():
            pos[placed] = self.new.find(keys[placed], 0)[0]
        return pos

    def _back_to(self, stop: int) -> None:
        """Bytes ``[0, stop)`` of the new index backed."""
        stop = min(stop, self.new.nbytes)
        if stop > self.backed:
            self._back(self.backed, stop)
            self.backed = stop

    def _place(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Insert ``keys`` (not in the new index) with ``slots``, backing the buckets their
        probe runs reach first; set aside those homed far beyond what is backed."""
        if not keys.size:
            return
        reach = self._reach(keys)
        near = reach <= self.backed + _FAR
        if not near.all():
            self._later.update(zip(keys[~near].tolist(), slots[~near].tolist(), strict=True))
            keys, slots, reach = keys[near], slots[near], reach[near]
        if keys.size:
            self._back_to(int(reach.max()))
            self.new.insert(keys, slots, None)

    def _work(self, budget: float, col: int) -> bool:
        old, n = self.old, self.old.buckets
        per_bucket = 1 + self.new.nbytes / n / _BYTES_PER_UNIT  # copy and its share of backing
        stop = n if budget == float("inf") else \
            min(n, self.cursor + max(1, int(budget / per_bucket)))
        if stop > self.cursor:
            # the copied share of the new index at least, so the backing advances evenly
            # where a slice holds few keys
            self._back_to(self.new.nbytes * min(n, self.start + stop) // n)
            lo, hi = self.start + self.cursor, self.start + stop
            for a, b in ((lo, min(hi, n)), (max(lo, n) - n, hi - n)):
                if b > a:
                    self._place(*old.live(col, a, b))
            self.cursor = stop
        if self.done:
            self._back_to(self.new.nbytes)
            if self._later:
                later, self._later = self._later, {}
                self.new.insert(np.fromiter(later, np.int64, len(later)),
                                np.fromiter(later.values(), np.int32, len(later)), None)
        return self.done
