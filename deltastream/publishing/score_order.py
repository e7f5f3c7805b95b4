"""Pending rows kept in the order a budget takes them, updated by what changed.

A :class:`~deltastream.publishing.pending.PendingRows` table holds every row waiting to be
published in *slots*. Two orders over those slots are kept here, each updated in
O(rows changed) amortized, never by re-sorting the whole pending set:

* :class:`ScoreOrder` — slots by serving error, largest first. A batch of re-scored slots
  becomes a new sorted *run*; runs are merged when the newer is at least half the size of
  the older (as in a log-structured merge tree), so a slot takes part in O(log n) merges.
  An entry is *live* while the slot's stamp still equals the stamp it was added with: a
  slot that is re-scored, published or removed gets a new stamp, and its old entries are
  skipped lazily and dropped by the next merge or rebuild (when dead entries outnumber
  live ones). :meth:`ScoreOrder.top` reads the largest live entries from the runs' heads.
* :class:`AgeQueue` — slots by the tick they were first carried (oldest first), as
  batches appended in tick order: the ``max_age`` tier reads the oldest batches only.

Both work on numpy arrays (1-D, int64 slots and stamps, float64 keys): sorting and
filtering release the GIL, and small numpy calls cost less Python time than torch's.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

__all__ = ["ScoreOrder", "AgeQueue"]

_EMPTY_F = np.empty(0, dtype=np.float64)
_EMPTY_I = np.empty(0, dtype=np.int64)


@dataclass
class _Run:
    keys: np.ndarray  # float64 [m], descending
    slots: np.ndarray  # int64 [m]
    stamps: np.ndarray  # int64 [m]
    head: int = 0  # entries before head are known dead

    def __len__(self) -> int:
        return int(self.keys.size) - self.head


def _sorted_run(keys: np.ndarray, slots: np.ndarray, stamps: np.ndarray) -> _Run:
    order = np.argsort(-keys, kind="stable")  # ties keep the batch's order (ascending ids)
    return _Run(keys[order], slots[order], stamps[order])


class ScoreOrder:
    """Slots ordered by a float key, largest first (see the module docstring).

    ``stamps`` (int64 ``[capacity]``, owned and grown by the caller) holds each slot's
    current stamp; an entry ``(key, slot, stamp)`` is live iff ``stamps[slot] == stamp``.
    """

    def __init__(self) -> None:
        self._runs: list[_Run] = []
        self._entries = 0

    @property
    def entries(self) -> int:
        """Entries held, dead ones included (memory: 24 bytes each)."""
        return self._entries

    def add(self, keys: np.ndarray, slots: np.ndarray, stamps: np.ndarray,
            current: np.ndarray, live: int) -> None:
        """Add entries for ``slots`` (``keys`` float64 ``[n]``, their ``stamps``);
        ``current`` is the caller's stamp array, ``live`` the slots pending now."""
        if keys.size == 0:
            return
        self._runs.append(_sorted_run(keys, slots, stamps))
        self._entries += int(keys.size)
        if self._entries > 2 * live + 4096:
            self.rebuild(current)
            return
        while len(self._runs) >= 2 and 2 * len(self._runs[-1]) >= len(self._runs[-2]):
            b, a = self._runs.pop(), self._runs.pop()
            self._entries -= len(a) + len(b) + a.head + b.head
            merged = self._merge(a, b, current)
            self._entries += int(merged.keys.size)
            self._runs.append(merged)

    @staticmethod
    def _merge(a: _Run, b: _Run, current: np.ndarray) -> _Run:
        keys = np.concatenate([a.keys[a.head:], b.keys[b.head:]])
        slots = np.concatenate([a.slots[a.head:], b.slots[b.head:]])
        stamps = np.concatenate([a.stamps[a.head:], b.stamps[b.head:]])
        ok = current[slots] == stamps
        keys, slots, stamps = keys[ok], slots[ok], stamps[ok]
        # two sorted runs concatenated: the stable sort (timsort) merges them in O(n)
        order = np.argsort(-keys, kind="stable")
        return _Run(keys[order], slots[order], stamps[order])

    def rebuild(self, current: np.ndarray) -> None:
        """Drop every dead entry: one run (O(entries); called when most are dead)."""
        runs = [r for r in self._runs if len(r)]
        if not runs:
            self._runs, self._entries = [], 0
            return
        keys = np.concatenate([r.keys[r.head:] for r in runs])
        slots = np.concatenate([r.slots[r.head:] for r in runs])
        stamps = np.concatenate([r.stamps[r.head:] for r in runs])
        ok = current[slots] == stamps
        run = _sorted_run(keys[ok], slots[ok], stamps[ok])
        self._runs = [run] if run.keys.size else []
        self._entries = int(run.keys.size)

    def top(self, m: int, current: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
        """The ``m`` largest live entries: ``(keys [k], slots [k], more)``, keys
        descending, ``k <= m``; ``more`` is False when no live entry is left out."""
        keys, slots, more = [], [], False
        for run in self._runs:
            k, s, rest = self._live_prefix(run, m, current)
            keys.append(k)
            slots.append(s)
            more |= rest
        if not keys:
            return _EMPTY_F, _EMPTY_I, False
        k, s = np.concatenate(keys), np.concatenate(slots)
        if k.size > m:
            more = True
        order = np.argsort(-k, kind="stable")[:m]
        return k[order], s[order], more

    @staticmethod
    def _live_prefix(run: _Run, m: int, current: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, bool]:
        """Up to ``m`` live entries from ``run``'s head; advances the head past the dead
        entries in front (published rows are the ones at the head)."""
        n = run.keys.size
        want = max(2 * m, 64)
        while True:
            stop = min(n, run.head + want)
            ok = current[run.slots[run.head:stop]] == run.stamps[run.head:stop]
            live = np.flatnonzero(ok)
            if live.size and live[0] > 0:
                run.head += int(live[0])
                live -= live[0]
            elif not live.size:
                run.head = stop
            if live.size >= m or stop == n:
                at = run.head + live[:m]
                rest = bool(live.size > m) or stop < n
                return run.keys[at], run.slots[at], rest
            want *= 4


class AgeQueue:
    """Slots by the tick they were first carried, oldest first (see the module docstring).

    Entries are ``(birth, slot, life)``; an entry is live iff ``life`` equals the slot's
    current life counter (bumped when the slot stops being pending).
    """

    def __init__(self) -> None:
        self._births: list[int] = []  # ascending
        self._batches: list[tuple[np.ndarray, np.ndarray]] = []  # (slots, lives)
        self._entries = 0

    @property
    def entries(self) -> int:
        """Entries held, dead ones included."""
        return self._entries

    def add(self, birth: int, slots: np.ndarray, lives: np.ndarray) -> None:
        """Add ``slots`` first carried at tick ``birth`` (usually the newest tick; a batch
        handed back after a failed send keeps its older ``birth``)."""
        if slots.size == 0:
            return
        at = bisect.bisect_right(self._births, birth)
        self._births.insert(at, birth)
        self._batches.insert(at, (slots, lives))
        self._entries += int(slots.size)

    def oldest(self, up_to_birth: int, current: np.ndarray):
        """Yield ``(birth, slots)`` of live entries born at or before ``up_to_birth``,
        oldest batch first; fully dead batches are dropped on the way."""
        i = 0
        while i < len(self._births) and self._births[i] <= up_to_birth:
            slots, lives = self._batches[i]
            ok = current[slots] == lives
            if not ok.any():
                self._entries -= int(slots.size)
                del self._births[i], self._batches[i]
                continue
            if not ok.all():
                slots, lives = slots[ok], lives[ok]
                self._entries -= int(ok.size - slots.size)
                self._batches[i] = (slots, lives)
            yield self._births[i], slots
            i += 1

    def rebuild(self, current: np.ndarray) -> None:
        """Drop every dead entry (O(entries))."""
        births, batches, n = [], [], 0
        for b, (slots, lives) in zip(self._births, self._batches, strict=True):
            ok = current[slots] == lives
            if ok.any():
                births.append(b)
                batches.append((slots[ok], lives[ok]))
                n += int(ok.sum())
        self._births, self._batches, self._entries = births, batches, n
