"""Pending rows kept in the order a budget takes them, updated by what changed.

A :class:`~deltastream.publishing.pending.PendingRows` table holds every row waiting to be
published in *slots*. Two orders over those slots are kept here, each updated in
O(rows changed) amortized, never by re-sorting the whole pending set:

* :class:`ScoreOrder` — slots by serving error, largest first. Entries go into *buckets*
  by their key's binary exponent and mantissa (:data:`PER_OCTAVE` buckets per factor of
  two); within a bucket, each added batch is a *run*. When :meth:`ScoreOrder.top` reads a
  bucket, its new runs are sorted and runs are merged while the newer is at least half the
  size of the older (as in a log-structured merge tree: an entry takes part in O(log n)
  merges). The budget reads the top few hundred rows of a pending set of ~10⁵: the buckets
  below are appended to and never merged or sorted until rows rise there. An entry is
  *live* while the slot's stamp still equals the stamp it was added with: a slot that is
  re-scored, published or removed gets a new stamp, and its old entries are skipped lazily
  (a run's head moves past the dead entries in front: published rows are the ones at the
  head) and dropped by the next merge or rebuild (when dead entries outnumber live ones).
* :class:`AgeQueue` — slots by the tick they were first carried (oldest first), as
  batches appended in tick order: the ``max_age`` tier reads the oldest batches only.

Both work on numpy arrays (1-D, int64 slots and stamps, float64 keys): sorting and
filtering release the GIL, and small numpy calls cost less Python time than torch's.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

__all__ = ["ScoreOrder", "AgeQueue", "PER_OCTAVE", "bucket_of"]

_EMPTY_F = np.empty(0, dtype=np.float64)
_EMPTY_I = np.empty(0, dtype=np.int64)

#: buckets per factor of two in the key: a key's bucket is its float64 bit pattern without
#: the low mantissa bits, so each octave is cut in ``PER_OCTAVE`` equal parts
PER_OCTAVE = 4
_SHIFT = 52 - (PER_OCTAVE.bit_length() - 1)  # 52 mantissa bits, the top log2(PER_OCTAVE) kept


def bucket_of(keys: np.ndarray) -> np.ndarray:
    """Each float64 key's bucket (int16 ``[n]``): non-decreasing in the key (the bit
    patterns of non-negative floats sort as integers; keys <= 0 and NaN go to the lowest
    bucket, ``+inf`` above every finite key); keys 1.25× or more apart (at 4 per octave)
    never share one."""
    return (np.where(keys > 0, keys, 0.0).view(np.int64) >> _SHIFT).astype(np.int16)


@dataclass
class _Run:
    keys: np.ndarray  # float64 [m], descending when ``ordered``
    slots: np.ndarray  # int64 [m]
    stamps: np.ndarray  # int64 [m]
    head: int = 0  # entries before head are known dead
    ordered: bool = True  # False: in the order added (sorted when its bucket is read)

    def __len__(self) -> int:
        return int(self.keys.size) - self.head


def _sorted(run: _Run) -> _Run:
    """``run`` sorted by key, descending; equal keys keep their order in it."""
    if run.ordered:
        return run
    order = np.argsort(-run.keys[run.head:], kind="stable") + run.head
    return _Run(run.keys[order], run.slots[order], run.stamps[order])


def _live_run(runs: list[_Run], current: np.ndarray) -> _Run:
    """The live entries of ``runs`` (oldest first) as one run, concatenated in that order:
    sorted only when ``runs`` is one sorted run. (:func:`_sorted` of it is stable, so equal
    keys keep the order they were added in, and merges sorted runs in about one pass.)"""
    keys = np.concatenate([r.keys[r.head:] for r in runs])
    slots = np.concatenate([r.slots[r.head:] for r in runs])
    stamps = np.concatenate([r.stamps[r.head:] for r in runs])
    ok = current[slots] == stamps
    return _Run(keys[ok], slots[ok], stamps[ok], ordered=len(runs) == 1 and runs[0].ordered)


def _live_prefix(run: _Run, m: int, current: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, bool]:
    """Up to ``m`` live entries from ``run``'s head; advances the head past the dead
    entries in front."""
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
            return run.keys[at], run.slots[at], bool(live.size > m) or stop < n
        want *= 4


class _Bucket:
    """One key range's entries: sorted runs, oldest first."""

    __slots__ = ("runs",)

    def __init__(self) -> None:
        self.runs: list[_Run] = []

    def size(self) -> int:
        """Entries held, dead ones included."""
        return sum(int(r.keys.size) for r in self.runs)

    def merge(self, current: np.ndarray) -> int:
        """Sort the runs added since the last read, then merge the newest runs while the
        newer is at least half the older; the change in entries held (merges drop the dead
        ones)."""
        self.runs = [_sorted(r) for r in self.runs]
        change = 0
        while len(self.runs) >= 2 and 2 * len(self.runs[-1]) >= len(self.runs[-2]):
            b, a = self.runs.pop(), self.runs.pop()
            merged = _sorted(_live_run([a, b], current))
            change += int(merged.keys.size) - int(a.keys.size) - int(b.keys.size)
            self.runs.append(merged)
        return change

    def top(self, m: int, current: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
        """The ``m`` largest live entries, keys descending (ties: oldest first), and
        whether live entries may be left out."""
        parts = [_live_prefix(r, m, current) for r in self.runs]
        more = any(p[2] for p in parts)
        if len(parts) == 1:
            k, s, _ = parts[0]
        else:
            k = np.concatenate([p[0] for p in parts])
            s = np.concatenate([p[1] for p in parts])
            order = np.argsort(-k, kind="stable")  # runs oldest first: ties keep that order
            k, s = k[order], s[order]
        return k[:m], s[:m], more or k.size > m

    def rebuild(self, current: np.ndarray) -> int:
        """Keep the live entries only, in one run (sorted at the next read); how many
        entries it now holds."""
        self.runs = [r for r in [_live_run(self.runs, current)] if r.keys.size]
        return self.size()


class ScoreOrder:
    """Slots ordered by a float key, largest first (see the module docstring).

    ``stamps`` (int64 ``[capacity]``, owned and grown by the caller) holds each slot's
    current stamp; an entry ``(key, slot, stamp)`` is live iff ``stamps[slot] == stamp``.
    Entries with equal keys come out in the order they were added.
    """

    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}
        self._ids: list[int] = []  # the buckets' numbers, ascending
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
        b = bucket_of(keys)
        if b.size > 1 and bool((b[1:] != b[:-1]).any()):  # one bucket: nothing to group
            order = np.argsort(b, kind="stable")  # int16: a radix sort, batch order kept
            b, keys, slots, stamps = b[order], keys[order], slots[order], stamps[order]
        bounds = [0, *(np.flatnonzero(b[1:] != b[:-1]) + 1).tolist(), int(b.size)]
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            bid = int(b[lo])
            bucket = self._buckets.get(bid)
            if bucket is None:
                bucket = self._buckets[bid] = _Bucket()
                bisect.insort(self._ids, bid)
            bucket.runs.append(_Run(keys[lo:hi], slots[lo:hi], stamps[lo:hi], ordered=False))
        self._entries += int(keys.size)
        if self._entries > 2 * live + 4096:
            self.rebuild(current)

    def rebuild(self, current: np.ndarray) -> None:
        """Drop every dead entry (O(entries); called when most are dead)."""
        self._entries = 0
        for bid in list(self._ids):
            held = self._buckets[bid].rebuild(current)
            if held:
                self._entries += held
            else:
                self._forget(bid)

    def _forget(self, bid: int) -> None:
        del self._buckets[bid]
        self._ids.pop(bisect.bisect_left(self._ids, bid))

    def top(self, m: int, current: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
        """The ``m`` largest live entries: ``(keys [k], slots [k], more)``, keys
        descending, ``k <= m``; ``more`` is False when no live entry is left out."""
        keys, slots, count, more, empty = [], [], 0, False, []
        for at in range(len(self._ids) - 1, -1, -1):
            if count >= m:  # the buckets below hold smaller keys only
                more = True
                break
            bid = self._ids[at]
            bucket = self._buckets[bid]
            self._entries += bucket.merge(current)
            k, s, rest = bucket.top(m - count, current)
            more |= rest
            if k.size:
                keys.append(k)
                slots.append(s)
                count += int(k.size)
            elif not rest:  # only dead entries left
                self._entries -= bucket.size()
                empty.append(bid)
        for bid in empty:
            self._forget(bid)
        if not keys:
            return _EMPTY_F, _EMPTY_I, more
        return np.concatenate(keys), np.concatenate(slots), more


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
