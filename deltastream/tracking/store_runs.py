"""A table's records in the :class:`~deltastream.tracking.store.DeltaStore` (runs), and
their merge into ascending unique ids with FIRST or LAST states."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from deltastream.tracking.sorted_ids import group_mask, union
from deltastream.types import UpdateMode

__all__ = ["Run", "dedupe", "index_for", "merge_runs", "normalized", "ready"]


@dataclass
class Run:
    """Ids (ascending, unique) a table saw at ``idx``, with aligned states or ``None``."""

    idx: int
    ids: torch.Tensor
    states: Optional[torch.Tensor]
    sorted: bool = True  # False: ids as recorded (duplicates, arrival order), see append
    version: Optional[int] = None  # borrowed states: their ``_version`` when appended
    #: an ids-only record still growing: ``(buffer, its tensor)``, ``ids`` the tensor's
    #: head, until its table is read or its records change (``_Table.seal``)
    grow: Optional[tuple[np.ndarray, torch.Tensor]] = None
    #: ids written later: returns once they are (:func:`ready`)
    ready: Optional[Callable[[], None]] = None


def index_for(from_idx: int | Mapping[str, int], fqn: str) -> int:
    """The first record index of table ``fqn`` a read takes: ``from_idx`` itself, or its
    entry for ``fqn`` (a start per table)."""
    return from_idx if isinstance(from_idx, int) else from_idx[fqn]


def ready(runs: list[Run]) -> list[Run]:
    """``runs``, their ids all written (each :attr:`Run.ready` waited for once)."""
    for r in runs:
        if r.ready is not None:
            r.ready()
            r.ready = None
    return runs


def dedupe(ids: torch.Tensor, states: Optional[torch.Tensor],
            mode: UpdateMode) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Sort ``ids`` [N] and keep one entry per id; states [N, dim] follow FIRST/LAST.

    Returns new tensors (never views of the inputs).
    """
    if states is None or mode is UpdateMode.NONE:
        return torch.unique(ids, sorted=True), None
    # A stable sort keeps equal ids in arrival order: the first of a group is the earliest.
    sorted_ids, perm = torch.sort(ids, stable=True)
    keep = group_mask(sorted_ids, last=mode is UpdateMode.LAST).nonzero().squeeze(1)
    if keep.numel() == sorted_ids.numel():
        return sorted_ids, states.index_select(0, perm)
    return sorted_ids.index_select(0, keep), states.index_select(0, perm.index_select(0, keep))


def _merge2(a: Run, b: Run, mode: UpdateMode,
            with_states: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Merge two runs, ``a`` recorded before ``b``: ids ascending unique, states by mode."""
    keep_states = with_states and a.states is not None and b.states is not None
    out, pos_a, b_only, pos_b, in_a, at_a = union(a.ids, b.ids)
    if not keep_states:
        return out, None
    last = mode is UpdateMode.LAST
    if b_only.numel() == 0 and not last:
        return a.ids, a.states  # FIRST: b adds nothing
    # Fresh tensors: runs are never modified in place because they may have been handed out.
    states = torch.empty((out.numel(), a.states.shape[1]), dtype=a.states.dtype,
                         device=a.states.device)
    states[pos_a] = a.states
    if b_only.numel():
        states[pos_b] = b.states.index_select(0, b_only)
    if last:
        common = in_a.nonzero().squeeze(1)
        if common.numel():
            states[pos_a.index_select(0, at_a.index_select(0, common))] = \
                b.states.index_select(0, common)
    return out, states


def normalized(r: Run, mode: UpdateMode, with_states: bool) -> Run:
    """``r`` with ids ascending unique (itself when already so)."""
    if r.sorted:
        return r
    ids, states = dedupe(r.ids, r.states if with_states else None, mode)
    return Run(r.idx, ids, states)


def merge_runs(runs: list[Run], mode: UpdateMode,
                with_states: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Merge runs given in recording order into (ids ascending unique, states or None)."""
    if len(runs) <= 2:
        runs = [normalized(r, mode, with_states) for r in runs]
        if len(runs) == 1:
            r = runs[0]
            return r.ids, (r.states if with_states else None)
        return _merge2(runs[0], runs[1], mode, with_states)
    ids = torch.cat([r.ids for r in runs])
    if not with_states or any(r.states is None for r in runs):
        return torch.unique(ids, sorted=True), None
    # A stable sort keeps equal ids in recording order (runs in order, and arrival order
    # inside a run as recorded), so a group's first entry is FIRST and its last LAST.
    sorted_ids, perm = torch.sort(ids, stable=True)
    keep = group_mask(sorted_ids, last=mode is UpdateMode.LAST).nonzero().squeeze(1)
    out_ids = sorted_ids.index_select(0, keep)
    src = perm.index_select(0, keep)  # concatenation position of the chosen entry per out row
    # Gather the chosen states run by run (each run's chosen rows in position order), then
    # put them in id order with one gather: never a concatenation of every run's states, no
    # scatter, no second sort. A chosen position's index in the staged rows is its rank
    # among chosen positions.
    chosen = torch.zeros(ids.numel(), dtype=torch.bool, device=ids.device)
    chosen[src] = True
    first = runs[0].states
    staged = torch.empty((src.numel(), first.shape[1]), dtype=first.dtype, device=first.device)
    start = at = 0
    for r in runs:
        size = r.ids.numel()
        rows = chosen[start:start + size].nonzero().squeeze(1)
        k = rows.numel()
        if k:
            torch.index_select(r.states, 0, rows, out=staged[at:at + k])
            at += k
        start += size
    rank = chosen.cumsum(0).sub_(1)
    return out_ids, staged.index_select(0, rank.index_select(0, src))
