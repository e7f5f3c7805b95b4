"""Reads taken early for the tracker's reader of states, at the read of a consumer of ids.

A consumer of ids only (``DeltaTracker(id_only_consumers=...)``, the demo's snapshot) reads
every pending lookup. Its read's boundary would turn the pending marks of every table into
sorted records with FIRST states (~1 ms a table at 12 K rows), and the reader of states (a
publisher's consumer, reading unordered with its current rows owed) would then read each such
table the sorted way, on the training thread: flush, merge, current rows gathered, ~3.5 ms a
table (BENCHMARKS, stop 76). Instead the tables that reader's reads owe are read for it first,
the way its own hand-off reads them (unordered, rows owed; the interval becoming the consumers
of ids' record as it does then), and held here until its next read of each, which returns them:
a read as of that moment, what changed since staying for its read after. A sorted read by that
consumer takes them in as retained rows (:meth:`EarlyReads.take`, then the tracker's merge).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Optional

import torch

from deltastream.embedding.row_storage import cpu_row_storage
from deltastream.tracking.rows import UnorderedRows, carry_rows, drop_ids
from deltastream.types import DeltaRows

__all__ = ["EarlyReads"]


class EarlyReads:
    """Which consumer reads owing its current rows, the tables it owed, and the rows read
    early for it that it has not been handed yet."""

    def __init__(self) -> None:
        self.reader: Optional[str] = None  #: the consumer that reads with rows owed
        self.owed: frozenset[str] = frozenset()  #: tables its reads owed (ever)
        self.rows: dict[str, Any] = {}  #: ``{fqn: UnorderedRows | DeltaRows}`` not handed over

    def note(self, reader: str, owe: Mapping[str, torch.Tensor]) -> None:
        """``reader`` read owing the current rows of ``owe``'s tables."""
        if owe:
            if reader != self.reader:
                self.reader, self.owed = reader, frozenset()
            self.owed |= owe.keys()

    def take(self, reader: Optional[str], tables: Iterable[str]) -> dict[str, Any]:
        """The rows read early for ``reader`` of ``tables``, handed over (removed)."""
        if reader is None or reader != self.reader or not self.rows:
            return {}
        return {f: self.rows.pop(f) for f in list(tables) if f in self.rows}

    def due(self, pending: Mapping[str, Any], tables: Mapping[str, Any],
            carried: Iterable[str]) -> dict[str, torch.Tensor]:
        """``{fqn: its rows' storage now}`` of the tables to read early: owed by the
        reader's reads, with lookups ``pending`` (``.n`` > 0), none held early or
        ``carried`` (retained: those read the sorted way); ``tables``: ``{fqn: its
        TrackedTable}``."""
        out = {}
        for fqn in self.owed - self.rows.keys() - set(carried):
            if getattr(pending.get(fqn), "n", 0):
                rows = cpu_row_storage(tables[fqn].module)
                if rows is not None:
                    out[fqn] = rows
        return out

    def retain(self, reader: str, tables: Iterable[str], written: Callable[[], Any],
               evicted: Callable[[list[str]], Mapping[str, torch.Tensor]],
               carry: dict[str, DeltaRows]) -> dict[str, torch.Tensor]:
        """The rows read early for ``reader``, which now reads whole, join its ``carry``
        (retained rows, older: theirs win), sorted, less the ids ``evicted(tables)`` since;
        returns their tombstones (``{fqn: ids}``) for that read. ``written()`` completes
        their owed walks first (their ids)."""
        early = self.take(reader, tables)
        if not early:
            return {}
        written()
        gone, tombs = evicted(list(early)), {}
        for fqn, d in early.items():
            rows = d.finish()[0] if isinstance(d, UnorderedRows) else d
            _give_back(d)
            tombs[fqn] = rows.tombstones
            carry_rows(carry, fqn, drop_ids(rows, gone[fqn]), retains=0)  # not retained
        return tombs

    def drop(self, reader: Optional[str], tables: Iterable[str],
             written: Callable[[], Any]) -> None:
        """Forget the rows read early for ``reader`` (None: whoever it is) of ``tables``,
        their buffers given back once ``written()`` completed their walks."""
        dropped = self.take(self.reader if reader is None else reader, tables)
        if dropped:
            written()
            for d in dropped.values():
                _give_back(d)


def _give_back(d: Any) -> None:
    """Let the tracker reuse the buffers of rows read early (an ``UnorderedRows``'s)."""
    if isinstance(d, UnorderedRows) and d.give_back is not None:
        d.give_back()
