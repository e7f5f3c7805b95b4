"""IdIndex: the serving table's int64 id -> row slot index (numpy open addressing).

Layout: one ``int64 [B, 2]`` bucket array (B a power of 2). Column 0 holds the key; column
1 holds two ``int32`` slot values, **copy 0 and copy 1** (viewed as ``int32 [B, 4]``,
columns 2 and 3). A value is a row slot (≥ 1) for a live key, ``EMPTY_SLOT`` (0) for a bucket
never used, ``DELETED_SLOT`` (-1) for a removed key. Fresh zeroed memory is an empty index, so a
new index costs no fill pass and its pages are committed only when touched.

Why two copies: readers never lock. The single writer publishes state ``S`` in copy
``S & 1`` and builds state ``S + 1`` in the other copy; a reader reads the copy of the
state it started in and retries when the writer began to rebuild that very copy (see
:mod:`consumers.serving.core`). Both copies sit in the same 16-byte bucket, so a probe
costs one cache line whatever the copy.

Probing: linear, Fibonacci hashing of the id. A key sits before the first EMPTY_SLOT bucket of
its probe path, so the first bucket holding the key live, or EMPTY_SLOT, decides.
:func:`lookup_slots` looks at every key's home bucket first (one gather decides most
keys); the others continue with 8- then 32-bucket windows, or for bulk requests one bucket
per round while many remain. The owner keeps the load
(live + DELETED_SLOT markers) below ~0.4 by migrating to a bigger index
(:mod:`consumers.serving.growth`), so ~80% of keys resolve in their home bucket.

Why a hash and not sorted keys + ``searchsorted``: a sorted index costs an O(resident)
merge for every batch that brings new ids; the hash costs O(batch).

Where the C extension runs (:mod:`consumers.serving.accel`), :meth:`IdIndex.find` and
:meth:`IdIndex.insert` are C loops that release the GIL for big batches: the numpy rounds
held it for up to ~20 ms per 4096-id batch on a loaded 2-core box, and every reader thread
of the daemon's process waited that long. The C insert places keys one after another
instead of in claim rounds; either way each key sits before the first EMPTY_SLOT bucket of its
walk, which is all a probe relies on.

Not thread-safe for writes: one writer (its owner holds a lock); reads need no lock.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from consumers.serving import accel

__all__ = ["IdIndex", "lookup_slots", "as_ids", "EMPTY_SLOT", "DELETED_SLOT", "buckets_for", "bucket_of"]

log = logging.getLogger(__name__)

# Slot values, named apart from the trainer index's row-position markers (EMPTY -1, DELETED -2 in
# deltastream.kernels.hash_layout): slot 0 is the shared zero row, so 0 means "no slot".
EMPTY_SLOT = 0
DELETED_SLOT = -1
_MULT = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: 2^64 / golden ratio, odd
_FOLD = np.uint64(32)
_SMALL = 1024  # ... ids a lookup resolves past their home bucket with windows at once
_W = 8  # first window of those
_FEW = 64  # bulk rounds switch from 1 bucket to a window when fewer keys remain
_WINDOW = 32
_WIN_OFFSETS = np.arange(_WINDOW, dtype=np.int64)[None, :]
_SLACK = 3  # a new index has buckets ≥ 3 × ids (power of 2: load in [0.17, 1/3])
_NOGIL_KEYS = 1024  # native writer calls with this many keys release the GIL


def as_ids(ids: Any, what: str = "ids") -> np.ndarray:
    """``ids`` as a contiguous 1-D int64 array (the same array when it already is one), or
    ``TypeError``/``ValueError`` naming ``what``."""
    if type(ids) is np.ndarray and ids.dtype == np.int64 and ids.ndim == 1 \
            and ids.flags.c_contiguous:
        return ids  # the common case, checked in well under a microsecond
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


def buckets_for(expected: int) -> int:
    """Buckets (a power of 2, ≥ 16) of an index sized for ``expected`` ids."""
    return max(16, 1 << (max(1, _SLACK * int(expected)) - 1).bit_length())


def bucket_of(keys: np.ndarray, buckets: int) -> np.ndarray:
    """Home bucket of each int64 key: the top bits of (key ^ key >> 32) × golden-ratio
    constant. The fold first: ids that are themselves multiples of that constant (a common
    way to hash feature ids) would otherwise land in long runs."""
    shift = np.uint64(64 - (buckets.bit_length() - 1))
    x = keys.view(np.uint64)
    x = x ^ (x >> _FOLD)
    x *= _MULT
    x >>= shift
    return x.view(np.int64)  # < 2^(64-shift): viewing it as int64 is exact and free


def _probe(tab: np.ndarray, col: int, keys: np.ndarray, pos: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray]:
    """(bucket holding each key live or -1, its slot or 0), probing from buckets ``pos``."""
    mask = tab.shape[0] - 1
    n = keys.shape[0]
    out_pos = np.full(n, -1, np.int64)
    out_slot = np.zeros(n, np.int32)
    active = np.arange(n)
    p, k = pos, keys
    while active.size > _FEW:  # one bucket per round: one 16-byte gather per key
        g = np.take(tab, p, axis=0)
        v = g.view(np.int32)[:, 2 + col]
        hit = (g[:, 0] == k) & (v > 0)
        if hit.any():
            out_pos[active[hit]] = p[hit]
            out_slot[active[hit]] = v[hit]
        keep = ~hit & (v != EMPTY_SLOT)
        active, p, k = active[keep], (p[keep] + 1) & mask, k[keep]
    while active.size:  # the last keys sit in long runs: a window per round
        idx = (p[:, None] + _WIN_OFFSETS) & mask
        g = np.take(tab, idx, axis=0)
        v = g.view(np.int32)[..., 2 + col]
        hit = (g[..., 0] == k[:, None]) & (v > 0)
        stop = hit | (v == EMPTY_SLOT)
        first = stop.argmax(axis=1)
        r = np.arange(active.shape[0])
        found = hit[r, first]
        out_pos[active[found]] = idx[r, first][found]
        out_slot[active[found]] = v[r, first][found]
        more = ~stop[r, first]  # nothing decisive in this window: the next one
        active, p, k = active[more], (p[more] + _WINDOW) & mask, k[more]
    return out_pos, out_slot


def lookup_slots(tab: np.ndarray, keys: np.ndarray, col: int) -> np.ndarray:
    """Row slot of each int64 key (contiguous ``[n]``) in value copy ``col``, 0 when absent.

    Reads only: safe while the writer changes the *other* copy. ``tab``: ``int64 [B, 2]``.
    Every key first looks at its home bucket (one 16-byte gather: ~80% are decided there);
    the rest go on in windows, or for bulk requests in rounds (:func:`_probe`).
    """
    n = keys.shape[0]
    if n == 0:
        return np.zeros(0, np.int32)
    home = bucket_of(keys, tab.shape[0])
    g = np.take(tab, home, axis=0)
    v = g.view(np.int32)[:, 2 + col]
    slot = np.where(g[:, 0] == keys, v, 0)  # the key, live (> 0), or DELETED_SLOT (-1)
    rest = np.flatnonzero((slot <= 0) & (v != EMPTY_SLOT))  # neither found nor an EMPTY_SLOT bucket
    if rest.size:
        start = (home[rest] + 1) & (tab.shape[0] - 1)
        if rest.size <= _SMALL:
            slot[rest] = _windows(tab, col, keys[rest], start, _W)
        else:
            slot[rest] = _probe(tab, col, keys[rest], start)[1]
    return slot


def _windows(tab: np.ndarray, col: int, keys: np.ndarray, pos: np.ndarray, w: int
             ) -> np.ndarray:
    """Slots of a few ``keys`` probing windows of ``w``, then :data:`_WINDOW` buckets
    from ``pos`` (window-major arrays: numpy reduces over their outer axis fast)."""
    out = np.zeros(keys.shape[0], np.int32)
    active = np.arange(keys.shape[0])
    while True:
        g = np.take(tab, pos + np.arange(w)[:, None], axis=0, mode="wrap")  # [w, k, 2]
        v = g.view(np.int32)[..., 2 + col]
        found = np.where(g[..., 0] == keys, v, 0).max(axis=0)  # a key is live once at most
        np.maximum(found, 0, out=found)  # (a window of nothing but DELETED_SLOT copies of a key)
        out[active] = found
        more = (found == 0) & np.all(v, axis=0)  # not found, no EMPTY_SLOT bucket: undecided
        if not more.any():
            return out
        active, keys, pos = active[more], keys[more], pos[more] + w
        w = _WINDOW


class IdIndex:
    """Map unique int64 ids to positive int32 row slots, in two value copies.

    Args:
        tab: ``int64 [B, 2]`` bucket memory (B a power of 2 ≥ 16), private or shared:
            zeroed for a new index.
        name: shown in log lines (the owning table's name).
        used: buckets of ``tab`` that are not EMPTY_SLOT (0 for zeroed memory; counting them
            here would touch every page of a fresh index).
    """

    def __init__(self, tab: np.ndarray, name: str = "", used: int = 0) -> None:
        b = tab.shape[0]
        if tab.dtype != np.int64 or tab.ndim != 2 or tab.shape[1] != 2 or b < 16 \
                or b & (b - 1):
            raise ValueError(f"tab: expected int64 [B, 2] with B a power of 2 ≥ 16, got "
                             f"{tab.dtype} {tab.shape}")
        self.name = name
        self.tab = tab
        self._v = tab.view(np.int32).reshape(b, 4)
        # 1-D strided views: numpy's fast path for fancy indexing (2-D [array, int] is not)
        self._k = tab[:, 0]
        self._c = (self._v[:, 2], self._v[:, 3])
        self._mask = b - 1
        self.used = int(used)  # buckets not EMPTY_SLOT (live + DELETED_SLOT markers)

    @property
    def buckets(self) -> int:
        """Number of buckets (a power of 2)."""
        return self._mask + 1

    @property
    def nbytes(self) -> int:
        """Bytes of the bucket array."""
        return int(self.tab.nbytes)

    def find(self, keys: np.ndarray, col: int) -> tuple[np.ndarray, np.ndarray]:
        """(bucket of each key live in copy ``col`` or -1, its slot or 0)."""
        n = keys.shape[0]
        if n == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int32)
        if not accel.native_enabled():
            return _probe(self.tab, col, keys, bucket_of(keys, self.buckets))
        pos, slot = np.empty(n, np.int64), np.empty(n, np.int32)
        accel.native.index_find(self.tab, np.ascontiguousarray(keys, np.int64), col, pos, slot,
                                n >= _NOGIL_KEYS)
        return pos, slot

    def insert(self, keys: np.ndarray, slots: np.ndarray, col: int | None,
               other: int | None = None) -> np.ndarray:
        """Insert ``keys`` (unique, absent) with ``slots`` into copy ``col`` (None: both
        copies); returns their buckets. A bucket is free when its value is ≤ 0 in ``col``
        (and in copy ``other``, when given: a bucket live in the published copy is not
        reused even if this batch deleted it there).

        Each round, every unplaced key claims its bucket if free, else moves one bucket
        on. Several keys may claim one bucket: all write their key, the one whose key reads
        back won (keys are unique, so exactly one did) and only winners write their slot —
        never relying on the order of a fancy assignment. The key column of a free bucket
        is invisible to readers (they match only buckets live in their copy). The C loop
        (where it runs) places keys one at a time; ``ValueError`` there when no bucket is
        free (the owner keeps the load far below that).
        """
        n = keys.shape[0]
        if accel.native_enabled() and n:
            out = np.empty(n, np.int64)
            self.used += accel.native.index_insert(
                self.tab, np.ascontiguousarray(keys, np.int64),
                np.ascontiguousarray(slots, np.int32), -1 if col is None else col,
                -1 if other is None else other, out, n >= _NOGIL_KEYS)
            return out
        tab, hk, mask = self.tab, self._k, self._mask
        c = 0 if col is None else col
        vc = self._c[c]
        out = np.empty(keys.shape[0], np.int64)
        pos = bucket_of(keys, self.buckets)
        active = np.arange(keys.shape[0])
        k = keys
        rounds = 0  # each round moves every unplaced key on by a bucket at least
        while active.size:
            rounds += 1
            if rounds > self.buckets:
                raise self._full(active.size)
            g = np.take(tab, pos, axis=0).view(np.int32)
            free = g[:, 2 + c] <= 0
            if other is not None:
                free &= g[:, 2 + other] <= 0
            if free.all():
                fa, fp, fk, fs = active, pos, k, g[:, 2 + c]
            else:
                fa, fp, fk, fs = active[free], pos[free], k[free], g[:, 2 + c][free]
            hk[fp] = fk
            won = hk[fp] == fk
            if won.all():
                wa, wp, ws = fa, fp, fs
            else:
                wa, wp, ws = fa[won], fp[won], fs[won]
            self.used += int(np.count_nonzero(ws == EMPTY_SLOT))
            vals = slots[wa]
            vc[wp] = vals
            if col is None:
                self._c[1][wp] = vals
            out[wa] = wp
            keep = ~free
            if not won.all():
                keep[np.flatnonzero(free)[~won]] = True  # losers go on probing
            if not keep.any():
                break
            active, pos, k = active[keep], (pos[keep] + 1) & mask, k[keep]
            if active.size <= _FEW:  # the last keys sit in long runs: a window per round
                self._insert_tail(k, slots[active], active, pos, c, other, col, out,
                                  self.buckets - rounds)
                break
        return out

    def _full(self, left: int) -> ValueError:
        return ValueError(f"index {self.name!r}: no free bucket for {left} keys (all "
                          f"{self.buckets} buckets are live)")

    def _insert_tail(self, keys: np.ndarray, slots: np.ndarray, which: np.ndarray,
                     pos: np.ndarray, c: int, other: int | None, col: int | None,
                     out: np.ndarray, rounds: int) -> None:
        """:meth:`insert` for a few keys: each claims the first free bucket of a window
        from its position (same claim protocol; losers go on from the bucket they lost),
        in ``rounds`` rounds at most."""
        tab, hk, mask, vc = self.tab, self._k, self._mask, self._c[c]
        r = np.arange(keys.shape[0])
        while keys.size:
            rounds -= 1
            if rounds < 0:
                raise self._full(keys.size)
            idx = (pos[:, None] + _WIN_OFFSETS) & mask
            g = np.take(tab, idx, axis=0).view(np.int32)
            free = g[..., 2 + c] <= 0
            if other is not None:
                free &= g[..., 2 + other] <= 0
            first = free.argmax(axis=1)
            r = r[: keys.size]
            has = free[r, first]
            fp = idx[r, first]
            hk[fp[has]] = keys[has]
            won = has & (hk[fp] == keys)
            wp, ws = fp[won], slots[won]
            self.used += int(np.count_nonzero(g[r, first, 2 + c][won] == EMPTY_SLOT))
            vc[wp] = ws
            if col is None:
                self._c[1][wp] = ws
            out[which[won]] = wp
            more = ~won
            # no free bucket in the window: the next window; lost a claim: the next bucket
            pos = np.where(has, fp + 1, pos + _WINDOW)[more] & mask
            keys, slots, which = keys[more], slots[more], which[more]

    def set(self, pos: np.ndarray, values: np.ndarray | int, col: int | None) -> None:
        """Value of buckets ``pos`` in copy ``col`` (None: both copies)."""
        if col is None:
            self._c[0][pos] = values
            self._c[1][pos] = values
        else:
            self._c[col][pos] = values

    def copy_values(self, pos: np.ndarray, src: int, dst: int) -> None:
        """Copy the values of buckets ``pos`` from copy ``src`` to copy ``dst``."""
        if pos.size:
            self._c[dst][pos] = self._c[src][pos]

    def sync_copies(self, src: int) -> None:
        """Make the other copy equal to copy ``src`` everywhere (O(buckets))."""
        self._c[1 - src][...] = self._c[src]

    def first_empty(self) -> int:
        """The first bucket EMPTY_SLOT in both copies — no probe run crosses it, so every key
        after it sits at or after its home bucket — or 0 when there is none."""
        step = 1 << 12
        for lo in range(0, self.buckets, step):
            hit = np.flatnonzero((self._v[lo:lo + step, 2:] == EMPTY_SLOT).all(axis=1))
            if hit.size:
                return lo + int(hit[0])
        return 0

    def live(self, col: int, start: int = 0, stop: int | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
        """(keys, slots) live in copy ``col`` among buckets ``[start, stop)``; copies."""
        v = self._c[col][start:stop]
        hit = np.flatnonzero(v > 0)
        return self._k[start:stop][hit], v[hit]
