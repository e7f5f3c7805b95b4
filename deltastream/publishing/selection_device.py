"""The kernel path of :func:`~deltastream.publishing.selection.select_changed` (CUDA).

Same contract as the torch reference path (:mod:`deltastream.publishing.selection`, whose
docstring is the specification), built for a GPU: no chunk loop and a single host sync.
One call costs, for ``n`` candidates:

=====  ==========================================================  =====================
step   what                                                        launches / syncs
=====  ==========================================================  =====================
1      positions of the ids in the table's storage                 the table's find (an
                                                                   ``nn.Embedding`` has none)
2      :func:`~deltastream.kernels.row_diff.row_drift`: gather     1 kernel
       current rows in place, diff against FIRST, norm, finiteness
3      :func:`~deltastream.kernels.select_key.priority_key`:       1 kernel (+1 fill for
       weights, threshold, tiers -> float64 key, eligible count    a threshold)
4      read back the counts and the deferred argument checks       **1 sync** (a few
                                                                   bytes)
5      ``torch.topk`` + ``torch.sort`` of the chosen positions     a few (only when the
                                                                   budget binds)
6      gather ids, rows, scores; leftover FIRST/new/age; rejected  ~10 small launches,
       (output sizes known from step 4: ``nonzero_static``)        no sync
=====  ==========================================================  =====================

Rows are read from the table's storage by position (:func:`~deltastream.publishing.
table_rows.row_storage`), so the ``n × dim`` candidate rows are never copied out of the
table; tables without such a storage are read whole with ``lookup(ids)`` first. When
some id is not in the table (or is out of an ``nn.Embedding``'s range) step 4 sees it and
the call is redone from ``lookup(ids)``, which reads or raises exactly as the reference
path does (a second sync, off the common path). Memory: a few ``[n]`` vectors, no chunking
(``chunk_rows`` does not apply).
"""

from __future__ import annotations

import logging
import math
from typing import Optional

import torch

from deltastream.kernels.row_diff import COUNT_MISSING, COUNT_NONFINITE, row_drift
from deltastream.kernels.select_key import priority_key
from deltastream.publishing.selection_checks import ValueCheck, raise_failed
from deltastream.publishing.selection_rules import (
    AGE_CAP,
    TIER_NEW,
    TIER_OVERDUE,
    Budget,
    Selection,
    leftover_rows,
    warn_rejected,
)
from deltastream.publishing.table_rows import Reader, row_storage
from deltastream.types import DeltaRows

__all__ = ["select_on_device"]

log = logging.getLogger(__name__)


def select_on_device(delta: DeltaRows, table, read: Reader, dim: int,
                     table_dtype: Optional[torch.dtype], checks: list[ValueCheck],
                     budget: Budget, weights: Optional[torch.Tensor]) -> Selection:
    """``select_changed`` on the kernel path; arguments already checked for type and shape
    (``checks``: the value checks still to read back). See the module docstring."""
    ids, states = delta.ids, delta.states
    n, dev = ids.numel(), ids.device
    # the kernels index every [n] input densely: make them contiguous (no-ops as a rule)
    new = delta.new.to(dev).contiguous() if delta.new is not None else None
    # new_rows="drift": a never-published row is served as zeros, its error is ‖current‖
    zero_new = new if budget.new_rows == "drift" and states is not None else None
    cdtype = torch.float64 if states is not None and states.dtype == torch.float64 \
        else torch.float32
    first = states if states is None or states.stride(1) == 1 else states.contiguous()
    age = delta.age.to(device=dev, dtype=torch.int64).contiguous() \
        if delta.age is not None else None
    tier_new = new if budget.new_rows == "first" else None
    w = weights.to(dev).contiguous() if weights is not None else None

    def score(storage: torch.Tensor, pos: Optional[torch.Tensor]):
        drift = row_drift(storage, pos, first, zero_new, compute_dtype=cdtype,
                          want_norm=budget.relative and states is not None)
        n_elig = torch.zeros(1, dtype=torch.int32, device=dev)
        key = priority_key(drift.finite, drift.score, norm=drift.norm, weights=w,
                           new=tier_new, age=age, threshold=budget.threshold,
                           max_age=budget.max_age, tier_new=TIER_NEW,
                           tier_overdue=TIER_OVERDUE, age_cap=AGE_CAP, counts=n_elig)
        # the one host sync: every count that sizes an output, and the argument checks
        back = torch.cat([drift.counts, n_elig]
                         + [c.bad.reshape(1).to(torch.int32) for c in checks]).tolist()
        raise_failed(checks, [bool(b) for b in back[3:]])
        return drift, key, back[COUNT_MISSING], back[COUNT_NONFINITE], back[2]

    storage, pos = _in_place(table, ids, dim)
    missing = 1
    if storage is not None:
        drift, key, missing, n_bad, n_elig = score(storage, pos)
    if missing:
        # no storage to gather from, or ids it does not hold: read the rows (the reader
        # raises for out-of-range ids and reads absent ones as the eval value)
        storage, pos = _read_all(read, ids, dim, dev), None
        drift, key, _, n_bad, n_elig = score(storage, pos)

    # ---- choose positions (ascending): the budget's cap of the eligible rows
    cap = budget.cap(n - n_bad, dim)
    if cap >= n_elig:
        sel = torch.arange(n, device=dev) if n_elig == n else _where(key > -math.inf, n_elig)
    elif cap <= 0:
        sel = torch.empty(0, dtype=torch.int64, device=dev)
    else:
        sel = torch.sort(torch.topk(key, cap, sorted=False).indices).values
    rows = storage.index_select(0, pos.index_select(0, sel) if pos is not None else sel)
    if table_dtype is not None and rows.dtype != table_dtype:
        rows = rows.to(table_dtype)
    return _assemble(delta, drift, sel, rows, n_bad, dim)


def _assemble(delta: DeltaRows, drift, sel: torch.Tensor, rows: torch.Tensor, n_bad: int,
              dim: int) -> Selection:
    """The :class:`Selection` of positions ``sel`` (ascending; their ``rows``), with no host
    sync: every output size is known (``n_bad`` non-finite rows)."""
    ids, n, dev = delta.ids, delta.ids.numel(), delta.ids.device
    # index_fill_, not chosen[sel] = True: a Python scalar assigned by index is copied to the
    # device first, a second host sync (seen on an H100)
    chosen = torch.zeros(n, dtype=torch.bool, device=dev).index_fill_(0, sel, True)
    sel_ids = ids.index_select(0, sel)
    if delta.states is not None:
        scores = drift.score.index_select(0, sel).to(torch.float32)
    else:
        scores = torch.full((sel.numel(),), math.nan, dtype=torch.float32, device=dev)
    leftover = leftover_rows(delta, _where(drift.finite & ~chosen, n - n_bad - sel.numel()),
                             dim)
    rejected = ids.index_select(0, _where(~drift.finite, n_bad)) if n_bad else ids.new_empty(0)
    warn_rejected(n_bad, n, log)
    log.debug("select_changed (kernels): %d candidates -> %d selected, %d leftover, "
              "%d rejected", n, sel.numel(), leftover.ids.numel(), n_bad)
    return Selection(ids=sel_ids, rows=rows, scores=scores, leftover=leftover,
                     rejected=rejected, tombstones=delta.tombstones)


def _in_place(table, ids: torch.Tensor, dim: int
              ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The table's storage and each id's row in it, when the kernel can gather there."""
    source = row_storage(table)
    if source is None:
        return None, None
    storage, positions = source
    if storage.device != ids.device or storage.dim() != 2 or storage.shape[1] != dim \
            or storage.stride(1) != 1 or not storage.is_floating_point():
        return None, None
    return storage, positions(ids).contiguous()


def _read_all(read: Reader, ids: torch.Tensor, dim: int, dev: torch.device) -> torch.Tensor:
    """Every candidate's current row ``[n, dim]`` via the table's reader, on ``dev``."""
    cur = read(ids)
    if cur.device != dev:
        cur = cur.to(dev)
    if cur.shape != (ids.numel(), dim):
        raise RuntimeError(f"table returned rows of shape {tuple(cur.shape)}, "
                           f"expected {(ids.numel(), dim)}")
    return cur if cur.stride(1) == 1 else cur.contiguous()


def _where(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Ascending positions of the ``count`` True entries of ``mask``; the count is known,
    so no host sync (``nonzero`` would need one to size its output)."""
    if count == 0:
        return torch.empty(0, dtype=torch.int64, device=mask.device)
    return torch.nonzero_static(mask, size=count).squeeze(1)
