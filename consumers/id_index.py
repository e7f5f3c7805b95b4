"""IdIndex: the serving table's int64 id -> row slot index (numpy open addressing).

An open-addressing hash table with linear probing (Fibonacci hashing of the int64 id) held
in two numpy arrays (``int64`` keys, ``int32`` slot or EMPTY/DELETED marker), probed
vectorized: each round handles every id still unresolved (one bucket per round, then windows
of 16 buckets for the last few ids in long runs), until every id hit its key or an EMPTY
bucket. The load factor (live + deleted markers) is kept in [0.2, 0.4] by rebuilding, so
~80-90% of ids resolve in the first round. At 1M ids the index costs 48 MB (4M buckets × 12
bytes).

Why a hash and not sorted keys + ``searchsorted``: a sorted index answers lookups in
O(log n) but every batch that brings new ids must merge them in, an O(resident) copy (16 MB
of keys and slots at 1M ids) per batch; a trainer that keeps discovering ids would make
every apply cost milliseconds regardless of batch size. The hash costs O(batch) per apply
and lookup, with an amortized O(resident) rebuild only when it grows (or when delete markers
pile up).

Not thread-safe: its owner (:class:`~consumers.serving_table.ServingTable`) holds a lock
around every call.
"""

from __future__ import annotations

import logging

import numpy as np

__all__ = ["IdIndex"]

log = logging.getLogger(__name__)

_EMPTY = np.int32(-1)
_DELETED = np.int32(-2)
_MULT = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: 2^64 / golden ratio, odd
_FEW = 64  # probe rounds switch from 1 bucket to a window when fewer keys remain
_WINDOW = 16
_WIN_OFFSETS = np.arange(_WINDOW, dtype=np.int64)[None, :]
_MAX_LOAD = 0.4  # rebuild when (live + deleted markers) would exceed this fraction
_REBUILD_SLACK = 3  # after a rebuild: buckets ≥ 3 × ids (power of 2: load in [0.19, 1/3])


def _hash(keys: np.ndarray, shift: np.uint64) -> np.ndarray:
    """Bucket of each int64 key: the top bits of key × golden-ratio constant (mod 2^64)."""
    # the result is < 2^(64-shift), so viewing it as int64 is exact and free
    return ((keys.view(np.uint64) * _MULT) >> shift).view(np.int64)


def _pow2_at_least(n: int) -> int:
    return max(16, 1 << (max(1, int(n)) - 1).bit_length())


class IdIndex:
    """Map unique int64 ids to positive int32 row slots (0 means "absent").

    Args:
        expected: ids to size the buckets for (grows by rebuilding).
        name: shown in log lines (the owning table's name).
    """

    def __init__(self, expected: int, name: str = "") -> None:
        self.name = name
        self._init(_pow2_at_least(_REBUILD_SLACK * max(int(expected), 1)))

    def _init(self, buckets: int) -> None:
        self._hkeys = np.zeros(buckets, np.int64)
        self._hvals = np.full(buckets, _EMPTY, np.int32)
        self._mask = buckets - 1
        self._shift = np.uint64(64 - (buckets.bit_length() - 1))
        self._used = 0  # buckets not EMPTY (live + DELETED markers)

    @property
    def buckets(self) -> int:
        """Number of buckets (a power of 2)."""
        return self._mask + 1

    @property
    def nbytes(self) -> int:
        """Bytes held by the bucket arrays."""
        return int(self._hkeys.nbytes + self._hvals.nbytes)

    def probe(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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

    def slots(self, keys: np.ndarray) -> np.ndarray:
        """Row slot of each key, 0 for absent keys."""
        return self.probe(keys)[1]

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

    def insert(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Insert ``keys`` (unique, all absent) pointing at row ``slots``; room reserved
        with :meth:`reserve`.

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

    def delete(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Remove the present ones of ``keys`` (repeats allowed); returns (their row slots,
        the removed keys), both ``[m]`` for the m distinct keys that were present."""
        pos, _ = self.probe(keys)
        pos = pos[pos >= 0]
        if pos.size == 0:
            return np.zeros(0, np.int32), np.zeros(0, np.int64)
        pos = np.unique(pos)  # a tombstone list may repeat an id
        slots = self._hvals[pos]
        self._hvals[pos] = _DELETED
        return slots, self._hkeys[pos]

    def reserve(self, new_keys: int, live: int) -> None:
        """Make room for ``new_keys`` more keys next to ``live`` present ones (rebuilds
        the buckets when the load factor would pass its bound)."""
        if self._used + new_keys > _MAX_LOAD * (self._mask + 1):
            self._rebuild(live + new_keys)

    def _rebuild(self, expected: int) -> None:
        """Rehash live ids into fresh buckets sized for ``expected`` ids (drops markers)."""
        keys, slots = self.items()
        old = (self._hkeys, self._hvals, self._mask, self._shift, self._used)
        try:
            self._init(_pow2_at_least(_REBUILD_SLACK * max(expected, 1)))
            self.insert(keys, slots)
        except BaseException:
            self._hkeys, self._hvals, self._mask, self._shift, self._used = old
            raise
        log.debug("table %s: index rebuilt with %d buckets for %d ids", self.name,
                  self._mask + 1, keys.shape[0])

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(present keys, their row slots), in bucket order (not sorted); copies."""
        live = self._hvals >= 0
        return self._hkeys[live], self._hvals[live]

    def keys(self) -> np.ndarray:
        """Present keys in bucket order (not sorted); a copy."""
        return self._hkeys[self._hvals >= 0]
