"""A budget publisher's state and its rounds, whichever thread runs them.

:class:`BudgetEngine` owns the pending rows (:class:`~.pending.PendingTable` per table),
the token bucket, the learnt message overheads and the counters. Its steps, in order:

1. :meth:`~BudgetEngine.merge` — fold a hand-off in (O(rows changed)); refill the bucket;
2. :meth:`~BudgetEngine.start` — choose the round's rows (:func:`~.budget_plan.choose`,
   O(rows chosen)) and take them out of the pending set: a :class:`RoundJob`;
3. :meth:`~BudgetEngine.send` — publish the job's rows per table and wait until the broker
   acknowledged them (the slow step: it runs on the worker's sender thread, or inline in
   synchronous mode);
4. :meth:`~BudgetEngine.settle` — count what was delivered; rows that were not go back to
   the pending set with the state predictors still hold, and rows sent as residuals
   (``BudgetPolicy.residuals``) go back with what they left against what predictors hold
   now.

:class:`~.budget.BudgetPublisher` drives it from the training thread (synchronous mode) or
from :class:`~.budget_worker.BudgetWorker`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import numpy as np
import torch

from deltastream import wire
from deltastream.publishing.budget_plan import Candidate, choose
from deltastream.publishing.budget_policy import BudgetPolicy
from deltastream.publishing.handoff import Handoff
from deltastream.publishing.pending import SENT_BIRTH, PendingTable, TakenRows
from deltastream.publishing.rounds import (
    PublishRound,
    RowPublisher,
    TableRound,
    shard_publish_kwargs,
    table_name,
)
from deltastream.publishing.table_rows import row_reader
from deltastream.publishing.token_bucket import TokenBucket

__all__ = ["BudgetEngine", "BudgetTick", "RoundJob", "TableSpec", "table_specs", "count_round",
           "report_round", "wait_delivered"]

log = logging.getLogger(__name__)

#: first guess of a message's bytes beyond its rows (keys, names, counters, CRC); learnt
#: per table from what the publisher reports after the first message.
_OVERHEAD_GUESS = 256
#: the birth given to rows whose residual send failed: overdue at once, so they go soon
#: (and whole: their send count is set to ``whole_every``)
_OVERDUE_BIRTH = -(1 << 62)


@dataclass(frozen=True)
class BudgetTick:
    """What one budget round (a tick's, or a ``flush``) did.

    Attributes:
        round: the per-table publish records (:class:`~deltastream.publishing.rounds.PublishRound`).
        tokens: bytes the round could spend (after the refill, before sending).
        bound: largest normalized serving error among the rows left pending (0 if none):
            every other served row is exact, up to wire rounding.
        table_bounds: ``{table name: largest error left pending}`` in embedding units.
        overdue: rows published from the overdue tier.
        exact: changed rows dropped because predictors already hold their current value.
    """

    round: PublishRound
    tokens: float
    bound: float
    table_bounds: dict[str, float]
    overdue: int
    exact: int

    @property
    def bytes(self) -> int:
        return self.round.bytes

    @property
    def published(self) -> int:
        return self.round.published

    @property
    def carried(self) -> int:
        return self.round.carried


@dataclass
class _Residual:
    """A table's ranked rows sent as 1-bit residuals (``BudgetPolicy.residuals``).

    ``rows``: as taken (``served``/``new``: what predictors hold before, ``base``: served,
    zeros for a ``new`` row); ``sent``: float32 ``[n, dim]`` ``current − base``; ``held``:
    float32 what predictors hold once it is delivered, ``base +
    wire.residual_values(sent)`` (the float32 additions they make); ``attempted``: handed
    to the publisher (if that fails, predictors may hold either, so the rows go whole)."""

    rows: TakenRows
    sent: torch.Tensor
    held: torch.Tensor
    attempted: bool = False


@dataclass
class _JobTable:
    fqn: str
    rows: TakenRows  # whole rows (all of them without residuals, or at a final flush)
    tombstones: Optional[torch.Tensor]
    pending_before: int
    # pending right after the take: counted here, since hand-offs merge during the send
    carried: int = 0
    residual: Optional[_Residual] = None

    def __len__(self) -> int:
        return len(self.rows) + (len(self.residual.rows) if self.residual else 0)


@dataclass
class RoundJob:
    """The rows one round takes out of the pending set, and how it went."""

    step: int
    ts: int
    final: bool
    tokens: float
    overdue: int
    exact: int
    t0: float
    tables: list[_JobTable] = field(default_factory=list)
    done: list[TableRound] = field(default_factory=list)
    failed: list[_JobTable] = field(default_factory=list)  # not delivered: back to pending
    delivered: list[_JobTable] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return sum(len(t) for t in self.tables)


@dataclass(frozen=True)
class TableSpec:
    """What a round needs of one tracked table, without the module (picklable: a worker
    process gets these). ``name``: published name; ``dim``: row width; ``dtype``: row dtype
    (None: learnt from the first hand-off); ``publish_kwargs``: column-shard keywords."""

    name: str
    dim: int
    dtype: Optional[torch.dtype]
    publish_kwargs: dict[str, int]


def table_specs(modules: Mapping[str, Any]) -> dict[str, TableSpec]:
    """``{fqn: TableSpec}`` of tracked table modules."""
    out = {}
    for fqn, m in modules.items():
        _, dim, dtype, _ = row_reader(m)
        out[fqn] = TableSpec(table_name(fqn, m), int(dim), dtype, shard_publish_kwargs(m))
    return out


def count_round(n: dict[str, int], rnd: PublishRound, error: Optional[BaseException]
                ) -> None:
    """Add settled round ``rnd`` to an engine's counters ``n`` (a final flush's bytes and
    rows apart from the budgeted ones)."""
    if rnd.final:
        n["final_bytes"] += rnd.bytes
        n["final_rows"] += rnd.published
    else:
        n["rounds"] += int(rnd.published > 0 or rnd.tombstones > 0)
        n["bytes"] += rnd.bytes
        n["rows"] += rnd.published
    n["failed_rounds"] += int(error is not None)
    n["messages"] += rnd.messages
    n["tombstones"] += rnd.tombstones


def wait_delivered(publisher: RowPublisher, results: Iterable[Any]) -> None:
    """Wait until the broker acknowledged every message of ``results`` (what ``publish``
    returned; those without a ``wait`` are done), each up to the publisher's
    ``send_timeout``; raises the first ``PublishError``."""
    timeout = getattr(publisher, "send_timeout", None)
    for res in results:
        wait = getattr(res, "wait", None)
        if callable(wait):
            wait(timeout)


def report_round(on_round: Optional[Callable[[BudgetTick], None]], tick: BudgetTick) -> None:
    """Call the user's ``on_round`` with a settled round's record (its error logged: the
    user's callback must not undo the accounting)."""
    if on_round is not None:
        try:
            on_round(tick)
        except Exception:
            log.exception("publisher: on_round callback failed")


def _quantile(values: list[float], q: float) -> Optional[float]:
    # one of the values, not an interpolation: an unbounded round (+inf, e.g. a new row
    # pending under new_rows="first") next to another reads inf, where a linear
    # interpolation would give inf - inf = NaN
    return float(np.quantile(np.asarray(values, dtype=np.float64), q,
                             method="inverted_cdf")) if values else None


class BudgetEngine:
    """Pending rows, bucket and counters of one budget publisher (see the module docstring).

    Args:
        publisher: where rows go; its ``dtype`` is the wire dtype rows are costed in.
        policy: the budget and the ranking.
        specs: ``{fqn: TableSpec}`` of the tracked tables (:func:`table_specs`).
        on_round: called with every settled round's record (on the thread that ran it).
    """

    def __init__(self, publisher: RowPublisher, policy: BudgetPolicy,
                 specs: Mapping[str, TableSpec],
                 on_round: Optional[Callable[[BudgetTick], None]] = None) -> None:
        self.publisher, self.policy, self.specs = publisher, policy, dict(specs)
        self._on_round = on_round
        self.bucket = TokenBucket(policy.rate, policy.burst)
        self.tables: dict[str, PendingTable] = {}
        self._names = {fqn: spec.name for fqn, spec in self.specs.items()}
        self._overhead: dict[str, float] = {}
        # bytes of one row's id as last sent, per table: 8, fewer with wire v3's varints
        self._id_cost: dict[str, float] = {}
        self._warned_burst = False
        self._exact_since = 0  # exact rows merged since the last round
        # BudgetPolicy.residuals: r1e where the publisher writes a wire version that has it
        version = getattr(publisher, "wire_version", wire.VERSION)
        self.residual_dtype = "r1e" if version >= wire.residual_version("r1e") else "r1"
        self._lock = threading.Lock()  # counters and bounds, read by stats()
        self.last: Optional[BudgetTick] = None
        self.n = dict.fromkeys(("ticks", "rounds", "bytes", "rows", "messages", "tombstones",
                                "overdue_rows", "rejected", "out_of_range", "exact",
                                "final_bytes", "final_rows", "failed_rounds",
                                "coalesced_rows", "charged_bytes"), 0)
        self.select_s = 0.0
        self.send_s = 0.0
        self._bounds: deque = deque(maxlen=policy.window)
        self._table_bounds: dict[str, deque] = {}

    # ------------------------------------------------------------------ 1. merge

    def _table(self, fqn: str, like: torch.Tensor) -> PendingTable:
        t = self.tables.get(fqn)
        if t is None:
            spec = self.specs[fqn]
            t = self.tables[fqn] = PendingTable(
                spec.dim, like.dtype if like.is_floating_point() else
                (spec.dtype or torch.float32),
                new_rows=self.policy.new_rows, read_decay=self.policy.read_decay,
                range_limit=wire.F16_MAX if self._dtype(spec.dim) == "f16" else None)
        return t

    def merge(self, h: Handoff) -> None:
        """Fold hand-off ``h`` into the pending rows, refill the bucket with its units and
        charge it the bytes sent outside the rounds (``h.charged``)."""
        h.wait()
        self.bucket.refill(h.units, h.read_units)
        if h.charged:
            self.bucket.spend(int(h.charged))
            with self._lock:
                self.n["charged_bytes"] += int(h.charged)
        rejected = out_of_range = exact = coalesced = 0
        for th in h.tables:
            # a hash table's rows come in storage order, FIRST rows in the tracker's arena:
            # merged as they are (no sort, no permuted copies)
            new, tombstones = th.live()
            t = self._table(th.fqn, th.current)
            c = t.merge(th.ids, th.first, th.current, new, tombstones, h.tick, th.first_at)
            th.rows_read()
            rejected += c.rejected
            out_of_range += c.out_of_range
            exact += c.exact
            coalesced += c.coalesced
        if rejected:
            log.warning("budget publisher: %d changed rows are not publishable (%d NaN/Inf, "
                        "%d beyond the %s range); they are rejected (not published, counted)",
                        rejected, rejected - out_of_range, out_of_range, self.publisher.dtype)
        with self._lock:
            self.n["rejected"] += rejected
            self.n["out_of_range"] += out_of_range
            self.n["exact"] += exact
            self.n["coalesced_rows"] += coalesced
        self._exact_since += exact

    # ------------------------------------------------------------------ 2. choose

    def _scale(self, t: PendingTable) -> float:
        """What a table's errors are divided by to compare across tables (1: none)."""
        return t.scale.value if self.policy.scale == "table" and t.scale.value else 1.0

    def _candidates(self) -> tuple[list[str], list[Candidate]]:
        pol = self.policy
        fqns, cands = [], []
        for fqn, t in self.tables.items():
            fqns.append(fqn)
            cands.append(Candidate(table=t, scale=self._scale(t),
                                   weight=float(pol.weights.get(self._names[fqn], 1.0)),
                                   row_cost=self._row_cost(fqn, t.dim, self._residual(fqn)),
                                   overhead=self._overhead.get(fqn, _OVERHEAD_GUESS)))
        return fqns, cands

    def _dtype(self, dim: int) -> str:
        """Wire dtype of a table's rows: the policy's ``wide_dtype`` where a row costs fewer
        bytes in it, else the publisher's."""
        base, wide = self.publisher.dtype, self.policy.wide_dtype
        return wide if wide and wire.row_bytes(dim, wide) < wire.row_bytes(dim, base) else base

    def _residual(self, fqn: str) -> bool:
        """Whether table ``fqn``'s ranked rows go as residuals: ``policy.residuals``, a
        float32 table (its pending ``served`` rows hold what predictors hold exactly) and
        a residual cheaper than its whole row."""
        t = self.tables[fqn]
        return self.policy.residuals and t.dtype == torch.float32 and \
            wire.value_bytes(t.dim, self.residual_dtype) < wire.value_bytes(t.dim,
                                                                             self._dtype(t.dim))

    def _row_cost(self, fqn: str, dim: int, residual: bool = False) -> float:
        """Wire bytes of one row of table ``fqn`` (a whole row, or its ``residual``): its
        values (and scale) plus its id's bytes per row in the table's last round (8 until
        one is sent)."""
        dtype = self.residual_dtype if residual else self._dtype(dim)
        return wire.value_bytes(dim, dtype) + self._id_cost.get(fqn, 8.0)

    def start(self, tick: int, step: int, ts: int, final: bool) -> RoundJob:
        """Choose the round's rows and take them out of the pending set."""
        t0 = time.monotonic()
        tokens = self.bucket.tokens
        fqns, cands = self._candidates()
        exact, self._exact_since = self._exact_since, 0
        if final:
            slots = {i: c.table.live_slots() for i, c in enumerate(cands)}
            overdue = 0
        else:
            pol = self.policy
            ch = choose(cands, tokens, tick=tick, max_age=pol.max_age,
                        overdue_share=pol.overdue_share, min_error=pol.min_error,
                        per_byte=pol.per_byte, burst=self.bucket.burst)
            slots, overdue = ch.slots, ch.overdue
            if ch.starved and not self._warned_burst:
                self._warned_burst = True
                log.warning("budget publisher: a full bucket (burst_bytes=%g) pays for no "
                            "pending row (largest row %d bytes + ~%d bytes message "
                            "overhead); raise burst_bytes", self.bucket.burst,
                            max(c.row_cost for c in cands), int(max(c.overhead
                                                                    for c in cands)))
        job = RoundJob(step=step, ts=ts, final=final, tokens=tokens, overdue=overdue,
                       exact=exact, t0=t0)
        none = np.empty(0, dtype=np.int64)
        for i, (fqn, c) in enumerate(zip(fqns, cands, strict=True)):
            before = len(c.table)
            s = slots.get(i, none)
            rows, residual = c.table.take(s), None
            if self._residual(fqn) and not final:
                residual, rows = self._take_residual(rows)
            tombs = c.table.take_tombstones()
            if len(rows) or residual is not None or tombs is not None or before:
                # rows sent as residuals come back pending with what they leave
                carried = len(c.table) + (len(residual.rows) if residual else 0)
                job.tables.append(_JobTable(fqn, rows, tombs, before, carried, residual))
        self.select_s += time.monotonic() - t0
        return job

    def _take_residual(self, rows: TakenRows) -> tuple[Optional[_Residual], TakenRows]:
        """Split taken rows into residuals and whole rows: a row goes whole at its
        ``policy.whole_every``-th send, or when the wire cannot carry its residual (``r1``:
        a mean magnitude past f16)."""
        base = torch.where(rows.new[:, None], 0.0, rows.served.float())
        sent = rows.current.float() - base
        # the scale as the encoder takes it, so both draw the line alike
        ok = torch.from_numpy(wire.residual_fits(sent.numpy(), self.residual_dtype)) \
            & (rows.sends < self.policy.whole_every - 1)
        whole = rows.pick(~ok)
        if len(whole):
            rows, base, sent = rows.pick(ok), base[ok], sent[ok]
        if not len(rows):
            return None, whole
        held = base + torch.from_numpy(wire.residual_values(sent.numpy(), self.residual_dtype))
        return _Residual(rows, sent, held), whole

    # ------------------------------------------------------------------ 3. send

    def send(self, job: RoundJob) -> None:
        """Publish the job's rows and wait for their acknowledgement. Raises the first
        failure after recording every table not delivered in ``job.failed``."""
        pending_results: list[tuple[_JobTable, list[Any]]] = []
        error: Optional[BaseException] = None
        t0 = time.monotonic()
        for k, jt in enumerate(job.tables):
            results: list[Any] = []
            try:
                self._publish(job, jt, results)
            except BaseException as e:
                error = e
                job.failed.extend(job.tables[k:])
                break
            pending_results.append((jt, results))
        for jt, results in pending_results:
            try:
                wait_delivered(self.publisher, results)
            except BaseException as e:
                error = error or e
                job.failed.append(jt)
                continue
            job.done.append(self._record(jt, results))
            job.delivered.append(jt)
        self.send_s += time.monotonic() - t0
        if error is not None:
            raise error

    def _publish(self, job: RoundJob, jt: _JobTable, results: list[Any]) -> None:
        """Hand one table's messages to the publisher, appending their results: whole rows
        (with the tombstones), then residuals (``fresh``: rows predictors start from zeros)
        — in this order, so a re-inserted id's tombstone never follows its residual."""
        spec, name = self.specs[jt.fqn], self._names[jt.fqn]
        tombs, r = jt.tombstones, jt.residual
        if len(jt.rows) or (tombs is not None and r is None):
            kwargs = dict(spec.publish_kwargs)
            dtype = self._dtype(spec.dim)
            if dtype != self.publisher.dtype:  # a publisher that takes one dtype is asked none
                kwargs["dtype"] = dtype
            results.append(self.publisher.publish(name, jt.rows.ids, jt.rows.current,
                                                  step=job.step, ts=job.ts, tombstones=tombs,
                                                  **kwargs))
            tombs = None
        if r is not None:
            r.attempted = True
            results.append(self.publisher.publish(
                name, r.rows.ids, r.sent, step=job.step, ts=job.ts, tombstones=tombs,
                dtype=self.residual_dtype,
                fresh=r.rows.new.numpy() if bool(r.rows.new.any()) else None,
                **spec.publish_kwargs))

    def _record(self, jt: _JobTable, results: list[Any]) -> TableRound:
        n, dim = len(jt), self.specs[jt.fqn].dim
        total = {k: sum(int(getattr(res, k)) for res in results)
                 for k in ("rows", "tombstones", "messages", "bytes")}
        ids = jt.rows.ids if jt.residual is None else \
            torch.sort(torch.cat([jt.rows.ids, jt.residual.rows.ids])).values
        if total["messages"] and n:
            version = getattr(self.publisher, "wire_version", wire.VERSION)
            self._id_cost[jt.fqn] = wire.id_bytes(ids.cpu().numpy(), version) / n
            values = len(jt.rows) * self._row_cost(jt.fqn, dim) + (
                len(jt.residual.rows) * self._row_cost(jt.fqn, dim, True) if jt.residual else 0)
            # a message's header and id bytes; its tombstones are not a row's to pay
            rest = total["bytes"] - values - wire.TOMBSTONE_BYTES * total["tombstones"]
            self._overhead[jt.fqn] = max(0.0, rest / total["messages"])
        return TableRound(
            fqn=jt.fqn, table=self._names[jt.fqn], tracked=jt.pending_before,
            published=total["rows"], tombstones=total["tombstones"], carried=jt.carried,
            rejected=0, messages=total["messages"], bytes=total["bytes"], ids=ids,
            result=results[-1] if results else None)

    # ------------------------------------------------------------------ 4. settle

    def settle(self, job: RoundJob, error: Optional[BaseException]) -> BudgetTick:
        """Account the delivered part of ``job``; put the rest back in the pending set."""
        rows = 0
        for jt in job.failed:
            t = self.tables[jt.fqn]
            t.put_back(jt.rows, jt.tombstones)
            rows += len(jt)
            r = jt.residual
            if r is not None:  # predictors may or may not hold it: the rows go whole, soon
                t.put_back(replace(r.rows, birth=torch.full_like(r.rows.birth, _OVERDUE_BIRTH),
                                   sends=torch.full_like(r.rows.sends, self.policy.whole_every))
                           if r.attempted else r.rows, None)
        for jt in job.delivered:
            if jt.residual is not None:
                self._residual_sent(jt)
        if error is not None:
            text = (f"budget publisher: {rows} rows not delivered are pending again "
                    f"(tables {[self._names[jt.fqn] for jt in job.failed]})")
            log.warning("%s (after %s: %s)", text, type(error).__name__, error)
            if hasattr(error, "add_note"):
                error.add_note(text)
        rnd = PublishRound(step=job.step, ts=job.ts, final=job.final,
                           seconds=time.monotonic() - job.t0, tables=tuple(job.done))
        # tombstones go whatever the budget (a predictor must not serve an evicted row) and
        # are not charged: charged, ids evicted faster than the budget refills kept the
        # bucket in a debt no refill paid back, and no row went out again
        self.bucket.spend(rnd.bytes - wire.TOMBSTONE_BYTES * rnd.tombstones)
        bound, table_bounds = 0.0, {}
        for fqn, t in self.tables.items():
            e = t.max_error()
            name = self._names[fqn]
            table_bounds[name] = max(table_bounds.get(name, 0.0), e)
            bound = max(bound, e / self._scale(t))
        tick = BudgetTick(round=rnd, tokens=job.tokens, bound=bound,
                          table_bounds=table_bounds, overdue=job.overdue, exact=job.exact)
        with self._lock:
            count_round(self.n, rnd, error)
            if not job.final:
                self.n["overdue_rows"] += job.overdue
                self._bounds.append(bound)
                for name, v in table_bounds.items():
                    self._table_bounds.setdefault(
                        name, deque(maxlen=self.policy.window)).append(v)
            self.last = tick
        report_round(self._on_round, tick)
        return tick

    def _residual_sent(self, jt: _JobTable) -> None:
        """Delivered residuals: what they left stays pending against what predictors hold
        now (its send counted; never overdue until the row changes again), unless it is
        within the error a whole row in the table's dtype would leave (as exact as one)."""
        r, t = jt.residual, self.tables[jt.fqn]
        left = torch.linalg.vector_norm(r.rows.current.double() - r.held.double(), dim=1)
        tol = wire.error_bound(r.rows.current.float().numpy(), self._dtype(t.dim))
        keep = left > torch.from_numpy(tol)
        rows = r.rows.pick(keep)
        t.put_back(replace(rows, served=r.held[keep].to(t.dtype),
                           new=torch.zeros_like(rows.new),
                           birth=torch.full_like(rows.birth, SENT_BIRTH), sends=rows.sends + 1),
                   None)

    # ------------------------------------------------------------------ reading

    @property
    def tokens(self) -> float:
        """Bytes the next round could spend before its refill (negative: a small debt)."""
        return self.bucket.tokens

    def pending_rows(self) -> int:
        """Rows waiting to be published."""
        return sum(len(t) for t in self.tables.values())

    def stats(self) -> dict:
        """Counters, pending rows and memory, the bound quantiles (plain values)."""
        with self._lock:
            b = list(self._bounds)
            return {
                **self.n, "tokens": self.bucket.tokens, "select_s": self.select_s,
                "send_s": self.send_s, "pending": self.pending_rows(),
                "pending_bytes": sum(t.memory_bytes() for t in self.tables.values()),
                "bound": {"last": b[-1] if b else None, "p50": _quantile(b, 0.5),
                          "p99": _quantile(b, 0.99), "max": max(b) if b else None,
                          "ticks": len(b)},
                # wire bytes a row of each table is costed at (values + learnt id bytes)
                "row_bytes": {self._names[fqn]: self._row_cost(fqn, t.dim)
                              for fqn, t in self.tables.items()},
                "table_bounds": {name: {"last": v[-1], "p50": _quantile(list(v), 0.5),
                                        "p99": _quantile(list(v), 0.99), "max": max(v)}
                                 for name, v in sorted(self._table_bounds.items()) if v},
            }
