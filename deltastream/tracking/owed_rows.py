"""A hand-off's current rows, copied over the next ticks instead of all at its own.

A budget publisher's hand-off needs every changed row's value at the step boundary it was
taken at. Gathered at once, that is tens of thousands of cache misses in one tick of the
training thread. Deferred, the read only drains the marks and says which rows it **owes**;
each owed row is copied later, on the training thread, by whichever comes first:

* the next lookup of its position (the tracker's hook, in the forward, before the
  optimizer can write it: the row is the boundary's value, and hot from the forward's own
  read);
* the publisher's next ticks, a bounded slice of the owed positions each
  (:meth:`OwedRows.capture`);
* anything else about to change rows or reuse their positions: the tracker completes the
  capture first (a flush, an eviction, a reload, a switch to the scan, the next read).

That is exact under the lookups path's contract — a row changes only in a step that looked
it up — so every copied row is its value at the boundary, however late it is copied.
State: ``owed`` (int32 per position: 0, or 1 + the row of ``out`` its value goes to), the
drained ``positions`` (ascending) and a cursor into them. The C code is
``deltastream.tracking.native.capture_owed``; numpy does the same without it.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from deltastream.tensor_views import as_bytes
from deltastream.tracking.spare_rows import SpareRows

__all__ = ["OwedRows"]


class OwedRows:
    """The rows one hand-off still owes of one table (at most one hand-off at a time).

    Args:
        capacity: positions ``[0, capacity)`` (:meth:`grow` extends them).
    """

    __slots__ = ("owed", "positions", "out", "base", "storage", "next", "left", "_out_bytes")

    def __init__(self, capacity: int) -> None:
        self.owed = np.zeros(capacity, dtype=np.int32)
        self.positions = np.empty(0, dtype=np.int64)
        self.out: Optional[torch.Tensor] = None
        #: the buffer ``out`` is the first rows of (``[>= n, dim]``)
        self.base: Optional[torch.Tensor] = None
        self.storage: Optional[torch.Tensor] = None
        self._out_bytes: Optional[np.ndarray] = None
        self.next = 0  # positions before it were captured (by a slice or a lookup)
        self.left = 0  # rows still owed

    def grow(self, capacity: int) -> None:
        """Cover ``capacity`` positions (the owed ones kept)."""
        if capacity > self.owed.size:
            owed = np.zeros(capacity, dtype=np.int32)
            owed[:self.owed.size] = self.owed
            self.owed = owed

    def start(self, positions: torch.Tensor, storage: torch.Tensor,
              spares: SpareRows) -> torch.Tensor:
        """Owe the rows of ``positions`` (int64 CPU ``[n]``, unique, ascending) as they are
        in ``storage`` (the table's ``[capacity, dim]`` rows) now; returns the tensor
        ``[n, dim]`` they are copied to (complete once :attr:`left` is 0; the first rows of
        :attr:`base`, a buffer of ``spares``). The drain wrote ``owed``
        already (``owed[positions[i]] = i + 1``: ``drain_marked``'s ``owed``). Any rows
        still owed must have been captured (:meth:`capture` with no limit) first."""
        assert self.left == 0, "the previous hand-off's rows are still owed"
        n = int(positions.numel())
        self.base = spares.take(n, storage.shape[1], storage.dtype)
        self.out = self.base[:n]
        self._out_bytes = as_bytes(self.out)
        self.storage = storage
        self.positions = positions.numpy()
        self.next, self.left = 0, n
        return self.out

    def on_lookup(self, native: object, ids: np.ndarray, src: torch.Tensor,
                  by_occurrence: bool) -> None:
        """A lookup of positions ``ids`` (int32/int64 ``[n]``, checked by the marking) whose
        rows are ``src`` (the table's, or with ``by_occurrence`` the lookup's ``[n, dim]``
        output; None: the storage's), before any update: copy the owed ones."""
        if src is None or src.dtype != self.out.dtype or not src.is_contiguous():
            src, by_occurrence = self.storage, False  # the table's own rows, not yet updated
        if native is not None and src.is_contiguous():
            k = native.capture_owed(self.owed, ids, as_bytes(src), by_occurrence,
                                    self._out_bytes, self._row_bytes())
        else:
            k = self._capture_numpy(ids, src, by_occurrence)
        self._done(k)

    def capture(self, native: object, max_positions: Optional[int]) -> int:
        """Copy the owed rows among the next ``max_positions`` drained positions (None:
        all) from the storage; returns the positions walked."""
        if not self.left or max_positions == 0:
            return 0
        end = self.positions.size if max_positions is None \
            else min(self.positions.size, self.next + int(max_positions))
        ids = self.positions[self.next:end]
        src = self.storage
        if native is not None and src.is_contiguous():
            k = native.capture_owed(self.owed, ids, as_bytes(src), False, self._out_bytes,
                                    self._row_bytes())
        else:
            k = self._capture_numpy(ids, src, False)
        walked = end - self.next
        self.next = end
        self._done(k)
        return walked

    def _row_bytes(self) -> int:
        return self.out.shape[1] * self.out.element_size()

    def _capture_numpy(self, ids: np.ndarray, src: torch.Tensor, by_occurrence: bool) -> int:
        q = ids.astype(np.int64, copy=False)
        r = self.owed[q].astype(np.int64) - 1
        hit = np.flatnonzero(r >= 0)
        if hit.size:
            at = torch.from_numpy(hit if by_occurrence else q[hit])
            self.out[torch.from_numpy(r[hit])] = src.index_select(0, at).to(self.out.dtype)
            self.owed[q[hit]] = 0  # a repeat of a position: the same row again, harmless
        return int(np.unique(q[hit]).size) if hit.size else 0

    def _done(self, k: int) -> None:
        self.left -= k
        if self.left == 0:  # drop the references: the reader owns the rows now
            self.out, self.base, self._out_bytes, self.storage = None, None, None, None
            self.positions = np.empty(0, dtype=np.int64)
