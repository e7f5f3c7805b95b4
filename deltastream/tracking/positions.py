"""Lookups recorded as row positions, and the FIRST state of each touched row.

A :class:`~deltastream.HashTable` reports the storage positions each training lookup
resolved (its lookup hook); an ``nn.Embedding``/``EmbeddingBag`` or a TorchRec shard is
seen the same way (a row's position is its id). On CUDA the tracker keeps the positions,
borrowed and unsorted, in a :class:`PendingLookups` per table (a hook must not sync), and
at the next flush turns them into the distinct touched positions (:func:`mark_positions`:
a bool mark per position, no sort) and, in EMBEDDING mode, each one's earliest recorded row
(:func:`first_states`). On the CPU it keeps :class:`UniqueLookups` instead: at each lookup
only the positions new since the flush, with a copy of their rows (from the forward's
output, or from the weight for a fused kernel or a pooled bag).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import numpy as np
import torch

from deltastream.tracking.fresh_rows import FreshRows
from deltastream.tracking.sorted_ids import sort_ids, sort_ids_with_perm

__all__ = ["PendingLookups", "UniqueLookups", "mark_positions", "mark_positions_torch", "first_states",
           "first_states_cpu", "first_states_torch", "row_buffers"]


class PendingLookups:
    """Lookups of one positional table since its last flush into the store.

    ``pos`` holds each lookup's row positions (the forward's own tensor, borrowed: no copy).
    Positions stand for the ids they hold only while no row is freed, so the tracker flushes
    (positions -> ids, one sorted run) whenever the table frees rows (row listener, before
    any reuse), at every read boundary and before any store operation. The flush marks the
    positions in ``marks`` (a bool scratch tensor over the table's capacity, all False
    between flushes): its ``nonzero`` is each touched position once, with no sort. In
    EMBEDDING mode the lookups' output rows are kept too (borrowed, with their version
    counters): the earliest occurrence of each position gives its FIRST state.
    """

    __slots__ = ("marks", "pos", "states", "versions", "n", "n_states", "stateless")

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.marks = torch.zeros(capacity, dtype=torch.bool, device=device)
        self.reset()

    def reset(self) -> None:
        """Forget every pending lookup (after a flush, or when the tracker is cleared)."""
        self.pos: list[torch.Tensor] = []
        self.states: list[torch.Tensor] = []
        self.versions: list[int] = []
        self.n = 0  # ids recorded (duplicates counted, as the store counts raw records)
        self.n_states = 0  # of which with a borrowed state
        self.stateless = False  # some lookup was recorded without its state (degraded)

    def states_changed(self) -> bool:
        """Whether a borrowed lookup output was modified in place since it was recorded."""
        return any(s._version != v for s, v in zip(self.states, self.versions, strict=True))

    def drop_states(self) -> None:
        """Keep the positions only (the table is degraded to ids)."""
        self.states, self.versions = [], []
        self.n_states = 0
        self.stateless = True

    def drain(self, table: Any, with_states: bool
              ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The pending lookups as one sorted run, then forget them (:meth:`reset`).

        ``table`` maps positions to ids (``ids_at``; still valid: no position was reused
        since the lookups; with a true ``ids_ascending`` attribute, ascending positions map
        to ascending ids and no sort is needed). Returns ``(ids, states)``: the distinct ids touched, int64
        ascending, and with ``with_states`` each one's FIRST state ``[k, dim]`` (else None).
        Call only with lookups pending (``n > 0``).
        """
        dev = self.pos[0].device
        self.fit(int(table.capacity), dev)  # positions only grow past capacity with storage
        states = None
        if with_states:
            touched, rows, src = first_states(self.marks, self.pos, self.states)
        else:
            touched = mark_positions(self.marks, self.pos)  # ascending positions, each once
        ids = table.ids_at(touched.to(getattr(table, "device", dev))).to(dev)
        if getattr(table, "ids_ascending", False):  # positions are the ids: sorted already
            if with_states:
                states = rows.index_select(0, src)
        elif not with_states:
            ids = sort_ids(ids)
        else:
            ids, order = sort_ids_with_perm(ids)
            states = rows.index_select(0, src.index_select(0, order.to(src.device)))
        self.reset()
        return ids, states

    def fit(self, capacity: int, device: torch.device) -> None:
        """Make ``marks`` (all False) cover ``capacity`` positions on ``device``."""
        m = self.marks
        if m.numel() < capacity or m.device != device:
            self.marks = torch.zeros(max(capacity, m.numel()), dtype=torch.bool, device=device)


class UniqueLookups(PendingLookups):
    """:class:`PendingLookups` of a CPU table that keeps each touched position once, with
    its FIRST row copied at the lookup: a TorchRec shard in a fused kernel (no forward
    output to borrow: rows are gathered from the weight; id = position) or a
    :class:`~deltastream.HashTable` (rows taken from the forward's output).

    :meth:`add` keeps only the positions no earlier lookup had since the last flush and
    copies their rows into one arena: a row looked up again costs no gather and no copy,
    and the work of a flush is spread over the lookups (a read no longer pays for every
    lookup since the last one). The drain returns the touched ids ascending with their
    arena rows, gathered once. For a table whose ids are its positions (``ids_ascending``)
    one pass over the marked words of the marks gives them in order; otherwise their ids
    are sorted. Either way the drain's work follows the positions touched, not the table's
    capacity. The bookkeeping is a :class:`~deltastream.tracking.fresh_rows.FreshRows` (C
    when built, else numpy).
    """

    __slots__ = ("fresh", "drained", "_ids_of", "_keys")

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.fresh = FreshRows(capacity)
        PendingLookups.reset(self)  # nothing marked yet
        #: ``(ids, positions)`` of the last drain of a hashed table, aligned (None when a
        #: row was freed since: positions may then hold other ids)
        self.drained: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        #: ``(table, ascending, offset)`` of the last drain's table (see :meth:`_id_map`)
        self._ids_of: Optional[tuple[Any, bool, int]] = None
        #: ``(position_ids tensor, its numpy view or None)`` (see :meth:`_keys_of`)
        self._keys: Optional[tuple[torch.Tensor, Optional[np.ndarray]]] = None

    def _id_map(self, table: Any) -> tuple[bool, int]:
        """Whether ``table``'s ids are its positions (``ids_ascending``) and their offset,
        read once per table: a hash table is a module, whose ``getattr`` of a missing
        attribute raises inside (~6 µs on a tick's cold cache, per table)."""
        got = self._ids_of
        if got is None or got[0] is not table:
            asc = bool(getattr(table, "ids_ascending", False))
            got = self._ids_of = (table, asc, int(getattr(table, "offset", 0)) if asc else 0)
        return got[1], got[2]

    def _keys_of(self, held: torch.Tensor) -> Optional[np.ndarray]:
        """``held`` (a hash table's ``position_ids()``) as numpy, or None when it is not a
        contiguous CPU array over every marked position. The view is kept while the table
        hands out the same tensor (until it grows): the checks cost ~5 µs a table cold. A
        grown table's old array is held until the next drain reads the new one."""
        got = self._keys
        if got is None or got[0] is not held:
            ok = held.device.type == "cpu" and held.is_contiguous()
            got = self._keys = (held, held.numpy() if ok else None)
        view = got[1]
        return view if view is not None and view.size >= self.fresh.slot.size else None

    @property
    def marks(self) -> torch.Tensor:  # the FreshRows' (not the base class's bool scratch)
        return self.fresh.marks

    def reset(self) -> None:
        super().reset()
        self.fresh.clear()

    def grow(self, capacity: int) -> None:
        """Cover ``capacity`` positions, keeping the marks set (a table that grew between
        two flushes)."""
        self.fresh.grow(capacity)

    def add(self, positions: torch.Tensor, weight: Optional[torch.Tensor] = None,
            rows: Optional[torch.Tensor] = None, later: bool = False,
            capacity: Optional[int] = None) -> None:
        """Record a lookup of int32/int64 CPU ``positions`` ``[n]`` (repeats allowed, each
        ``< marks.numel()``: :meth:`grow` first; ``IndexError`` otherwise, nothing
        recorded). With ``weight`` (the table's ``[capacity, dim]`` rows, before the update)
        or ``rows`` (the lookup's output ``[n, dim]``, row ``i`` the row at
        ``positions[i]``) keep the FIRST state of each new position; with neither, the
        positions only. With ``later`` the marking may run on the C code's lane thread
        (:meth:`FreshRows.add`): ``fresh.sync()`` before a row of ``weight`` changes; until
        then the lookup counts as its ``n`` ids (``n`` stays an upper bound). ``capacity``:
        the table's positions now, when it may have grown (:meth:`grow` runs first if
        needed)."""
        fresh = self.fresh
        if capacity is not None and fresh.must_grow(capacity):
            self.grow(capacity)
        src = weight if weight is not None else rows
        k = fresh.add(positions, src, by_occurrence=weight is None, later=later)
        if k is None:
            k = int(positions.numel())
        # what the markings run later (each with rows) counted too many
        over, self.fresh.overcount = self.fresh.overcount, 0
        self.n += k - over
        self.n_states = max(0, self.n_states - over)
        if src is not None:
            self.n_states += k

    def add_output(self, positions: torch.Tensor, rows: torch.Tensor) -> bool:
        """``add(positions, rows=rows)`` in one C call (:meth:`FreshRows.add_output`:
        ``rows`` the lookup's output ``[n, dim]``, no autograd), or False (nothing
        recorded) where :meth:`add` must run (with the table's capacity: it may have
        grown)."""
        k = self.fresh.add_output(positions, rows)
        if k is None:
            return False
        self.n += k
        self.n_states += k
        return True

    def forget(self, positions: torch.Tensor) -> None:
        """Rows at ``positions`` (int64 CPU ``[k]``) are being freed: their marks go
        (:meth:`FreshRows.forget`); the other marks keep their ids."""
        k = self.fresh.forget(positions.numpy())
        self.drained = None  # positions may now hold other ids
        self.n = max(0, self.n - k)
        self.n_states = max(0, self.n_states - k)

    def drain(self, table: Any, with_states: bool
              ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """:meth:`PendingLookups.drain`: the ids ascending, their FIRST states gathered once
        from the arena. A table without ``ids_ascending`` gives the id of every position at
        once (``position_ids()``, int64 ``[capacity]``): the sort and the gather are one
        call."""
        f = self.fresh
        with_states = with_states and f.arena is not None
        if self._id_map(table)[0]:  # ascending positions = ascending ids
            touched, states = f.drain(with_states)
            ids = table.ids_at(touched)
        else:
            ids, touched, states = f.drain_by_key(table.position_ids(), with_states)
            self.drained = (ids, touched)
        PendingLookups.reset(self)  # the marks are clear already
        return ids, states

    def drain_unordered(self, table: Any, storage: Optional[torch.Tensor] = None
                        ) -> Optional[tuple[Any, ...]]:
        """``(ids, positions, at, arena, current, give_back)`` of the touched positions,
        in no id order, with no sort and no copy of the FIRST rows
        (:meth:`FreshRows.take_unordered`: row ``at[i]`` of ``arena`` is the FIRST row of
        ``ids[i]``; with ``storage``, ``current`` and a hash table's ``ids`` are filled as
        the rows are owed, else ``current`` is None; ``give_back()`` once they are read);
        None (nothing drained) when the C code did not keep this interval's rows alone."""
        keys = None
        ascending, offset = self._id_map(table)
        if not ascending:  # a hash table: the id held at each position (else position + offset)
            keys = self._keys_of(table.position_ids())
            if keys is None:  # not every position's id at hand: drained now, mapped by ids_at
                storage = None
        got = self.fresh.take_unordered(storage, keys, offset)
        if got is None:
            return None
        ids, pos = got[0], got[1]
        self.drained = None
        PendingLookups.reset(self)  # the marks are clear already
        return (table.ids_at(pos) if ids is None else ids, *got[1:])

    def marked_rows(self, table: Any) -> Optional[tuple[torch.Tensor, torch.Tensor, bool]]:
        """:meth:`FreshRows.marked_rows` of ``table`` (call it before
        :meth:`drain_unordered`); None also when not every position's id is at hand."""
        ascending, offset = self._id_map(table)
        keys = None if ascending else self._keys_of(table.position_ids())
        if not ascending and keys is None:
            return None
        return self.fresh.marked_rows(keys, offset)

def first_states(marks: torch.Tensor, pos: list[torch.Tensor], states: list[torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct positions in the ``pos`` runs (ascending) and each one's earliest state.

    ``pos[i]`` [n_i] are a lookup's row positions and ``states[i]`` [n_i, dim] its output,
    in recording order; ``marks`` is an all-False bool scratch over the positions (left all
    False). Returns ``(touched [k], rows [r, dim], src [k])``: the earliest state of
    ``touched[j]`` is ``rows[src[j]]`` (the caller gathers once, in its final order). Run by
    run, only the occurrences of positions no earlier run had are gathered: about one row per distinct
    position is copied, never a concatenation of every lookup's output. Occurrences of one
    position inside one run are copies of the same row (one lookup), so any of them is the
    earliest state.
    """
    if marks.device.type == "cpu":
        return first_states_cpu(marks, pos, states)
    return first_states_torch(marks, pos, states)


#: first_states_torch concatenates runs in groups of at most this many state elements (one
#: device sync per group instead of one per run; the concatenation is bounded memory)
_GROUP_ELEMS = 1 << 24


def _groups(pos: list[torch.Tensor], states: list[torch.Tensor]) -> list[list[int]]:
    """Consecutive run indices, grouped so each group's states hold <= _GROUP_ELEMS values
    (a run larger than that is a group of its own)."""
    out: list[list[int]] = []
    size = 0
    for i, st in enumerate(states):
        n = st.numel()
        if not out or size + n > _GROUP_ELEMS:
            out.append([])
            size = 0
        out[-1].append(i)
        size += n
    return out


def first_states_torch(marks: torch.Tensor, pos: list[torch.Tensor], states: list[torch.Tensor]
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`first_states` in torch ops (any device).

    Runs are handled in groups (:data:`_GROUP_ELEMS`): a group's positions and states are
    concatenated, the earliest occurrence of each position in the group is found with one
    ``scatter_reduce`` (``amin`` of the occurrence index), and occurrences of positions an
    earlier group had are dropped by ``marks``. On CUDA that is one device sync per group
    (the ``nonzero`` sizing the fresh occurrences) plus one for the touched positions, not
    one per lookup.
    """
    dev = marks.device
    pieces_pos, pieces_states = [], []
    first = None
    for group in _groups(pos, states):
        q = torch.cat([pos[i].to(dev) for i in group]) if len(group) > 1 else pos[group[0]].to(dev)
        n = q.numel()
        if n == 0:
            continue
        st = torch.cat([states[i] for i in group]) if len(group) > 1 else states[group[0]]
        order = torch.arange(n, device=dev)
        if first is None:
            first = torch.empty(marks.numel(), dtype=torch.int64, device=dev)
        first.fill_(n)
        first.scatter_reduce_(0, q, order, "amin")
        is_first = first.index_select(0, q) == order  # the earliest occurrence in the group
        is_first &= marks.index_select(0, q).logical_not_()  # and no earlier group had it
        fresh = is_first.nonzero().squeeze(1)
        if fresh.numel():
            qf = q.index_select(0, fresh)
            marks.index_fill_(0, qf, True)
            pieces_pos.append(qf)
            pieces_states.append(st.index_select(0, fresh.to(st.device)))
    touched = marks.nonzero().squeeze(1)
    marks.index_fill_(0, touched, False)
    if not pieces_pos:
        return touched, states[0][:0].clone(), touched
    allpos = pieces_pos[0] if len(pieces_pos) == 1 else torch.cat(pieces_pos)
    rows = pieces_states[0] if len(pieces_states) == 1 else torch.cat(pieces_states)
    slot = torch.empty(marks.numel(), dtype=torch.int64, device=dev)
    slot.index_copy_(0, allpos, torch.arange(allpos.numel(), device=dev))
    return touched, rows, slot.index_select(0, touched).to(rows.device)


def first_states_cpu(marks: torch.Tensor, pos: list[torch.Tensor], states: list[torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`first_states` with the position bookkeeping in numpy (several times faster
    than torch's small CPU ops here); the rows are still gathered by torch (any dtype)."""
    m = marks.numpy()
    pieces_pos, pieces_states, total = [], [], 0
    for q, st in zip(pos, states, strict=True):
        qn = q.cpu().numpy()
        fresh = np.flatnonzero(~m[qn])
        if fresh.size:
            qf = qn[fresh]
            m[qf] = True
            pieces_pos.append(qf)
            pieces_states.append((st, torch.from_numpy(fresh)))
            total += fresh.size
    touched = np.flatnonzero(m)
    m[touched] = False
    if not pieces_pos:
        t = torch.from_numpy(touched.astype(np.int64, copy=False))
        return t, states[0][:0].clone(), t
    st0 = pieces_states[0][0]
    rows = torch.empty((total, st0.shape[1]), dtype=st0.dtype)
    at = 0
    for st, fresh in pieces_states:  # staged in place: no concatenation afterwards
        k = fresh.numel()
        torch.index_select(st, 0, fresh, out=rows[at:at + k])
        at += k
    slot = np.empty(m.size, dtype=np.int64)
    allpos = np.concatenate(pieces_pos)
    slot[allpos] = np.arange(allpos.size)
    return torch.from_numpy(touched.astype(np.int64, copy=False)), rows, \
        torch.from_numpy(slot[touched])


def mark_positions(marks: torch.Tensor, pos: list[torch.Tensor]) -> torch.Tensor:
    """Distinct positions in ``pos`` (int64 tensors), ascending, via the all-False bool
    scratch ``marks`` (left all False again)."""
    if marks.device.type == "cpu":
        # numpy: its flatnonzero is ~6x faster than torch's nonzero on CPU, and nonzero
        # over the table's capacity was the largest cost of a read after the sort.
        m = marks.numpy()
        for q in pos:
            m[q.cpu().numpy()] = True
        touched = np.flatnonzero(m)
        if touched.size * 16 < m.size:  # few: clear them, else clear everything
            m[touched] = False
        else:
            m[:] = False
        return torch.from_numpy(touched.astype(np.int64, copy=False))
    return mark_positions_torch(marks, pos)


def mark_positions_torch(marks: torch.Tensor, pos: list[torch.Tensor]) -> torch.Tensor:
    """:func:`mark_positions` in torch ops (any device)."""
    for q in pos:
        marks.index_fill_(0, q.to(marks.device), True)
    touched = marks.nonzero().squeeze(1)
    marks.index_fill_(0, touched, False)
    return touched


def row_buffers(pending: Iterable[PendingLookups]) -> dict[str, int]:
    """``{"reused", "allocated"}``: row buffers (FIRST-row arenas, a hand-off's current
    rows) the tables of ``pending`` took from the ones their readers gave back, and
    allocated anew (:class:`~deltastream.tracking.spare_rows.SpareRows`)."""
    out = {"reused": 0, "allocated": 0}
    for p in pending:
        if isinstance(p, UniqueLookups) and p.fresh is not None:
            out["reused"] += p.fresh.spares.reused
            out["allocated"] += p.fresh.spares.allocated
    return out
