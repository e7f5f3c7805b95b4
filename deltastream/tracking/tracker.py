"""DeltaTracker: which embedding rows changed since each consumer's last read.

The tracker finds every :class:`~deltastream.HashTable`, ``nn.Embedding``, ``nn.EmbeddingBag``
and TorchRec ``EmbeddingBagCollection``/``EmbeddingCollection`` table (unsharded or this
rank's shards under ``DistributedModelParallel``, global ids, TorchRec names:
:mod:`.torchrec_tables`) in a model (through DDP, DataParallel, ``torch.compile`` and DMP
wrappers) and reports, per consumer, every row that changed since that consumer's last read,
with its FIRST state in ``TrackingMode.EMBEDDING`` (the value at that read: what the
predictors hold). Semantics follow TorchRec's ``ModelDeltaTracker`` (per-consumer cursors,
compaction of the interval nobody has read yet, deletion once every consumer has read)
without its known faults: an interval without changes gives empty results (**every tracked
table is always a key**), ``clear(consumer)`` works for one consumer among several, ids are
global, and a read is a hard boundary (a change after ``get_delta`` returns is in the next
read, ``step()`` or not).

**How changes are found** (``stats()["paths"]``, :attr:`DeltaTracker.paths`):

* ``"lookups"`` — every training lookup is recorded; exact when rows change only through
  their lookups. Always used for a HashTable (deltastream's sparse optimizers update only
  rows with a gradient); its ``load_state_dict`` through the model is reported too (every
  row, ids only; dropped ids as tombstones). Also for a TorchRec shard a fused kernel
  updates (:mod:`.torchrec_lookups`; its ``load_state_dict`` moves it to the scan).
* ``"scan"`` — other TorchRec tables, and by default ``nn.Embedding``/``EmbeddingBag``: a
  dense optimizer with momentum, moments or weight decay (SGD momentum, Adam, AdamW, Adagrad),
  ``load_state_dict`` or a manual write moves rows that were not looked up. The tracker
  keeps a shadow copy of the weight and at each read compares it bit for bit (:mod:`.scan`):
  every changed row is reported with its exact FIRST state. Cost: one copy of the table and
  one pass over it per read (``deltastream bench tracker-overhead``).
* ``sparse_updates_only`` declares dense tables whose rows move only with their lookups
  (lookups path, no shadow); :meth:`DeltaTracker.watch_optimizer` moves the tables an
  optimizer updates to the lookups path when it is sparse-only (plain SGD, Adagrad without
  decay, SparseAdam; :mod:`.path_choice`). A step of any ``torch.optim`` optimizer that is
  not sparse-only on such a table's weight, or its ``load_state_dict``, first moves it back
  to the scan (with a warning), so a wrong declaration never loses a row; a manual write to
  a declared table cannot be seen. A declaration that cannot be exact is refused at
  construction: under ``DistributedDataParallel`` (rows also move through other ranks'
  lookups), with ``max_norm`` (forward renormalizes rows) or for a tied weight.

Also: ``DeltaRows.tombstones`` (ids evicted from a HashTable since the read) and ``.new``
(ids inserted since; ``None`` for dense tables); ``retain`` (unpublished rows come back at
that consumer's next read with their FIRST state and ``age + 1``); ``pause()`` (lookups on
this thread are not recorded; a scan table still reports changed rows);
``max_tracked_rows`` (bounded memory: compact, then degrade tables to ids only, largest
first; counted and logged, ids never dropped; :mod:`.recorder`). Eval-mode lookups are
skipped and counted, except on a dense lookups-path table while autograd is on (they can
train it). Embedding-like modules it cannot track are named in a ``UserWarning``.

Names: ``get_delta``'s keys are FQNs inside the unwrapped model; :meth:`DeltaTracker.table`
returns the module of a key whatever wrapper the caller holds, and
:func:`~deltastream.publish_delta` publishes a whole delta under the right table names.
Thread safety: hooks, reads, ``retain`` and ``clear`` take one lock. On CUDA the training
hooks never sync and reads make no host copy (:mod:`.recorder`).

Its parts: :mod:`.discovery` finds the tables, :mod:`.recorder` records changes into the
:mod:`.store` (with :mod:`.positions` for HashTable lookups and :mod:`.scan` for shadows),
:mod:`.rows` merges retained rows, :mod:`.path_choice` decides when the lookups path is exact
and moves tables between the paths, :mod:`.model_hooks` holds the hooks on the model.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Optional, Union

import torch

from deltastream.tracking.discovery import discover
from deltastream.tracking.early_reads import EarlyReads
from deltastream.tracking.model_hooks import ModelHooks, eager
from deltastream.tracking.options import consumer_names, resolve_consumer, tracking_mode
from deltastream.tracking.path_choice import PathSwitch, declare_lookups
from deltastream.tracking.positions import row_buffers
from deltastream.tracking.recorder import Recorder
from deltastream.tracking.rows import (
    RawRows,
    UnorderedRows,
    assemble_delta,
    canonical_rows,
    carry_rows,
    drop_ids,
    held_rows,
)
from deltastream.tracking.store_runs import index_for
from deltastream.types import DeltaRows, TrackingMode

__all__ = ["DeltaTracker"]

log = logging.getLogger(__name__)


class DeltaTracker:
    """Track changed embedding rows of ``model`` per consumer.

    Args:
        model: the module to track (or a ``DistributedDataParallel``/``DataParallel``/
            ``torch.compile``/``DistributedModelParallel`` wrapper of it: keys are the inner
            model's FQNs; a TorchRec table's key is ``<collection>.embedding_bags.<table>``
            or ``.embeddings.<table>``, plus ``#<shard_id>`` per shard when this rank holds
            several column shards of it). Modules inside a tracked module are not tracked.
        consumers: consumer names, each with its own read cursor (default ``["default"]``).
        delete_on_read: drop records once every consumer has read them.
        auto_compact: compact the unread interval at every :meth:`step` (otherwise at reads).
        mode: ``TrackingMode.ID_ONLY`` or ``TrackingMode.EMBEDDING`` (FIRST states).
        fqns_to_skip: dotted names matched against whole segments: ``"user"`` skips ``user``
            and ``user.x`` (and ``tower.user``), never ``username``. Also silences the
            warning about an embedding-like module the tracker cannot track.
        max_tracked_rows: bound on the rows held (see the module docstring); ``None`` = none.
        sparse_updates_only: ``True`` or FQNs of ``nn.Embedding``/``EmbeddingBag`` tables
            whose rows change only through their own lookups (optimizer without momentum or
            weight decay, no other writes): they use the lookups path instead of the scan.
        id_only_consumers: consumers that read ids only, whatever ``mode``: their
            ``DeltaRows.states`` are None (a snapshot writer that reads the rows' current
            values itself). Their reads merge no states, and the records kept for them alone
            hold none (in EMBEDDING mode, a hand-off's FIRST rows are not kept for them).

    Raises:
        ValueError: bad arguments, no table found, or a ``sparse_updates_only`` table the
            lookups path cannot track exactly (the message says what to do).
    """

    DEFAULT_CONSUMER: str = "default"

    def __init__(self, model: torch.nn.Module, consumers: Optional[Iterable[str]] = None,
                 delete_on_read: bool = True, auto_compact: bool = False,
                 mode: TrackingMode = TrackingMode.ID_ONLY,
                 fqns_to_skip: Iterable[str] = (),
                 max_tracked_rows: Optional[int] = None,
                 sparse_updates_only: Union[bool, Iterable[str]] = False,
                 id_only_consumers: Iterable[str] = ()) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self._mode = tracking_mode(mode)
        self._consumers = consumer_names(consumers, self.DEFAULT_CONSUMER)
        self._ids_only = frozenset(id_only_consumers)
        if not self._ids_only <= set(self._consumers):
            raise ValueError(f"id_only_consumers {sorted(self._ids_only)} must be consumers "
                             f"of this tracker: {self._consumers}")
        if max_tracked_rows is not None and (not isinstance(max_tracked_rows, int)
                                             or isinstance(max_tracked_rows, bool)
                                             or max_tracked_rows <= 0):
            raise ValueError(f"max_tracked_rows must be a positive int or None, "
                             f"got {max_tracked_rows!r}")
        self._delete_on_read = bool(delete_on_read)
        self._auto_compact = bool(auto_compact)
        self._max_rows = max_tracked_rows
        self._lock = threading.RLock()
        self.curr_batch_idx = 0  #: number of step() calls
        self._cursor: dict[str, int] = dict.fromkeys(self._consumers, 0)  # first unread index
        self._carry: dict[str, dict[str, DeltaRows]] = {c: {} for c in self._consumers}
        # tables a read in parts left unread: {fqn: its first unread index} (one consumer)
        self._lag: dict[str, int] = {}
        self._low = 0  # every record before this index was deleted (see _delete_read)
        self._early = EarlyReads()  # rows read for the reader of states at others' reads

        found = discover(model, fqns_to_skip)
        self._tables = found.tables
        declare_lookups(self._tables, sparse_updates_only, found.distributed)
        self._rec = Recorder(self._mode, self._tables, max_tracked_rows,
                             lambda: [*self._cursor.values(), *self._lag.values()])
        self._closed = False
        self._switch = PathSwitch(self._tables, found.distributed, self._rec, self._lock, eager)
        self._hooks = ModelHooks(self._tables, found.root, self._rec, self._lock, self._switch,
                                 self._drop_carried)
        self._switch.update_guard()
        log.info("DeltaTracker (%s) tracks %s", self._mode.value,
                 {f: i.path for f, i in self._tables.items()})

    # ------------------------------------------------------------------ paths

    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> dict[str, str]:
        """Check ``optimizer`` and set the path of the dense tables whose weight it updates.

        A sparse-only optimizer (:mod:`deltastream.tracking.path_choice`) moves them to the
        lookups path (no shadow, no scan) unless another watched optimizer is not
        sparse-only or the lookups path cannot be exact for them (DDP, ``max_norm``, tied
        weight: they stay on the scan); any other optimizer keeps them on the scan path.
        Watch every optimizer that updates a table. Returns ``{fqn: path}`` of its tables.
        """
        return self._switch.watch_optimizer(optimizer)

    @property
    def paths(self) -> dict[str, str]:
        """``{fqn: "lookups" | "scan"}``: how each table's changes are found."""
        return {fqn: info.path for fqn, info in self._tables.items()}

    def _drop_carried(self, fqn: str, ids: torch.Tensor) -> None:
        """Retained rows of ``ids`` (gone from HashTable ``fqn``) are forgotten."""
        for carry in self._carry.values():
            rows = carry.get(fqn)
            if rows is not None and len(rows):
                carry[fqn] = drop_ids(rows, ids)

    # ------------------------------------------------------------------ public API

    @property
    def mode(self) -> TrackingMode:
        """The tracking mode."""
        return self._mode

    @property
    def consumers(self) -> list[str]:
        """Consumer names."""
        return list(self._consumers)

    @property
    def tracked_fqns(self) -> list[str]:
        """FQNs of the tracked tables (the keys of :meth:`get_delta`)."""
        return list(self._tables)

    def get_tracked_modules(self) -> dict[str, torch.nn.Module]:
        """``{fqn: module}`` of the tracked tables."""
        return {fqn: t.module for fqn, t in self._tables.items()}

    def table(self, fqn: str) -> torch.nn.Module:
        """The module of a :meth:`get_delta` key (FQNs are relative to the unwrapped model,
        so this works whatever wrapper the caller holds). Raises ``KeyError`` if unknown."""
        info = self._tables.get(fqn)
        if info is None:
            raise KeyError(f"unknown table {fqn!r}; tracked: {sorted(self._tables)}")
        return info.module

    def row_positions(self, fqn: str, ids: torch.Tensor) -> Optional[torch.Tensor]:
        """Storage positions of ``ids`` (int64, aligned) if ``ids`` is the tensor a read of
        CPU HashTable ``fqn`` just returned (one flush, no row freed since), else None."""
        with self._lock:
            return self._rec.drained_positions(fqn, ids)

    def capture_rows(self, max_positions: Optional[int] = None, *, lane: bool = True,
                     tables: Optional[Iterable[str]] = None) -> bool:
        """Walk the marks an ``owe``-ing :meth:`get_delta_unordered` handed over: about
        ``max_positions`` of its positions in all (whole 64-bit words of marks; None: every
        one), writing their ids, positions, arena rows and current rows; True when nothing
        is left (every ``UnorderedRows`` it returned is complete). Call at a step boundary:
        O(max_positions). Where torch leaves a core spare, a bounded call queues every
        table's whole walk on the C code's lane thread (whatever ``max_positions``: the walk
        is not this thread's); with ``lane`` False a call with ``max_positions`` 0 queues none.
        ``tables``: walk those tables' marks only (None: every table's), True when they
        owe nothing (the hand-off of a read in parts, :meth:`get_delta_unordered`)."""
        with self._lock:
            return self._rec.capture(max_positions, lane, tables)

    def step(self) -> None:
        """Mark the end of a training step (compacts the unread interval if auto_compact)."""
        with self._lock:
            if self._auto_compact:
                self._rec.flush_all()
                self._rec.compact(max(self._cursor.values()), self._rec.idx + 1)
            self.curr_batch_idx += 1
            self._rec.idx += 1

    def _resolve(self, consumer: Optional[str]) -> str:
        return resolve_consumer(consumer, self._consumers, self.DEFAULT_CONSUMER)

    def _boundary(self) -> None:
        """Everything that changed so far goes into the store (a read boundary)."""
        self._rec.flush_all()
        if not self._closed:
            self._rec.scan_all()

    def get_delta(self, consumer: Optional[str] = None) -> dict[str, DeltaRows]:
        """Rows changed since ``consumer``'s last read, per tracked table FQN.

        Each :class:`DeltaRows` has ``ids`` (int64 ``[n]`` ascending global ids), ``states``
        (``[n, dim]`` FIRST states in EMBEDDING mode, ``None`` in ID_ONLY mode, for an
        id-only consumer or for a degraded table), ``new`` (bool ``[n]``; ``None`` for
        ``nn.Embedding``/``Bag``),
        ``tombstones`` (int64 ``[m]`` evicted ids, disjoint from ``ids``) and ``age`` (int64
        ``[n]``: retains in a row). Every tracked table is a key, possibly with empty rows.
        Tensors stay on the table's device (no host copy).
        """
        with self._lock:
            c = self._resolve(consumer)
            return self._read(c, {}, before=self._retain_early(c))

    def get_delta_unordered(self, consumer: Optional[str] = None,
                            owe: Optional[Mapping[str, torch.Tensor]] = None,
                            tables: Optional[Iterable[str]] = None
                            ) -> dict[str, DeltaRows | UnorderedRows | RawRows]:
        """:meth:`get_delta` for a reader that sorts elsewhere (a publisher's worker): a CPU
        table whose lookups the C code kept comes as :class:`UnorderedRows` — ids in
        storage order, the FIRST rows handed over without a copy, ``finish()`` gives the
        ``DeltaRows`` — when ``consumer`` is the only consumer, records are deleted on read
        and it retains nothing of that table; a positional table on an accelerator as
        :class:`RawRows` — every lookup as recorded, no sort and no device sync,
        ``finish()`` deduplicates — when ``consumer`` retains nothing of it (with other
        consumers its records stay for them, unmerged); every other table as
        :meth:`get_delta`. The work left here is O(rows changed) with no sort.

        ``owe``: ``{fqn: the table's [capacity, dim] rows}``: those tables' rows also carry
        ``current``, their values now, copied later — at their next lookup, by
        :meth:`capture_rows`, or before anything else changes a row
        (:mod:`.owed_rows`); their ``ids``, ``positions`` and ``at`` are written by the same
        walk: read any of them once :meth:`capture_rows` returned True.

        ``tables``: read these tables only (the keys returned); the others keep what
        changed in them for their next read, whenever that is: a reader of many tables
        spreads one hand-off over several ticks, each a bounded part of the training
        thread's time. Only where :meth:`reads_in_parts` (else ``ValueError``)."""
        with self._lock:
            c = self._resolve(consumer)
            part = None
            if tables is not None:
                part = frozenset(tables)
                if part - self._tables.keys():
                    raise ValueError(f"unknown tables {sorted(part - self._tables.keys())}; "
                                     f"tracked: {sorted(self._tables)}")
                if not self.reads_in_parts(c):
                    raise ValueError(f"consumer {c!r} cannot read some tables only: it is "
                                     f"not the only consumer of states, or records are kept "
                                     f"after a read (delete_on_read=False)")
            raw: dict[str, tuple | RawRows] = {}
            owe = owe or {}
            if c in self._ids_only:  # nothing to own: a read of ids
                return self._read(c, {})
            # a reader in parts gets the tables read early for it (at a consumer of ids'
            # read) as they were read; a whole read has them merged into its own, so that
            # it holds everything up to now (a flush, a round)
            early, before = {}, {}
            if part is not None:
                self._early.note(c, owe)
                early = self._early.take(c, part)
                part = part - early.keys()
                if early and not part:
                    return early
            else:
                before = self._retain_early(c)
            only = len(self._cursor) == 1 and self._delete_on_read  # deleting on read
            # with other consumers the interval is recorded for them as it is drained,
            # with its FIRST rows where one of them reads states
            share = not only and self._delete_on_read
            rows = any(o not in self._ids_only for o in self._cursor if o != c)
            frm = self._unread_from(c)
            pending = self._rec.pending
            for fqn in pending if part is None else [f for f in pending if f in part]:
                if fqn in self._carry[c]:
                    continue
                since = index_for(frm, fqn)
                got = self._rec.drain_unordered(fqn, owe.get(fqn), since, share, rows) \
                    if only or share else None
                if got is None:
                    got = self._rec.drain_raw(fqn, since, take=only)
                if got is not None:
                    raw[fqn] = got
            return {**self._read(c, raw, take=only, part=part, before=before), **early}

    def reads_in_parts(self, consumer: Optional[str] = None) -> bool:
        """Whether :meth:`get_delta_unordered` may read ``consumer``'s tables some at a
        time (``tables=``): it is the only consumer of states (any other reads ids only)
        and records are deleted on read, so a table left unread keeps its records from its
        own first unread index (another consumer's read turns its pending lookups into
        records, kept until then)."""
        c = self._resolve(consumer)
        return self._delete_on_read and c not in self._ids_only \
            and all(o in self._ids_only for o in self._cursor if o != c)

    def _unread_from(self, c: str) -> int | dict[str, int]:
        """The first index holding records ``c`` has not read: its cursor, or per table
        (``{fqn: index}``) where a read in parts left tables unread (only ``c`` reads in
        parts: the tables' lags are its)."""
        if not self._lag or c in self._ids_only:
            return self._cursor[c]
        cursor = self._cursor[c]
        return {f: self._lag.get(f, cursor) for f in self._tables}

    def _delete_read(self, read: Iterable[str]) -> None:
        """Drop the records every consumer has read (those before every cursor) of the
        tables no read in parts left unread: all of them when the lowest cursor moved,
        else of ``read`` only (the tables just read). A table left unread keeps its records
        until its own read: cheaper than a deletion of each table at its own index."""
        low = min(self._cursor.values())
        if low > self._low:
            read, self._low = self._tables, low
        self._rec.delete(low, [f for f in read if f not in self._lag])

    def _read_early(self) -> None:
        """Before a consumer of ids reads (:mod:`.early_reads`): the tables the reader of
        states owes, with lookups pending, are read for it now and held for its next read
        of each."""
        e = self._early
        if e.reader is None or self._closed or not self.reads_in_parts(e.reader):
            return
        owe = e.due(self._rec.pending, self._tables, self._carry[e.reader])
        if owe:
            e.rows.update(self.get_delta_unordered(e.reader, owe, tables=owe))

    def _retain_early(self, c: str) -> dict[str, torch.Tensor]:
        """:meth:`EarlyReads.retain` for a whole read of ``c``: its tombstones."""
        rec = self._rec
        return self._early.retain(
            c, self._tables, lambda: rec.capture(None),
            lambda fqns: rec.tombs.ids_since(fqns, self._unread_from(c), take=False),
            self._carry[c])

    def _read(self, c: str, raw: dict[str, tuple | RawRows], take: bool = True,
              part: Optional[frozenset[str]] = None, states: bool = True,
              before: Mapping[str, torch.Tensor] = {}
              ) -> dict[str, DeltaRows | UnorderedRows | RawRows]:
        """A read of consumer ``c``; ``raw``: ``{fqn: (ids, positions, at, arena, current,
        give_back)}`` drained unordered before the boundary, or ``RawRows`` (their tables
        have nothing else to read); ``take``: ``c`` is the only consumer (the inserts and
        evictions of ``raw``'s tables are taken, not left for the others); ``part``: the
        tables read (None: all), the others left as they are for a later read; ``states``:
        False for a read of ids only (as for every read of an id-only consumer);
        ``before``: ``{fqn: ids}`` evicted in rows read early for ``c``, now retained."""
        states = states and c not in self._ids_only
        if c in self._ids_only and part is None:
            self._read_early()
        if part is None:
            self._boundary()
        else:  # the boundary of the tables read only: the others' lookups stay pending
            for fqn in part:
                self._rec.flush(fqn)
                if fqn in self._rec.scans and not self._closed:
                    self._rec.scan(fqn)
        rec = self._rec
        end = rec.idx + 1
        start = max(self._cursor.values())
        frm = self._unread_from(c)
        others = frozenset() if part is None else frozenset(self._tables) - part
        # tables read as recorded keep their records as they are (other consumers merge
        # them); a table drained unordered reads its evictions and inserts as recorded too
        # (taken when c is the only consumer): their sort is the reader's
        # (UnorderedRows.finish), not this thread's — a few ms a hand-off at 26 tables
        # while new ids keep arriving
        skip = frozenset(raw) | others
        unordered = [f for f, r in raw.items() if not isinstance(r, RawRows)]
        evicted = rec.tombs.ids_since(unordered, frm, take)
        inserted = rec.news.ids_since(unordered, frm, take)
        touched = tombs = news = {}
        if not skip >= self._tables.keys():  # some tables read from the stores
            if start < end:  # the interval nobody has read yet becomes one record
                rec.compact(start, end, skip)
            # none of raw's tables is read from the touched store: those read as recorded
            # keep their records, and one is drained unordered only while it has none there
            touched = rec.touched.get_unique(frm, skip, states=states)
            tombs = rec.tombs.get_unique(frm, skip)
            news = rec.news.get_unique(frm, skip)
        carry = self._carry[c]
        self._carry[c] = {f: r for f, r in carry.items() if f in others}
        out: dict[str, DeltaRows | UnorderedRows | RawRows] = {}
        for fqn, info in self._tables.items():
            if fqn in others:
                continue
            if isinstance(raw.get(fqn), RawRows):
                out[fqn] = raw[fqn]
            elif fqn in raw:
                ids, pos, at, arena, current, give_back = raw[fqn]
                out[fqn] = UnorderedRows(ids, pos, at, arena, evicted[fqn], inserted[fqn],
                                         info.dynamic, current, give_back)
            else:
                gone = tombs[fqn].ids
                if fqn in before:
                    gone = torch.unique(torch.cat([before[fqn].to(gone.device), gone]))
                out[fqn] = assemble_delta(touched[fqn], gone, news[fqn].ids,
                                          carry.get(fqn), info.dynamic)
        if c not in self._ids_only:  # the tables' lags are the reader of states'
            for fqn in out:
                self._lag.pop(fqn, None)
            for fqn in others:  # a table left unread keeps its first unread index
                self._lag.setdefault(fqn, self._cursor[c])
        self._cursor[c] = end
        rec.idx = end
        if self._delete_on_read:  # the tables left unread keep their records
            self._delete_read(out)
        rec.counts["reads"] += 1
        return out

    #: Alias of :meth:`get_delta` (TorchRec's store name).
    get_unique = get_delta

    def get_delta_ids(self, consumer: Optional[str] = None) -> dict[str, torch.Tensor]:
        """``{fqn: ids}`` changed since ``consumer``'s last read (advances its cursor);
        no state is merged."""
        with self._lock:
            c = self._resolve(consumer)
            read = self._read(c, {}, states=False, before=self._retain_early(c))
            return {fqn: rows.ids for fqn, rows in read.items()}

    def clear(self, consumer: Optional[str] = None) -> None:
        """Forget what ``consumer`` has not read yet (its retained rows too).

        ``None`` clears every consumer and all records (scan shadows take the current
        weights: what exists now counts as read).
        """
        with self._lock:
            rec = self._rec
            end = rec.idx + 1
            self._early.drop(None if consumer is None else self._resolve(consumer),
                             self._tables, lambda: rec.capture(None))
            if consumer is None or self._resolve(consumer) not in self._ids_only:
                self._lag.clear()  # what tables a read in parts left unread had is forgotten
            if consumer is None:
                rec.resync()
                rec.delete()
                for c in self._cursor:
                    self._cursor[c] = end
                    self._carry[c] = {}
            else:
                c = self._resolve(consumer)
                self._boundary()  # the other consumers still read these changes
                self._cursor[c] = end
                self._carry[c] = {}
                if self._delete_on_read:
                    self._delete_read(self._tables)  # (a deletion seals growing records)
            rec.idx = end

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Context manager: lookups on this thread inside the block are not recorded.

        Inserts and evictions are still recorded (they change the table), and a scan-path
        table still reports the rows that changed.
        """
        with self._hooks.pause():
            yield

    def retain(self, consumer: str, fqn: str, rows: DeltaRows) -> None:
        """Hand back ``rows`` read by ``consumer`` but not published.

        They are returned again by that consumer's next :meth:`get_delta` with their FIRST
        state (older than any state recorded since, so it wins), their ``new`` flag, and
        ``age + 1``. Ids no longer in the table (evicted meanwhile) are dropped: the
        consumer gets them as tombstones.
        """
        if not isinstance(rows, DeltaRows):
            raise TypeError(f"rows must be a DeltaRows, got {type(rows).__name__}")
        with self._lock:
            c = self._resolve(consumer)
            if fqn not in self._tables:
                raise ValueError(f"unknown table {fqn!r}; tracked: {sorted(self._tables)}")
            info = self._tables[fqn]
            rows = canonical_rows(rows, info.dim, info.dynamic,
                                  self._mode is TrackingMode.EMBEDDING
                                  and c not in self._ids_only)
            if info.dynamic:
                rows = held_rows(rows, info.module)
            if not len(rows):
                return
            carry_rows(self._carry[c], fqn, rows)
            self._rec.counts["retained_total"] += len(rows)

    def stats(self) -> dict:
        """Counters and gauges (plain ints/floats/str/lists/dicts).

        ``paths``: ``{fqn: "lookups" | "scan"}``; ``scans``, ``scan_seconds``: drift scans
        run and their time; ``rows_moved_without_lookup``: rows a scan found changed that
        no lookup had touched (what lookups alone would have missed); ``shadow_bytes``:
        memory of the shadows; ``row_buffers``: ``{"reused", "allocated"}``, row buffers
        (FIRST rows, a hand-off's current rows) taken from those a reader gave back, and
        allocated anew (whose pages fault in on the training thread); ``compactions``:
        records merged into one at a read, over the stores of touches, evictions and
        inserts (a sort on the reading thread; an unordered read of a table leaves its
        records to the reader).
        """
        with self._lock:
            rec = self._rec
            s = dict(rec.counts)
            scans = rec.scans.values()
            s.update(
                mode=self._mode.value,
                consumers=list(self._consumers),
                tables=len(self._tables),
                paths=self.paths,
                steps=self.curr_batch_idx,
                rows_tracked=rec.touched.num_rows() + rec.pending_rows(),
                state_rows=rec.touched.num_state_rows() + rec.pending_state_rows(),
                tombstones_pending=rec.tombs.num_rows(),
                compactions=sum(store.compactions for store in rec.stores()),
                states_modified=rec.touched.states_modified,
                degraded_tables=sorted(f for f in self._tables if rec.touched.is_degraded(f)),
                retained=sum(len(r) for carry in self._carry.values() for r in carry.values()),
                max_tracked_rows=self._max_rows,
                scans=sum(sc.scans for sc in scans),
                scan_seconds=sum(sc.seconds for sc in scans),
                rows_moved_without_lookup=sum(sc.unlooked for sc in scans),
                shadow_bytes=sum(sc.nbytes for sc in scans),
                row_buffers=row_buffers(rec.pending.values()),
            )
            return s

    def close(self) -> None:
        """Remove every hook the tracker registered (it records nothing afterwards).

        What was recorded (and, for scan tables, what changed until now) stays readable.
        """
        with self._lock:
            self._boundary()  # marks mean ids only while the tables report freed rows
            self._closed = True
            self._hooks.remove()
            self._switch.close()

    def __enter__(self) -> DeltaTracker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

