"""Which path finds a dense table's changes: when the lookups path can be exact, and the
switch that moves tables between the paths as the training run shows what moves its rows.

:func:`declare_lookups` applies ``DeltaTracker(sparse_updates_only=...)`` (with
:func:`declared_tables`), :func:`lookups_refusal` says why the lookups path cannot be exact
for a table (DDP, ``max_norm``, a tied weight), and :func:`sparse_only_reason` which
``torch.optim`` optimizers move only the rows that were looked up. :class:`PathSwitch` holds
the tracker's later decisions: ``watch_optimizer``, the optimizer-step guard and reloads.

A table's changes can be found from its lookups alone (the tracker's ``"lookups"`` path) only
when nothing moves a row that had no gradient in the step. For an ``nn.Embedding`` or
``nn.EmbeddingBag`` that holds for an optimizer that leaves a parameter entry untouched when
its gradient is zero (or absent from a sparse gradient):

* ``torch.optim.SGD`` without momentum and without weight decay (``w -= lr * 0`` is ``w``,
  bit for bit);
* ``torch.optim.Adagrad`` without weight decay (its accumulator grows by ``0``, the step is
  ``lr * 0 / ...``);
* ``torch.optim.SparseAdam`` (updates only the entries of the sparse gradient).

Every other optimizer keeps moving rows after their last gradient: momentum (SGD with
``momentum``), moments (Adam, AdamW, RMSprop, ...) or weight decay. Subclasses count as
"other": their ``step`` may differ. :func:`sparse_only_reason` says which case applies.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Optional, Union

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from deltastream.tracking.discovery import LOOKUPS, TrackedTable
from deltastream.tracking.recorder import Recorder
from deltastream.tracking.torchrec_tables import TORCHREC_KIND

__all__ = ["sparse_only_reason", "owned_weights", "lookups_refusal", "declared_tables",
           "declare_lookups", "PathSwitch"]

log = logging.getLogger(__name__)


def _groups_with(optimizer: Any, keys: tuple[str, ...]) -> list[str]:
    """The hyperparameters among ``keys`` that are non-zero in some param group."""
    bad = []
    for key in keys:
        if any(group.get(key) for group in optimizer.param_groups):
            bad.append(key)
    return bad


def sparse_only_reason(optimizer: Any) -> Optional[str]:
    """``None`` when ``optimizer`` moves only rows with a gradient; else why it does not.

    Checked against the optimizer's current ``param_groups`` (hyperparameters can change
    between steps, so callers check again before every step).
    """
    kind = type(optimizer)
    if kind is torch.optim.SparseAdam:
        return None
    if kind is torch.optim.SGD:
        bad = _groups_with(optimizer, ("momentum", "weight_decay"))
        return None if not bad else f"SGD with {' and '.join(bad)} moves rows after their " \
            "last gradient"
    if kind is torch.optim.Adagrad:
        bad = _groups_with(optimizer, ("weight_decay",))
        return None if not bad else "Adagrad with weight_decay moves every row each step"
    return (f"{kind.__name__} keeps per-row state (momentum, moments) or decays weights, so "
            "it moves rows that were not looked up")


def owned_weights(optimizer: Any, weights: dict[str, torch.Tensor]) -> list[str]:
    """The keys of ``weights`` whose tensor is one of ``optimizer``'s parameters."""
    params = {id(p) for group in optimizer.param_groups for p in group.get("params", ())}
    return [key for key, w in weights.items() if id(w) in params]


def declared_tables(tables: dict[str, TrackedTable],
                    sparse_updates_only: Union[bool, Iterable[str]]) -> list[str]:
    """The dense tables ``sparse_updates_only`` (True = all, or FQNs) declares. A HashTable
    named there is accepted and left out (it always uses its lookups). Raises
    ``ValueError`` for a name that is not tracked."""
    dense = [f for f, i in tables.items() if not i.dynamic]
    if isinstance(sparse_updates_only, bool):  # True: the nn.Embedding/EmbeddingBag tables
        return [f for f in dense if tables[f].kind != "torchrec"] \
            if sparse_updates_only else []
    names = [sparse_updates_only] if isinstance(sparse_updates_only, str) \
        else list(sparse_updates_only)
    unknown = sorted(n for n in names if n not in tables)
    if unknown:
        raise ValueError(f"sparse_updates_only names tables the tracker does not track: "
                         f"{unknown}; tracked: {sorted(tables)}")
    return [n for n in names if n in dense]


def lookups_refusal(info: TrackedTable, distributed: bool) -> Optional[str]:
    """Why the lookups path cannot be exact for dense table ``info`` (None: it can be)."""
    if info.kind == "torchrec":
        return ("TorchRec tables are tracked by the scan: their fused optimizers update rows "
                "inside the backward pass, where no lookup hook sees them")
    if distributed:
        return ("the model is wrapped in DistributedDataParallel: its rows also move "
                "through the other ranks' lookups (gradients are all-reduced), which "
                "this rank never sees")
    if getattr(info.module, "max_norm", None) is not None:
        return "max_norm renormalizes looked-up rows inside forward, before any hook"
    if info.shared_with:
        return (f"its weight is shared with {', '.join(info.shared_with)}, which moves "
                "its rows without a lookup")
    return None


def declare_lookups(tables: dict[str, TrackedTable],
                    sparse_updates_only: Union[bool, Iterable[str]], distributed: bool) -> None:
    """Put the tables ``sparse_updates_only`` declares on the lookups path (before the
    recorder is built: it gives scan tables their shadows). Raises ``ValueError`` for a
    table the lookups path cannot track exactly (the message says what to do)."""
    for fqn in declared_tables(tables, sparse_updates_only):
        why = lookups_refusal(tables[fqn], distributed)
        if why is not None:
            raise ValueError(
                f"sparse_updates_only cannot track table {fqn!r} exactly: {why}; leave it "
                f"out of sparse_updates_only (the default scan path reports every changed "
                f"row)")
        tables[fqn].path = LOOKUPS


class PathSwitch:
    """Moves dense tables between the lookups and the scan path for one tracker.

    A table goes to the lookups path when a watched optimizer is sparse-only, and back to
    the scan (``pinned`` there) when an optimizer that is not sparse-only steps on its
    weight or its weights are reloaded. ``eager`` wraps a hook so that it runs outside
    ``torch.compile``; ``lock`` is the tracker's lock.
    """

    def __init__(self, tables: dict[str, TrackedTable], distributed: bool, rec: Recorder,
                 lock: threading.RLock, eager: Callable[[Any], Any]) -> None:
        self._tables = tables
        self._distributed = distributed
        self._rec = rec
        self._lock = lock
        self._eager = eager
        self._pinned: set[str] = set()  # dense tables a watched optimizer keeps on the scan
        self._guard = None  # global optimizer step pre-hook while a dense table uses lookups

    def update_guard(self) -> None:
        """Watch every optimizer step while a dense table uses the lookups path."""
        need = any(not i.dynamic and i.path == LOOKUPS and i.kind != TORCHREC_KIND
                   for i in self._tables.values())
        if need and self._guard is None:
            ref = weakref.ref(self)  # a process-wide hook must not keep the tracker alive

            def guard(optimizer: Any, args: Any, kwargs: Any) -> None:
                switch = ref()
                if switch is not None:
                    switch.before_step(optimizer)

            self._guard = register_optimizer_step_pre_hook(self._eager(guard))
            weakref.finalize(self, self._guard.remove)
        elif not need and self._guard is not None:
            self._guard.remove()
            self._guard = None

    def _to_scan(self, fqn: str, why: str) -> None:
        self._rec.use_scan(fqn)
        log.warning("DeltaTracker: table %s now uses the scan path: %s", fqn, why)

    def before_step(self, optimizer: Any) -> None:
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
                self.update_guard()

    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> dict[str, str]:
        """See :meth:`DeltaTracker.watch_optimizer`. Returns ``{fqn: path}`` of its tables."""
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
                elif fqn not in self._pinned and \
                        lookups_refusal(self._tables[fqn], self._distributed) is None:
                    self._rec.use_lookups(fqn)
            self.update_guard()
            return {fqn: self._tables[fqn].path for fqn in owned}

    def before_dense_reload(self, fqn: str) -> None:
        """A dense table's ``load_state_dict`` writes rows without a lookup: to the scan."""
        with self._lock:
            if self._tables[fqn].path == LOOKUPS:
                self._pinned.add(fqn)
                self._to_scan(fqn, "load_state_dict writes rows without a lookup")
                self.update_guard()

    def close(self) -> None:
        """Remove the optimizer-step guard."""
        if self._guard is not None:
            self._guard.remove()
            self._guard = None
