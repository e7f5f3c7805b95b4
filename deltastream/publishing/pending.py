"""The rows a budget has not published yet, with their serving errors kept current.

:class:`PendingTable` holds one table's pending rows in slots: the id, the value
predictors serve (``served``: the row's FIRST state when it was first handed over, or
zeros for a row predictors never received), the trainer's latest value (``current``), and
the row's serving error ``‖current − served‖₂`` (float64, embedding units). A pending row's
error changes only when the row changes or is published, so a merge
(:meth:`PendingTable.merge`) re-scores just the rows of one hand-off, and the orders the
budget reads (:mod:`~deltastream.publishing.score_order`) are updated with them: the work
is O(rows changed), not O(rows pending).

Rules (the same as a tracker delta scored with
:func:`~deltastream.publishing.serving_error.serving_errors`):

* a row already pending keeps its ``served`` value, ``new`` flag and birth tick; only
  ``current`` is replaced (coalescing: the newest value wins);
* a row whose error is 0 (predictors already hold it) leaves the pending set (``exact``);
* a non-finite row, or one beyond the wire dtype's range (f16), is *rejected*: never
  published, counted, and it leaves the pending set — predictors keep the last good value;
* ``new_rows="first"``: a new row's error is ``+inf`` (it goes before every other row);
* a tombstone (evicted id) drops the id's pending row and is sent with the table's next
  message; a re-inserted id whose tombstone was not sent yet is scored against zeros;
* a row put back with what a residual left (birth :data:`SENT_BIRTH`) is never overdue;
  its next change gives it that hand-off's tick as its birth;
* ``read_decay``: the rows are also kept in a second order, ``by_rank``, by error × a
  weight for how often the row is read (:mod:`~deltastream.publishing.read_weights`; the
  same unit in every table). ``by_error`` still gives the largest error (the bound);
  without ``read_decay`` both names are one order.

Memory: two ``[pending, dim]`` row arrays in the table's dtype, plus ~100 bytes per slot;
with ``read_decay`` also 24 bytes an entry of ``by_rank`` and ~50 bytes an id changed in
the last few dozen hand-offs.
Torch (CPU) holds the rows and the id index; the orders are numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

import numpy as np
import torch

from deltastream.publishing.read_weights import ReadWeights
from deltastream.publishing.row_moves import move_rows
from deltastream.publishing.score_order import AgeQueue, ScoreOrder
from deltastream.publishing.serving_error import TableScale, row_errors
from deltastream.publishing.slot_pool import SlotPool
from deltastream.tracking.sorted_ids import member, union

__all__ = ["PendingTable", "TakenRows", "MergeCounts", "MERGE_CHUNK_ROWS", "SENT_BIRTH"]

#: rows a merge scores at once: its float64 temporaries stay ~16 MB at dim 32
MERGE_CHUNK_ROWS = 1 << 16
#: the birth of a row whose every change went out as a residual: what is pending is what
#: the residuals left, which is never overdue (its next change gives it a birth again)
SENT_BIRTH = np.iinfo(np.int64).max // 2


@dataclass
class TakenRows:
    """Rows taken out of a :class:`PendingTable` to be published (ids ascending).

    ``served``/``new``/``birth``/``sends`` are kept so that rows whose send fails go back
    with the state predictors still hold (:meth:`PendingTable.put_back`)."""

    ids: torch.Tensor  # int64 [n]
    served: torch.Tensor  # [n, dim]
    current: torch.Tensor  # [n, dim]
    new: torch.Tensor  # bool [n]
    birth: torch.Tensor  # int64 [n]
    sends: torch.Tensor  # int64 [n]: residuals sent since the row last went whole

    def __len__(self) -> int:
        return int(self.ids.numel())

    def pick(self, mask: torch.Tensor) -> TakenRows:
        """The rows where ``mask`` (bool ``[n]``) is set, ids still ascending."""
        at = mask.nonzero().squeeze(1)
        return TakenRows(**{f.name: getattr(self, f.name).index_select(0, at)
                            for f in fields(self)})


@dataclass
class MergeCounts:
    """What one merge did: rows scored, dropped as exact, rejected (non-finite / range)."""

    scored: int = 0
    exact: int = 0
    rejected: int = 0
    out_of_range: int = 0
    coalesced: int = 0  # rows already pending that changed again (newest value kept)


class PendingTable:
    """One table's pending rows (see the module docstring).

    Args:
        dim: row width. dtype: the rows' dtype (the table's).
        new_rows: ``"drift"`` or ``"first"`` (how a row predictors never received scores).
        range_limit: largest finite magnitude the wire dtype carries (``None``: any).
        read_decay: rank by error × √(read count decayed by this a hand-off) (``None``:
            by error).
    """

    def __init__(self, dim: int, dtype: torch.dtype, *, new_rows: str = "drift",
                 range_limit: Optional[float] = None, read_decay: Optional[float] = None,
                 capacity: int = 1024) -> None:
        self.dim, self.dtype, self.new_rows, self.range_limit = dim, dtype, new_rows, range_limit
        #: slots and their columns: what predictors hold (``served``), the newest value
        #: (``current``), never received (``new``), birth tick, serving error, AgeQueue life
        self._slots = SlotPool({"served": torch.zeros(capacity, dim, dtype=dtype),
                                "current": torch.zeros(capacity, dim, dtype=dtype),
                                "new": torch.zeros(capacity, dtype=torch.bool),
                                "birth": np.zeros(capacity, dtype=np.int64),
                                "sends": np.zeros(capacity, dtype=np.int64),
                                "err": np.zeros(capacity, dtype=np.float64),
                                "w": np.zeros(capacity, dtype=np.float64),
                                "life": np.zeros(capacity, dtype=np.int64)}, "pending")
        self._c = self._slots.cols
        self.by_error = ScoreOrder()
        self.reads = None if read_decay is None else ReadWeights(read_decay)
        #: the order the budget takes rows in (``by_error`` itself without read weights)
        self.by_rank = self.by_error if self.reads is None else ScoreOrder()
        self._tick = 0  # the last hand-off merged
        self.by_age = AgeQueue()
        self.scale = TableScale()
        self.tombstones = torch.empty(0, dtype=torch.int64)  #: evicted ids not sent yet

    # ------------------------------------------------------------------ reading

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def stamps(self) -> np.ndarray:
        """Each slot's stamp (for :meth:`ScoreOrder.top`)."""
        return self._slots.stamp

    @property
    def lives(self) -> np.ndarray:
        """Each slot's life counter (for :meth:`AgeQueue.oldest`)."""
        return self._c["life"]

    def errors(self, slots: np.ndarray) -> np.ndarray:
        """Serving errors (float64, embedding units) of pending ``slots``."""
        return self._c["err"][slots]

    def ids_of(self, slots: np.ndarray) -> torch.Tensor:
        """The ids (int64) in pending ``slots``."""
        return self._slots.ids.index_select(0, torch.from_numpy(np.asarray(slots, np.int64)))

    def rank_keys(self, slots: np.ndarray) -> np.ndarray:
        """The keys ``by_rank`` holds for pending ``slots`` (float64): their errors, times
        their read weights with ``read_decay``."""
        err = self._c["err"][slots]
        return err if self.reads is None else err * self._c["w"][slots]

    def max_error(self) -> float:
        """The largest serving error among the pending rows (0 if none)."""
        k, _, _ = self.by_error.top(1, self._slots.stamp)
        return float(k[0]) if k.size else 0.0

    def live_slots(self) -> np.ndarray:
        """Every pending slot (O(capacity): for a final flush)."""
        return self._slots.live_slots()

    def memory_bytes(self) -> int:
        """Bytes held for rows, slots and orders."""
        served = self._c["served"]
        rows = 2 * served.numel() * served.element_size()
        orders = self.by_error.entries + self.by_age.entries
        if self.reads is not None:
            orders += self.by_rank.entries
            rows += self.reads.memory_bytes()
        return rows + self._slots.capacity * 64 + 24 * orders

    # ------------------------------------------------------------------ slots

    def _drop(self, ids: torch.Tensor) -> int:
        """Remove the pending rows of ``ids`` (unique); how many were pending."""
        slots = self._slots.remove(ids)
        self._c["life"][slots] += 1  # their AgeQueue entries are dead now
        return int(slots.size)

    def _rebase(self, tick: int) -> None:
        """Move the read weights' base to ``tick``: every weight times one factor, and
        ``by_rank`` keyed again (O(pending), every few hundred hand-offs)."""
        factor = self.reads.rebase(tick)
        s = self.live_slots()
        w = self._c["w"]
        w[s] *= factor
        self.by_rank = ScoreOrder()
        self.by_rank.add(self._c["err"][s] * w[s], s, self._slots.stamp[s], self._slots.stamp,
                         len(self))

    # ------------------------------------------------------------------ scoring

    def _score(self, current: torch.Tensor, served: torch.Tensor, new: torch.Tensor,
               amax: Optional[torch.Tensor] = None, **at: Optional[torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`row_errors` under this table's ``new_rows`` rule: a row predictors never
        received scores against zeros (``"drift"``) or ``+inf`` (``"first"``); ``amax``
        and ``current_at`` / ``served_at`` as there."""
        err, norm, ok = row_errors(current, served, new if self.new_rows == "drift" else None,
                                   amax, **at)
        if self.new_rows == "first":
            err = torch.where(new & ok, math.inf, err)
        return err, norm, ok

    def merge(self, ids: torch.Tensor, first: torch.Tensor, current: torch.Tensor,
              new: Optional[torch.Tensor], tombstones: Optional[torch.Tensor],
              tick: int, first_at: Optional[torch.Tensor] = None) -> MergeCounts:
        """Fold one hand-off into the pending set (O(len(ids)); see the module docstring).

        Args:
            ids: int64 ``[n]`` unique ids changed since the last hand-off, in any order.
            first: ``[n, dim]`` their FIRST states (the value before their first update
                since the last hand-off), or with ``first_at`` (int64 ``[n]``) the rows
                holding them: ``ids[i]``'s is ``first[first_at[i]]`` (a tracker's arena,
                read in place). current: ``[n, dim]`` their values now.
            new: bool ``[n]`` or None: inserted into the table in the interval.
            tombstones: int64 ``[m]`` ids evicted in the interval, or None.
            tick: the hand-off's tick (birth of rows that start pending).
        """
        counts = MergeCounts()
        self._tick = tick
        w = None
        if self.reads is not None:  # every id changed counts a read, published or not
            if self.reads.due(tick):
                self._rebase(tick)
            w = self.reads.touch(ids, tick)
        if tombstones is not None and tombstones.numel():
            self._drop(tombstones)
            self.tombstones = union(self.tombstones, torch.unique(tombstones))[0]
        # in chunks: the scoring's float64 temporaries stay bounded (a hand-off of 10M rows
        # of dim 32 would need several 2.5 GB copies at once)
        if first_at is None:
            first_at = torch.arange(ids.numel())
        norms = [self._merge_rows(ids[a:a + MERGE_CHUNK_ROWS], first,
                                  first_at[a:a + MERGE_CHUNK_ROWS],
                                  current[a:a + MERGE_CHUNK_ROWS],
                                  None if new is None else new[a:a + MERGE_CHUNK_ROWS], tick,
                                  None if w is None else w[a:a + MERGE_CHUNK_ROWS], counts)
                 for a in range(0, int(ids.numel()), MERGE_CHUNK_ROWS)]
        if norms:  # one update of the table's scale per hand-off, whatever its size
            self.scale.update(norms[0] if len(norms) == 1 else torch.cat(norms))
        return counts

    def _merge_rows(self, ids: torch.Tensor, first: torch.Tensor, first_at: torch.Tensor,
                    current: torch.Tensor, new: Optional[torch.Tensor], tick: int,
                    w: Optional[np.ndarray], counts: MergeCounts) -> torch.Tensor:
        """:meth:`merge` of ``ids`` (at most :data:`MERGE_CHUNK_ROWS`; ``w``: their read
        weights), added to ``counts``; returns the rows' norms for the table's scale (NaN
        for rows rejected)."""
        n = int(ids.numel())
        new = torch.zeros(n, dtype=torch.bool) if new is None else new.to(torch.bool)
        if self.tombstones.numel():  # re-inserted before its tombstone went out
            back, at_t = member(self.tombstones, ids)
            if bool(back.any()):
                gone = torch.zeros(self.tombstones.numel(), dtype=torch.bool)
                gone[at_t[back]] = True
                self.tombstones = self.tombstones[~gone]
                new = new | back
        pos = self._slots.find(ids)
        had = pos >= 0
        at = had.nonzero().squeeze(1)
        fr = (~had).nonzero().squeeze(1)
        slots_had = pos.index_select(0, at)
        # each row scored where its served value lies: a pending row's stays (the slot's),
        # a row not pending starts from its FIRST state (the hand-off's) — nothing gathered
        is_new = new.clone()
        is_new[at] = self._c["new"][slots_had]
        err, norm, ok = (torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.float64),
                         torch.empty(n, dtype=torch.bool))
        amax = None if self.range_limit is None else torch.empty(n, dtype=torch.float64)
        for rows, src, src_at in ((at, self._c["served"], slots_had),
                                  (fr, first, first_at.index_select(0, fr))):
            part = None if amax is None else torch.empty(rows.numel(), dtype=torch.float64)
            err[rows], norm[rows], ok[rows] = self._score(
                current, src, is_new.index_select(0, rows), part, current_at=rows,
                served_at=src_at)
            if amax is not None:
                amax[rows] = part
        if amax is not None:
            big = ok & (amax > self.range_limit)
            counts.out_of_range += int(big.sum())
            ok = ok & ~big
        keep = ok & (err > 0)
        counts.scored += n
        counts.rejected += int((~ok).sum())
        counts.exact += int((ok & (err == 0)).sum())
        counts.coalesced += int((had & keep).sum())
        gone = had & ~keep
        if bool(gone.any()):
            self._drop(ids[gone])
        stay = (had & keep).nonzero().squeeze(1)
        if stay.numel():
            s = pos.index_select(0, stay)
            move_rows(self._c["current"], s, current, stay)
            sn = s.numpy()
            self._rescore(sn, err.index_select(0, stay).numpy(),
                          None if w is None else w[stay.numpy()])
            sent = sn[self._c["birth"][sn] == SENT_BIRTH]
            if sent.size:  # a change after its residual went out: it ages from now
                self._c["life"][sent] += 1
                self._c["birth"][sent] = tick
                self._age(sent)
        fresh = (~had & keep).nonzero().squeeze(1)
        if fresh.numel():
            self._add(ids.index_select(0, fresh), first, current, is_new.index_select(0, fresh),
                      np.full(fresh.numel(), tick, dtype=np.int64),
                      err.index_select(0, fresh).numpy(),
                      w=None if w is None else w[fresh.numpy()],
                      served_at=first_at.index_select(0, fresh), current_at=fresh)
        return torch.where(ok, norm, math.nan)

    def _rescore(self, slots: np.ndarray, err: np.ndarray, w: Optional[np.ndarray] = None
                 ) -> None:
        """New errors (and read weights: None keeps the slots') of pending ``slots``."""
        self._c["err"][slots] = err
        self._slots.stamp[slots] += 1
        stamps = self._slots.stamp[slots]
        self.by_error.add(err, slots, stamps, self._slots.stamp, len(self))
        if self.reads is not None:
            if w is not None:
                self._c["w"][slots] = w
            self.by_rank.add(err * self._c["w"][slots], slots, stamps, self._slots.stamp,
                             len(self))

    def _add(self, ids: torch.Tensor, served: torch.Tensor, current: torch.Tensor,
             new: torch.Tensor, birth: np.ndarray, err: np.ndarray,
             sends: Optional[np.ndarray] = None, *, w: Optional[np.ndarray] = None,
             served_at: Optional[torch.Tensor] = None,
             current_at: Optional[torch.Tensor] = None) -> None:
        """New pending rows of ``ids``: their values are ``served`` / ``current`` rows
        ``served_at`` / ``current_at`` (None: aligned with ``ids``); ``w``: their read
        weights (None: as of their last change)."""
        slots = self._slots.add(ids)
        move_rows(self._c["served"], slots, served, served_at)
        move_rows(self._c["current"], slots, current, current_at)
        self._c["new"][slots] = new
        s = slots.numpy()
        self._c["birth"][s] = birth
        self._c["sends"][s] = 0 if sends is None else sends
        if self.reads is not None and w is None:
            w = self.reads.weights(ids, self._tick)
        self._rescore(s, err, w)
        self._age(s)

    def _age(self, slots: np.ndarray) -> None:
        """Enter ``slots`` in the age order, one batch per birth tick (a hand-off has one;
        rows handed back may have several)."""
        birth = self._c["birth"][slots]
        for b in np.unique(birth):
            at = slots[birth == b]
            self.by_age.add(int(b), at, self._c["life"][at])
        if self.by_age.entries > 2 * len(self) + 4096:
            self.by_age.rebuild(self._c["life"])

    # ------------------------------------------------------------------ publishing

    def take(self, slots: np.ndarray) -> TakenRows:
        """Remove pending ``slots`` (unique) and return their rows, ids ascending."""
        ids, s = self._slots.by_id(slots)
        out = TakenRows(ids=ids, served=self._c["served"].index_select(0, s),
                        current=self._c["current"].index_select(0, s),
                        new=self._c["new"].index_select(0, s),
                        birth=torch.from_numpy(self._c["birth"][s.numpy()]),
                        sends=torch.from_numpy(self._c["sends"][s.numpy()]))
        self._drop(ids)
        return out

    def take_tombstones(self) -> Optional[torch.Tensor]:
        """The evicted ids not sent yet (they are sent with the next message), or None."""
        t, self.tombstones = self.tombstones, torch.empty(0, dtype=torch.int64)
        return t if t.numel() else None

    def put_back(self, rows: TakenRows, tombstones: Optional[torch.Tensor]) -> None:
        """Rows (and tombstones) whose send failed, or rows a residual left an error in:
        pending again with the state predictors hold (``rows.served``/``new``/birth). A
        row that changed meanwhile keeps its newer ``current`` and the older birth, and
        takes the rest back; a row
        whose error is then 0 (predictors hold its current value) is not pending."""
        if tombstones is not None and tombstones.numel():
            self.tombstones = union(self.tombstones, torch.unique(tombstones))[0]
        if not len(rows):
            return
        pos = self._slots.find(rows.ids)
        had = pos >= 0
        if bool(had.any()):
            w = had.nonzero().squeeze(1)
            s = pos.index_select(0, w)
            sn = s.numpy()
            self._c["served"].index_copy_(0, s, rows.served.index_select(0, w))
            self._c["new"].index_copy_(0, s, rows.new.index_select(0, w))
            cur = self._c["current"].index_select(0, s)
            err, _, _ = self._score(cur, rows.served.index_select(0, w),
                                    rows.new.index_select(0, w))
            self._c["life"][sn] += 1  # its AgeQueue entry moves to the older birth
            self._c["birth"][sn] = np.minimum(self._c["birth"][sn],
                                              rows.birth.index_select(0, w).numpy())
            self._c["sends"][sn] = rows.sends.index_select(0, w).numpy()
            self._rescore(sn, err.numpy())
            self._age(sn)
            if bool((err == 0).any()):
                self._drop(rows.ids.index_select(0, w)[err == 0])
        if not bool(had.all()):
            back = rows.pick(~had)
            err, _, _ = self._score(back.current, back.served, back.new)
            live = err != 0  # NaN (a row gone bad) stays pending
            back = back.pick(live)
            self._add(back.ids, back.served, back.current, back.new, back.birth.numpy(),
                      err[live].numpy(), back.sends.numpy())
