"""The hooks a :class:`~deltastream.DeltaTracker` registers on the model's tables.

Each hook turns one event of a tracked table into a call on the tracker's
:class:`~.recorder.Recorder`, under the tracker's lock: a lookup (forward hook, a HashTable's
lookup hook, or a TorchRec fused kernel's ids through :mod:`.torchrec_lookups`), rows being
freed, an insert, an eviction, a reload (``load_state_dict``: ids before and after for a
HashTable; a dense table goes back to the scan through the :class:`~.path_choice.PathSwitch`).
:meth:`ModelHooks.pause` stops lookups on one thread from being recorded.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch

from deltastream.tracking.discovery import LOOKUPS, TrackedTable
from deltastream.tracking.fresh_rows import spare_core
from deltastream.tracking.path_choice import PathSwitch
from deltastream.tracking.recorder import Recorder
from deltastream.tracking.torchrec_lookups import tap_tables
from deltastream.tracking.torchrec_tables import TORCHREC_KIND

__all__ = ["ModelHooks", "eager"]

log = logging.getLogger(__name__)


def first_rows_on_lane() -> bool:
    """Whether a CPU ``HashTable`` lookup's FIRST rows are copied from its storage on the C
    code's lane thread (where torch leaves a core spare), the table's update hook waiting
    for the copy, instead of at the lookup from its output. Off: on a 2-core VM with a 6 ms
    step the lane's copies cost the step 1.3–3.0 % more than the training thread's own, in
    two interleaved A/B runs with a budget publisher (the cross-core hand-over, and rows the
    optimizer then writes held in the other core's cache; ``BENCHMARKS.md``, stop 58). On a
    14 ms step (stop 56) they took 0.11 ms a step off the hook. Tests turn it on."""
    return False


def eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` made to run eagerly under ``torch.compile``."""
    # Hooks record real tensors under a lock. Importing dynamo costs seconds, so only when it
    # is in use already (a model compiled later reaches the hooks through a graph break).
    return torch.compiler.disable(fn) if "torch._dynamo" in sys.modules else fn


class _PauseDepth(threading.local):
    """This thread's :meth:`ModelHooks.pause` depth: 0 on a thread that never paused (a
    class default, so that reading it never raises and catches an ``AttributeError``)."""

    depth = 0


class ModelHooks:
    """Registers the tracker's hooks on ``tables`` (and the ``root`` model) and records what
    they see into ``rec``; ``drop_carried(fqn, ids)`` forgets retained rows of ids that left
    a HashTable (they become tombstones)."""

    def __init__(self, tables: dict[str, TrackedTable], root: torch.nn.Module, rec: Recorder,
                 lock: threading.RLock, switch: PathSwitch,
                 drop_carried: Callable[[str, torch.Tensor], None]) -> None:
        self._tables = tables
        self._rec = rec
        self._lock = lock
        self._switch = switch
        self._drop_carried = drop_carried
        self._local = _PauseDepth()
        self._handles: list[Any] = []
        self._row_listeners: list[Any] = []
        self._reload_before: dict[str, torch.Tensor] = {}
        #: tables whose lookups may copy their FIRST rows on the C code's lane thread
        #: (torch leaves a core spare, and the table says before its rows move: an update
        #: hook): see :meth:`_lane_source`
        self._lane: set[str] = set()
        for fqn, info in tables.items():
            self._attach(fqn, info)
        self._attach_torchrec()
        if any(i.dynamic for i in tables.values()):
            self._handles.append(root.register_load_state_dict_pre_hook(
                eager(self._before_reload)))

    def remove(self) -> None:
        """Remove every hook (nothing is recorded afterwards)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._row_listeners = []  # held weakly by the tables: they go with these refs

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Lookups on this thread inside the block are not recorded."""
        self._local.depth += 1
        try:
            yield
        finally:
            self._local.depth -= 1

    def _attach(self, fqn: str, info: TrackedTable) -> None:
        mod = info.module
        if info.kind == TORCHREC_KIND:
            return  # hooked per collection by _attach_torchrec
        if info.positional:
            self._handles.append(mod.register_lookup_hook(eager(
                lambda m, pos, rows: self._on_positions(fqn, m, pos, rows))))
            if callable(getattr(mod, "register_write_hook", None)):  # HashTable.insert
                self._handles.append(mod.register_write_hook(eager(
                    lambda m, pos, rows: self._on_write(fqn, pos, rows))))
            if callable(getattr(mod, "register_update_hook", None)) and first_rows_on_lane() \
                    and spare_core():
                self._handles.append(mod.register_update_hook(eager(
                    lambda table: self._before_update())))
                self._lane.add(fqn)
            cb = eager(lambda table, positions: self._rows_freed(fqn, positions))
            self._row_listeners.append(cb)  # the table holds it weakly
            mod.register_row_listener(cb)
        else:
            self._handles.append(mod.register_forward_hook(eager(
                lambda m, args, kwargs, out: self._on_forward(fqn, m, args, kwargs, out)),
                with_kwargs=True))
        if info.dynamic:
            self._handles.append(mod.register_insert_hook(eager(
                lambda table, ids: self._on_insert(fqn, ids))))
            self._handles.append(mod.register_evict_hook(eager(
                lambda table, ids: self._on_evict(fqn, ids))))
            self._handles.append(mod.register_load_state_dict_post_hook(eager(
                lambda m, keys: self._after_reload(fqn))))
        else:
            self._handles.append(mod.register_load_state_dict_pre_hook(eager(
                lambda m, *a: self._switch.before_dense_reload(fqn))))

    def _attach_torchrec(self) -> None:
        """Hook the fused kernels of TorchRec tables on the lookups path (their collection's
        ``load_state_dict`` moves them to the scan). CPU tables copy their FIRST rows on
        the C code's lane thread when torch leaves a core spare (CUDA tables copy none at
        the lookup: no lane, no wait after the kernel)."""
        tables = {f: i.module for f, i in self._tables.items()
                  if i.kind == TORCHREC_KIND and i.path == LOOKUPS}
        lane = spare_core() and any(t.device.type == "cpu" for t in tables.values())
        self._handles.extend(tap_tables(
            tables, self._on_torchrec_ids,
            lambda fqns: [self._switch.before_dense_reload(f) for f in fqns], eager,
            self._before_update if lane else None))

    def _paused(self) -> bool:
        return self._local.depth > 0

    def _on_torchrec_ids(self, fqn: str, local_ids: torch.Tensor, later: bool) -> None:
        if self._paused():
            self._rec.counts["lookups_paused"] += 1
            return
        with self._lock:
            self._rec.record_lookup(fqn, local_ids, None, later)

    def _before_update(self) -> None:
        # a fused kernel's backward is next: the FIRST rows copied off the training thread
        # must be in the arena before it writes the rows
        with self._lock:
            self._rec.sync_lookups()

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
        # every training lookup of a HashTable runs this: each call and attribute here
        # costs ~1 µs on the step's cold caches, so the checks are inline
        if self._local.depth > 0:
            self._rec.counts["lookups_paused"] += 1
            return
        if positions is None or not module.training:
            self._rec.counts["lookups_eval_skipped"] += 1
            return
        storage = self._lane_source(fqn, module, rows) if fqn in self._lane else None
        with self._lock:
            if storage is None:
                self._rec.record_positions(fqn, positions, rows)
            else:  # copied on the lane thread; the table's update hook waits for it
                self._rec.record_positions(fqn, positions, storage, whole_table=True,
                                           later=True)

    def _lane_source(self, fqn: str, module: torch.nn.Module, rows: torch.Tensor
                     ) -> Optional[torch.Tensor]:
        """The storage a lookup of ``fqn`` (in ``_lane``) may copy its FIRST rows from on
        the lane thread (a contiguous CPU storage of the output's dtype, its table with an
        update hook), or None: copied now, from the lookup's ``rows``."""
        if not self._rec.keeps_unique(fqn):
            return None
        storage = module.storage
        if storage.device.type != "cpu" or storage.dtype != rows.dtype \
                or not storage.is_contiguous():
            return None
        return storage

    def _on_write(self, fqn: str, positions: torch.Tensor, rows: torch.Tensor) -> None:
        # HashTable.insert changed rows without a lookup: recorded as a lookup of them (rows
        # before the write: their FIRST state), in eval mode and paused alike, since a
        # pause skips lookups, not changes
        with self._lock:
            self._rec.record_positions(fqn, positions, rows)

    def _rows_freed(self, fqn: str, positions: Optional[torch.Tensor]) -> None:
        # Rows are being freed: their positions may be reused by the next insert, so their
        # marks go now (Recorder.rows_freed), and rows a hand-off owes are copied while
        # they still hold their values.
        with self._lock:
            self._rec.settle_all()
            self._rec.rows_freed(fqn, positions)

    def _on_insert(self, fqn: str, ids: torch.Tensor) -> None:
        with self._lock:
            self._rec.record_insert(fqn, ids.detach().reshape(-1))

    def _on_evict(self, fqn: str, ids: torch.Tensor) -> None:
        ids = ids.detach().reshape(-1).to(torch.int64)
        with self._lock:
            self._rec.record_evict(fqn, ids)
            self._drop_carried(fqn, ids)  # the row is gone: a tombstone, not a retained row

    def _before_reload(self, *args: Any) -> None:
        """Model ``load_state_dict`` pre-hook: remember the ids each HashTable holds (and
        copy the rows a hand-off still owes: the load changes rows without lookups)."""
        with self._lock:
            self._rec.settle_all()
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
