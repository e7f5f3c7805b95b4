"""Byte-budgeted continuous publishing: the most freshness per byte.

Instead of ``k`` / ``fraction`` / ``threshold`` per round, the user gives a **bandwidth
budget** — bytes per second per trainer, or bytes per step — and calls
:meth:`BudgetPublisher.tick` from the training loop after every step. Each tick:

1. the token bucket (:class:`~deltastream.publishing.token_bucket.TokenBucket`) gains
   ``rate × elapsed`` bytes (seconds by the publisher's clock, or steps), up to
   ``burst_bytes``: bursts are bounded, idle time does not pile up;
2. the tracker's delta of every table is read (``get_delta(consumer)``: rows changed since
   the last tick plus the rows carried) and each row's **serving error** is computed:
   ``‖current − served‖`` with ``served`` = FIRST, or zeros for a row predictors never
   received (:mod:`~deltastream.publishing.serving_error`);
3. errors are made comparable across tables (``scale="table"``: divided by the table's RMS
   row norm, so neither width nor value scale matters) and weighted per table by name
   (``weights``); the rows of **all tables** are merged and taken by decreasing score per
   wire byte (``per_byte``, the default: the most error removed per byte) until the tick's
   tokens are spent (each row costs its wire bytes, each table's message its overhead);
   the rest is handed back with ``tracker.retain`` (it keeps its FIRST state, so
   its error keeps accumulating against what predictors hold); rows whose error is exactly
   zero (predictors already hold the current value) are dropped, not carried;
4. the chosen rows are published per table; the bucket is charged the bytes actually sent
   (an estimate short by a message header leaves a small debt, repaid next tick).

**The error bound.** After a tick every row predictors serve is exact (wire rounding
aside) except the rows left pending, so the largest error among them *is* the current
serving-error bound. It is reported per tick (``BudgetTick.bound``, normalized;
``table_bounds``, embedding units) and as p50 / p99 / max over the last ``window`` ticks in
:meth:`BudgetPublisher.stats`.

**No table starves.** With ``scale="table"`` a row's score does not depend on its table's
width or value scale, so an absolute L2 no longer shuts out a dim-1 bias table next to a
dim-64 one; ``per_byte`` then favours the cheap rows, so the risk is now the wide table.
Neither starves: a pending row whose normalized error is at least ``min_error`` and that was
carried ``max_age`` ticks is *overdue*; overdue rows go first, oldest first, taking up to
``overdue_share`` of each tick's tokens and always at least the oldest one — while the
oldest overdue row does not fit in the tokens, nothing else is sent and the tokens
accumulate for it. Hence, with ``R`` the bytes the bucket gains per tick, ``c`` the cost of
the largest row plus one message overhead (``burst_bytes >= c``) and ``q`` overdue rows
older than it, **a row is published at most** ``max_age + (q + 1) · (⌈c / R⌉ + 1)`` **ticks
after it was first carried** (the ``+ 1`` covers the small debt a tick may leave); when
``R >= c`` and the rows turning overdue per tick fit in ``overdue_share · R``, ``q = 0`` and
the bound is ``max_age + 2`` ticks (tested with a dim-1 bias table next to a dim-64 table,
each ranking).

**Threads.** Not thread-safe, and meant not to be: the tracker and the tables are updated
by the training loop, so call :meth:`~BudgetPublisher.tick` from that loop (after the
optimizer step and ``tracker.step()``); the internal clock decides how many bytes the tick
may spend, and ``min_interval_s`` skips ticks that come too soon (they only refill). A
background thread would read rows the optimizer is writing.

A final :meth:`~BudgetPublisher.flush` on stop publishes every pending row whatever the
budget (its bytes are counted apart: ``final_bytes``).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from deltastream import wire
from deltastream.publishing.budget_policy import SCALES, BudgetPolicy
from deltastream.publishing.rounds import (
    PublishRound,
    RowPublisher,
    TableRound,
    shard_publish_kwargs,
    table_name,
)
from deltastream.publishing.serving_error import RowErrors, TableScale, serving_errors
from deltastream.publishing.table_rows import read_rows, row_reader
from deltastream.publishing.token_bucket import TokenBucket
from deltastream.types import DeltaRows

if TYPE_CHECKING:
    from deltastream.tracking.tracker import DeltaTracker

__all__ = ["BudgetPolicy", "BudgetPublisher", "BudgetTick", "SCALES"]

log = logging.getLogger(__name__)

#: first guess of a message's bytes beyond its rows (keys, names, counters, CRC); learnt
#: per table from what the publisher reports after the first message.
_OVERHEAD_GUESS = 256


@dataclass(frozen=True)
class BudgetTick:
    """What one :meth:`BudgetPublisher.tick` (or ``flush``) did.

    Attributes:
        round: the per-table publish records (:class:`~deltastream.publishing.rounds.PublishRound`).
        tokens: bytes the tick could spend (after the refill, before sending).
        bound: largest normalized serving error among the rows left pending (0 if none):
            every other served row is exact, up to wire rounding.
        table_bounds: ``{table name: largest error left pending}`` in embedding units.
        overdue: rows published from the overdue tier.
        exact: candidates dropped because predictors already hold their current value.
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
class _Table:
    """One table's candidates in a round."""

    fqn: str
    name: str
    module: Any
    delta: DeltaRows
    errs: Optional[RowErrors]
    norm_error: Optional[torch.Tensor]  # float64 [n], error / scale
    dim: int
    row_cost: int


def _subset(delta: DeltaRows, pos: torch.Tensor) -> DeltaRows:
    """Rows of ``delta`` at ascending positions ``pos`` (every column, no tombstones)."""
    def pick(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if x is None else x.index_select(0, pos.to(x.device))

    return DeltaRows(ids=pick(delta.ids), states=pick(delta.states), new=pick(delta.new),
                     age=pick(delta.age))


def _quantile(values: list[float], q: float) -> Optional[float]:
    return float(np.quantile(np.asarray(values, dtype=np.float64), q)) if values else None


class BudgetPublisher:
    """Publish a tracker consumer's changes continuously within a byte budget.

    Args:
        tracker: a :class:`~deltastream.DeltaTracker` in EMBEDDING mode with ``consumer``.
        publisher: a :class:`~deltastream.DeltaPublisher` (any :class:`RowPublisher`); its
            ``dtype`` is the wire dtype the rows are costed in.
        consumer: the tracker consumer this publisher reads.
        policy: the budget and ranking (:class:`BudgetPolicy`).
        tables: ``{fqn: module}`` where rows are read; default
            ``tracker.get_tracked_modules()``.
        clock: seconds, monotonic (for ``bytes_per_s`` and ``min_interval_s``).
        start_step: the step before the first tick (per-step budgets refill
            ``step − start_step`` at the first tick).

    See the module docstring for what a tick does and the bounds it keeps.
    """

    def __init__(self, tracker: DeltaTracker, publisher: RowPublisher, consumer: str,
                 policy: BudgetPolicy, *, tables: Optional[Mapping[str, Any]] = None,
                 clock: Callable[[], float] = time.monotonic, start_step: int = 0) -> None:
        if not isinstance(policy, BudgetPolicy):
            raise TypeError(f"policy must be a BudgetPolicy, got {type(policy).__name__}")
        self.tracker, self.publisher, self.consumer, self.policy = \
            tracker, publisher, consumer, policy
        self._modules = dict(tracker.get_tracked_modules() if tables is None else tables)
        self._clock = clock
        self._bucket = TokenBucket(policy.rate, policy.burst)
        self._scales: dict[str, TableScale] = {}
        self._overhead: dict[str, float] = {}
        self._t0 = clock()
        self._last_t = self._t0
        self._last_step = int(start_step)
        self._first_step: Optional[int] = None
        self._last_round_t: Optional[float] = None
        self._bounds: deque = deque(maxlen=policy.window)
        self._table_bounds: dict[str, deque] = {}
        self._last: Optional[BudgetTick] = None
        self._warned_burst = False
        self._n = dict.fromkeys(("ticks", "rounds", "bytes", "rows", "messages", "tombstones",
                                 "overdue_rows", "rejected", "exact", "final_bytes",
                                 "final_rows"), 0)
        self._select_s = 0.0

    # ------------------------------------------------------------------ public

    def tick(self, step: int, *, ts: Optional[int] = None) -> Optional[BudgetTick]:
        """Refill the budget and, unless the last round was under ``min_interval_s`` ago,
        publish the rows with the largest serving error it pays for.

        Returns the tick's record, or ``None`` for a tick that only refilled. Raises what
        the publisher raises (``PublishError``) after handing every unsent row back to the
        tracker.
        """
        now = self._clock()
        units = max(0, int(step) - self._last_step) if self.policy.per_step \
            else max(0.0, now - self._last_t)
        self._last_t, self._last_step = now, max(self._last_step, int(step))
        self._bucket.refill(units)
        self._n["ticks"] += 1
        if self._first_step is None:
            self._first_step = int(step)
        if self._last_round_t is not None and self.policy.min_interval_s > 0 \
                and now - self._last_round_t < self.policy.min_interval_s:
            return None
        self._last_round_t = now
        return self._round(int(step), ts, final=False)

    def flush(self, step: int, *, ts: Optional[int] = None) -> BudgetTick:
        """Publish every pending row whatever the budget (the final flush on stop)."""
        return self._round(int(step), ts, final=True)

    @property
    def tokens(self) -> float:
        """Bytes the next tick could spend before its refill (negative: a small debt)."""
        return self._bucket.tokens

    @property
    def last(self) -> Optional[BudgetTick]:
        """The last tick's record."""
        return self._last

    def stats(self) -> dict:
        """Counters, rates and the serving-error bound (plain values).

        ``bound`` / ``table_bounds``: p50 / p99 / max / last over the last ``window`` ticks
        (normalized, and in embedding units per table). ``bytes_per_s`` / ``bytes_per_step``:
        budgeted bytes (the final flush apart) over the time and steps since the first tick.
        """
        n = dict(self._n)
        secs = max(1e-9, self._last_t - self._t0)
        steps = (self._last_step - self._first_step + 1) if self._first_step is not None else 0
        b = list(self._bounds)
        return {
            **n, "policy": self.policy.describe(), "tokens": self._bucket.tokens,
            "seconds": secs, "steps": steps, "bytes_per_s": n["bytes"] / secs,
            "bytes_per_step": n["bytes"] / steps if steps else None,
            "pending": self._last.carried if self._last is not None else 0,
            "select_s": self._select_s,
            "bound": {"last": b[-1] if b else None, "p50": _quantile(b, 0.5),
                      "p99": _quantile(b, 0.99), "max": max(b) if b else None,
                      "ticks": len(b)},
            "table_bounds": {name: {"last": v[-1], "p50": _quantile(list(v), 0.5),
                                    "p99": _quantile(list(v), 0.99), "max": max(v)}
                             for name, v in sorted(self._table_bounds.items()) if v},
        }

    # ------------------------------------------------------------------ one round

    def _round(self, step: int, ts: Optional[int], *, final: bool) -> BudgetTick:
        t0 = time.monotonic()
        ts = time.time_ns() if ts is None else ts
        delta = self.tracker.get_delta(self.consumer)
        try:
            tables = self._score(delta)
        except BaseException:
            for fqn, d in delta.items():  # nothing was retained or sent: all goes back
                if len(d):
                    self.tracker.retain(self.consumer, fqn, _subset(d, torch.arange(len(d))))
            raise
        tokens = self._bucket.tokens
        chosen, overdue = self._choose(tables, tokens, final)
        self._select_s += time.monotonic() - t0
        # leftovers back to the tracker first: from here on only the chosen rows are at stake
        pending, exact, rejected = [], 0, 0
        bound, table_bounds = 0.0, {}
        for t, sel in zip(tables, chosen, strict=True):
            if t.errs is None:
                pending.append(None)
                continue
            e = t.errs
            live = e.finite & (e.error > 0)
            left = live & ~sel.to(live.device)  # the masks are on the CPU, rows may not be
            exact += int((e.finite & (e.error == 0)).sum())
            rejected += int((~e.finite).sum())
            if bool(left.any()):
                pos = left.nonzero().squeeze(1)
                self.tracker.retain(self.consumer, t.fqn, _subset(t.delta, pos))
                bound = max(bound, float(t.norm_error[pos].max()))
                table_bounds[t.name] = max(table_bounds.get(t.name, 0.0),
                                           float(e.error[pos].max()))
            else:
                table_bounds.setdefault(t.name, 0.0)
            pending.append(int(left.sum()))
        if rejected:
            log.warning("budget publisher: %d candidate rows have NaN/Inf current values; "
                        "they are rejected (not published, not retained)", rejected)
        done = self._publish(tables, chosen, pending, step, ts)
        rnd = PublishRound(step=step, ts=ts, final=final, seconds=time.monotonic() - t0,
                           tables=tuple(done))
        sent = rnd.bytes
        self._bucket.spend(sent)
        tick = BudgetTick(round=rnd, tokens=tokens, bound=bound, table_bounds=table_bounds,
                          overdue=overdue, exact=exact)
        self._account(tick, rejected)
        return tick

    def _score(self, delta: Mapping[str, DeltaRows]) -> list[_Table]:
        """Serving errors of every table with candidates, normalized and weighted."""
        out = []
        dtype = self.publisher.dtype
        for fqn, d in delta.items():
            n_tomb = 0 if d.tombstones is None else int(d.tombstones.numel())
            if len(d) == 0 and n_tomb == 0:
                continue
            if fqn not in self._modules:
                raise KeyError(f"table {fqn!r} of the delta is not in tables "
                               f"{sorted(self._modules)}")
            module = self._modules[fqn]
            name = table_name(fqn, module)
            errs = norm = None
            dim = row_reader(module)[1]
            if len(d):
                errs = serving_errors(d, module, new_rows=self.policy.new_rows)
                norm = errs.error
                if self.policy.scale == "table":
                    scale = self._scales.setdefault(fqn, TableScale())
                    scale.update(errs.norm)
                    norm = scale.normalize(errs.error)
            out.append(_Table(fqn=fqn, name=name, module=module, delta=d, errs=errs,
                              norm_error=norm, dim=dim, row_cost=wire.row_bytes(dim, dtype)))
        return out

    def _choose(self, tables: list[_Table], tokens: float,
                final: bool) -> tuple[list[torch.Tensor], int]:
        """Per table a bool mask of the rows to publish; and how many were overdue."""
        masks = [torch.zeros(len(t.delta), dtype=torch.bool) for t in tables]
        if final:
            for t, m in zip(tables, masks, strict=True):
                if t.errs is not None:
                    m |= (t.errs.finite & (t.errs.error > 0)).cpu()
            return masks, 0
        pol = self.policy
        parts = [(i, t) for i, t in enumerate(tables) if t.errs is not None and len(t.delta)]
        if not parts:
            return masks, 0
        cat = lambda xs: torch.cat([x.detach().cpu() for x in xs])  # noqa: E731
        norm = cat([t.norm_error for _, t in parts]).to(torch.float64)
        weight = cat([torch.full((len(t.delta),), float(pol.weights.get(t.name, 1.0)),
                                 dtype=torch.float64) for _, t in parts])
        key = norm * weight
        finite = cat([t.errs.finite for _, t in parts])
        err = cat([t.errs.error for _, t in parts])
        age = cat([t.delta.age if t.delta.age is not None
                   else torch.zeros(len(t.delta), dtype=torch.int64) for _, t in parts])
        tidx = cat([torch.full((len(t.delta),), j, dtype=torch.int64)
                    for j, (_, t) in enumerate(parts)])
        cost = cat([torch.full((len(t.delta),), t.row_cost, dtype=torch.int64)
                    for _, t in parts]).to(torch.float64)
        overhead = torch.tensor([self._overhead.get(t.fqn, _OVERHEAD_GUESS) for _, t in parts],
                                dtype=torch.float64)
        if pol.per_byte:
            key = key / cost
        # a key of NaN (0 x inf weight) on a finite row: it moved, it must go
        key = torch.where(torch.isnan(key) & finite, math.inf, key)
        eligible = finite & (err > 0) & (norm >= pol.min_error)
        pick = torch.zeros(key.numel(), dtype=torch.bool)
        paid = torch.zeros(len(parts), dtype=torch.bool)
        spent, n_overdue = 0.0, 0
        blocked = False
        if pol.max_age is not None:
            od = eligible & (age >= pol.max_age)
            if bool(od.any()):
                pos = od.nonzero().squeeze(1)
                # oldest first, then by key: two stable sorts
                pos = pos[torch.sort(key[pos], descending=True, stable=True).indices]
                pos = pos[torch.sort(age[pos], descending=True, stable=True).indices]
                head = float(cost[pos[0]] + overhead[tidx[pos[0]]])
                cap = min(tokens, max(pol.overdue_share * tokens, head))
                got, spent = self._prefix(pos, cost, tidx, overhead, paid, cap)
                pick[got] = True
                n_overdue = int(got.numel())
                # the oldest overdue row does not fit: save the tokens for it (unless it
                # never can: a full bucket is smaller than it, warned about below)
                blocked = n_overdue == 0 and head <= self._bucket.burst
        if not blocked:
            rest = (eligible & ~pick).nonzero().squeeze(1)
            if rest.numel():
                rest = rest[torch.sort(key[rest], descending=True, stable=True).indices]
                got, more = self._prefix(rest, cost, tidx, overhead, paid, tokens - spent)
                pick[got] = True
                spent += more
        if not bool(pick.any()) and bool(eligible.any()) \
                and tokens >= self._bucket.burst - 1e-9 and not self._warned_burst:
            self._warned_burst = True
            log.warning("budget publisher: a full bucket (burst_bytes=%g) pays for no pending "
                        "row (largest row %d bytes + ~%d bytes message overhead); raise "
                        "burst_bytes", self._bucket.burst, int(cost.max()),
                        int(overhead.max()))
        start = 0
        for i, t in parts:
            n = len(t.delta)
            masks[i] = pick[start:start + n]
            start += n
        return masks, n_overdue

    @staticmethod
    def _prefix(order: torch.Tensor, cost: torch.Tensor, tidx: torch.Tensor,
                overhead: torch.Tensor, paid: torch.Tensor,
                cap: float) -> tuple[torch.Tensor, float]:
        """The longest prefix of ``order`` whose bytes (rows, plus one message overhead per
        table not ``paid`` yet) fit in ``cap``; marks its tables paid. Returns (positions,
        bytes)."""
        if cap <= 0 or order.numel() == 0:
            return order[:0], 0.0
        c = cost[order].clone()
        t = tidx[order]
        for j in torch.unique(t).tolist():
            if not bool(paid[j]):
                first = int((t == j).nonzero()[0])
                c[first] += overhead[j]
        cum = torch.cumsum(c, 0)
        n = int(torch.searchsorted(cum, torch.tensor([cap], dtype=cum.dtype), right=True))
        got = order[:n]
        if n:
            paid[torch.unique(t[:n])] = True
        return got, float(cum[n - 1]) if n else 0.0

    def _publish(self, tables: list[_Table], chosen: list[torch.Tensor],
                 pending: list[Optional[int]], step: int, ts: int) -> list[TableRound]:
        """Publish each table's chosen rows and tombstones; on failure hand the rows not
        yet sent back to the tracker before the error propagates."""
        done: list[TableRound] = []
        for k, (t, sel) in enumerate(zip(tables, chosen, strict=True)):
            n_tomb = 0 if t.delta.tombstones is None else int(t.delta.tombstones.numel())
            pos = sel.nonzero().squeeze(1).to(t.delta.ids.device)
            res = None
            try:
                if pos.numel() or n_tomb:
                    ids = t.delta.ids.index_select(0, pos)
                    # read now, right after scoring, in the same thread: the values scored
                    read, _, dtype, _ = row_reader(t.module)
                    rows = read_rows(read, ids, t.dim, dtype or t.delta.states.dtype,
                                     ids.device) if t.errs is not None \
                        else torch.empty(0, t.dim)
                    res = self.publisher.publish(t.name, ids, rows, step=step, ts=ts,
                                                 tombstones=t.delta.tombstones if n_tomb
                                                 else None, **shard_publish_kwargs(t.module))
            except BaseException as e:
                self._hand_back(tables[k:], chosen[k:], e)
                raise
            if res is not None and int(res.messages) and pos.numel():
                per_msg = (int(res.bytes) - int(pos.numel()) * t.row_cost) / int(res.messages)
                self._overhead[t.fqn] = max(0.0, per_msg)
            done.append(TableRound(
                fqn=t.fqn, table=t.name, tracked=len(t.delta),
                published=0 if res is None else int(res.rows),
                tombstones=0 if res is None else int(res.tombstones),
                carried=pending[k] or 0,
                rejected=0 if t.errs is None else int((~t.errs.finite).sum()),
                messages=0 if res is None else int(res.messages),
                bytes=0 if res is None else int(res.bytes),
                ids=t.delta.ids.index_select(0, pos), result=res))
        return done

    def _hand_back(self, tables: list[_Table], chosen: list[torch.Tensor],
                   error: BaseException) -> None:
        rows, lost = 0, []
        for t, sel in zip(tables, chosen, strict=True):
            if t.delta.tombstones is not None and t.delta.tombstones.numel():
                lost.append(t.name)
            pos = sel.nonzero().squeeze(1)
            if pos.numel():
                self.tracker.retain(self.consumer, t.fqn, _subset(t.delta, pos))
                rows += int(pos.numel())
        log.warning("budget publisher: publishing failed (%s); %d unsent rows handed back to "
                    "the tracker", type(error).__name__, rows)
        if lost and hasattr(error, "add_note"):
            error.add_note(f"tombstones of tables {lost} were not published")

    def _account(self, tick: BudgetTick, rejected: int) -> None:
        rnd = tick.round
        n = self._n
        n["rejected"] += rejected
        n["exact"] += tick.exact
        if rnd.final:
            n["final_bytes"] += rnd.bytes
            n["final_rows"] += rnd.published
        else:
            n["rounds"] += int(rnd.published > 0 or rnd.tombstones > 0)
            n["bytes"] += rnd.bytes
            n["rows"] += rnd.published
            n["overdue_rows"] += tick.overdue
            self._bounds.append(tick.bound)
            for name, v in tick.table_bounds.items():
                self._table_bounds.setdefault(name, deque(maxlen=self.policy.window)).append(v)
        n["messages"] += rnd.messages
        n["tombstones"] += rnd.tombstones
        self._last = tick
