"""Frozen views of a serving table: what a checkpoint or an export reads, off the lock.

A view is taken by the table's writer side in O(free slots) or O(changes) — no row is
copied then — and pins the rows it refers to: the table keeps applying meanwhile (rows are
copy-on-write, so the pinned slots keep the values of the frozen state) and reuses none of
them until :meth:`release`. Everything expensive (sorting the ids, gathering the rows in
id order chunk by chunk) happens in the thread that consumes the view, e.g. a background
checkpoint writer, while readers and the writer go on.

* :class:`FrozenTable` — every row of the table at one state (a base, an export);
* :class:`FrozenChanges` — the rows written and ids deleted since the previous take
  (a checkpoint segment).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any, Optional

import numpy as np

__all__ = ["FrozenTable", "FrozenChanges", "CHUNK_ROWS"]

log = logging.getLogger(__name__)

#: rows gathered per chunk when a view is written out (16 MiB at dim 64 f32)
CHUNK_ROWS = 1 << 16


class _Frozen:
    """Common part: slots to read, their ids sorted, row chunks, release."""

    def __init__(self, name: str, dim: int, dtype: str, rows: np.ndarray,
                 slot_ids: np.ndarray, release: Callable[[], None]) -> None:
        self.name, self.dim, self.dtype = name, dim, dtype
        self._rows, self._slot_ids = rows, slot_ids
        self._release: Optional[Callable[[], None]] = release
        self._ids: Optional[np.ndarray] = None
        self._slots: Optional[np.ndarray] = None

    def _live_slots(self) -> np.ndarray:
        raise NotImplementedError

    def _sorted(self) -> tuple[np.ndarray, np.ndarray]:
        # big arrays go through take/argsort/flatnonzero, which run without the GIL
        # (np.unique and boolean indexing of millions of items would hold it for long)
        if self._ids is None:
            self._check()
            slots = self._live_slots()
            ids = np.take(self._slot_ids, slots)
            order = np.argsort(ids)  # ids are unique: no need for a stable sort
            self._ids, self._slots = np.take(ids, order), np.take(slots, order)
        assert self._slots is not None
        return self._ids, self._slots

    def _check(self) -> None:
        if self._release is None:
            raise RuntimeError(f"frozen view of table {self.name!r} used after release()")

    @property
    def ids(self) -> np.ndarray:
        """Ids, int64 ascending ``[n]``."""
        return self._sorted()[0]

    @property
    def n(self) -> int:
        """Rows in the view."""
        return int(self._sorted()[0].shape[0])

    def row_chunks(self, rows: int = CHUNK_ROWS) -> Iterator[np.ndarray]:
        """Rows in id order (storage dtype), ``[≤ rows, dim]`` per chunk."""
        _, slots = self._sorted()
        for i in range(0, slots.shape[0], rows):
            self._check()
            yield np.take(self._rows, slots[i: i + rows], axis=0)

    def rows(self) -> np.ndarray:
        """All rows in id order (storage dtype ``[n, dim]``): a copy."""
        _, slots = self._sorted()
        self._check()
        return np.take(self._rows, slots, axis=0)

    def release(self) -> None:
        """Done reading: the table may reuse the pinned rows. Idempotent."""
        rel, self._release = self._release, None
        if rel is not None:
            rel()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __del__(self) -> None:  # a view dropped unreleased must not pin rows forever
        try:
            self.release()
        except Exception:  # interpreter shutdown
            pass


class FrozenTable(_Frozen):
    """Every row of a table at one published state: the slots below ``hwm`` but those in
    ``non_live`` (free or retired at that state)."""

    def __init__(self, name: str, dim: int, dtype: str, rows: np.ndarray,
                 slot_ids: np.ndarray, hwm: int, non_live: np.ndarray, live: int,
                 release: Callable[[], None]) -> None:
        super().__init__(name, dim, dtype, rows, slot_ids, release)
        self._hwm, self._non_live, self._live = hwm, non_live, live

    def _live_slots(self) -> np.ndarray:
        mask = np.ones(self._hwm, np.bool_)
        mask[0] = False  # the zero row of unknown ids
        mask[self._non_live] = False
        slots = np.flatnonzero(mask)
        if slots.shape[0] != self._live:  # a bookkeeping bug must not write a wrong base
            raise RuntimeError(f"table {self.name!r}: {slots.shape[0]} live slots, "
                               f"{self._live} ids")
        return slots


class FrozenChanges(_Frozen):
    """Rows written and ids deleted since the previous take of a table: of the slots
    ``written`` since (arrays), those live at the frozen state (below ``hwm``, not in
    ``non_live``); of the ids ``deleted`` since (arrays), those absent at that state."""

    def __init__(self, name: str, dim: int, dtype: str, rows: np.ndarray,
                 slot_ids: np.ndarray, hwm: int, non_live: np.ndarray,
                 written: list[np.ndarray], deleted: list[np.ndarray],
                 release: Callable[[], None]) -> None:
        super().__init__(name, dim, dtype, rows, slot_ids, release)
        self._hwm, self._non_live = hwm, non_live
        self._written, self._gone = written, deleted
        self._deleted: Optional[np.ndarray] = None

    def _live_slots(self) -> np.ndarray:
        mask = np.zeros(self._hwm, np.bool_)  # dedup and sort by marking: no np.unique
        for s in self._written:
            mask[s] = True
        mask[self._non_live] = False
        mask[0] = False
        return np.flatnonzero(mask)

    @property
    def deleted(self) -> np.ndarray:
        """Ids deleted since the previous take and absent at this state, int64 ascending
        (an id deleted then written again is an upsert)."""
        if self._deleted is None:
            ids = self.ids
            gone = np.unique(np.concatenate(self._gone)) if self._gone else \
                np.zeros(0, np.int64)
            self._deleted = np.setdiff1d(gone, ids, assume_unique=True)
        return self._deleted
