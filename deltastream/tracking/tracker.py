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
  decay, SparseAdam; :mod:`.paths`). A step of any ``torch.optim`` optimizer that is
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
:mod:`.rows` merges retained rows, :mod:`.paths` decides when the lookups path is exact.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Optional, Union

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from deltastream.tracking.discovery import LOOKUPS, TrackedTable, discover
from deltastream.tracking.options import consumer_names, resolve_consumer, tracking_mode
from deltastream.tracking.paths import (
    declared_tables,
    lookups_refusal,
    owned_weights,
    sparse_only_reason,
)
from deltastream.tracking.recorder import Recorder
from deltastream.tracking.rows import (
    assemble_delta,
    canonical_rows,
    carry_rows,
    drop_ids,
    select_rows,
)
from deltastream.tracking.torchrec_lookups import tap_tables
from deltastream.tracking.torchrec_tables import TORCHREC_KIND
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
                 sparse_updates_only: Union[bool, Iterable[str]] = False) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self._mode = tracking_mode(mode)
        self._consumers = consumer_names(consumers, self.DEFAULT_CONSUMER)
        if max_tracked_rows is not None and (not isinstance(max_tracked_rows, int)
                                             or isinstance(max_tracked_rows, bool)
                                             or max_tracked_rows <= 0):
            raise ValueError(f"max_tracked_rows must be a positive int or None, "
                             f"got {max_tracked_rows!r}")
        self._delete_on_read = bool(delete_on_read)
        self._auto_compact = bool(auto_compact)
        self._max_rows = max_tracked_rows
        self._lock = threading.RLock()
        self._local = threading.local()
        self.curr_batch_idx = 0  #: number of step() calls
        self._cursor: dict[str, int] = dict.fromkeys(self._consumers, 0)  # first unread index
        self._carry: dict[str, dict[str, DeltaRows]] = {c: {} for c in self._consumers}

        found = discover(model, fqns_to_skip)
        self._tables: dict[str, TrackedTable] = found.tables
        self._root = found.root
        self._distributed = found.distributed
        self._pinned: set[str] = set()  # dense tables a watched optimizer keeps on the scan
        for fqn in declared_tables(self._tables, sparse_updates_only):
            self._check_lookups_exact(fqn)
            self._tables[fqn].path = LOOKUPS
        self._rec = Recorder(self._mode, self._tables, max_tracked_rows,
                             lambda: self._cursor.values())
        self._handles: list[Any] = []
        self._row_listeners: list[Any] = []
        self._reload_before: dict[str, torch.Tensor] = {}
        self._guard = None  # global optimizer step pre-hook while a dense table uses lookups
        self._closed = False
        for fqn, info in self._tables.items():
            self._attach(fqn, info)
        self._attach_torchrec()
        if any(i.dynamic for i in self._tables.values()):
            self._handles.append(self._root.register_load_state_dict_pre_hook(
                self._hook(self._before_reload)))
        self._update_guard()
        log.info("DeltaTracker (%s) tracks %s", self._mode.value,
                 {f: i.path for f, i in self._tables.items()})

    # ------------------------------------------------------------------ paths

    def _lookups_refusal(self, fqn: str) -> Optional[str]:
        return lookups_refusal(self._tables[fqn], self._distributed)

    def _check_lookups_exact(self, fqn: str) -> None:
        why = self._lookups_refusal(fqn)
        if why is not None:
            raise ValueError(
                f"sparse_updates_only cannot track table {fqn!r} exactly: {why}; leave it "
                f"out of sparse_updates_only (the default scan path reports every changed "
                f"row)")

    def _update_guard(self) -> None:
        """Watch every optimizer step while a dense table uses the lookups path."""
        need = any(not i.dynamic and i.path == LOOKUPS and i.kind != TORCHREC_KIND
                   for i in self._tables.values())
        if need and self._guard is None:
            ref = weakref.ref(self)  # a process-wide hook must not keep the tracker alive

            def guard(optimizer: Any, args: Any, kwargs: Any) -> None:
                tracker = ref()
                if tracker is not None:
                    tracker._before_step(optimizer, args, kwargs)

            self._guard = register_optimizer_step_pre_hook(self._hook(guard))
            weakref.finalize(self, self._guard.remove)
        elif not need and self._guard is not None:
            self._guard.remove()
            self._guard = None

    def _to_scan(self, fqn: str, why: str) -> None:
        self._rec.use_scan(fqn)
        log.warning("DeltaTracker: table %s now uses the scan path: %s", fqn, why)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Global optimizer pre-step hook: a dense lookups-path table about to be moved by
        an optimizer that is not sparse-only goes back to the scan (exact: see
        ``Recorder.use_scan``)."""
        with self._lock:
            dense = {f: i.module.weight for f, i in self._tables.items()
                     if not i.dynamic and i.path == LOOKUPS and i.kind != TORCHREC_KIND}
            owned = owned_weights(optimizer, dense) if dense else []
            why = sparse_only_reason(optimizer) if owned else None
            for fqn in owned if why else ():
                self._pinned.add(fqn)
                self._to_scan(fqn, why)
            if owned and why:
                self._update_guard()

    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> dict[str, str]:
        """Check ``optimizer`` and set the path of the dense tables whose weight it updates.

        A sparse-only optimizer (:mod:`deltastream.tracking.paths`) moves them to the
        lookups path (no shadow, no scan) unless another watched optimizer is not
        sparse-only or the lookups path cannot be exact for them (DDP, ``max_norm``, tied
        weight: they stay on the scan); any other optimizer keeps them on the scan path.
        Watch every optimizer that updates a table. Returns ``{fqn: path}`` of its tables.
        """
        if not hasattr(optimizer, "param_groups"):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        with self._lock:
            dense = {f: i.module.weight for f, i in self._tables.items()
                     if not i.dynamic and i.kind != TORCHREC_KIND}
            owned = owned_weights(optimizer, dense)
            why = sparse_only_reason(optimizer)
            for fqn in owned:
                if why is not None:
                    self._pinned.add(fqn)
                    if self._tables[fqn].path == LOOKUPS:
                        self._to_scan(fqn, why)
                elif fqn not in self._pinned and self._lookups_refusal(fqn) is None:
                    self._rec.use_lookups(fqn)
            self._update_guard()
            return {fqn: self._tables[fqn].path for fqn in owned}

    @property
    def paths(self) -> dict[str, str]:
        """``{fqn: "lookups" | "scan"}``: how each table's changes are found."""
        return {fqn: info.path for fqn, info in self._tables.items()}

    # ------------------------------------------------------------------ hooks

    def _hook(self, fn):
        # Under torch.compile hooks must run eagerly (they record real tensors under a
        # lock). Importing dynamo costs seconds, so only when it is in use already (a model
        # compiled later reaches the hooks through a graph break instead).
        return torch.compiler.disable(fn) if "torch._dynamo" in sys.modules else fn

    def _attach(self, fqn: str, info: TrackedTable) -> None:
        mod = info.module
        if info.kind == TORCHREC_KIND:
            return  # hooked per collection by _attach_torchrec
        if info.positional:
            self._handles.append(mod.register_lookup_hook(self._hook(
                lambda m, pos, rows: self._on_positions(fqn, m, pos, rows))))
            cb = self._hook(lambda table, positions: self._flush(fqn))
            self._row_listeners.append(cb)  # the table holds it weakly
            mod.register_row_listener(cb)
        else:
            self._handles.append(mod.register_forward_hook(self._hook(
                lambda m, args, kwargs, out: self._on_forward(fqn, m, args, kwargs, out)),
                with_kwargs=True))
        if info.dynamic:
            self._handles.append(mod.register_insert_hook(self._hook(
                lambda table, ids: self._on_insert(fqn, ids))))
            self._handles.append(mod.register_evict_hook(self._hook(
                lambda table, ids: self._on_evict(fqn, ids))))
            self._handles.append(mod.register_load_state_dict_post_hook(self._hook(
                lambda m, keys: self._after_reload(fqn))))
        else:
            self._handles.append(mod.register_load_state_dict_pre_hook(self._hook(
                lambda m, *a: self._before_dense_reload(fqn))))

    def _attach_torchrec(self) -> None:
        """Hook the fused kernels of TorchRec tables on the lookups path (their collection's
        ``load_state_dict`` moves them to the scan)."""
        self._handles.extend(tap_tables(
            {f: i.module for f, i in self._tables.items()
             if i.kind == TORCHREC_KIND and i.path == LOOKUPS},
            self._on_torchrec_ids, lambda fqns: [self._before_dense_reload(f) for f in fqns],
            self._hook))

    def _on_torchrec_ids(self, fqn: str, local_ids: torch.Tensor) -> None:
        if self._paused():
            self._rec.counts["lookups_paused"] += 1
            return
        with self._lock:
            self._rec.record_lookup(fqn, local_ids, None)

    def _paused(self) -> bool:
        return getattr(self._local, "pause_depth", 0) > 0

    def _on_forward(self, fqn: str, module: torch.nn.Module, args: tuple, kwargs: dict,
                    output: Any) -> None:
        if self._paused():
            self._rec.counts["lookups_paused"] += 1
            return
        info = self._tables[fqn]
        if not module.training and not (info.path == LOOKUPS and not info.dynamic
                                         and torch.is_grad_enabled()
                                         and module.weight.requires_grad):
            self._rec.counts["lookups_eval_skipped"] += 1
            return
        ids = args[0] if args else kwargs.get("input", kwargs.get("ids"))
        if not isinstance(ids, torch.Tensor):
            return
        with self._lock:
            self._rec.record_lookup(fqn, ids.detach().reshape(-1), output)

    def _on_positions(self, fqn: str, module: torch.nn.Module,
                      positions: Optional[torch.Tensor], rows: torch.Tensor) -> None:
        if self._paused():
            self._rec.counts["lookups_paused"] += 1
            return
        if positions is None or not module.training:
            self._rec.counts["lookups_eval_skipped"] += 1
            return
        with self._lock:
            self._rec.record_positions(fqn, positions, rows)

    def _flush(self, fqn: str) -> None:
        # Rows are being freed: their positions may be reused by the next insert, so the
        # marks must become ids now (the table still knows which id each position held).
        with self._lock:
            self._rec.flush(fqn)

    def _on_insert(self, fqn: str, ids: torch.Tensor) -> None:
        with self._lock:
            self._rec.record_insert(fqn, ids.detach().reshape(-1))

    def _drop_carried(self, fqn: str, ids: torch.Tensor) -> None:
        for carry in self._carry.values():
            rows = carry.get(fqn)
            if rows is not None and len(rows):
                carry[fqn] = drop_ids(rows, ids)

    def _on_evict(self, fqn: str, ids: torch.Tensor) -> None:
        ids = ids.detach().reshape(-1).to(torch.int64)
        with self._lock:
            self._rec.record_evict(fqn, ids)
            self._drop_carried(fqn, ids)  # the row is gone: a tombstone, not a retained row

    def _before_reload(self, *args: Any) -> None:
        """Model ``load_state_dict`` pre-hook: remember the ids each HashTable holds."""
        with self._lock:
            for fqn, info in self._tables.items():
                if info.dynamic and callable(getattr(info.module, "ids", None)):
                    self._reload_before[fqn] = info.module.ids()

    def _after_reload(self, fqn: str) -> None:
        module = self._tables[fqn].module
        if not callable(getattr(module, "ids", None)):
            return
        with self._lock:
            before = self._reload_before.pop(fqn, None)
            if before is None:
                log.warning("DeltaTracker: %s was loaded directly (not through the model's "
                            "load_state_dict): every row it holds is reported, but ids it "
                            "held before cannot be reported as tombstones", fqn)
                before = torch.empty(0, dtype=torch.int64)
            gone = self._rec.record_reload(fqn, before, module.ids())
            self._drop_carried(fqn, gone)

    def _before_dense_reload(self, fqn: str) -> None:
        with self._lock:
            if self._tables[fqn].path == LOOKUPS:
                self._pinned.add(fqn)
                self._to_scan(fqn, "load_state_dict writes rows without a lookup")
                self._update_guard()

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
        (``[n, dim]`` FIRST states in EMBEDDING mode, ``None`` in ID_ONLY mode or for a
        degraded table), ``new`` (bool ``[n]``; ``None`` for ``nn.Embedding``/``Bag``),
        ``tombstones`` (int64 ``[m]`` evicted ids, disjoint from ``ids``) and ``age`` (int64
        ``[n]``: retains in a row). Every tracked table is a key, possibly with empty rows.
        Tensors stay on the table's device (no host copy).
        """
        with self._lock:
            c = self._resolve(consumer)
            self._boundary()
            rec = self._rec
            end = rec.idx + 1
            start = max(self._cursor.values())
            if start < end:  # the interval nobody has read yet becomes one record
                rec.compact(start, end)
            frm = self._cursor[c]
            touched = rec.touched.get_unique(frm)
            tombs = rec.tombs.get_unique(frm)
            news = rec.news.get_unique(frm)
            carry = self._carry[c]
            self._carry[c] = {}
            out = {}
            for fqn, info in self._tables.items():
                out[fqn] = assemble_delta(touched[fqn], tombs[fqn].ids, news[fqn].ids,
                                          carry.get(fqn), info.dynamic)
            self._cursor[c] = end
            rec.idx = end
            if self._delete_on_read:
                rec.delete(min(self._cursor.values()))
            rec.counts["reads"] += 1
            return out

    #: Alias of :meth:`get_delta` (TorchRec's store name).
    get_unique = get_delta

    def get_delta_ids(self, consumer: Optional[str] = None) -> dict[str, torch.Tensor]:
        """``{fqn: ids}`` changed since ``consumer``'s last read (advances its cursor)."""
        return {fqn: rows.ids for fqn, rows in self.get_delta(consumer).items()}

    def clear(self, consumer: Optional[str] = None) -> None:
        """Forget what ``consumer`` has not read yet (its retained rows too).

        ``None`` clears every consumer and all records (scan shadows take the current
        weights: what exists now counts as read).
        """
        with self._lock:
            rec = self._rec
            end = rec.idx + 1
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
                    rec.delete(min(self._cursor.values()))
            rec.idx = end

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Context manager: lookups on this thread inside the block are not recorded.

        Inserts and evictions are still recorded (they change the table), and a scan-path
        table still reports the rows that changed.
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
            rows = canonical_rows(rows, info.dim, info.dynamic,
                                  self._mode is TrackingMode.EMBEDDING)
            if len(rows) and info.dynamic and callable(getattr(info.module, "contains", None)):
                live = info.module.contains(rows.ids)
                if isinstance(live, torch.Tensor) and live.shape == rows.ids.shape:
                    live = live.to(device=rows.ids.device, dtype=torch.bool)
                    if not bool(live.all()):
                        rows = select_rows(rows, live.nonzero().squeeze(1))
            if not len(rows):
                return
            carry_rows(self._carry[c], fqn, rows)
            self._rec.counts["retained_total"] += len(rows)

    def stats(self) -> dict:
        """Counters and gauges (plain ints/floats/str/lists/dicts).

        ``paths``: ``{fqn: "lookups" | "scan"}``; ``scans``, ``scan_seconds``: drift scans
        run and their time; ``rows_moved_without_lookup``: rows a scan found changed that
        no lookup had touched (what lookups alone would have missed); ``shadow_bytes``:
        memory of the shadows.
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
                compactions=rec.touched.compactions,
                states_modified=rec.touched.states_modified,
                degraded_tables=sorted(f for f in self._tables if rec.touched.is_degraded(f)),
                retained=sum(len(r) for carry in self._carry.values() for r in carry.values()),
                max_tracked_rows=self._max_rows,
                scans=sum(sc.scans for sc in scans),
                scan_seconds=sum(sc.seconds for sc in scans),
                rows_moved_without_lookup=sum(sc.unlooked for sc in scans),
                shadow_bytes=sum(sc.nbytes for sc in scans),
            )
            return s

    def close(self) -> None:
        """Remove every hook the tracker registered (it records nothing afterwards).

        What was recorded (and, for scan tables, what changed until now) stays readable.
        """
        with self._lock:
            self._boundary()  # marks mean ids only while the tables report freed rows
            self._closed = True
            for h in self._handles:
                h.remove()
            self._handles = []
            self._row_listeners = []  # held weakly by the tables: they go with these refs
            if self._guard is not None:
                self._guard.remove()
                self._guard = None

    def __enter__(self) -> DeltaTracker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

