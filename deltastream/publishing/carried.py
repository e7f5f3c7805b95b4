"""The rows :func:`~deltastream.publish_delta` carries between rounds, kept scored and ordered.

A round of a count or error budget publishes some of a table's candidates and carries the
rest to the next round. Re-reading and re-scoring every carried row each round costs
O(rows carried); yet a carried row's drift ``‖current − FIRST‖`` changes only when the row
changes, and the tracker reports every row that changed. :class:`CarriedTable` keeps one
table's carried rows in slots — id, FIRST state (what predictors hold), ``new`` flag, the
round it was first a candidate (``birth``: its age is ``round − birth``) and its drift —
and keeps them ordered by drift, one :class:`~deltastream.publishing.score_order.ScoreOrder`
per ``(birth, new)`` group. A row's priority key
(:func:`~deltastream.publishing.selection_rules.priority_keys`) is a function of its drift,
age and ``new`` flag only, increasing in the drift within a group; so the rows a budget
takes are found from the groups' heads (:func:`top_slots`), and a round reads the rows
that changed plus about the rows it takes, not every carried row.

:class:`CarriedState` holds these tables per consumer of one tracker, with the round count.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Optional

import numpy as np
import torch

from deltastream.publishing.score_order import ScoreOrder
from deltastream.publishing.slot_pool import SlotPool
from deltastream.types import DeltaRows

__all__ = ["CarriedTable", "CarriedState", "carried_state", "top_slots"]

_EMPTY = np.empty(0, dtype=np.int64)

#: ``(births int64 [m], new flags bool [m], drifts float64 [m]) -> float64 keys [m]``
KeyFn = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


class CarriedTable:
    """One table's carried rows (see the module docstring).

    Args:
        dim: row width. dtype: the FIRST states' dtype.
        new_rows: the ``new_rows`` rule the drifts were computed under.
    """

    def __init__(self, dim: int, dtype: torch.dtype, new_rows: str,
                 capacity: int = 1024) -> None:
        self.dim, self.dtype, self.new_rows = dim, dtype, new_rows
        #: slots and their columns: FIRST state, new flag, birth round, drift
        self._slots = SlotPool({"first": torch.zeros(capacity, dim, dtype=dtype),
                                "new": np.zeros(capacity, dtype=bool),
                                "birth": np.zeros(capacity, dtype=np.int64),
                                "drift": np.zeros(capacity, dtype=np.float64)}, "carried")
        self._c = self._slots.cols
        self.groups: dict[tuple[int, bool], ScoreOrder] = {}
        self._group_live: dict[tuple[int, bool], int] = {}

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def group_sizes(self) -> dict[tuple[int, bool], int]:
        """Carried rows per ``(birth, new)`` group (read only)."""
        return self._group_live

    @property
    def stamps(self) -> np.ndarray:
        """Each slot's stamp (for :meth:`ScoreOrder.top`)."""
        return self._slots.stamp

    def live_slots(self) -> np.ndarray:
        """Every carried slot (O(capacity): for a round that takes them all)."""
        return self._slots.live_slots()

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """Slot of each id of int64 ``ids`` ``[n]`` (-1 when not carried)."""
        return self._slots.find(ids)

    def columns(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """``(FIRST [n, dim], new bool np [n], birth int64 np [n])`` of ``slots``."""
        s = slots.numpy()
        return self._c["first"].index_select(0, slots), self._c["new"][s], self._c["birth"][s]

    def add(self, ids: torch.Tensor, first: torch.Tensor, new: np.ndarray, birth: np.ndarray,
            drift: np.ndarray) -> None:
        """Carry rows of ``ids`` (int64 ``[n]``, unique, not carried yet) with their FIRST
        states ``[n, dim]``, ``new`` flags, birth rounds and drifts (float64)."""
        if ids.numel() == 0:
            return
        slots = self._slots.add(ids)
        s = slots.numpy()
        self._c["first"].index_copy_(0, slots, first.to(self.dtype))
        self._c["new"][s], self._c["birth"][s], self._c["drift"][s] = new, birth, drift
        self._slots.stamp[s] += 1
        self._join(s)

    def rescore(self, slots: np.ndarray, new: np.ndarray, drift: np.ndarray) -> None:
        """Carried ``slots`` (unique) changed: their new drifts (float64) and ``new`` flags
        (their FIRST states and births stay); they are ordered anew."""
        if slots.size == 0:
            return
        self._leave(slots)
        self._c["new"][slots], self._c["drift"][slots] = new, drift
        self._slots.stamp[slots] += 1  # their older entries in the orders are dead now
        self._join(slots)

    def remove(self, slots: np.ndarray) -> None:
        """Stop carrying ``slots`` (unique, live)."""
        if slots.size == 0:
            return
        self._leave(slots)
        self._slots.remove_slots(slots)

    def _join(self, slots: np.ndarray) -> None:
        """Enter ``slots`` (their current stamps) in their groups' orders."""
        for key, where in _by_group(self._c["birth"][slots], self._c["new"][slots]):
            at = slots[where]
            order = self.groups.setdefault(key, ScoreOrder())
            self._group_live[key] = self._group_live.get(key, 0) + int(at.size)
            stamp = self._slots.stamp
            order.add(self._c["drift"][at], at, stamp[at], stamp, self._group_live[key])

    def _leave(self, slots: np.ndarray) -> None:
        """Count ``slots`` out of their groups (their entries die with their stamps)."""
        for key, where in _by_group(self._c["birth"][slots], self._c["new"][slots]):
            left = self._group_live[key] - int(where.size)
            if left:
                self._group_live[key] = left
            else:
                del self._group_live[key], self.groups[key]

    def take(self, slots: np.ndarray, round_: int) -> tuple[DeltaRows, np.ndarray]:
        """Remove ``slots`` and return their rows, ids ascending, as ``(DeltaRows with FIRST
        states, new flags and ages at round ``round_``, drifts float64)``."""
        ids, s = self._slots.by_id(slots)
        sn = s.numpy()
        rows = DeltaRows(ids=ids, states=self._c["first"].index_select(0, s),
                         new=torch.from_numpy(self._c["new"][sn].copy()),
                         age=torch.from_numpy(round_ - self._c["birth"][sn]))
        drift = self._c["drift"][sn].copy()
        self.remove(sn)
        return rows, drift


def _by_group(birth: np.ndarray, new: np.ndarray):
    """``((birth, new), positions)`` of each group present in ``birth``/``new`` ``[n]``."""
    code = birth * 2 + new
    uniq, inverse = np.unique(code, return_inverse=True)
    if uniq.size == 1:
        yield (int(uniq[0]) >> 1, bool(uniq[0] & 1)), np.arange(code.size)
        return
    order = np.argsort(inverse, kind="stable")
    bounds = np.searchsorted(inverse[order], np.arange(uniq.size + 1))
    for i, c in enumerate(uniq.tolist()):
        yield (c >> 1, bool(c & 1)), order[bounds[i]:bounds[i + 1]]


def _tagged(groups: list[tuple[int, bool]], sizes: list[int]
            ) -> tuple[np.ndarray, np.ndarray]:
    """Births and new flags of ``sizes[i]`` rows of each group ``groups[i]``."""
    births = np.repeat(np.array([g[0] for g in groups], dtype=np.int64), sizes)
    return births, np.repeat(np.array([g[1] for g in groups], dtype=bool), sizes)


def top_slots(table: CarriedTable, cap: int, key: KeyFn,
              eligible_from: Callable[[bool], Optional[float]]) -> np.ndarray:
    """The (at most ``cap``) eligible carried slots of highest priority ``key``.

    ``eligible_from(new)``: the least drift a row of a group with that ``new`` flag needs to
    be eligible (None: every row is). A group whose lowest possible key (drift 0) is at
    least every other group's highest (drift ``inf``) — a tier of its own, e.g. new or
    overdue rows of one age — is taken whole while it fits. Of the others, each group's
    best rows are read, more of a group only while its next row could still outrank the
    ``cap``-th best row read so far: about ``cap`` rows plus a few per group, not every
    carried row. Rows of exactly equal key at the boundary: either may be taken (as in
    ``select_changed``)."""
    if cap <= 0 or not table.groups:
        return _EMPTY
    groups = list(table.groups)
    b = key(*_tagged(groups, [2] * len(groups)), np.tile([0.0, np.inf], len(groups)))
    bounds = dict(zip(groups, b.reshape(-1, 2).tolist(), strict=True))
    rest = sorted(groups, key=lambda g: -bounds[g][1])
    whole = []
    while rest and eligible_from(rest[0][1]) is None:
        g, n = rest[0], table.group_sizes[rest[0]]
        if n > cap or (len(rest) > 1 and bounds[g][0] < bounds[rest[1]][1]):
            break
        whole.append(table.groups[g].top(n, table.stamps)[1])
        cap -= n
        rest.pop(0)
    if cap > 0 and rest:
        whole.append(_best_of(table, rest, cap, key, eligible_from))
    return np.concatenate(whole) if whole else _EMPTY


def _best_of(table: CarriedTable, groups: list[tuple[int, bool]], cap: int, key: KeyFn,
             eligible_from: Callable[[bool], Optional[float]]) -> np.ndarray:
    """The ``cap`` eligible slots of highest key among ``groups`` (see :func:`top_slots`)."""
    want = dict.fromkeys(groups, max(64, 2 * cap // len(groups)))
    while True:
        drifts, slots, more = [], [], []
        for g in groups:
            d, s, rest = table.groups[g].top(want[g] + 1, table.stamps)
            floor = eligible_from(g[1])
            if floor is not None:
                ok = int(np.count_nonzero(d >= floor))  # drifts descend: a prefix
                rest = rest and ok == d.size
                d, s = d[:ok], s[:ok]
            more.append(rest or d.size > want[g])
            drifts.append(d[:want[g]])
            slots.append(s[:want[g]])
        sizes = [d.size for d in drifts]
        k = key(*_tagged(groups, sizes), np.concatenate(drifts))
        s = np.concatenate(slots)
        ends = np.cumsum(sizes)
        # a group's next row is at most its last read row's key
        edge = {g: float(k[e - 1]) if n else np.inf
                for g, m, n, e in zip(groups, more, sizes, ends, strict=True) if m}
        if not edge:
            return s if k.size <= cap else s[np.argpartition(-k, cap - 1)[:cap]]
        kth = float(np.partition(k, k.size - cap)[k.size - cap]) if k.size >= cap else -np.inf
        if kth >= max(edge.values()):  # no unread row outranks the cap-th read one
            return s[np.argpartition(-k, cap - 1)[:cap]]
        for g, e in edge.items():
            if e > kth:
                want[g] *= 4


class CarriedState:
    """The carried tables of every consumer of one tracker, and each consumer's round."""

    def __init__(self) -> None:
        self.tables: dict[str, dict[str, CarriedTable]] = {}
        self.rounds: dict[str, int] = {}
        #: ``{(consumer, fqn): rows}`` the table's last round from carried rows read
        self.changed: dict[tuple[str, str], int] = {}

    def next_round(self, consumer: str) -> int:
        """Count a round of ``consumer``; returns its number (1, 2, ...)."""
        self.rounds[consumer] = self.rounds.get(consumer, 0) + 1
        return self.rounds[consumer]

    def of(self, consumer: str) -> dict[str, CarriedTable]:
        """``{fqn: CarriedTable}`` of ``consumer`` (created empty)."""
        return self.tables.setdefault(consumer, {})


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def carried_state(tracker: Any) -> CarriedState:
    """The :class:`CarriedState` of ``tracker`` (created on first use, gone with it)."""
    state = _STATES.get(tracker)
    if state is None:
        state = _STATES[tracker] = CarriedState()
    return state
