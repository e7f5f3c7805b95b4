"""What a :class:`~deltastream.DeltaTracker` has recorded, and how a change gets recorded.

:class:`Recorder` holds the tracker's three stores (touched rows with FIRST states, evicted
ids, inserted ids), the lookups of positional tables not yet turned into ids
(:class:`~deltastream.tracking.positions.PendingLookups`), the shadows of scan-path tables
(:class:`~deltastream.tracking.scan.DriftScan`) and the memory bound. The tracker calls it
under its lock from its hooks (``record_*``) and at read boundaries (:meth:`Recorder.flush_all`,
:meth:`Recorder.scan_all`); per-consumer cursors and retained rows stay in the tracker.

How each table's changes are recorded (its ``path``):

* ``lookups``: every training lookup is recorded. A positional table (HashTable) keeps the
  positions its forward resolved and, in EMBEDDING mode, the forward's output rows (on the
  CPU a copy of the rows of positions new since the last flush; on CUDA borrowed);
  an ``nn.Embedding``/``EmbeddingBag`` is handled the same way (:class:`DenseRows`: a row's
  position is its id), its rows being the forward's output (``nn.Embedding``) or the
  table's own rows gathered at the lookup (``nn.EmbeddingBag``, whose output is pooled);
  other (duck-typed) tables append ids and output rows to the store at once.
* ``scan``: lookups only mark rows; at each read boundary the table's weight is compared
  with its shadow and every changed or marked row is recorded with its shadow value (the
  exact FIRST state), whatever moved it.

**On CUDA** the training hooks (``record_lookup``, ``record_positions``, ``record_insert``)
never read a value back to the host (no ``.item()``, no ``nonzero``/``unique`` sized by the
data, no ``.cpu()``). Syncs remain only where a size depends on the data, off a plain step's
hooks: an eviction (pending positions become ids), a ``max_tracked_rows`` compaction, and
reads, which return device tensors (no host copy).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch

from deltastream.tracking import fresh_rows
from deltastream.tracking.dense_rows import DenseRows
from deltastream.tracking.discovery import LOOKUPS, SCAN, TrackedTable
from deltastream.tracking.positions import PendingLookups, UniqueLookups
from deltastream.tracking.rows import RawRows
from deltastream.tracking.scan import DriftScan
from deltastream.tracking.shared_interval import drain_sharing_ids, drain_sharing_rows
from deltastream.tracking.sorted_ids import member
from deltastream.tracking.store import DeltaStore
from deltastream.types import TrackingMode, UpdateMode

__all__ = ["Recorder", "DenseRows", "COUNTERS"]

log = logging.getLogger(__name__)

_UPDATE_MODE = {TrackingMode.ID_ONLY: UpdateMode.NONE, TrackingMode.EMBEDDING: UpdateMode.FIRST}

#: Records an accelerator's table keeps as recorded for other consumers (:meth:`Recorder.
#: drain_raw`) hold every lookup, repeats too: once they pass twice the rows held after the
#: last merge plus this many, they are merged (sorted and deduplicated: a device sync, once
#: per this many rows at least), so memory stays proportional to the distinct rows.
RAW_MERGE_MIN = 1 << 20
#: seconds :meth:`Recorder.capture` reuses :func:`~.fresh_rows.spare_core`'s answer for: it
#: is asked once per hand-off, and its syscall, environment read and torch call cost ~25 µs
#: on a tick's cold cache (a change of threads or affinity shows within this time)
SPARE_CORE_TTL_S = 1.0

#: counters the recorder keeps (the tracker adds them to ``stats()``)
COUNTERS = ("lookups_recorded", "ids_recorded", "lookups_paused", "lookups_eval_skipped",
            "bound_compactions", "degradations", "over_bound_events", "tombstones",
            "inserted", "retained_total", "reads", "reloads", "path_switches")


def records_as_is(device: torch.device) -> bool:
    """Whether a positional table on ``device`` records every lookup as it is (an
    accelerator: a hook must not sync, and keeping each position once has a
    data-dependent size) rather than each position once, its FIRST row copied at the
    lookup (the CPU). Tests run the accelerators' path on CPU tensors by replacing it."""
    return device.type != "cpu"


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)``, or the one part itself (no copy, no launch)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class Recorder:
    """The record-keeping of one tracker (see the module docstring).

    Args:
        mode: the tracking mode (EMBEDDING keeps FIRST states).
        tables: the tracked tables by FQN (their ``path`` is read at every record).
        max_rows: bound on the rows held (see ``DeltaTracker``), or None.
        cursors: returns the consumers' read cursors (records before all of them are
            never read again; the memory bound drops them first).
    """

    def __init__(self, mode: TrackingMode, tables: dict[str, TrackedTable],
                 max_rows: Optional[int], cursors: Callable[[], Iterable[int]]) -> None:
        self.mode = mode
        #: whether FIRST states are kept (EMBEDDING mode); an attribute, not a property:
        #: it is read at every lookup
        self.with_states = mode is TrackingMode.EMBEDDING
        self._cursors = cursors
        self.tables = tables
        self.max_rows = max_rows
        self.touched = DeltaStore(_UPDATE_MODE[mode])  # touched ids (+ FIRST states)
        self.tombs = DeltaStore(UpdateMode.NONE)  # evicted ids
        self.news = DeltaStore(UpdateMode.NONE)  # inserted ids
        #: store index new records go to (advanced by the tracker's steps and reads)
        self.idx = 0
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.pending: dict[str, PendingLookups] = {}  # positional tables' unflushed lookups
        self.row_maps: dict[str, Any] = {}  # position -> id map of each pending table
        self.scans: dict[str, DriftScan] = {}  # scan-path tables' shadows
        self._next_bound_check = 0
        self._spare_core = (float("-inf"), False)  # (valid until, spare_core's answer)
        #: the walks :meth:`capture` queued on the lane, not taken in yet
        self._on_lane: list[fresh_rows.FreshRows] = []
        self._merged_rows: dict[str, int] = {}  # rows held after a raw table's last merge
        self._warned_degraded: set[str] = set()
        self._warned_over = False
        for fqn, info in tables.items():
            for store in self.stores():
                store.add_table(fqn, info.dim, dtype=info.dtype, device=info.device)
            if info.positional:
                self._add_pending(fqn, info.module)
            elif info.path == SCAN:
                self.scans[fqn] = DriftScan(info.weight)
            elif not info.dynamic:
                self._add_pending(fqn, DenseRows(info.module, info.row_offset), info)

    def _add_pending(self, fqn: str, row_map: Any, info: Optional[TrackedTable] = None
                     ) -> None:
        self.row_maps[fqn] = row_map
        # On the CPU repeats add nothing to the ids nor to the FIRST states: keeping each
        # position once, its row copied at the lookup, spreads a read's work over the steps
        # (a hand-off per budget tick pays O(rows), not O(lookups)) and holds no borrowed
        # outputs. On CUDA every lookup is recorded as is: a boolean selection has a
        # data-dependent size, and a hook must not sync.
        self.pending[fqn] = (PendingLookups if records_as_is(row_map.device)
                             else UniqueLookups)(int(row_map.capacity), row_map.device)

    def stores(self) -> tuple[DeltaStore, DeltaStore, DeltaStore]:
        """The touched, tombstone and insert stores (advanced together)."""
        return self.touched, self.tombs, self.news

    # ------------------------------------------------------------------ recording

    def record_lookup(self, fqn: str, ids: torch.Tensor, output: Any,
                      later: bool = False) -> None:
        """A lookup of a non-positional table: ``ids`` (flattened int tensor) and the
        forward's ``output``; ``later``: see :meth:`record_positions`."""
        info = self.tables[fqn]
        if fqn in self.pending:  # a dense table on the lookups path: positions = ids
            self._record_dense(fqn, info, ids, output, later)
            return
        n = int(ids.numel())
        self.counts["lookups_recorded"] += 1
        self.counts["ids_recorded"] += n
        if info.path == SCAN:
            self.scans[fqn].note(ids)  # FIRST comes from the shadow at the next read
            return
        states = None
        why = None
        if self.with_states and not self.touched.is_degraded(fqn):
            if info.kind == "embedding_bag":
                # the output is pooled: FIRST is the table's own rows, before the update
                states = info.module.weight.detach().index_select(0, ids)
            elif isinstance(output, torch.Tensor) and output.numel() == n * info.dim:
                states = output.detach().reshape(n, info.dim)
            else:
                why = "forward output is not [*ids.shape, dim]"
        if why is not None:
            self.degrade(fqn, why)  # cannot pair rows with ids: keep the ids, say so
        # A lookup's output is fresh memory nobody else keeps: borrow it instead of copying
        # (the store detects an in-place change through its version counter).
        self.touched.append(self.idx, fqn, ids, states, copy_states=False)
        self.enforce_bound_if_set()

    def _record_dense(self, fqn: str, info: TrackedTable, ids: torch.Tensor,
                      output: Any, later: bool = False) -> None:
        unique = isinstance(self.pending[fqn], UniqueLookups)
        # kept as is (CUDA): a copy, the caller may reuse its id buffer before the flush
        pos = ids if unique and ids.dtype == torch.int64 else \
            ids.to(torch.int64, copy=not unique)
        rows, whole = None, False
        if self.with_states and not self.touched.is_degraded(fqn):
            if info.kind in ("embedding_bag", "torchrec"):
                # pooled output / a fused kernel (no output here): FIRST is the table's own
                # rows, before the update (the CPU path gathers the new positions' only)
                rows, whole = info.module.weight.detach(), unique
                if not unique:
                    rows = rows.index_select(0, pos)
            elif isinstance(output, torch.Tensor) and output.numel() == pos.numel() * info.dim:
                rows = output.detach().reshape(pos.numel(), info.dim)
            else:
                self.degrade(fqn, "forward output is not [*ids.shape, dim]")
        self.record_positions(fqn, pos, rows, whole_table=whole, later=later)

    def record_positions(self, fqn: str, positions: torch.Tensor,
                         rows: Optional[torch.Tensor], whole_table: bool = False,
                         later: bool = False) -> None:
        """A training lookup of a positional table: its int64 ``positions`` ``[n]`` and, in
        EMBEDDING mode, the rows before the update: ``rows`` ``[n, dim]`` (the forward's
        output; a CUDA table borrows it, checked for in-place changes at the flush through
        its version counter) or, with ``whole_table``, the table's ``[capacity, dim]``
        weight. No copy, sort or sync on CUDA; on the CPU only the positions new since the
        flush are kept, with a copy of their rows (:class:`UniqueLookups`). With
        ``later`` and ``whole_table`` that copy may run on the C code's lane thread while
        training goes on: :meth:`sync_lookups` must run before the table's rows change (a
        forward hook after the kernel's forward)."""
        p = self.pending[fqn]
        states = self.with_states
        keep = states and not (p.stateless or rows is None or self.touched.is_degraded(fqn))
        if states and not keep:
            p.stateless = True
        n = positions.numel()
        if isinstance(p, UniqueLookups):
            src = rows.detach() if keep else None
            if src is None or whole_table or not p.add_output(positions, src):
                p.add(positions, weight=src if whole_table else None,
                      rows=None if whole_table else src, later=later and whole_table,
                      capacity=self.row_maps[fqn].capacity)
        else:
            p.pos.append(positions)
            p.n += n
            if keep:
                states = rows.detach()
                p.states.append(states)
                p.versions.append(states._version)
                p.n_states += n
        self.counts["lookups_recorded"] += 1
        self.counts["ids_recorded"] += n
        self.enforce_bound_if_set()

    def record_insert(self, fqn: str, ids: torch.Tensor) -> None:
        """Ids inserted into a dynamic table (they are ``new`` until each consumer reads)."""
        self.news.append(self.idx, fqn, ids, grow=True)
        self.counts["inserted"] += int(ids.numel())

    def rows_freed(self, fqn: str, positions: Optional[torch.Tensor]) -> None:
        """Table ``fqn`` is freeing the rows at ``positions`` (int64 ``[k]``; None:
        every row), whose ids are evicted: their positions may be reused by the next insert.
        A table that keeps each position once (:class:`UniqueLookups`) on the CPU forgets
        just their marks, in O(k); any other has its lookups flushed into the store now,
        while the table still knows which id each position held."""
        p = self.pending.get(fqn)
        if isinstance(p, UniqueLookups) and positions is not None \
                and positions.device.type == "cpu":
            p.forget(positions.to(torch.int64))
        else:
            self.flush(fqn)

    def record_evict(self, fqn: str, ids: torch.Tensor) -> None:
        """Ids evicted from a dynamic table: their touches are void, they become tombstones.
        (The tracker drops them from retained rows.) On CUDA this syncs (the flush and the
        discard have data-dependent sizes), as the eviction itself does."""
        if not isinstance(self.pending.get(fqn), UniqueLookups):
            # touches before the eviction are in the store (a UniqueLookups' marks of the
            # freed rows were forgotten as they were freed: rows_freed)
            self.flush(fqn)
        # A later re-insert + lookup records the id afresh (after this point). Its inserts
        # stay recorded: a read flags `new` only on ids that are rows, and an evicted id is
        # a row again only once re-inserted (new either way); dropping them cost a search
        # of every insert record per eviction, on the training thread.
        self.touched.discard(fqn, ids)
        self.tombs.append(self.idx, fqn, ids, grow=True)
        self.counts["tombstones"] += int(ids.numel())

    def record_reload(self, fqn: str, before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
        """A dynamic table was reloaded (``load_state_dict``): it held ids ``before`` and
        holds ``after``. Every row held is reported, without FIRST states (the table is
        degraded: selection publishes them all); ids gone are tombstones (returned)."""
        self.flush(fqn)
        before, after = torch.unique(before), torch.unique(after)
        gone = before[~member(after, before)[0]] if before.numel() else before
        new = after[~member(before, after)[0]] if after.numel() else after
        if self.with_states and not self.touched.is_degraded(fqn):
            self.degrade(fqn, "load_state_dict replaced its rows")
        if gone.numel():
            self.record_evict(fqn, gone)
        if new.numel():
            self.record_insert(fqn, new)
        self.touched.append_unique(self.idx, fqn, after)
        self.counts["reloads"] += 1
        return gone

    def flush(self, fqn: str) -> None:
        """Move a positional table's pending lookups into the store as one sorted run.

        Recorded at the current index: every pending lookup came after the last read
        boundary, and nothing reads the records at or after it separately.
        """
        p = self.pending.get(fqn)
        if isinstance(p, UniqueLookups):
            p.drained = None  # a flush may precede freeing rows: their positions go stale
        if p is None or p.n == 0:
            return
        want_states = False
        if self.with_states:
            if not p.stateless and p.states_changed():
                self.touched.note_states_modified(fqn)
                p.drop_states()
            if p.stateless:
                if not self.touched.is_degraded(fqn):
                    self.touched.degrade(fqn)  # the ids-only lookups keep it degraded
            else:
                want_states = not self.touched.is_degraded(fqn)
        ids, states = p.drain(self.row_maps[fqn], want_states)
        self.touched.append_unique(self.idx, fqn, ids, states)

    def drain_unordered(self, fqn: str, storage: Optional[torch.Tensor] = None,
                        since: int = 0, share: bool = False, share_rows: bool = True
                        ) -> Optional[tuple[Any, ...]]:
        """:meth:`flush` of table ``fqn`` for a reader that orders the rows itself:
        :meth:`UniqueLookups.drain_unordered`'s ``(ids, positions, at, arena, current,
        give_back)``
        (``current`` owed from ``storage``, or None), nothing sorted or copied. None
        (nothing done: :meth:`flush` then stores them) unless FIRST rows are kept whole for
        this table, none of its rows the reader has yet to read (at index ``since`` or
        later) is in the store and the C code kept this interval's rows.

        ``share``: other readers have yet to read this interval. It also becomes their
        record, at the current index (:mod:`.shared_interval`): its ids and FIRST rows, or
        without ``share_rows`` (those readers read ids only) its ids alone."""
        p = self.pending.get(fqn)
        if not isinstance(p, UniqueLookups) or not self.with_states or p.stateless \
                or self.touched.is_degraded(fqn) or self.touched.num_records(fqn, since):
            return None
        table = self.row_maps[fqn]
        if not share:
            return p.drain_unordered(table, storage)
        drain = drain_sharing_rows if share_rows else drain_sharing_ids
        return drain(self.touched, self.idx, fqn, p, table, storage)

    def keeps_unique(self, fqn: str) -> bool:
        """Whether positional table ``fqn`` keeps each position once (see
        :func:`records_as_is`)."""
        return isinstance(self.pending.get(fqn), UniqueLookups)

    def drain_raw(self, fqn: str, from_idx: int, take: bool) -> Optional[RawRows]:
        """Table ``fqn``'s records at indices ``>= from_idx`` and its pending lookups as
        recorded, with no sort and no device sync (but a merge now and then, below):
        :class:`RawRows`, or None (nothing done) unless the table records every lookup as
        is (:func:`records_as_is`) with its FIRST states. The pending lookups join the
        store as one record (no flush); ``take``: the records read are removed (one
        consumer, deleted on read); else they stay for the other consumers, merged now and
        then (:data:`RAW_MERGE_MIN`)."""
        p = self.pending.get(fqn)
        if not self.with_states or p is None or self.keeps_unique(fqn) or p.stateless \
                or self.touched.is_degraded(fqn) or p.states_changed():
            return None
        if not take and self.touched.num_rows(fqn) + p.n \
                > 2 * self._merged_rows.get(fqn, 0) + RAW_MERGE_MIN:
            self.compact_all(list(self._cursors()))  # flushes the pending lookups too
            self._merged_rows[fqn] = self.touched.num_rows(fqn)
        positions = got = None
        if p.n:
            row_map = self.row_maps[fqn]
            dev = p.pos[0].device
            positions = _joined([x.reshape(-1) for x in p.pos])
            ids = row_map.ids_at(positions.to(getattr(row_map, "device", dev))).to(dev)
            states = _joined([x.reshape(-1, x.shape[-1]) for x in p.states])
            p.reset()
            if take and not self.touched.num_records(fqn):
                got = ids, states  # nothing stored: no round trip through the store
            else:
                self.touched.append(self.idx, fqn, ids, states, copy_states=False)
        if got is None:
            got = self.touched.raw_since(fqn, from_idx, take)
            if got is None:
                return None
        ids, states = got
        if positions is not None and positions.numel() != ids.numel():
            positions = None  # older records came too: their rows are found by their ids
        if states is None:  # a borrowed state changed in place: degraded, ids kept
            if take:
                self.touched.append(self.idx, fqn, ids)
            return None

        def raw(store: DeltaStore) -> torch.Tensor:
            out = store.raw_since(fqn, from_idx, take)
            return ids[:0] if out is None else out[0]

        return RawRows(ids, states, positions, raw(self.tombs), raw(self.news),
                       self.tables[fqn].dynamic)

    def capture(self, max_positions: Optional[int], lane: bool = True,
                tables: Optional[Iterable[str]] = None) -> bool:
        """Walk handed-over marks (:meth:`FreshRows.capture`): about ``max_positions``
        positions in all on this thread (None: every one), of ``tables`` only (None: all);
        True when none of them owes rows any more. A walk the lane thread ran costs this
        thread only its wait, which it does not count: else a tick would finish one table's
        lane walk at a time, and a hand-off of many tables would wait a tick per table for
        walks long done. A walk is
        queued on the lane whatever ``max_positions`` (it is not this thread's), except with
        ``lane`` False and ``max_positions`` 0 (left to a later call). Every lane walk an
        earlier call queued that has run is taken in too, whatever ``tables``: a hand-off
        read in parts takes in its earlier parts' walks a part at a time, not all in its
        last part's tick (~25 µs a table)."""
        pending = self.pending.values() if tables is None \
            else [self.pending[f] for f in tables if f in self.pending]
        owing = [p.fresh for p in pending if isinstance(p, UniqueLookups) and p.fresh.owes]
        queued = [f for f in self._on_lane if f.walk_queued]
        for f in queued:
            if f not in owing:
                f.capture(0, False)  # taken in if it ran, else left queued
        # asked only while a walk is still to queue, at most once per SPARE_CORE_TTL_S
        spare = max_positions is not None and any(not f.walk_queued for f in owing) \
            and self._spare()
        for f in owing:
            on_lane = f.walk_queued  # its positions are the lane's, not this thread's
            if max_positions is not None and max_positions <= 0:
                if not (on_lane or spare and lane):
                    continue  # nothing more to walk here, and no lane walk to queue
                max_positions = 0  # (whole words may have overshot it)
            walked = f.capture(max_positions, spare)
            if max_positions is not None and not on_lane:
                max_positions -= walked
        self._on_lane = [f for f in dict.fromkeys(queued + owing) if f.walk_queued]
        return not any(f.owes for f in owing)

    def _spare(self) -> bool:
        """:func:`~.fresh_rows.spare_core`, asked at most once per :data:`SPARE_CORE_TTL_S`."""
        until, answer = self._spare_core
        now = time.monotonic()
        if now >= until:
            answer = fresh_rows.spare_core()
            self._spare_core = (now + SPARE_CORE_TTL_S, answer)
        return answer

    def sync_lookups(self) -> None:
        """Wait for every lookup's marking left on the lane thread (before rows change)."""
        for p in self.pending.values():
            if isinstance(p, UniqueLookups):
                p.fresh.sync()

    def settle_all(self) -> None:
        """Finish every lookup's marking and copy every owed current row (before a change
        the lookups do not see)."""
        self.sync_lookups()
        self.capture(None)

    def drained_positions(self, fqn: str, ids: torch.Tensor) -> Optional[torch.Tensor]:
        """The storage positions of ``ids`` (int64, aligned) when ``ids`` is the very
        tensor the last flush of positional table ``fqn`` recorded and no row was freed
        since, else None (the caller looks them up)."""
        p = self.pending.get(fqn)
        drained = p.drained if isinstance(p, UniqueLookups) else None
        return drained[1] if drained is not None and drained[0] is ids else None

    def flush_all(self) -> None:
        """Flush every positional table's pending lookups."""
        for fqn in self.pending:
            self.flush(fqn)

    def scan(self, fqn: str) -> None:
        """Record the rows of scan-path table ``fqn`` changed or looked up since its last
        scan, with their shadow values as FIRST states."""
        info = self.tables[fqn]
        keep = self.with_states and not self.touched.is_degraded(fqn)
        res = self.scans[fqn].scan(info.module.weight, keep)
        if res.reset and keep:
            self.degrade(fqn, "its weight changed shape or dtype")
        if res.ids.numel():
            ids = res.ids + info.row_offset if info.row_offset else res.ids  # global ids
            self.touched.append_unique(self.idx, fqn, ids, res.states if keep else None)

    def scan_all(self) -> None:
        """Scan every scan-path table (at a read boundary)."""
        for fqn in self.scans:
            self.scan(fqn)

    def resync(self) -> None:
        """Every consumer has read everything: shadows equal the weights again."""
        for fqn, sc in self.scans.items():
            sc.resync(self.tables[fqn].module.weight)
        for p in self.pending.values():
            p.reset()

    # ------------------------------------------------------------------ paths

    def use_scan(self, fqn: str) -> None:
        """Find ``fqn``'s changes by scanning from now on. Exact at any instant at which
        every change so far followed a recorded lookup: rows not looked up since the last
        read still hold their value of that read, which the new shadow copies."""
        info = self.tables[fqn]
        if info.path == SCAN:
            return
        self.settle_all()  # rows a hand-off owes: a step the lookups do not see comes next
        self.flush(fqn)  # its lookups so far, with their FIRST states
        self.pending.pop(fqn, None)
        self.row_maps.pop(fqn, None)
        self.scans[fqn] = DriftScan(info.module.weight)
        info.path = SCAN
        self.counts["path_switches"] += 1

    def use_lookups(self, fqn: str) -> None:
        """Find ``fqn``'s changes from its lookups from now on (after one last scan)."""
        info = self.tables[fqn]
        if info.path == LOOKUPS:
            return
        self.scan(fqn)
        del self.scans[fqn]
        self._add_pending(fqn, DenseRows(info.module, info.row_offset), info)
        info.path = LOOKUPS
        self.counts["path_switches"] += 1

    # ------------------------------------------------------------------ bounded memory

    def pending_rows(self) -> int:
        """Ids recorded by positional tables and not flushed yet (repeats counted)."""
        return sum(p.n for p in self.pending.values())

    def pending_state_rows(self) -> int:
        """Of :meth:`pending_rows`, those held with a borrowed state."""
        return sum(p.n_states for p in self.pending.values())

    def compact(self, start: int, end: int, skip: frozenset[str] = frozenset()) -> None:
        """Compact ``[start, end)`` in every store (the tables in ``skip`` apart)."""
        for store in self.stores():
            store.compact(start, end, skip)

    def delete(self, upto: Optional[int] = None, tables: Optional[Iterable[str]] = None) -> None:
        """Drop records before ``upto`` (all with None) of ``tables`` (None: all), every store."""
        for store in self.stores():
            store.delete(upto, tables)
        self._next_bound_check = 0

    def compact_all(self, cursors: list[int]) -> None:
        """Compact every interval that no read boundary (``cursors``) splits."""
        self.flush_all()
        bounds = sorted(set(cursors) | {self.idx + 1})
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            self.compact(start, end)

    def degrade(self, fqn: str, why: str) -> None:
        """Drop ``fqn``'s FIRST states (ids kept), count and log it."""
        freed = self.touched.degrade(fqn)
        p = self.pending.get(fqn)
        if p is not None and self.with_states:
            freed += p.n_states
            p.drop_states()
        self.counts["degradations"] += 1
        emit = log.warning if fqn not in self._warned_degraded else log.info
        self._warned_degraded.add(fqn)
        emit("DeltaTracker: table %s degraded to ID_ONLY (%s); %d FIRST states dropped, ids "
             "kept", fqn, why, freed)

    def enforce_bound_if_set(self) -> None:
        """Keep the rows held under ``max_rows`` (no-op without a bound).

        Called from the hooks: below the bound it compares host-side counters only; the
        compaction that reaching the bound triggers syncs on CUDA (unavoidable: it sorts and
        deduplicates), at most once per ``max_rows / 4`` recorded rows."""
        if self.max_rows is not None:
            self.enforce_bound(list(self._cursors()))

    def enforce_bound(self, cursors: list[int]) -> None:
        """Compact, then degrade tables (largest first) until the state rows held fit the
        bound with a quarter of it free; count ids held past the bound."""
        limit = self.max_rows
        states_over = self.touched.num_state_rows() + self.pending_state_rows() > limit
        rows = self.touched.num_rows() + self.pending_rows()
        if not states_over and rows <= max(limit, self._next_bound_check):
            return
        self.flush_all()
        # Records before every cursor can never be read again (kept only because
        # delete_on_read=False): under pressure they go first.
        for store in self.stores():
            store.delete(min(cursors))
        self.compact_all(cursors)
        self.counts["bound_compactions"] += 1
        # Compaction must leave a quarter of the bound free, else tables are degraded
        # (largest first) until it does: the bound holds at every append and the next
        # compaction is at least limit/4 recorded rows away (amortized O(1) per row).
        target = limit - limit // 4
        while self.touched.num_state_rows() > target:
            fqn = max(self.tables, key=self.touched.num_state_rows)
            self.degrade(fqn, f"over max_tracked_rows={limit} after compaction")
        rows = self.touched.num_rows()
        if rows > limit:
            # Ids alone exceed the bound: they are never dropped. Compacting again only pays
            # once the store has grown by half.
            self.counts["over_bound_events"] += 1
            if not self._warned_over:
                self._warned_over = True
                log.warning("DeltaTracker: %d unique ids held exceed max_tracked_rows=%d; "
                            "ids are kept (never dropped), states are not", rows, limit)
            self._next_bound_check = rows + rows // 2
        else:
            self._next_bound_check = 0
