""":func:`~deltastream.publish_delta`'s rounds, run on the rows the hand-offs copied.

:class:`RoundEngine` has the steps of :class:`~.budget_engine.BudgetEngine`, so the budget
publisher's threads, worker process and hand-off run it unchanged
(:class:`~.round_publisher.RoundPublisher`); what it does in them is a ``publish_delta``
round (:func:`~.rounds.run_round`):

1. :meth:`~RoundEngine.merge` — fold a hand-off in: its rows become this round's delta
   (sorted ids, FIRST states, ``new``, age 0, the tombstones), united with the rows merged
   before and not yet in a round (the older FIRST state wins, as in the tracker); their
   current values go to :class:`~.held_rows.HeldRows`, the table the round reads. An
   evicted id drops what is held or carried for it, as the tracker purges it.
2. :meth:`~RoundEngine.start` — take the delta; the rows the last round handed back
   (its leftover, with ``age + 1``) join it, as a tracker's ``get_delta`` joins retained
   rows.
3. :meth:`~RoundEngine.send` — the round: ``policy.select`` per table on the held rows
   (carried rows kept scored between rounds, as ``publish_delta`` keeps them), the
   leftover handed back to this engine (:meth:`retain`), the selection published; then
   wait until the broker acknowledged it. The ids of messages that were not delivered
   come back (FIRST state zeros, overdue: a later round sends their current value), as
   ``publish_delta`` hands them back.
4. :meth:`~RoundEngine.settle` — count; held rows no round can read any more are dropped.

Run in order for every hand-off (a synchronous :class:`~.round_publisher.RoundPublisher`),
the rounds publish what ``publish_delta`` called at the same steps publishes
(``tests/deltastream/publishing/test_round_publisher.py``). A worker that falls behind
merges several hand-offs into one round: rows coalesce (their newest value, their oldest
FIRST state). The worker's threads merge (its worker thread) while a round is sent (its
sender thread); the round's selection and its hand-over to the publisher hold the engine's
lock, so a merge waits for them, never for the broker's acknowledgement.
"""

from __future__ import annotations

import logging
import numbers
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from deltastream.publishing.budget_engine import (
    BudgetEngine,
    BudgetTick,
    TableSpec,
    count_round,
    report_round,
    wait_delivered,
)
from deltastream.publishing.carried import carried_state
from deltastream.publishing.handoff import Handoff, TableHandoff
from deltastream.publishing.held_rows import HeldRows
from deltastream.publishing.rounds import (
    PublishRound,
    RowPublisher,
    SelectionPolicy,
    TableRound,
    hand_back_failed,
    run_round,
)
from deltastream.tracking.row_copy import gather_rows
from deltastream.tracking.rows import canonical_rows, carry_rows, drop_ids, merge_carry
from deltastream.tracking.sorted_ids import member, member_sorted, sort_ids_with_perm
from deltastream.types import DeltaRows

__all__ = ["RoundPolicy", "RoundEngine", "engine_for", "unite_deltas"]

log = logging.getLogger(__name__)

#: the consumer name the engine's rounds carry their rows under (its own state)
_CONSUMER = "rounds"


@dataclass(frozen=True)
class RoundPolicy:
    """What a :class:`~.round_publisher.RoundPublisher` publishes, and how often.

    Attributes:
        select: which of a round's changed rows go out (:class:`SelectionPolicy`:
            ``k`` / ``fraction`` / ``threshold``, ``max_bytes``, ``max_age``...).
        every: steps from one round to the next (``>= 1``): a tick hands off the rows
            changed since the last round when ``step`` is this many past it.
        window: rounds the ``stats()`` quantiles cover.

    Raises:
        TypeError / ValueError: naming the bad field and what was expected.
    """

    select: SelectionPolicy = field(default_factory=SelectionPolicy)
    every: int = 1
    window: int = 1024

    # what the budget publisher's tick reads of a policy: a round is a step count, not
    # a byte budget; no residuals, nothing charged
    per_step = True
    residuals = False
    charge_dense = False

    def __post_init__(self) -> None:
        if not isinstance(self.select, SelectionPolicy):
            raise TypeError(f"RoundPolicy.select must be a SelectionPolicy, got "
                            f"{type(self.select).__name__}")
        for name in ("every", "window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"RoundPolicy.{name} must be an int >= 1, got {v!r}")

    def describe(self) -> dict:
        """Plain values for ``stats()``."""
        s = self.select
        return {"every": self.every, "k": s.k, "fraction": s.fraction,
                "threshold": s.threshold, "max_bytes": s.max_bytes, "max_age": s.max_age,
                "relative": s.relative, "new_rows": s.new_rows,
                "weighted": s.weights is not None}


@dataclass
class _Job:
    """One round: its deltas (taken at :meth:`RoundEngine.start`) and what it published."""

    tick: int
    step: int
    ts: int
    final: bool
    deltas: dict[str, DeltaRows]
    t0: float
    done: list[TableRound] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return sum(len(d) for d in self.deltas.values())


def unite_deltas(old: DeltaRows, fresh: DeltaRows, evicted: Optional[torch.Tensor]) -> DeltaRows:
    """``old`` rows (earlier, not in a round yet) united with ``fresh`` (a later interval
    whose raw evictions are ``evicted``): an id evicted later drops its old row (a row
    again only if ``fresh`` has it, with ``fresh``'s state); common ids keep ``old``'s FIRST
    state; tombstones are both sides' minus the ids that are rows."""
    if evicted is not None and evicted.numel() and len(old):
        old = drop_ids(old, evicted)
    rows = merge_carry(old, fresh) if len(old) else fresh
    parts = [t for t in (old.tombstones, fresh.tombstones) if t is not None and t.numel()]
    tombs = torch.unique(torch.cat(parts)) if parts else fresh.tombstones
    if tombs is not None and tombs.numel() and len(rows):
        tombs = tombs[~member(rows.ids, tombs)[0]]
    rows.tombstones = tombs
    return rows


def _union(parts: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """The ids of ``parts`` (int64 ``[n_i]`` each, unique within each) once, ascending
    where there are several; None if all are empty."""
    parts = [x for x in parts if x.numel()]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else torch.unique(torch.cat(parts))


class RoundEngine:
    """Held rows, merged deltas and counters of one round publisher (see the module
    docstring).

    Args:
        publisher: where rows go; its ``dtype`` is the wire dtype ``max_bytes`` counts in.
        policy: the round's selection and cadence (:class:`RoundPolicy`).
        specs: ``{fqn: TableSpec}`` of the tracked tables.
        on_round: called with every settled round's record (on the thread that ran it).
    """

    def __init__(self, publisher: RowPublisher, policy: RoundPolicy,
                 specs: Mapping[str, TableSpec],
                 on_round: Optional[Callable[[BudgetTick], None]] = None) -> None:
        self.publisher, self.policy, self.specs = publisher, policy, dict(specs)
        self._on_round = on_round
        self._names = {fqn: spec.name for fqn, spec in self.specs.items()}
        self.held: dict[str, HeldRows] = {}
        self._fresh: dict[str, DeltaRows] = {}  # merged, not in a round yet
        self._carry: dict[str, DeltaRows] = {}  # handed back by the last round
        self._dynamic: dict[str, bool] = {}  # tables whose rows have ``new``
        # merge (worker thread) against a round's selection (sender thread)
        self._lock = threading.RLock()
        self.last: Optional[BudgetTick] = None
        self.tokens = 0.0  # no byte bucket: rounds follow steps
        self.n = dict.fromkeys(("rounds", "bytes", "rows", "messages", "tombstones",
                                "rejected", "final_bytes", "final_rows", "failed_rounds",
                                "coalesced_rows"), 0)
        self.select_s = 0.0
        self.send_s = 0.0

    # ------------------------------------------------------------------ 1. merge

    def merge(self, h: Handoff) -> None:
        """Fold hand-off ``h`` into the next round's delta and the held rows."""
        h.wait()
        with self._lock:
            for th in h.tables:
                self._merge_table(th)
                th.rows_read()

    def _merge_table(self, th: TableHandoff) -> None:
        new, tombs = th.live()
        # the current rows go to the held rows in the hand-off's order (a copy: its memory
        # is reused once merged); the delta's columns are copied once, sorted by id (the
        # FIRST rows through first_at where the arena holds them)
        held = self._held(th.fqn, th.current.dtype)
        if th.ordered:
            ids, order = th.ids.clone(), None
            new = None if new is None else new.clone()
        else:
            ids, order = sort_ids_with_perm(th.ids)
            new = None if new is None else new.index_select(0, order)
        at = th.first_at if order is None else \
            order if th.first_at is None else th.first_at.index_select(0, order)
        first = th.first.clone() if at is None else gather_rows(th.first, at)
        dynamic = self._dynamic.setdefault(th.fqn, new is not None or th.inserted is not None)
        if dynamic and new is None:
            new = torch.zeros(ids.numel(), dtype=torch.bool)
        fresh = DeltaRows(ids=ids, states=first, new=new, tombstones=tombs,
                          age=torch.zeros(ids.numel(), dtype=torch.int64))
        # every id evicted in the interval: the tombstones, and the ids inserted in it (a
        # row held from before was evicted first): its earlier rows are purged, as the
        # tracker purges touches and retained rows at an eviction
        evicted = th.tombstones
        if new is not None and bool(new.any()):
            evicted = ids[new] if evicted is None else torch.cat([evicted, ids[new]])
        old = self._fresh.get(th.fqn)
        if old is not None:
            self.n["coalesced_rows"] += int(member_sorted(old.ids, ids)[0].sum()) \
                if len(old) else 0
        self._fresh[th.fqn] = fresh if old is None else unite_deltas(old, fresh, evicted)
        carried = self._carry.get(th.fqn)
        if carried is not None and evicted is not None and evicted.numel():
            self._carry[th.fqn] = drop_ids(carried, evicted)
        if tombs is not None and tombs.numel():
            held.drop(tombs)
        held.put(th.ids, th.current)

    def _held(self, fqn: str, dtype: torch.dtype) -> HeldRows:
        t = self.held.get(fqn)
        if t is None:
            spec = self.specs[fqn]
            t = self.held[fqn] = HeldRows(spec.name, spec.dim, spec.dtype or dtype,
                                          spec.publish_kwargs)
        return t

    # ------------------------------------------------------------------ 2. start

    def start(self, tick: int, step: int, ts: int, final: bool) -> _Job:
        """Take the merged delta, the last round's leftover joined in."""
        with self._lock:
            fresh, self._fresh = self._fresh, {}
            carry, self._carry = self._carry, {}
            deltas = dict(fresh)
            for fqn, c in carry.items():
                d = fresh.get(fqn)
                deltas[fqn] = c if d is None else unite_deltas(c, d, None)
            return _Job(tick, step, ts, final, deltas, time.monotonic())

    # ------------------------------------------------------------------ 3. send

    def retain(self, consumer: str, fqn: str, rows: DeltaRows) -> None:
        """The tracker's ``retain`` for the round: ``rows`` join the next round's delta
        (their FIRST state wins, ``age + 1``)."""
        rows = canonical_rows(rows, self.specs[fqn].dim, self._dynamic.get(fqn, False), True)
        with self._lock:
            carry_rows(self._carry, fqn, rows)

    def send(self, job: _Job) -> None:
        """Run the round on the held rows and wait for the broker's acknowledgement."""
        pol = self.policy.select
        with self._lock:
            t0 = time.monotonic()
            # the tables a hand-off brought (every table of a round's deltas)
            names = {fqn: self._names[fqn] for fqn in self.held}
            job.done = run_round(self, _CONSUMER, self.publisher, pol, self.held, names,
                                 lambda: job.deltas, step=job.step, ts=job.ts,
                                 final=job.final)
            self.select_s += time.monotonic() - t0
        t1 = time.monotonic()
        try:
            wait_delivered(self.publisher, (rec.result for rec in job.done))
        except BaseException as e:  # publish_delta's final flush does the same
            with self._lock:
                hand_back_failed(self, _CONSUMER, e, names, self.held, pol)
            raise
        finally:
            self.send_s += time.monotonic() - t1

    # ------------------------------------------------------------------ 4. settle

    def settle(self, job: _Job, error: Optional[BaseException]) -> BudgetTick:
        """Count the round; drop the held rows no later round reads."""
        if error is not None and hasattr(error, "add_note"):
            text = (f"round publisher: the rows of round {job.tick} (step {job.step}) that "
                    f"were not delivered are pending again (the next round sends them)")
            log.warning("%s (after %s: %s)", text, type(error).__name__, error)
            error.add_note(text)
        rnd = PublishRound(step=job.step, ts=job.ts, final=job.final,
                           seconds=time.monotonic() - job.t0,
                           tables=tuple(job.done) if error is None else ())
        with self._lock:
            self._drop_unread(job, error)
            count_round(self.n, rnd, error)
            self.n["rejected"] += rnd.rejected
            tick = BudgetTick(round=rnd, tokens=0.0, bound=float("nan"), table_bounds={},
                              overdue=0, exact=0)
            self.last = tick
        report_round(self._on_round, tick)
        return tick

    def _drop_unread(self, job: _Job, error: Optional[BaseException]) -> None:
        """Forget the held rows the job published (carried rows it took included) that
        no later round reads: in no delta merged since, no carry (rows handed back) and
        no carried table. A round that rejected rows, or failed, checks every candidate
        it had instead (a rejected row is in none of them either)."""
        carried = carried_state(self).of(_CONSUMER)
        everything = error is not None or any(rec.rejected for rec in job.done)
        ids_of: dict[str, list[torch.Tensor]] = {}
        for rec in job.done:
            ids_of.setdefault(rec.fqn, []).append(rec.ids)
        if everything:
            for fqn, d in job.deltas.items():
                ids_of.setdefault(fqn, []).append(d.ids)
        for fqn, parts in ids_of.items():
            held, ids = self.held.get(fqn), _union(parts)
            if held is None or ids is None:
                continue
            keep = torch.zeros(ids.numel(), dtype=torch.bool)
            for other in (self._fresh.get(fqn), self._carry.get(fqn)):
                if other is not None and len(other):
                    keep |= member_sorted(other.ids, ids)[0]
            ct = carried.get(fqn)
            if ct is not None and len(ct):
                keep |= ct.find(ids) >= 0
            held.drop(ids[~keep] if bool(keep.any()) else ids)

    # ------------------------------------------------------------------ reading

    def pending_rows(self) -> int:
        """Distinct rows waiting for a round: merged since the last one, handed back, or
        carried (a row changed again while it is carried is in two of them; O(rows merged
        and handed back))."""
        with self._lock:
            carried = carried_state(self).of(_CONSUMER)
            total = 0
            for fqn in set(self._fresh) | set(self._carry) | set(carried):
                ids = _union([d.ids for d in (self._fresh.get(fqn), self._carry.get(fqn))
                              if d is not None])
                ct = carried.get(fqn)
                n_ct = len(ct) if ct is not None else 0
                total += n_ct
                if ids is not None:
                    total += int(ids.numel()) if not n_ct else int((ct.find(ids) < 0).sum())
            return total

    def stats(self) -> dict:
        """Counters, pending and held rows (plain values)."""
        with self._lock:
            return {**self.n, "tokens": 0.0, "select_s": self.select_s,
                    "send_s": self.send_s, "pending": self.pending_rows(),
                    "held_rows": sum(len(h) for h in self.held.values()),
                    "held_bytes": sum(h.memory_bytes() for h in self.held.values())}


def engine_for(publisher: RowPublisher, policy: Any, specs: Mapping[str, TableSpec],
               on_round: Optional[Callable[[BudgetTick], None]] = None) -> Any:
    """The engine a policy runs on: a :class:`RoundEngine` for a :class:`RoundPolicy`, a
    :class:`~.budget_engine.BudgetEngine` for a ``BudgetPolicy``."""
    if isinstance(policy, RoundPolicy):
        return RoundEngine(publisher, policy, specs, on_round)
    return BudgetEngine(publisher, policy, specs, on_round)
