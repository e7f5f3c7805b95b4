"""Rows keyed by id in reusable slots: the storage the pending set and the carried rows share.

A :class:`SlotPool` maps unique int64 ids to slots (a
:class:`~deltastream.embedding.hash_index.HashIndex`), keeps each slot's id, a stamp (the
liveness counter of :class:`~deltastream.publishing.score_order.ScoreOrder` entries: bumped
when a slot's entries die) and whether it is live, and hands out free slots from a stack.
The owner's per-slot columns (rows, flags, scores) live in :attr:`SlotPool.cols` and grow
with the slots, so a slot number indexes every one of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Union

import numpy as np
import torch

from deltastream.embedding.hash_index import HashIndex
from deltastream.tracking.sorted_ids import sort_ids_with_perm

__all__ = ["SlotPool", "Column"]

#: a per-slot column: first dimension = the pool's capacity
Column = Union[torch.Tensor, np.ndarray]


def _grown(x: Column, n: int) -> Column:
    """``x`` with ``n`` rows: its rows first, zeros (False) after."""
    if isinstance(x, np.ndarray):
        out = np.zeros((n,) + x.shape[1:], dtype=x.dtype)
    else:
        out = torch.zeros((n,) + tuple(x.shape[1:]), dtype=x.dtype)
    out[:x.shape[0]] = x
    return out


class SlotPool:
    """Slots for rows keyed by unique ids (see the module docstring).

    Args:
        columns: the owner's per-slot columns by name, zero-filled, all of ``capacity``
            rows (their first dimension); grown with the pool, read and written by the owner
            through :attr:`cols`.
        name: the index's name (in its messages).
    """

    def __init__(self, columns: Mapping[str, Column], name: str) -> None:
        capacity = len(next(iter(columns.values())))
        self.index = HashIndex(capacity, torch.device("cpu"), name=name)
        self.ids = torch.zeros(capacity, dtype=torch.int64)  #: the id in each slot
        self.stamp = np.zeros(capacity, dtype=np.int64)  #: ScoreOrder liveness
        self.live = np.zeros(capacity, dtype=bool)  #: slots in use
        self.cols: dict[str, Column] = dict(columns)
        self._free = np.arange(capacity - 1, -1, -1, dtype=np.int64)  # a stack
        self._nfree = capacity

    def __len__(self) -> int:
        return self.index.live

    @property
    def capacity(self) -> int:
        return int(self.ids.shape[0])

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """Slot of each id of int64 ``ids`` ``[n]`` (-1 where it has none)."""
        return self.index.probe(ids)[0]

    def by_id(self, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, slots)`` of live ``slots`` (unique), ordered by ascending id (int64)."""
        s = torch.from_numpy(np.asarray(slots, dtype=np.int64))
        ids, order = sort_ids_with_perm(self.ids.index_select(0, s))
        return ids, s.index_select(0, order)

    def live_slots(self) -> np.ndarray:
        """Every live slot, ascending (O(capacity))."""
        return np.flatnonzero(self.live)

    def add(self, ids: torch.Tensor) -> torch.Tensor:
        """Slots for ``ids`` (int64 ``[n]``, unique, none held yet), marked live; returns
        them (int64 ``[n]``). The owner fills its columns at those slots."""
        n = int(ids.numel())
        if n > self._nfree:
            self._grow(n)
        self._nfree -= n
        slots = torch.from_numpy(self._free[self._nfree:self._nfree + n].copy())
        self.index.reserve(n, self._entries)
        self.index.insert(ids, slots)
        self.ids.index_copy_(0, slots, ids)
        self.live[slots.numpy()] = True
        return slots

    def remove(self, ids: torch.Tensor) -> np.ndarray:
        """Free the slots of those of ``ids`` (unique) that hold one; returns those slots."""
        _, slots = self.index.remove(ids)
        s = slots.numpy()
        self._release(s)
        return s

    def remove_slots(self, slots: np.ndarray) -> None:
        """Free ``slots`` (unique, live)."""
        if slots.size:
            self.index.remove(self.ids.index_select(0, torch.from_numpy(slots)))
            self._release(slots)

    def _release(self, slots: np.ndarray) -> None:
        if slots.size == 0:
            return
        self.stamp[slots] += 1  # their entries in the orders are dead now
        self.live[slots] = False
        if self._nfree + slots.size > self._free.size:
            self._free = _grown(self._free, max(2 * self._free.size, self._nfree + slots.size))
        self._free[self._nfree:self._nfree + slots.size] = slots
        self._nfree += int(slots.size)

    def _grow(self, n: int) -> None:
        old = self.capacity
        cap = max(2 * old, old + n)
        self.ids, self.stamp, self.live = (_grown(self.ids, cap), _grown(self.stamp, cap),
                                           _grown(self.live, cap))
        for name, col in self.cols.items():
            self.cols[name] = _grown(col, cap)
        extra = np.arange(cap - 1, old - 1, -1, dtype=np.int64)
        self._free = np.concatenate([extra, self._free[:self._nfree]])
        self._nfree += cap - old

    def _entries(self) -> tuple[torch.Tensor, torch.Tensor]:
        slots = torch.from_numpy(self.live_slots())
        return self.ids.index_select(0, slots), slots
