"""DeltaStore: per-table log of touched ids (and optional states) indexed by batch.

Semantics follow TorchRec's ``DeltaStore``: ``append`` records the ids (and states) a table
saw at a batch index, ``compact(start, end)`` merges everything recorded in ``[start, end)``
into one record at ``start``, ``get_unique(from_idx)`` returns the unique ids (and the FIRST or
LAST state per id) recorded at indices ``>= from_idx``, ``delete(up_to_idx)`` drops records at
indices ``< up_to_idx``.

What differs, and why:

* Every record is a *run*. A large append of CPU ids (``EAGER_DEDUPE_MIN`` ids or more) is
  sorted and deduplicated at once (FIRST keeps the earliest state of a duplicated id, LAST
  the latest), so duplicates of hot ids (Zipf traffic) never take memory; a small append (a
  training step's lookup), and any append on an accelerator (where deduplicating would need
  a device->host sync for the result's size), is kept as recorded, with no sort and no sync
  on the training path, and deduplicated together with its neighbours when merged. Once compacted, a run stays
  sorted and unique, so a later compaction merges it instead of re-sorting the history:
  merging two runs (the incremental case: one compacted run plus the newest record) is a
  ``searchsorted`` merge that copies nothing when the newer run adds no id (FIRST); merging
  more runs sorts their ids once and gathers each chosen state straight from its run, so
  states are copied once, never concatenated.
* An ids-only append with ``grow`` joins the table's last such record until the table is
  read or its records change: the tracker's inserted and evicted ids are one record per
  read interval, not one per step, and a read takes it without joining a record a step
  (:mod:`~deltastream.tracking.store_runs` holds the records and their merge).
* Empty tables and empty intervals give empty results (``DeltaRows`` with zero ids), never
  exceptions.
* A table can be *degraded* to ids only (``degrade``): its states are dropped, its ids kept.
  The tracker uses it to bound memory. A degraded table returns to the store's mode once all
  of its records are deleted.

The store never aliases tensors passed to ``append`` (it keeps its own copies; see its
``copy_states`` for the one opt-in exception; ``append_unique``, for callers that already
deduplicated, takes ownership instead) and never
modifies in place the tensors it returned; treat returned tensors as read-only.
"""

from __future__ import annotations

import bisect
import logging
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from deltastream.tracking.sorted_ids import member
from deltastream.tracking.store_runs import (
    Run,
    dedupe,
    index_for,
    merge_runs,
    normalized,
    ready,
)
from deltastream.types import DeltaRows, UpdateMode

__all__ = ["DeltaStore"]

log = logging.getLogger(__name__)


#: Appends of at least this many CPU ids are deduplicated at once; smaller ones (and those
#: on an accelerator) are kept as recorded and deduplicated together when merged (one large
#: sort is about twice as cheap per id as many small ones, and the append itself does no
#: sort and no device sync).
EAGER_DEDUPE_MIN = 16384


@dataclass
class _Table:
    runs: list[Run]
    dim: Optional[int] = None
    dtype: torch.dtype = torch.float32
    device: Optional[torch.device] = None
    degraded: bool = False
    n_rows: int = 0  # ids held over all runs (kept current by the store)
    n_state_rows: int = 0  # of which held with a state
    #: ``(key, ids, states)``: the zero-row tensors of its empty results (``_empty``)
    empty: Optional[tuple] = None

    def rows(self) -> int:
        return self.n_rows

    def state_rows(self) -> int:
        return self.n_state_rows

    def seal(self) -> None:
        """The last record grows no more (a read or a change of the records is a boundary
        no record may span)."""
        if self.runs:
            self.runs[-1].grow = None

    def recount(self) -> None:
        if not self.runs:  # nothing held (most tables of a many-table read): no sums
            self.n_rows = self.n_state_rows = 0
            self.degraded = False  # the table keeps states again
            return
        self.n_rows = sum(int(r.ids.numel()) for r in self.runs)
        self.n_state_rows = sum(int(r.ids.numel()) for r in self.runs if r.states is not None)


#: the ids of a table no record ever named (a shared empty tensor: never written)
_NO_IDS = torch.empty(0, dtype=torch.int64)


def _id_buffer(n: int) -> tuple[np.ndarray, torch.Tensor]:
    """An int64 buffer of ``n`` ids, as numpy and as the tensor sharing its memory."""
    buf = np.empty(n, dtype=np.int64)
    return buf, torch.from_numpy(buf)


def _as_ids(ids: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor of integer ids, got {type(ids).__name__}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"{what} must hold integer ids, got dtype {ids.dtype}")
    # integer tensors never require grad: no detach; each torch call costs ~1 µs, per
    # table per step
    if ids.dim() != 1:
        ids = ids.reshape(-1)
    return ids if ids.dtype == torch.int64 else ids.to(torch.int64)


class DeltaStore:
    """Per-table log of touched ids (and FIRST/LAST states) keyed by batch index.

    Args:
        update_mode: ``UpdateMode.NONE`` (ids only), ``FIRST`` (keep the earliest state per
            id) or ``LAST`` (keep the latest). Strings ``"none"``/``"first"``/``"last"`` work too.
    """

    def __init__(self, update_mode: UpdateMode = UpdateMode.NONE) -> None:
        if isinstance(update_mode, str):
            try:
                update_mode = UpdateMode(update_mode.lower())
            except ValueError:
                raise ValueError(
                    f"update_mode must be one of {[m.value for m in UpdateMode]}, "
                    f"got {update_mode!r}") from None
        if not isinstance(update_mode, UpdateMode):
            raise TypeError(f"update_mode must be an UpdateMode, got {update_mode!r}")
        self._mode = update_mode
        self._tables: dict[str, _Table] = {}
        self.compactions = 0  #: number of merges performed by :meth:`compact`
        self.states_modified = 0  #: borrowed states found modified in place (see append)

    @property
    def update_mode(self) -> UpdateMode:
        """The store's :class:`UpdateMode`."""
        return self._mode

    def _with_states(self, t: _Table) -> bool:
        return self._mode is not UpdateMode.NONE and not t.degraded

    # -- tables -------------------------------------------------------------------------
    def add_table(self, fqn: str, dim: Optional[int] = None, *,
                  dtype: torch.dtype = torch.float32,
                  device: Optional[torch.device | str] = None) -> None:
        """Declare table ``fqn`` (row width ``dim``) so empty results carry ``[0, dim]`` states."""
        if not isinstance(fqn, str):
            raise TypeError(f"fqn must be a str, got {type(fqn).__name__}")
        if dim is not None and (not isinstance(dim, int) or dim <= 0):
            raise ValueError(f"dim must be a positive int or None, got {dim!r}")
        t = self._tables.setdefault(fqn, _Table(runs=[]))
        if dim is not None:
            t.dim = dim
            t.dtype = dtype
        if device is not None:
            t.device = torch.device(device)

    def tables(self) -> list[str]:
        """Names of the tables the store knows (declared or appended to)."""
        return list(self._tables)

    def num_rows(self, fqn: Optional[str] = None) -> int:
        """Rows held (ids summed over records) for ``fqn``, or over all tables."""
        if fqn is not None:
            t = self._tables.get(fqn)
            return 0 if t is None else t.rows()
        return sum(t.rows() for t in self._tables.values())

    def num_state_rows(self, fqn: Optional[str] = None) -> int:
        """Rows held together with a state (the memory that degrading frees)."""
        if fqn is not None:
            t = self._tables.get(fqn)
            return 0 if t is None else t.state_rows()
        return sum(t.state_rows() for t in self._tables.values())

    def num_records(self, fqn: str, from_idx: int = 0) -> int:
        """Number of separate records (runs) held for ``fqn`` at indices ``>= from_idx``."""
        t = self._tables.get(fqn)
        if t is None or not t.runs:
            return 0
        return len(t.runs) - bisect.bisect_left(t.runs, from_idx, key=lambda r: r.idx)

    def is_degraded(self, fqn: str) -> bool:
        """Whether ``fqn`` currently keeps ids only although the store keeps states."""
        t = self._tables.get(fqn)
        return bool(t is not None and t.degraded)

    def degrade(self, fqn: str) -> int:
        """Drop the states of ``fqn`` (ids are kept) until its records are all deleted.

        Returns the number of state rows freed.
        """
        t = self._tables.get(fqn)
        if t is None:
            raise KeyError(f"unknown table {fqn!r}; known: {sorted(self._tables)}")
        t.seal()
        freed = t.state_rows()
        t.degraded = self._mode is not UpdateMode.NONE
        for r in t.runs:
            r.states = None
        t.n_state_rows = 0
        return freed

    # -- TorchRec surface ---------------------------------------------------------------
    def append(self, batch_idx: int, fqn: str, ids: torch.Tensor,
               states: Optional[torch.Tensor] = None, *, copy_states: bool = True,
               unique: bool = False, released: Optional[Callable[[], None]] = None,
               grow: bool = False, ids_only: bool = False,
               ready: Optional[Callable[[], None]] = None) -> None:
        """Record that table ``fqn`` saw ``ids`` (any shape, flattened) at ``batch_idx``.

        ``states`` is ``[N, dim]`` (or ``[*ids.shape, dim]``) aligned with the flattened ids
        (required in FIRST/LAST mode; in NONE mode passing states is a ``ValueError``). Records may be appended at any
        index; records with equal index keep their append order.

        ``copy_states=False`` lets a small append keep a reference to ``states`` instead of a
        copy (the tracker passes a lookup's output, which nobody else keeps). The tensor's
        version counter is recorded: if it (or the tensor it views) is modified in place
        before the store has copied the rows, the table is degraded (its states are no longer
        the recorded values) with a warning, and :attr:`states_modified` counts it.
        ``unique``: the ids are distinct (in any order), so however many they are they are
        kept as recorded (no sort now; ``copy_states=False`` keeps the states by reference).
        ``released`` (with ``copy_states=False``): called once nothing the store handed out
        or keeps refers to ``states`` any more (at once when they are not kept), so that
        the caller may write their memory again. ``grow`` (ids only): the ids may join
        the table's last record, appended with ``grow`` too, until the table is read,
        compacted, trimmed or changed otherwise (the record's index is then the first of
        the two): for a caller that reads only at indices no such record spans (the
        tracker, at its reads). ``ids_only`` (no ``states``): a record for readers of
        ids only (``get_unique(states=False)``), kept without states whatever the mode; a
        read of states that spans it gets the table's states as None. ``ready``: ``ids`` are
        written later, by the caller (the store keeps them by reference): called before
        anything reads them, it returns once they are written.
        """
        if not isinstance(batch_idx, int) or isinstance(batch_idx, bool):
            raise TypeError(f"batch_idx must be an int, got {batch_idx!r}")
        if not isinstance(fqn, str):
            raise TypeError(f"fqn must be a str, got {type(fqn).__name__}")
        ids = _as_ids(ids, "ids")
        t = self._tables.get(fqn)
        if t is None:
            t = self._tables[fqn] = _Table(runs=[], device=ids.device)
        if ids_only and states is not None:
            raise ValueError(f"an ids_only record of table {fqn!r} takes no states")
        states = None if ids_only else self._checked_states(t, fqn, ids, states)
        if ids.numel() == 0:
            if released is not None:
                released()
            return
        t.device = ids.device  # empty results follow the table (moved to another device)
        keep = self._with_states(t)
        if grow and (states is None or not keep) and self._grown(t, batch_idx, ids):
            if released is not None:
                released()
            return
        version = None  # of states kept by reference
        if ids.numel() >= EAGER_DEDUPE_MIN and ids.device.type == "cpu" and not unique:
            u_ids, u_states = dedupe(ids, states if keep else None, self._mode)
            run = Run(batch_idx, u_ids, u_states)
        else:  # kept as recorded (own copies), deduplicated when merged
            u_ids = ids if ready is not None else ids.clone(memory_format=torch.contiguous_format)
            u_states = None
            if keep and states is not None:
                if copy_states:
                    u_states = states.clone(memory_format=torch.contiguous_format)
                else:
                    u_states, version = states, states._version
            run = Run(batch_idx, u_ids, u_states, sorted=False, version=version, ready=ready)
            if grow and u_states is None and u_ids.device.type == "cpu":
                run.grow = (u_ids.numpy(), u_ids)
        if released is not None:  # the states kept by reference, or none kept
            if version is None:
                released()
            else:
                weakref.finalize(u_states, released)
        t.n_rows += int(u_ids.numel())
        if u_states is not None:
            t.n_state_rows += int(u_ids.numel())
        if not t.runs or t.runs[-1].idx <= batch_idx:
            t.runs.append(run)
        else:
            t.runs.insert(bisect.bisect_right(t.runs, batch_idx, key=lambda r: r.idx), run)

    def _grown(self, t: _Table, batch_idx: int, ids: torch.Tensor) -> bool:
        """Append ids-only ``ids`` (CPU) to ``t``'s last record where it is still growing
        — not sealed since (every call that reads or changes records seals), at
        ``batch_idx`` or before —
        in place past its head (a head handed out stays as it was); False: not done."""
        last = t.runs[-1] if t.runs else None
        if last is None or last.grow is None or last.idx > batch_idx or ids.device.type != "cpu":
            return False
        (buf, whole), n, k = last.grow, last.ids.numel(), ids.numel()
        if n + k > buf.size:  # numpy: a torch slice and copy cost several times more
            buf, whole = _id_buffer(2 * (n + k))
            buf[:n] = last.ids.numpy()
        buf[n:n + k] = ids.numpy()
        last.ids = whole[:n + k]
        last.grow = (buf, whole)
        t.n_rows += k
        return True

    def _checked_states(self, t: _Table, fqn: str, ids: torch.Tensor,
                        states: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``states`` of an :meth:`append` to ``t`` as ``[N, dim]`` (detached), checked
        against the store's mode, ``ids`` and the table's width (set by the first)."""
        if self._mode is UpdateMode.NONE:
            if states is not None:
                # TorchRec's store refuses them too: an ids-only store that took states
                # would let a caller believe FIRST/LAST states are kept.
                raise ValueError(
                    f"DeltaStore(UpdateMode.NONE) keeps ids only; append got states "
                    f"{tuple(getattr(states, 'shape', ()))} for table {fqn!r}: pass "
                    f"states=None, or use DeltaStore(UpdateMode.FIRST) / UpdateMode.LAST to "
                    f"keep them")
            return None
        if states is None:
            if not t.degraded:
                raise ValueError(
                    f"update mode {self._mode.value} needs states [N, dim] for table {fqn!r}")
            return None
        if not isinstance(states, torch.Tensor):
            raise TypeError(f"states must be a torch.Tensor, got {type(states).__name__}")
        states = states.detach()
        if states.dim() > 2:  # [*ids.shape, dim] as an embedding lookup returns it
            states = states.reshape(-1, states.shape[-1])
        if states.dim() != 2 or states.shape[0] != ids.numel():
            raise ValueError(
                f"states must be [N, dim] with N = {ids.numel()} ids, got "
                f"{tuple(states.shape)} for table {fqn!r}")
        if t.dim is None:
            t.dim, t.dtype = int(states.shape[1]), states.dtype
        elif states.shape[1] != t.dim:
            raise ValueError(
                f"table {fqn!r} has dim {t.dim}, got states of dim {states.shape[1]}")
        return states

    def append_unique(self, batch_idx: int, fqn: str, ids: torch.Tensor,
                      states: Optional[torch.Tensor] = None) -> None:
        """Record ``ids`` that are already int64 ``[N]``, ascending and unique, at ``batch_idx``.

        For callers that deduplicated themselves (the tracker's per-row touch marks): the
        record is kept as one sorted run, with no sort, no check (that would need a device
        sync) and no copy: the store takes ownership of ``ids`` and ``states`` (``[N, dim]``,
        required when the store keeps states for ``fqn``, dropped while ``fqn`` is degraded,
        refused by an ids-only store).
        """
        if not isinstance(batch_idx, int) or isinstance(batch_idx, bool):
            raise TypeError(f"batch_idx must be an int, got {batch_idx!r}")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype != torch.int64:
            raise TypeError("ids must be an int64 [N] tensor")
        t = self._tables.get(fqn)
        if t is None:
            t = self._tables[fqn] = _Table(runs=[], device=ids.device)
        keep = self._with_states(t)
        if self._mode is UpdateMode.NONE and states is not None:
            raise ValueError(f"DeltaStore(UpdateMode.NONE) keeps ids only; append_unique got "
                             f"states for table {fqn!r}: pass states=None")
        if not keep:
            states = None
        elif states is None:
            raise ValueError(
                f"update mode {self._mode.value} needs states [N, dim] for table {fqn!r}")
        elif states.dim() != 2 or states.shape[0] != ids.numel():
            raise ValueError(f"states must be [N, dim] with N = {ids.numel()} ids, got "
                             f"{tuple(states.shape)} for table {fqn!r}")
        n = int(ids.numel())
        if n == 0:
            return
        t.device = ids.device
        t.n_rows += n
        if states is not None:
            t.n_state_rows += n
        run = Run(batch_idx, ids, states)
        if not t.runs or t.runs[-1].idx <= batch_idx:
            t.runs.append(run)
        else:
            t.runs.insert(bisect.bisect_right(t.runs, batch_idx, key=lambda r: r.idx), run)

    def compact(self, start_idx: int, end_idx: int, skip: frozenset[str] = frozenset()
                ) -> None:
        """Merge every table's records in ``[start_idx, end_idx)`` into one record at
        ``start_idx`` (FIRST/LAST resolved in index order), the tables in ``skip`` apart.
        An empty range is a no-op."""
        if not isinstance(start_idx, int) or not isinstance(end_idx, int):
            raise TypeError(f"start_idx and end_idx must be ints, got {start_idx!r}, {end_idx!r}")
        if start_idx > end_idx:
            raise ValueError(f"start_idx ({start_idx}) must not exceed end_idx ({end_idx})")
        for fqn, t in self._tables.items():
            if not t.runs or fqn in skip:  # nothing held: nothing to merge
                continue
            t.seal()
            self._check_borrowed(fqn, t)
            lo = bisect.bisect_left(t.runs, start_idx, key=lambda r: r.idx)
            hi = bisect.bisect_left(t.runs, end_idx, key=lambda r: r.idx)
            ready(t.runs[lo:hi])
            if hi - lo <= 1:
                if hi - lo == 1 and not t.runs[lo].sorted:  # same index: no semantic change
                    t.runs[lo] = normalized(t.runs[lo], self._mode, self._with_states(t))
                    t.recount()
                continue
            ids, states = merge_runs(t.runs[lo:hi], self._mode, self._with_states(t))
            t.runs[lo:hi] = [Run(start_idx, ids, states)]
            t.recount()
            self.compactions += 1

    def get_unique(self, from_idx: int | Mapping[str, int] = 0,
                   skip: frozenset[str] = frozenset(), states: bool = True
                   ) -> dict[str, DeltaRows]:
        """Unique ids (ascending) and FIRST/LAST states per table, over records at indices
        ``>= from_idx`` (per table: ``{fqn: index}`` naming every table read). Every known
        table is present (those in ``skip`` apart); one with no such records maps to an
        empty :class:`DeltaRows` (``[0, dim]`` states when the store keeps states).
        ``states=False``: the ids only (states None), a merge of ids with no state
        gathered."""
        if not isinstance(from_idx, (int, Mapping)):
            raise TypeError(f"from_idx must be an int or a mapping, got {from_idx!r}")
        out: dict[str, DeltaRows] = {}
        for fqn, t in self._tables.items():
            if fqn in skip:
                continue
            start = index_for(from_idx, fqn)
            t.seal()
            keep = self._with_states(t)
            if not t.runs:  # most tables of a read, in the stores of evictions and inserts
                out[fqn] = self._empty(t, keep and states)
                continue
            self._check_borrowed(fqn, t)
            lo = bisect.bisect_left(t.runs, start, key=lambda r: r.idx)
            ready(t.runs[lo:])
            for i in range(lo, len(t.runs)):  # normalize in place: same index, fewer rows
                if not t.runs[i].sorted and len(t.runs) - lo <= 2:
                    t.runs[i] = normalized(t.runs[i], self._mode, keep)
                    t.recount()
            runs = t.runs[lo:]
            if not runs:
                out[fqn] = self._empty(t, keep and states)
                continue
            ids, rows = merge_runs(runs, self._mode, keep and states)
            out[fqn] = DeltaRows(ids=ids, states=rows)
        return out

    #: TorchRec's name for :meth:`get_unique`.
    get_delta = get_unique

    def delete(self, up_to_idx: Optional[int] = None,
               tables: Optional[Iterable[str]] = None) -> None:
        """Drop records at indices ``< up_to_idx`` (all records when ``None``), of
        ``tables`` only (None: every table)."""
        if up_to_idx is not None and not isinstance(up_to_idx, int):
            raise TypeError(f"up_to_idx must be an int or None, got {up_to_idx!r}")
        held = self._tables
        for t in held.values() if tables is None else (held[f] for f in tables if f in held):
            t.seal()
            if up_to_idx is None:
                t.runs = []
            elif t.runs:
                lo = bisect.bisect_left(t.runs, up_to_idx, key=lambda r: r.idx)
                if not lo:  # nothing dropped: its counts stand
                    continue
                del t.runs[:lo]
            t.recount()

    # -- extras the tracker uses --------------------------------------------------------
    def raw_since(self, fqn: str, from_idx: int = 0, take: bool = True
                  ) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """``fqn``'s records at indices ``>= from_idx`` as recorded: ``(ids, states)``,
        the runs' ids (int64, duplicates kept) and aligned states (None when not kept)
        concatenated in index order, so an id's first occurrence has its FIRST state;
        None when there is no such record. ``take``: the records are removed. No sort, no
        device sync (for a reader that deduplicates elsewhere). A borrowed state changed
        in place degrades the table first (states None)."""
        t = self._tables.get(fqn)
        lo = 0 if t is None else bisect.bisect_left(t.runs, from_idx, key=lambda r: r.idx)
        if t is None or lo == len(t.runs):
            return None
        t.seal()
        self._check_borrowed(fqn, t)
        runs = ready(t.runs[lo:])
        keep = self._with_states(t) and all(r.states is not None for r in runs)
        if take:
            del t.runs[lo:]
            t.recount()
        ids = torch.cat([r.ids for r in runs]) if len(runs) > 1 else runs[0].ids
        if not keep:
            return ids, None
        return ids, torch.cat([r.states for r in runs]) if len(runs) > 1 else runs[0].states

    def ids_since(self, fqns: Iterable[str], from_idx: int | Mapping[str, int] = 0,
                  take: bool = True) -> dict[str, torch.Tensor]:
        """``{fqn: ids}``: :meth:`raw_since`'s ids of each table of ``fqns`` (``take``: the
        records taken; ``from_idx`` per table as in :meth:`get_unique`): int64, repeats
        kept, in recording order; empty (on the table's device) where there is no such
        record. One call for many tables: most have none."""
        out = {}
        for fqn in fqns:
            t = self._tables.get(fqn)
            got = self.raw_since(fqn, index_for(from_idx, fqn), take) if t is not None and t.runs else None
            out[fqn] = got[0] if got is not None else \
                _NO_IDS if t is None else self._empty(t, False).ids
        return out

    def discard(self, fqn: str, ids: torch.Tensor) -> int:
        """Remove ``ids`` from every record of ``fqn`` (e.g. evicted rows). Returns rows removed."""
        t = self._tables.get(fqn)
        if t is None or not t.runs:
            return 0
        t.seal()
        drop = torch.unique(_as_ids(ids, "ids"), sorted=True)
        if drop.numel() == 0:
            return 0
        removed = 0
        for r in ready(t.runs):
            hit, _ = member(drop.to(r.ids.device), r.ids)
            n = int(hit.sum())
            if n:
                keep = ~hit
                r.ids = r.ids[keep]
                if r.states is not None:
                    r.states = r.states[keep]
                removed += n
        t.runs = [r for r in t.runs if r.ids.numel()]
        t.recount()
        return removed

    def _check_borrowed(self, fqn: str, t: _Table) -> None:
        """Degrade ``fqn`` if a borrowed state tensor was modified in place since append."""
        for r in t.runs:
            if r.version is not None and r.states is not None \
                    and r.states._version != r.version:
                self.note_states_modified(fqn)
                return

    def note_states_modified(self, fqn: str) -> None:
        """Borrowed states of ``fqn`` were modified in place: count, warn, degrade ``fqn``."""
        self.states_modified += 1
        log.warning("DeltaStore: states recorded for table %s were modified in place "
                       "after they were recorded (e.g. an in-place op on a lookup's "
                       "output); its FIRST/LAST states are dropped, ids kept", fqn)
        self.degrade(fqn)

    def _empty(self, t: _Table, keep: bool) -> DeltaRows:
        """An empty result of ``t`` (``[0, dim]`` states when ``keep`` and the dim is
        known). Its zero-row tensors are made once per table and shape and shared by the
        table's later empty results: a read of a model of many tables finds most of them
        empty in most stores, and two new tensors each cost more than the rest of it."""
        dim = t.dim if keep else None
        key = (dim, t.dtype, t.device)
        if t.empty is None or t.empty[0] != key:
            e = DeltaRows.empty(dim, device=t.device or torch.device("cpu"), dtype=t.dtype)
            t.empty = (key, e.ids, e.states)
        return DeltaRows(ids=t.empty[1], states=t.empty[2])
