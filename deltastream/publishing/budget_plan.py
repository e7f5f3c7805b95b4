"""Which pending rows one budget round publishes: the overdue tier, then score per byte.

:func:`choose` reads the orders each :class:`~deltastream.publishing.pending.PendingTable`
keeps (by serving error, by birth tick) and returns the slots to publish per table. It
reads only the heads of those orders — about as many rows as the tokens pay for — so a
round costs O(rows chosen), whatever the number of rows pending.

Ranking (see :mod:`deltastream.publishing.budget` for the rules and their bounds): a row's
key is ``error / scale_t · weight_t`` (``/ row bytes`` when ``per_byte``; ``error`` times
its read weight when the tables keep them); rows of all
tables are taken by decreasing key until the tokens are spent, each table's first row also
paying its message overhead; overdue rows (carried ``max_age`` ticks or more) go first,
oldest first, within ``overdue_share`` of the tokens but always the oldest one.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from deltastream.publishing.pending import PendingTable

__all__ = ["Candidate", "Choice", "choose"]


@dataclass
class Candidate:
    """One table as the round sees it.

    ``scale``: the table's error scale (1 when errors are raw); ``weight``: its policy
    weight; ``row_cost``: wire bytes of one row; ``overhead``: estimated bytes of a message
    beyond its rows."""

    table: PendingTable
    scale: float
    weight: float
    row_cost: float
    overhead: float


@dataclass
class Choice:
    """Slots to publish per candidate index, and how many came from the overdue tier."""

    slots: dict[int, np.ndarray] = field(default_factory=dict)
    overdue: int = 0
    starved: bool = False  # a full bucket paid for no eligible row


def _keys(c: Candidate, rank: np.ndarray, per_byte: bool) -> np.ndarray:
    """Round keys of rows whose ``by_rank`` keys are ``rank``."""
    with np.errstate(invalid="ignore"):
        k = rank * (c.weight / c.scale)
        if per_byte:
            k = k / c.row_cost
    # a key of NaN (0 × inf weight) on a finite row: it moved, it must go
    return np.where(np.isnan(k), math.inf, k)


def _prefix(cost: np.ndarray, tidx: np.ndarray, overhead: np.ndarray, paid: np.ndarray,
            cap: float) -> tuple[int, float]:
    """Length and bytes of the longest prefix whose bytes (rows, plus one overhead per
    table not ``paid`` yet) fit in ``cap``; marks those tables paid."""
    if cap <= 0 or cost.size == 0:
        return 0, 0.0
    c = cost.astype(np.float64)
    uniq, first = np.unique(tidx, return_index=True)
    unpaid = ~paid[uniq]
    c[first[unpaid]] += overhead[uniq[unpaid]]
    cum = np.cumsum(c)
    n = int(np.searchsorted(cum, cap, side="right"))
    if n:
        paid[np.unique(tidx[:n])] = True
    return n, float(cum[n - 1]) if n else 0.0


def _overdue(cands: list[Candidate], tick: int, max_age: int, min_error: float,
             per_byte: bool, enough: float) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
    """The oldest overdue rows as ``[(birth, table index, slots, keys)]``, oldest first:
    whole births, until their rows' bytes reach ``enough`` (the round cannot take more, so
    a round reads O(rows it can take + one birth), not every overdue row). Within one birth
    the caller orders by key."""
    def stream(i: int, t: PendingTable):
        for b, s in t.by_age.oldest(tick - max_age, t.lives):
            yield b, i, s

    streams = [stream(i, c.table) for i, c in enumerate(cands)]
    out: list[tuple[int, int, np.ndarray, np.ndarray]] = []
    got = 0.0
    for birth, i, slots in heapq.merge(*streams, key=lambda x: (x[0], x[1])):
        if out and got >= enough and birth != out[-1][0]:
            break
        c = cands[i]
        slots = slots[c.table.errors(slots) >= min_error * c.scale]
        if slots.size:
            out.append((birth, i, slots, _keys(c, c.table.rank_keys(slots), per_byte)))
            got += slots.size * c.row_cost
    return out


def _ordered(groups: list[tuple[int, int, np.ndarray, np.ndarray]]
             ) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate groups into ``(table index, slot)`` order: birth, then key."""
    if not groups:
        e = np.empty(0, dtype=np.int64)
        return e, e
    births = np.concatenate([np.full(g[2].size, g[0], dtype=np.int64) for g in groups])
    tidx = np.concatenate([np.full(g[2].size, g[1], dtype=np.int64) for g in groups])
    slots = np.concatenate([g[2] for g in groups])
    keys = np.concatenate([g[3] for g in groups])
    order = np.lexsort((-keys, births))  # last key is primary: birth, then key descending
    return tidx[order], slots[order]


def choose(cands: list[Candidate], tokens: float, *, tick: int, max_age: Optional[int],
           overdue_share: float, min_error: float, per_byte: bool, burst: float) -> Choice:
    """The slots one round publishes within ``tokens`` bytes (see the module docstring).

    ``tick``: the round's tick (a row born at tick ``b`` has age ``tick − b``); ``burst``:
    the bucket's size (the oldest overdue row that never fits in it does not block)."""
    out = Choice()
    if not cands or tokens <= 0:
        out.starved = tokens >= burst - 1e-9 and any(len(c.table) for c in cands)
        return out
    overhead = np.array([c.overhead for c in cands], dtype=np.float64)
    cost_of = np.array([c.row_cost for c in cands], dtype=np.float64)
    paid = np.zeros(len(cands), dtype=bool)
    picked: dict[int, list[np.ndarray]] = {}
    spent, blocked = 0.0, False
    if max_age is not None:
        enough = max(overdue_share * tokens, float((cost_of + overhead).max()))
        tidx, slots = _ordered(_overdue(cands, tick, max_age, min_error, per_byte, enough))
        if slots.size:
            head = float(cost_of[tidx[0]] + overhead[tidx[0]])
            cap = min(tokens, max(overdue_share * tokens, head))
            n, spent = _prefix(cost_of[tidx], tidx, overhead, paid, cap)
            for i in np.unique(tidx[:n]):
                picked.setdefault(int(i), []).append(slots[:n][tidx[:n] == i])
            out.overdue = n
            # the oldest overdue row does not fit: save the tokens for it (unless it never
            # can: a full bucket is smaller than it)
            blocked = n == 0 and head <= burst
    if not blocked:
        spent += _by_key(cands, tokens - spent, paid, picked, cost_of, overhead,
                         min_error, per_byte)
    out.slots = {i: np.concatenate(v) for i, v in picked.items()}
    if not out.slots and tokens >= burst - 1e-9:
        out.starved = any(len(c.table) for c in cands)
    return out


def _by_key(cands: list[Candidate], cap: float, paid: np.ndarray,
            picked: dict[int, list[np.ndarray]], cost_of: np.ndarray, overhead: np.ndarray,
            min_error: float, per_byte: bool) -> float:
    """Take rows by decreasing key into ``picked`` within ``cap`` bytes; the bytes taken.

    Reads the ``m`` best rows of each table, merges them and takes the prefix that fits;
    when the prefix runs past what is known to be complete, ``m`` grows (× 4)."""
    if cap <= 0:
        return 0.0
    already = {i: np.concatenate(v) for i, v in picked.items()}
    m = 256
    while True:
        parts, threshold = [], -math.inf
        for i, c in enumerate(cands):
            rank, slots, more = c.table.by_rank.top(m, c.table.stamps)
            if more and rank.size:  # rows of this table beyond its last key are unseen
                threshold = max(threshold, float(_keys(c, rank[-1:], per_byte)[0]))
            # plain errors for min_error: the keys themselves when they are the errors
            err = rank if c.table.by_rank is c.table.by_error else c.table.errors(slots)
            ok = err >= max(min_error * c.scale, np.finfo(np.float64).tiny)
            if i in already:
                ok &= ~np.isin(slots, already[i])
            parts.append((np.full(int(ok.sum()), i, dtype=np.int64), slots[ok],
                          _keys(c, rank[ok], per_byte)))
        tidx = np.concatenate([p[0] for p in parts])
        slots = np.concatenate([p[1] for p in parts])
        keys = np.concatenate([p[2] for p in parts])
        order = np.argsort(-keys, kind="stable")
        tidx, slots, keys = tidx[order], slots[order], keys[order]
        known = int(np.count_nonzero(keys > threshold)) if threshold > -math.inf else keys.size
        trial = paid.copy()
        n, spent = _prefix(cost_of[tidx[:known]], tidx[:known], overhead, trial, cap)
        if n < known or threshold == -math.inf:
            paid[:] = trial
            for i in np.unique(tidx[:n]):
                picked.setdefault(int(i), []).append(slots[:n][tidx[:n] == i])
            return spent
        m *= 4
