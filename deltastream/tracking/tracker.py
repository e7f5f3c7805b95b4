"""DeltaTracker: which embedding rows changed since each consumer's last read.

The tracker finds every :class:`~deltastream.HashTable` and ``torch.nn.Embedding`` in a
model and registers a forward hook on each: every training-mode lookup appends its ids (and,
in ``TrackingMode.EMBEDDING``, the rows it returned, i.e. the value *before* this step's
optimizer update) to a :class:`~deltastream.tracking.store.DeltaStore`. ``get_delta(consumer)``
returns, per table, the unique ids touched since that consumer's last read with their FIRST
state (the value before the first update since that read).

Semantics follow TorchRec's ``ModelDeltaTracker`` (per-consumer cursors, compaction of the
interval nobody has read yet, deletion once every consumer has read) without its known faults:

* An interval without lookups gives empty results, never an exception. **Every tracked table
  is always a key** of ``get_delta``'s result; a table without changes maps to an empty
  :class:`~deltastream.types.DeltaRows` (zero ids, ``[0, dim]`` states in EMBEDDING mode,
  empty ``tombstones`` and ``age``).
* ``clear(consumer)`` works for one named consumer among several.
* Ids are the tables' own (global) ids.
* A read is a hard boundary: a lookup recorded after ``get_delta`` returns is reported by
  the next read even when ``step()`` was not called in between.

Additions:

* ``DeltaRows.tombstones``: ids evicted from a :class:`HashTable` since the read (evict
  hook). An evicted id leaves ``ids`` (its earlier touches are forgotten); an id evicted and
  then inserted and looked up again is reported in ``ids`` (``new`` True), not as tombstone.
* ``DeltaRows.new``: True for ids inserted since the consumer's last read (insert hook;
  ``None`` for modules without insert hooks such as ``nn.Embedding``).
* ``retain(consumer, fqn, rows)``: rows read but not published come back at that consumer's
  next read with their FIRST state (older than any state recorded since) and ``age + 1``.
* ``pause()``: lookups on the calling thread inside the block are not recorded.
* ``max_tracked_rows``: bounded memory. When the store holds more rows, the tracker drops
  records no consumer can read any more (kept by ``delete_on_read=False``) and compacts every
  interval between read cursors; if the rows held *with states* are still over the
  bound (EMBEDDING mode) — precisely: over three quarters of it, so that the next compaction
  is at least ``max_tracked_rows / 4`` recorded rows away and compaction cost stays amortized
  O(1) per row — tables are degraded to ids only, largest first (their FIRST states are
  dropped, ids kept: their next ``DeltaRows.states`` is ``None`` and selection publishes all
  of them). The state rows held never exceed the bound. Ids are never dropped (after
  compaction they are bounded by the distinct ids per read interval); when ids alone exceed
  the bound it is counted (``over_bound_events``). Each degradation is counted in
  :meth:`stats` and logged (a warning the first time per table). A degraded table tracks
  states again once every consumer has read past its degraded records.

What is recorded: ``forward`` calls of tracked modules in training mode (``module.training``)
outside ``pause()``. Eval-mode lookups (which neither insert nor, by convention, train) are
skipped and counted (``stats()["lookups_eval_skipped"]``). ``HashTable.lookup``/``insert``
are not lookups: explicit inserts only mark ids ``new``. ``HashTable.clear()`` fires no evict
hooks, so the tracker cannot report it.

Cost on the training path: for a :class:`HashTable` (which reports the row positions its
forward resolved, through a lookup hook) a lookup only keeps a reference to those positions
and, in EMBEDDING mode, to its output rows (an in-place change of the output is detected
through its version counter and the table is then degraded rather than report wrong FIRST
states). No copy, no sort and no device sync happen in the hook. At the next read (or
``step`` with ``auto_compact``, or before the table frees rows: positions stand for ids only
until a freed position is reused) the positions are marked in a bool tensor over the
table's capacity; its nonzero entries are the touched rows, each once, with no sort; then
one sort of the *distinct* ids per table (an LSD radix sort on CPU). In EMBEDDING mode only
the first occurrence of each row is copied out of the kept outputs. Other modules
(``nn.Embedding``, duck-typed tables) record through a forward hook: their ids are copied and
deduplicated in one sort per table at the next read.

Thread safety: hooks, reads, ``retain`` and ``clear`` take one lock, so a publisher thread
may call ``get_delta`` while the training thread runs forward passes.

Its parts: :mod:`.discovery` finds the tables, :mod:`.positions` turns recorded positions
into ids and FIRST states, :mod:`.store` keeps the records, :mod:`.rows` merges retained rows.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Iterator
from typing import Any, Optional

import torch

from deltastream.tracking.discovery import TrackedTable, find_tables
from deltastream.tracking.positions import PendingLookups
from deltastream.tracking.rows import (
    assemble_delta,
    canonical_rows,
    drop_ids,
    merge_carry,
    select_rows,
)
from deltastream.tracking.store import DeltaStore
from deltastream.types import DeltaRows, TrackingMode, UpdateMode

__all__ = ["DeltaTracker"]

log = logging.getLogger(__name__)

_UPDATE_MODE = {TrackingMode.ID_ONLY: UpdateMode.NONE, TrackingMode.EMBEDDING: UpdateMode.FIRST}


class DeltaTracker:
    """Track touched embedding rows of ``model`` per consumer.

    Args:
        model: the module to track; every ``HashTable`` and ``torch.nn.Embedding`` in it
            (a ``DistributedDataParallel``/``DataParallel`` wrapper is unwrapped, so keys are
            the inner model's FQNs). Modules inside a tracked module are not tracked again.
        consumers: consumer names, each with its own read cursor (default ``["default"]``).
        delete_on_read: drop records once every consumer has read them.
        auto_compact: compact the unread interval at every :meth:`step` (otherwise at reads).
        mode: ``TrackingMode.ID_ONLY`` or ``TrackingMode.EMBEDDING`` (FIRST states).
        fqns_to_skip: dotted names matched against whole segments: ``"user"`` skips ``user``
            and ``user.x`` (and ``tower.user``), never ``username``.
        max_tracked_rows: bound on the rows held (see the module docstring); ``None`` = none.
    """

    DEFAULT_CONSUMER: str = "default"

    def __init__(self, model: torch.nn.Module, consumers: Optional[Iterable[str]] = None,
                 delete_on_read: bool = True, auto_compact: bool = False,
                 mode: TrackingMode = TrackingMode.ID_ONLY,
                 fqns_to_skip: Iterable[str] = (),
                 max_tracked_rows: Optional[int] = None) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(mode, str):
            try:
                mode = TrackingMode(mode.lower())
            except ValueError:
                raise ValueError(f"mode must be one of {[m.value for m in TrackingMode]}, "
                                 f"got {mode!r}") from None
        if not isinstance(mode, TrackingMode):
            raise TypeError(f"mode must be a TrackingMode, got {mode!r}")
        if consumers is None:
            consumers = [self.DEFAULT_CONSUMER]
        elif isinstance(consumers, str):
            consumers = [consumers]
        consumers = list(consumers)
        if not consumers or any(not isinstance(c, str) or not c for c in consumers):
            raise ValueError(f"consumers must be a non-empty list of non-empty str, "
                             f"got {consumers!r}")
        if len(set(consumers)) != len(consumers):
            raise ValueError(f"consumers must be unique, got {consumers!r}")
        if max_tracked_rows is not None and (not isinstance(max_tracked_rows, int)
                                             or isinstance(max_tracked_rows, bool)
                                             or max_tracked_rows <= 0):
            raise ValueError(f"max_tracked_rows must be a positive int or None, "
                             f"got {max_tracked_rows!r}")

        self._mode = mode
        self._delete_on_read = bool(delete_on_read)
        self._auto_compact = bool(auto_compact)
        self._max_rows = max_tracked_rows
        self._consumers = consumers
        self._lock = threading.RLock()
        self._local = threading.local()

        self._store = DeltaStore(_UPDATE_MODE[mode])  # touched ids (+ FIRST states)
        self._tombs = DeltaStore(UpdateMode.NONE)  # evicted ids
        self._news = DeltaStore(UpdateMode.NONE)  # inserted ids
        # Store index new records go to. Advanced by step() and by every read/clear, so a
        # read is always a boundary between records.
        self._idx = 0
        self.curr_batch_idx = 0  #: number of step() calls
        self._cursor: dict[str, int] = dict.fromkeys(consumers, 0)  # first unread index
        self._carry: dict[str, dict[str, DeltaRows]] = {c: {} for c in consumers}
        self._next_bound_check = 0
        self._warned_degraded: set[str] = set()
        self._warned_over = False
        self._stats = dict.fromkeys(
            ("lookups_recorded", "ids_recorded", "lookups_paused", "lookups_eval_skipped",
             "bound_compactions", "degradations", "over_bound_events", "tombstones",
             "inserted", "retained_total", "reads"), 0)

        self._tables: dict[str, TrackedTable] = {}
        self._handles: list[Any] = []
        self._pending: dict[str, PendingLookups] = {}  # positional tables' unflushed lookups
        self._row_listeners: list[Any] = []
        self._discover(model, fqns_to_skip)

    # ------------------------------------------------------------------ discovery

    def _discover(self, model: torch.nn.Module, fqns_to_skip: Iterable[str]) -> None:
        self._tables = find_tables(model, fqns_to_skip)
        for fqn, info in self._tables.items():
            mod = info.module
            for store in (self._store, self._tombs, self._news):
                store.add_table(fqn, info.dim, dtype=info.dtype, device=info.device)
            if info.positional:
                self._pending[fqn] = PendingLookups(int(mod.capacity), info.device)
                self._handles.append(mod.register_lookup_hook(self._make_lookup_hook(fqn)))
                cb = self._make_row_listener(fqn)
                self._row_listeners.append(cb)  # the table holds it weakly
                mod.register_row_listener(cb)
            else:
                self._handles.append(mod.register_forward_hook(
                    self._make_forward_hook(fqn), with_kwargs=True))
            if info.dynamic:
                self._handles.append(mod.register_insert_hook(self._make_insert_hook(fqn)))
                self._handles.append(mod.register_evict_hook(self._make_evict_hook(fqn)))
        log.info("DeltaTracker (%s) tracks %s", self._mode.value, sorted(self._tables))

    # ------------------------------------------------------------------ hooks

    def _make_forward_hook(self, fqn: str):
        def hook(module, args, kwargs, output):
            self._record(fqn, module, args, kwargs, output)
        return hook

    def _make_insert_hook(self, fqn: str):
        def hook(table, ids):
            ids = ids.detach().reshape(-1)
            with self._lock:
                self._news.append(self._idx, fqn, ids)
                self._stats["inserted"] += int(ids.numel())
        return hook

    def _make_lookup_hook(self, fqn: str):
        def hook(module, positions, rows):
            self._record_positions(fqn, module, positions, rows)
        return hook

    def _make_row_listener(self, fqn: str):
        def listener(table, positions):
            # Rows are being freed: their positions may be reused by the next insert, so the
            # marks must become ids now (the table still knows which id each position held).
            with self._lock:
                self._flush(fqn)
        return listener

    def _make_evict_hook(self, fqn: str):
        def hook(table, ids):
            ids = ids.detach().reshape(-1).to(torch.int64)
            with self._lock:
                self._flush(fqn)  # touches before the eviction are in the store
                # Touches before the eviction are void for every consumer: the row is gone.
                # A later re-insert + lookup records the id afresh (after this point).
                self._store.discard(fqn, ids)
                self._news.discard(fqn, ids)
                self._tombs.append(self._idx, fqn, ids)
                for carry in self._carry.values():
                    rows = carry.get(fqn)
                    if rows is not None and len(rows):
                        carry[fqn] = drop_ids(rows, ids)
                self._stats["tombstones"] += int(ids.numel())
        return hook

    def _paused(self) -> bool:
        return getattr(self._local, "pause_depth", 0) > 0

    def _record(self, fqn: str, module: torch.nn.Module, args: tuple, kwargs: dict,
                output: Any) -> None:
        if self._paused():
            self._stats["lookups_paused"] += 1
            return
        if not module.training:
            self._stats["lookups_eval_skipped"] += 1
            return
        ids = args[0] if args else next(iter(kwargs.values()), None)
        if not isinstance(ids, torch.Tensor):
            return
        ids = ids.detach().reshape(-1)
        info = self._tables[fqn]
        states = None
        degrade = False
        if self._mode is TrackingMode.EMBEDDING:
            if isinstance(output, torch.Tensor) and output.numel() == ids.numel() * info.dim:
                states = output.detach().reshape(ids.numel(), info.dim)
            else:
                degrade = True  # cannot pair rows with ids: keep the ids, say so
        with self._lock:
            if degrade and not self._store.is_degraded(fqn):
                self._degrade(fqn, "forward output is not [*ids.shape, dim]")
            # The lookup's output is fresh memory nobody else keeps: borrow it instead of
            # copying (the store detects an in-place change through its version counter).
            self._store.append(self._idx, fqn, ids, states, copy_states=False)
            self._stats["lookups_recorded"] += 1
            self._stats["ids_recorded"] += int(ids.numel())
            if self._max_rows is not None:
                self._enforce_bound()

    def _record_positions(self, fqn: str, module: torch.nn.Module,
                          positions: Optional[torch.Tensor], rows: torch.Tensor) -> None:
        """Lookup hook of a positional table: keep its positions (no copy, sort or sync)."""
        if self._paused():
            self._stats["lookups_paused"] += 1
            return
        if positions is None or not module.training:
            self._stats["lookups_eval_skipped"] += 1
            return
        n = positions.numel()
        with self._lock:
            p = self._pending[fqn]
            p.pos.append(positions)
            p.n += n
            if self._mode is TrackingMode.EMBEDDING:
                if self._store.is_degraded(fqn) or p.stateless:
                    p.stateless = True
                else:
                    # Borrowed: the forward's own output, checked for in-place changes at
                    # the flush through its version counter.
                    states = rows.detach()
                    p.states.append(states)
                    p.versions.append(states._version)
                    p.n_states += n
            self._stats["lookups_recorded"] += 1
            self._stats["ids_recorded"] += n
            if self._max_rows is not None:
                self._enforce_bound()

    def _flush(self, fqn: str) -> None:
        """Move a positional table's pending lookups into the store as one sorted run.

        Recorded at the current index: every pending lookup came after the last read
        boundary, and nothing reads the records at or after it separately.
        """
        p = self._pending.get(fqn)
        if p is None or p.n == 0:
            return
        mod = self._tables[fqn].module
        want_states = False
        if self._mode is TrackingMode.EMBEDDING:
            if not p.stateless and any(s._version != v for s, v in
                                       zip(p.states, p.versions, strict=True)):
                self._store.note_states_modified(fqn)
                p.drop_states()
            if p.stateless:
                if not self._store.is_degraded(fqn):
                    self._store.degrade(fqn)  # the ids-only lookups keep it degraded
            else:
                want_states = not self._store.is_degraded(fqn)
        ids, states = p.drain(mod, want_states)
        self._store.append_unique(self._idx, fqn, ids, states)

    def _flush_all(self) -> None:
        for fqn in self._pending:
            self._flush(fqn)

    def _pending_rows(self) -> int:
        return sum(p.n for p in self._pending.values())

    def _pending_state_rows(self) -> int:
        return sum(p.n_states for p in self._pending.values())

    # ------------------------------------------------------------------ bounded memory

    def _compact_all(self) -> None:
        """Compact every interval that no read boundary splits."""
        self._flush_all()
        bounds = sorted(set(self._cursor.values()) | {self._idx + 1})
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            for store in (self._store, self._tombs, self._news):
                store.compact(start, end)

    def _degrade(self, fqn: str, why: str) -> None:
        freed = self._store.degrade(fqn)
        p = self._pending.get(fqn)
        if p is not None and self._mode is TrackingMode.EMBEDDING:
            freed += p.n_states
            p.drop_states()
        self._stats["degradations"] += 1
        emit = log.warning if fqn not in self._warned_degraded else log.info
        self._warned_degraded.add(fqn)
        emit("DeltaTracker: table %s degraded to ID_ONLY (%s); %d FIRST states dropped, ids "
            "kept", fqn, why, freed)

    def _enforce_bound(self) -> None:
        limit = self._max_rows
        states_over = self._store.num_state_rows() + self._pending_state_rows() > limit
        rows = self._store.num_rows() + self._pending_rows()
        if not states_over and rows <= max(limit, self._next_bound_check):
            return
        self._flush_all()
        # Records before every cursor can never be read again (kept only because
        # delete_on_read=False): under pressure they go first.
        upto = min(self._cursor.values())
        for store in (self._store, self._tombs, self._news):
            store.delete(upto)
        self._compact_all()
        self._stats["bound_compactions"] += 1
        # Compaction must leave a quarter of the bound free, else tables are degraded
        # (largest first) until it does: the bound holds at every append and the next
        # compaction is at least limit/4 recorded rows away (amortized O(1) per row).
        target = limit - limit // 4
        while self._store.num_state_rows() > target:
            fqn = max(self._tables, key=self._store.num_state_rows)
            self._degrade(fqn, f"over max_tracked_rows={limit} after compaction")
        rows = self._store.num_rows()
        if rows > limit:
            # Ids alone exceed the bound: they are never dropped. Compacting again only pays
            # once the store has grown by half.
            self._stats["over_bound_events"] += 1
            if not self._warned_over:
                self._warned_over = True
                log.warning("DeltaTracker: %d unique ids held exceed max_tracked_rows=%d; "
                               "ids are kept (never dropped), states are not", rows, limit)
            self._next_bound_check = rows + rows // 2
        else:
            self._next_bound_check = 0

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

    def step(self) -> None:
        """Mark the end of a training step (compacts the unread interval if auto_compact)."""
        with self._lock:
            if self._auto_compact:
                self._flush_all()
                start = max(self._cursor.values())
                for store in (self._store, self._tombs, self._news):
                    store.compact(start, self._idx + 1)
            self.curr_batch_idx += 1
            self._idx += 1

    def _resolve(self, consumer: Optional[str]) -> str:
        if consumer is None:
            if len(self._consumers) == 1:
                return self._consumers[0]
            if self.DEFAULT_CONSUMER in self._cursor:
                return self.DEFAULT_CONSUMER
            raise ValueError(f"consumer is required: this tracker has consumers "
                             f"{self._consumers}")
        if consumer not in self._cursor:
            raise ValueError(f"unknown consumer {consumer!r}; consumers: {self._consumers}")
        return consumer

    def get_delta(self, consumer: Optional[str] = None) -> dict[str, DeltaRows]:
        """Rows changed since ``consumer``'s last read, per tracked table FQN.

        Each :class:`DeltaRows` has ``ids`` (int64 ``[n]`` ascending global ids), ``states``
        (``[n, dim]`` FIRST states in EMBEDDING mode, ``None`` in ID_ONLY mode or for a
        degraded table), ``new`` (bool ``[n]``; ``None`` for ``nn.Embedding``),
        ``tombstones`` (int64 ``[m]`` evicted ids, disjoint from ``ids``) and ``age`` (int64
        ``[n]``: retains in a row). Every tracked table is a key, possibly with empty rows.
        """
        with self._lock:
            c = self._resolve(consumer)
            self._flush_all()
            end = self._idx + 1
            start = max(self._cursor.values())
            if start < end:  # the interval nobody has read yet becomes one record
                for store in (self._store, self._tombs, self._news):
                    store.compact(start, end)
            frm = self._cursor[c]
            touched = self._store.get_unique(frm)
            tombs = self._tombs.get_unique(frm)
            news = self._news.get_unique(frm)
            carry = self._carry[c]
            self._carry[c] = {}
            out = {}
            for fqn, info in self._tables.items():
                out[fqn] = assemble_delta(touched[fqn], tombs[fqn].ids, news[fqn].ids,
                                          carry.get(fqn), info.dynamic)
            self._cursor[c] = end
            self._idx = end
            if self._delete_on_read:
                self._delete_read()
            self._stats["reads"] += 1
            return out

    #: Alias of :meth:`get_delta` (TorchRec's store name).
    get_unique = get_delta

    def get_delta_ids(self, consumer: Optional[str] = None) -> dict[str, torch.Tensor]:
        """``{fqn: ids}`` changed since ``consumer``'s last read (advances its cursor)."""
        return {fqn: rows.ids for fqn, rows in self.get_delta(consumer).items()}

    def _delete_read(self) -> None:
        upto = min(self._cursor.values())
        for store in (self._store, self._tombs, self._news):
            store.delete(upto)
        self._next_bound_check = 0

    def clear(self, consumer: Optional[str] = None) -> None:
        """Forget what ``consumer`` has not read yet (its retained rows too).

        ``None`` clears every consumer and all records.
        """
        with self._lock:
            end = self._idx + 1
            if consumer is None:
                for p in self._pending.values():
                    p.reset()
                for store in (self._store, self._tombs, self._news):
                    store.delete()
                for c in self._cursor:
                    self._cursor[c] = end
                    self._carry[c] = {}
                self._next_bound_check = 0
            else:
                c = self._resolve(consumer)
                self._flush_all()  # the other consumers still read these lookups
                self._cursor[c] = end
                self._carry[c] = {}
                if self._delete_on_read:
                    self._delete_read()
            self._idx = end

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Context manager: lookups on this thread inside the block are not recorded.

        Inserts and evictions are still recorded (they change the table).
        """
        self._local.pause_depth = getattr(self._local, "pause_depth", 0) + 1
        try:
            yield
        finally:
            self._local.pause_depth -= 1

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
            rows = canonical_rows(rows, info.dim, info.dynamic, self._mode is TrackingMode.EMBEDDING)
            if len(rows) and info.dynamic and callable(getattr(info.module, "contains", None)):
                live = info.module.contains(rows.ids)
                if isinstance(live, torch.Tensor) and live.shape == rows.ids.shape:
                    live = live.to(device=rows.ids.device, dtype=torch.bool)
                    if not bool(live.all()):
                        rows = select_rows(rows, live.nonzero().squeeze(1))
            if not len(rows):
                return
            rows.age = rows.age + 1
            prev = self._carry[c].get(fqn)
            self._carry[c][fqn] = rows if prev is None or not len(prev) \
                else merge_carry(prev, rows)
            self._stats["retained_total"] += len(rows)

    def stats(self) -> dict:
        """Counters and gauges (plain ints/str/lists)."""
        with self._lock:
            s = dict(self._stats)
            s.update(
                mode=self._mode.value,
                consumers=list(self._consumers),
                tables=len(self._tables),
                steps=self.curr_batch_idx,
                rows_tracked=self._store.num_rows() + self._pending_rows(),
                state_rows=self._store.num_state_rows() + self._pending_state_rows(),
                tombstones_pending=self._tombs.num_rows(),
                compactions=self._store.compactions,
                states_modified=self._store.states_modified,
                degraded_tables=sorted(f for f in self._tables if self._store.is_degraded(f)),
                retained=sum(len(r) for carry in self._carry.values() for r in carry.values()),
                max_tracked_rows=self._max_rows,
            )
            return s

    def close(self) -> None:
        """Remove every hook the tracker registered (it records nothing afterwards).

        What was recorded stays readable.
        """
        with self._lock:
            self._flush_all()  # marks mean ids only while the tables report freed rows
            for h in self._handles:
                h.remove()
            self._handles = []
            self._row_listeners = []  # held weakly by the tables: they go with these refs

    def __enter__(self) -> DeltaTracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
