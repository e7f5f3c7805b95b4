"""One table's selection in a :func:`~deltastream.publish_delta` round, from carried rows.

:func:`select_carried` makes the same choice as
:func:`~deltastream.publishing.selection.select_changed` on the union of the rows the
round carries (:class:`~deltastream.publishing.carried.CarriedTable`) and the tracker's
delta, at a cost that follows what changed: only the delta's rows are read and scored
(a carried row's drift changes only when the row changes, and the tracker reports every
row that changed), the budget is taken from the carried groups' heads
(:func:`~deltastream.publishing.carried.top_slots`), and the selected rows are read to be
published. The leftover stays carried (nothing is handed back to the tracker).

Union rules (those of the tracker's ``retain``): a carried row keeps its FIRST state (what
predictors hold), its birth round (its age) and ORs the delta's ``new`` flag; a tombstone
(evicted id) ends the id's carried row, and so does an id inserted again (``new`` in the
delta: it was evicted in between).

What it covers: count budgets (``k``, ``fraction``), absolute thresholds, ``max_bytes``,
``max_age`` and both ``new_rows`` rules, on CPU tables in EMBEDDING mode.
:func:`carries` says when a round needs the full path instead (``weights``, ``relative``,
ID_ONLY deltas, a final round, a CUDA table) or gains nothing from carried rows: when the
rows that changed plus the rows a count budget takes are more than 1 / ``TAKE_SHARE`` of
the candidates, re-scoring every candidate in bulk costs less than keeping each row the
round reads and takes in order (both paths choose the same rows).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import numpy as np
import torch

from deltastream.kernels.runtime import use_kernels
from deltastream.publishing.carried import CarriedTable, top_slots
from deltastream.publishing.selection import DEFAULT_CHUNK_ROWS, read_drift
from deltastream.publishing.selection_checks import check_delta, raise_failed
from deltastream.publishing.selection_rules import (
    Budget,
    Selection,
    leftover_rows,
    priority_keys,
    warn_rejected,
)
from deltastream.publishing.table_rows import read_rows, row_reader
from deltastream.types import DeltaRows

__all__ = ["carries", "drop_gone", "select_carried", "TAKE_SHARE"]

log = logging.getLogger(__name__)

#: rounds run from carried rows when the candidates outnumber TAKE_SHARE times the rows a
#: round reads and takes (the changed rows plus a count budget's cap): a carried row costs
#: about 6x a row re-scored in bulk (CPU profile of a trainer-cost-like run, 2026-11-26)
TAKE_SHARE = 8


def carries(budget: Budget, delta: DeltaRows, carried: Optional[CarriedTable], *,
            final: bool, weighted: bool, changed_before: int = 0) -> bool:
    """Whether this round of a table can run from carried rows (else: the full path).

    ``changed_before``: rows the table's last round from carried rows read (the rows that
    changed then), an estimate of what such a round reads while the full path runs (its
    delta mixes the changed rows with the rows the tracker carried)."""
    if final or weighted or budget.relative or delta.states is None:
        return False  # the weights hook and ‖current‖ see every candidate; ID_ONLY: no drift
    if budget.k is None and budget.fraction is None and budget.threshold is None \
            and budget.max_bytes is None:
        return False  # no budget: every row goes out, nothing is carried
    if delta.ids.device.type != "cpu" or use_kernels(delta.ids):
        return False  # the kernel path scores on the device
    inside = carried is not None and len(carried) > 0
    if inside and not (carried.dtype == delta.states.dtype
                       and carried.new_rows == budget.new_rows
                       and carried.dim == delta.states.shape[1]):
        return False
    # Keeping rows scored and ordered costs several times more per row than re-scoring
    # them in bulk, so carried rows pay only when the round would otherwise re-score many
    # more rows than it reads and takes: a budget that takes a large share of the
    # candidates publishes O(candidates) rows anyway. A quarter of the margin less to stay
    # (no flip-flop: a switch costs one pass over the carried rows).
    n = len(delta) + (len(carried) if inside else 0)
    if inside:
        changed = len(delta)
    else:  # rows the tracker carried (age > 0) would be read once, then carried here
        changed = max(changed_before, len(delta) if delta.age is None
                      else int(torch.count_nonzero(delta.age == 0)))
    work = changed + (0 if budget.threshold is not None
                      else budget.cap(n, int(delta.states.shape[1])))
    return n > (0.75 * TAKE_SHARE if inside else TAKE_SHARE) * work


def drop_gone(carried: CarriedTable, delta: DeltaRows) -> torch.Tensor:
    """End the carried rows of ids the delta reports evicted, or inserted again; returns
    the slot of each of the delta's ids still carried (int64 ``[n]``, -1 where none)."""
    if delta.tombstones is not None and delta.tombstones.numel():
        pos = carried.find(delta.tombstones.to(torch.int64))
        carried.remove(pos[pos >= 0].numpy())
    if not (len(delta) and len(carried)):
        return torch.full((len(delta),), -1, dtype=torch.int64)
    pos = carried.find(delta.ids)
    if delta.new is not None:
        again = (pos >= 0) & delta.new
        if bool(again.any()):
            carried.remove(pos[again].numpy())
            pos = pos.masked_fill(again, -1)
    return pos


@torch.no_grad()
def select_carried(carried: CarriedTable, delta: DeltaRows, table: Any, budget: Budget,
                   round_: int) -> tuple[Selection, DeltaRows, int]:
    """Choose this round's rows of one table from ``carried`` ∪ ``delta`` (see the module
    docstring); ``round_`` is the round's number (a row's age is ``round_ − birth``).

    Returns ``(selection, taken, candidates)``: the selection (its ``leftover`` empty: the
    rest stays in ``carried``), the selected rows with their FIRST states, ``new`` flags
    and ages (to hand back if publishing fails) and how many candidates the round had.
    """
    read, dim, table_dtype, fresh = row_reader(table)
    raise_failed(check_delta(delta, dim))
    pos = drop_gone(carried, delta)  # one probe of the delta's ids
    ids = delta.ids
    hit = (pos >= 0).nonzero().squeeze(1)
    slots = pos.index_select(0, hit)
    # the union: a carried row keeps its FIRST state and birth, ORs the delta's new flag
    c_first, c_new, c_birth = carried.columns(slots)
    first = delta.states.index_copy(0, hit, c_first.to(delta.states.dtype))
    new = np.zeros(len(delta), dtype=bool) if delta.new is None else delta.new.numpy().copy()
    new[hit.numpy()] |= c_new
    birth = round_ - (np.zeros(len(delta), np.int64) if delta.age is None
                      else delta.age.to(torch.int64).numpy())
    birth[hit.numpy()] = c_birth
    candidates = len(carried) + len(delta) - int(hit.numel())
    zero_new = torch.from_numpy(new) if budget.new_rows == "drift" else None
    drift = read_drift(read, fresh, table_dtype, dim, ids, first, zero_new, False,
                       DEFAULT_CHUNK_ROWS)
    ok = drift.finite.numpy()
    rejected = ids[~drift.finite] if not ok.all() else ids.new_empty(0)
    warn_rejected(rejected.numel(), candidates, log)
    # carried rows that changed are ordered anew (a non-finite one ends); the others join
    d64 = drift.score.to(torch.float64).numpy()
    hn, sn = hit.numpy(), slots.numpy()
    carried.remove(sn[~ok[hn]])
    carried.rescore(sn[ok[hn]], new[hn[ok[hn]]], d64[hn[ok[hn]]])
    ok[hn] = False
    join = np.flatnonzero(ok)
    tj = torch.from_numpy(join)
    carried.add(ids.index_select(0, tj), first.index_select(0, tj), new[join], birth[join],
                d64[join])

    cap = budget.cap(candidates - rejected.numel(), dim)
    taken, scores = carried.take(top_slots(carried, cap, _key_fn(budget, round_),
                                           _floor_fn(budget, drift.score.dtype)), round_)
    taken.tombstones = delta.tombstones
    try:
        rows = read_rows(read, taken.ids, dim, drift.table_dtype, ids.device)
    except BaseException:  # nothing handed over: the taken rows stay carried
        carried.add(taken.ids, taken.states, taken.new.numpy(), round_ - taken.age.numpy(),
                    scores)
        raise
    log.debug("select_carried: %d candidates (%d changed) -> %d selected, %d carried, "
              "%d rejected", candidates, len(delta), len(taken), len(carried),
              rejected.numel())
    sel = Selection(ids=taken.ids, rows=rows, scores=torch.from_numpy(scores).float(),
                    leftover=leftover_rows(delta, ids.new_empty(0), dim), rejected=rejected,
                    tombstones=delta.tombstones)
    return sel, taken, candidates


def _key_fn(budget: Budget, round_: int):
    """The priority keys of a ``(birth, new)`` group's drifts (``select_changed``'s)."""
    tier_new = budget.new_rows == "first"

    def key(birth: np.ndarray, new: np.ndarray, drift: np.ndarray) -> np.ndarray:
        return priority_keys(torch.from_numpy(drift),
                             torch.from_numpy(new) if tier_new else None,
                             torch.from_numpy(round_ - birth), budget.max_age,
                             int(drift.size), torch.device("cpu")).numpy()

    return key


def _floor_fn(budget: Budget, dtype: torch.dtype):
    """The least drift that makes a row of a group eligible (None: every row is): the
    threshold as ``select_changed`` compares it, in the drift's dtype; a row of the new
    tier passes any threshold."""
    if budget.threshold is None:
        return lambda new: None
    floor = float(torch.tensor(float(budget.threshold), dtype=dtype))
    tier_new = budget.new_rows == "first"
    return lambda new: None if tier_new and new else floor
