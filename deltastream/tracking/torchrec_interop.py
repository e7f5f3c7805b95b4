"""Publish what TorchRec's own delta tracker recorded, through deltastream.

A trainer that already enabled ``DistributedModelParallel``'s delta tracker
(``dmp.init_torchrec_delta_tracker(DeltaTrackerConfig(...))``) can hand its output to
:func:`~deltastream.publish_delta` or :class:`~deltastream.BudgetPublisher` through
:class:`TorchRecDeltaSource`, which looks like a :class:`~deltastream.DeltaTracker` to them
(``get_delta``, ``retain``, ``get_tracked_modules``, ``consumers``).

TorchRec's tracker reports **rank-local** row ids (a row-wise shard's rows count from 0);
:func:`to_global` adds each local shard's row offset, so the ids are the table's global
rows, and the keys are those of :class:`~deltastream.DeltaTracker` on the same model (a
rank holding several column shards of one table gets the ids once per shard). Rows are read
from the sharded module's weights at publish time, as for ``DeltaTracker``.

An interval in which a table got no lookups gives that table empty rows (TorchRec 1.8's own
``get_unique`` raises there after a delete-on-read; the source steps around it).

What it cannot do better than TorchRec's tracker: it reports the rows that were **looked
up** (not rows an optimizer moved without a lookup, nor rows written by ``load_state_dict``),
and its FIRST states only in TorchRec's EMBEDDING mode (else ``states`` is ``None`` and the
selection publishes every reported row). ``DeltaTracker`` finds every changed row exactly.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any, Optional

import torch

from deltastream.tracking.discovery import discover
from deltastream.tracking.rows import canonical_rows, carry_rows, merge_carry
from deltastream.tracking.torchrec_tables import TorchRecTable
from deltastream.types import DeltaRows

__all__ = ["TorchRecDeltaSource", "to_global"]

log = logging.getLogger(__name__)


def to_global(views: dict[str, TorchRecTable], fqn: str,
              local_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Rank-local row ids ``[n]`` that TorchRec's tracker reported for table ``fqn`` as
    global ids per tracker key: ``{key: ascending unique int64 ids}`` for every local shard
    of that table (``key`` is ``fqn`` or ``fqn#<shard_id>``). Local ids outside a shard's
    rows are dropped with a warning (they cannot be rows of this rank)."""
    keys = [k for k in views if k == fqn or k.startswith(fqn + "#")]
    ids = torch.unique(local_ids.reshape(-1).to(torch.int64))
    out = {}
    for key in keys:
        v = views[key]
        ok = (ids >= 0) & (ids < v.rows)
        if not bool(ok.all()):
            log.warning("TorchRecDeltaSource: %d ids of %s are not rows of the local shard "
                        "(%d rows); dropped", int((~ok).sum()), key, v.rows)
        out[key] = ids[ok] + v.row_offset
    return out


def _drop_emptied_tables(tracker: Any) -> None:
    """Work around TorchRec 1.8's ``get_unique`` failing with ``torch.cat(): expected a
    non-empty list`` for a table whose lookups a delete-on-read removed and that got none
    since: such a table has nothing to report, so its empty entry is dropped first."""
    lookups = getattr(getattr(tracker, "store", None), "per_fqn_lookups", None)
    if isinstance(lookups, dict):
        for fqn in [f for f, entries in lookups.items() if not entries]:
            del lookups[fqn]


class TorchRecDeltaSource:
    """TorchRec's ``ModelDeltaTracker`` output as a delta source for deltastream publishing.

    Args:
        model: the ``DistributedModelParallel`` model (or the module it wraps).
        tracker: TorchRec's tracker; default ``model.get_delta_tracker()``.
        consumers: consumer names (each reads TorchRec's tracker under the same name);
            default the consumers TorchRec's tracker was configured with.

    Raises:
        ValueError: no TorchRec tracker, or no TorchRec table in ``model``.
    """

    def __init__(self, model: torch.nn.Module, tracker: Any = None,
                 consumers: Optional[Iterable[str]] = None) -> None:
        if tracker is None:
            get = getattr(model, "get_delta_tracker", None)
            tracker = get() if callable(get) else None
        if tracker is None or not callable(getattr(tracker, "get_unique", None)):
            raise ValueError("TorchRecDeltaSource needs TorchRec's delta tracker: enable it "
                             "with dmp.init_torchrec_delta_tracker(DeltaTrackerConfig(...)) "
                             "or pass tracker=")
        self._trec = tracker
        found = discover(model)
        self._views: dict[str, TorchRecTable] = {
            k: t.module for k, t in found.tables.items() if isinstance(t.module, TorchRecTable)}
        if consumers is None:
            consumers = list(getattr(tracker, "per_consumer_batch_idx", {}) or ["default"])
        self._consumers = [consumers] if isinstance(consumers, str) else list(consumers)
        self._carry: dict[str, dict[str, DeltaRows]] = {c: {} for c in self._consumers}
        self._lock = threading.Lock()

    @property
    def consumers(self) -> list[str]:
        """Consumer names."""
        return list(self._consumers)

    def get_tracked_modules(self) -> dict[str, TorchRecTable]:
        """``{key: TorchRecTable}``: the local tables, keyed as ``DeltaTracker`` keys them."""
        return dict(self._views)

    def table(self, fqn: str) -> TorchRecTable:
        """The table of a :meth:`get_delta` key (``KeyError`` if unknown)."""
        return self._views[fqn]

    def _consumer(self, consumer: Optional[str]) -> str:
        if consumer is None and len(self._consumers) == 1:
            return self._consumers[0]
        if consumer not in self._carry:
            raise ValueError(f"unknown consumer {consumer!r}; consumers: {self._consumers}")
        return consumer

    def get_delta(self, consumer: Optional[str] = None) -> dict[str, DeltaRows]:
        """TorchRec's ``get_unique(consumer)`` with global ids, per tracker key, united with
        the rows retained since; every local table is a key. ``states`` ``[n, dim]`` are
        TorchRec's (EMBEDDING mode, one local shard of the table) or ``None``."""
        with self._lock:
            c = self._consumer(consumer)
            _drop_emptied_tables(self._trec)
            raw = self._trec.get_unique(c)
            carry, self._carry[c] = self._carry[c], {}
            out: dict[str, DeltaRows] = {}
            for fqn, rows in raw.items():
                ids = getattr(rows, "ids", None)
                if ids is None or ids.numel() == 0:
                    continue
                states = getattr(rows, "states", None)
                for key, gids in to_global(self._views, fqn, ids).items():
                    out[key] = self._rows(key, ids, gids, states)
            for key, view in self._views.items():
                fresh = out.get(key)
                if fresh is None:
                    fresh = DeltaRows(ids=torch.empty(0, dtype=torch.int64, device=view.device),
                                      age=torch.empty(0, dtype=torch.int64, device=view.device))
                old = carry.get(key)
                out[key] = merge_carry(old, fresh) if old is not None and len(old) else fresh
            return out

    #: TorchRec's name of :meth:`get_delta`.
    get_unique = get_delta

    def _rows(self, key: str, local: torch.Tensor, gids: torch.Tensor,
              states: Optional[torch.Tensor]) -> DeltaRows:
        view = self._views[key]
        keep = None
        if states is not None and states.dim() == 2 and states.shape[0] == local.numel() \
                and states.shape[1] == view.embedding_dim:
            # TorchRec's rows come in the order of its ids: reorder to the ascending ids
            order = torch.argsort(local.reshape(-1).to(torch.int64), stable=True)
            srt = local.reshape(-1).to(torch.int64)[order]
            first = torch.ones_like(srt, dtype=torch.bool)
            first[1:] = srt[1:] != srt[:-1]
            ok = (srt >= 0) & (srt < view.rows)
            keep = states.index_select(0, order[first & ok].to(states.device))
        rows = DeltaRows(ids=gids.to(view.device), states=keep, new=None,
                         age=torch.zeros(gids.numel(), dtype=torch.int64, device=view.device))
        return rows

    def retain(self, consumer: str, fqn: str, rows: DeltaRows) -> None:
        """Hand back rows read but not published: the next :meth:`get_delta` of ``consumer``
        returns them again (their FIRST state wins, ``age + 1``)."""
        with self._lock:
            c = self._consumer(consumer)
            if fqn not in self._views:
                raise ValueError(f"unknown table {fqn!r}; tracked: {sorted(self._views)}")
            rows = canonical_rows(rows, self._views[fqn].embedding_dim, False,
                                  rows.states is not None)
            if not len(rows):
                return
            carry_rows(self._carry[c], fqn, rows)
