"""The training thread's part of a budget tick: a bounded hand-off of what changed.

:func:`take_handoff` runs on the training thread at the step boundary (after the optimizer
step and ``tracker.step()``): it reads the tracker consumer's delta — the rows changed since
the last hand-off, with their FIRST states — and copies those rows' **current values**.
The copy is what makes the rest safe off the thread: the publisher's worker scores and
sends the copy, never the live table the optimizer keeps writing, so no row is ever read
half-written. The work is O(rows changed since the last hand-off).

On the CPU, a table the tracker's C code keeps can **owe** its current rows instead
(:func:`owed_storages`, ``owe=`` here): the read takes the marks over whole, and the ids
and rows are written over the next ticks — a row at its next lookup (hot from the
forward's read), the rest a slice of the marks per tick
(:meth:`DeltaTracker.capture_rows`) — so no tick walks tens of thousands of rows at once
(:mod:`deltastream.tracking.owed_rows`). The hand-off goes to the worker once complete.

On CUDA the copy is asynchronous: the tracker hands over every lookup as recorded
(:class:`~deltastream.tracking.rows.RawRows`: repeats kept, since deduplicating on the
device needs a sync for the result's size), the current rows are gathered at the recorded
positions on the training stream (a kernel launch, no wait), then copied device → host
into pinned memory on a side stream that waits for the training stream; the hand-off
carries an event the worker polls before it deduplicates and reads
(:meth:`Handoff.wait`). The training stream is never synchronized with the host by this
code.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch

from deltastream.embedding.row_storage import cpu_row_storage, row_storage
from deltastream.publishing.table_rows import row_reader
from deltastream.tracking.row_copy import gather_rows
from deltastream.tracking.rows import RawRows, UnorderedRows
from deltastream.tracking.sorted_ids import first_occurrences, member
from deltastream.types import DeltaRows

if TYPE_CHECKING:
    from deltastream.tracking.tracker import DeltaTracker

__all__ = ["TableHandoff", "Handoff", "HostCopier", "owed_storages", "take_handoff"]


@dataclass
class TableHandoff:
    """One table's changed rows (host tensors once :meth:`Handoff.wait` returned).

    ``ids`` int64 ``[n]`` unique, ascending when ``ordered``; ``first`` ``[n, dim]`` FIRST
    states; ``current`` ``[n, dim]`` the values at the step boundary; ``new`` bool ``[n]``
    or None; ``tombstones`` int64 ``[m]`` or None. Not ``ordered`` (the tracker's
    :class:`~deltastream.tracking.rows.UnorderedRows`): ids in storage order, ``current``
    aligned with them, ``first`` the tracker's arena (``first_at[i]`` the row of
    ``ids[i]``), ``new`` None, ``inserted`` the interval's inserted ids (None: a table
    without ``new``), it and ``tombstones`` as recorded (repeats kept, any order); the
    worker works out ``new`` and the live tombstones (:meth:`live`), not the training
    thread, and merges the rows in that order.
    ``give_back`` (None: nothing to give): called once ``first`` and ``current`` are read
    (merged, or copied for the worker process: :meth:`rows_read`), it lets the tracker
    reuse their memory for a later interval. ``repeats``
    (an accelerator's :class:`~deltastream.tracking.rows.RawRows`): ``ids`` as recorded,
    repeats kept, ``first`` and ``current`` aligned, until :meth:`dedupe`."""

    fqn: str
    ids: torch.Tensor
    first: torch.Tensor
    current: torch.Tensor
    new: Optional[torch.Tensor]
    tombstones: Optional[torch.Tensor]
    inserted: Optional[torch.Tensor] = None
    first_at: Optional[torch.Tensor] = None
    ordered: bool = True
    give_back: Optional[Callable[[], None]] = None
    repeats: bool = False

    def __len__(self) -> int:
        return int(self.ids.numel())

    def rows_read(self) -> None:
        """``first`` and ``current`` are read (merged, or copied): call ``give_back`` once,
        so the tracker may write them again (later calls do nothing)."""
        back, self.give_back = self.give_back, None
        if back is not None:
            back()

    def dedupe(self) -> None:
        """Keep each id once (the tracker's :class:`~deltastream.tracking.rows.RawRows`,
        an accelerator's lookups as recorded): its first occurrence's FIRST state, the
        ids ascending; ``inserted`` and ``tombstones`` unique. Host work, off the
        training thread (:meth:`Handoff.wait`)."""
        if not self.repeats:
            return
        ids, where = first_occurrences(self.ids)
        self.ids, self.first = ids, self.first.index_select(0, where)
        self.current = self.current.index_select(0, where)
        self._unique_ids()
        self.repeats = False

    def _unique_ids(self) -> None:
        """Make ``tombstones`` and ``inserted`` ascending and unique: a hand-off not
        ``ordered`` carries them as the tracker recorded them (their sort is the
        worker's, not the training thread's)."""
        if self.tombstones is not None:
            self.tombstones = torch.unique(self.tombstones)
        if self.inserted is not None:
            self.inserted = torch.unique(self.inserted)

    def live(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(new, tombstones)`` for a merge: ``new`` bool ``[n]`` aligned with ``ids``
        (None: a table without it), and the tombstones (ascending, unique) of ids not live
        again — an id both
        evicted and changed was re-inserted after its last eviction (evictions purge the
        earlier touches), so it is a row, not a tombstone. The ids stay in their order: a
        merge does not need them sorted."""
        if self.ordered:
            return self.new, self.tombstones
        self._unique_ids()
        new = None
        if self.inserted is not None:
            new = member(self.inserted, self.ids)[0] if self.inserted.numel() \
                else torch.zeros(self.ids.numel(), dtype=torch.bool)
        tombs = self.tombstones
        if tombs is not None and tombs.numel() and self.ids.numel():
            hit, at = member(tombs, self.ids)
            dead = torch.ones(tombs.numel(), dtype=torch.bool)
            dead[at[hit]] = False
            tombs = tombs[dead]
        return new, tombs


@dataclass
class Handoff:
    """What one tick hands to the worker.

    ``tick``: the tick's number (1, 2, …); ``units``: budget units (seconds or steps) the
    bucket gains with it, ``read_units`` of them while it was read (in parts, over several
    ticks: they may fill the bucket past its burst, :meth:`TokenBucket.refill`'s
    ``over``); ``final``: a flush (publish everything). ``ready``: a CUDA event
    recorded after the device → host copies (None on CPU). ``charged``: bytes sent outside
    the rounds since the last hand-off that the bucket pays for too (dense versions, with
    ``BudgetPolicy.charge_dense``). ``merged``: called once the worker is done with the
    hand-off's tensors (merged, or its merge failed): they may be reused then (a worker
    process merges them where they lie, in the segment the parent writes)."""

    tick: int
    step: int
    ts: int
    units: float
    read_units: float = 0.0
    tables: list[TableHandoff] = field(default_factory=list)
    final: bool = False
    ready: Any = None
    charged: int = 0
    merged: Optional[Callable[[], None]] = None

    @property
    def rows(self) -> int:
        return sum(len(t) for t in self.tables)

    def wait(self) -> None:
        """Block until the host copies are complete (CUDA), then keep each table's ids
        once (:meth:`TableHandoff.dedupe`)."""
        if self.ready is not None:
            # polled, not ``synchronize()``: a wait that never counts as a host sync (the
            # training thread may run under ``torch.cuda.set_sync_debug_mode("error")``);
            # backing off, so that the poll seldom takes the GIL from the training thread
            nap = 100e-6
            while not self.ready.query():
                time.sleep(nap)
                nap = min(2e-3, 2 * nap)
            self.ready = None
        for t in self.tables:
            t.dedupe()

    def release(self) -> None:
        """Call ``merged`` (once; later calls do nothing)."""
        done, self.merged = self.merged, None
        if done is not None:
            done()


class HostCopier:
    """Copies device tensors to pinned host memory on a side stream (CUDA), or passes
    host tensors through. One per publisher."""

    def __init__(self) -> None:
        self._stream: Optional[torch.cuda.Stream] = None
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device, pinned)

    def host(self, x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``x`` on the host: itself on CPU; on CUDA a pinned tensor that :meth:`finish`
        fills asynchronously (valid once its event completed)."""
        if x is None or x.device.type == "cpu":
            return x
        if x.numel() == 0:  # nothing to copy: no pinned block, no launch
            return torch.empty(x.shape, dtype=x.dtype)
        out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        self._pending.append((x, out))
        return out

    def finish(self) -> Any:
        """Issue the copies asked for since the last call, on the side stream after the
        work queued so far on the current stream (no host wait); returns an event they
        complete at (None if none)."""
        if not self._pending:
            return None
        pairs, self._pending = self._pending, []
        dev = pairs[0][0].device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=dev)
        self._stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(self._stream):
            for x, out in pairs:
                out.copy_(x, non_blocking=True)
                # the caching allocator must not reuse x before the copy ran
                x.record_stream(self._stream)
        event = torch.cuda.Event()
        event.record(self._stream)
        return event


def _current_rows(module: Any, ids: torch.Tensor, first: torch.Tensor,
                  known: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The rows of ``ids`` now, as a new tensor on the table's device (a gather);
    ``known``: their storage positions, when the tracker has them (no probe)."""
    where = row_storage(module)
    if where is not None:
        storage, positions = where
        if known is not None:
            return gather_rows(storage, known)
        pos = positions(ids)
        # an id the table does not hold (a scan path, an eval-mode read) takes the reader;
        # on CUDA the tracker's ids are trusted: checking would synchronize the stream
        if ids.device.type != "cpu" or pos.numel() == 0 \
                or bool(((pos >= 0) & (pos < storage.shape[0])).all()):
            return gather_rows(storage, pos)
    read, dim, dtype, fresh = row_reader(module)
    rows = read(ids) if ids.numel() else torch.empty(0, dim, dtype=dtype or first.dtype,
                                                     device=ids.device)
    return rows if fresh else rows.clone()


def _table_handoff(tracker: DeltaTracker, fqn: str, d: DeltaRows | UnorderedRows,
                   module: Any, copier: HostCopier) -> TableHandoff:
    """One table's part of :func:`take_handoff` (``d`` has rows or tombstones)."""
    mine = module is tracker.table(fqn)
    if isinstance(d, RawRows):  # an accelerator's lookups as recorded: deduplicated later
        cur = _current_rows(module, d.ids, d.states, d.positions if mine else None)
        return TableHandoff(fqn=fqn, ids=copier.host(d.ids), first=copier.host(d.states),
                            current=copier.host(cur), new=None,
                            tombstones=copier.host(d.tombstones),
                            inserted=copier.host(d.news) if d.dynamic else None,
                            ordered=False, repeats=True)
    if isinstance(d, UnorderedRows):  # FIRST rows: the arena, through d.at; sorted later
        # a CPU table's by construction (the C marking's): nothing for the copier (six
        # device reads a table, in a tick that hands off every table)
        cur = d.current if d.current is not None \
            else _current_rows(module, d.ids, d.arena, d.positions if mine else None)
        return TableHandoff(fqn=fqn, ids=d.ids, first=d.arena, current=cur, new=None,
                            tombstones=d.tombstones,
                            inserted=d.news if d.dynamic else None,
                            first_at=d.at, ordered=False, give_back=d.give_back)
    if len(d) and d.states is None:
        raise ValueError("a budget needs an EMBEDDING-mode delta (FIRST states) to know "
                         f"serving errors; table {fqn!r} has states=None (use "
                         "DeltaTracker(mode=TrackingMode.EMBEDDING); a degraded table is "
                         "published with publish_delta)")
    first = d.states if d.states is not None else torch.empty(0, row_reader(module)[1])
    known = tracker.row_positions(fqn, d.ids) if mine else None
    cur = _current_rows(module, d.ids, first, known) if len(d) else first
    return TableHandoff(fqn=fqn, ids=copier.host(d.ids), first=copier.host(first),
                        current=copier.host(cur), new=copier.host(d.new),
                        tombstones=copier.host(d.tombstones))


def owed_storages(tracker: DeltaTracker, modules: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """``{fqn: storage}`` of the tables of ``modules`` that may owe their current rows
    (``take_handoff(owe=...)``): the tracker's own modules whose rows live in a CPU
    storage. Call per hand-off: a table's storage may be replaced as it grows."""
    out = {}
    for fqn, module in modules.items():
        try:
            mine = module is tracker.table(fqn)
        except KeyError:
            continue
        rows = cpu_row_storage(module) if mine else None
        if rows is not None:
            out[fqn] = rows
    return out


def take_handoff(tracker: DeltaTracker, consumer: str, modules: Mapping[str, Any],
                 copier: HostCopier, owe: Optional[Mapping[str, torch.Tensor]] = None,
                 tables: Optional[Iterable[str]] = None) -> list[TableHandoff]:
    """Read ``consumer``'s delta and copy the changed rows' current values.

    A CPU hash table's rows come in storage order (:meth:`DeltaTracker.get_delta_unordered`,
    so the current rows are gathered in one sweep); the worker merges them in that order,
    reading the FIRST rows in the tracker's arena (:meth:`TableHandoff.live`). With
    ``owe`` (:func:`owed_storages`) those tables' current rows are owed, not gathered: read
    them once ``tracker.capture_rows`` returned True. ``tables``: read those only (the
    others keep their changes for a later read: ``DeltaTracker.reads_in_parts``).
    Raises ``ValueError`` for an ID_ONLY delta (no FIRST states: no serving error) and
    ``KeyError`` for a table not in ``modules``, after handing the delta back to the
    tracker (nothing is consumed)."""
    delta = tracker.get_delta_unordered(consumer, owe, tables)
    try:
        out = []
        for fqn, d in delta.items():
            if len(d) == 0 and (d.tombstones is None or not d.tombstones.numel()):
                continue
            if fqn not in modules:
                raise KeyError(f"table {fqn!r} of the delta is not in tables {sorted(modules)}")
            out.append(_table_handoff(tracker, fqn, d, modules[fqn], copier))
        return out
    except BaseException:
        for fqn, d in delta.items():
            if isinstance(d, (UnorderedRows, RawRows)):
                d = d.finish()[0]
            if len(d):
                tracker.retain(consumer, fqn, DeltaRows(ids=d.ids, states=d.states, new=d.new,
                                                        age=d.age))
        raise
