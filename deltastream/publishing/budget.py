"""Byte-budgeted continuous publishing: the most freshness per byte.

Instead of ``k`` / ``fraction`` / ``threshold`` per round, the user gives a **bandwidth
budget** — bytes per second per trainer, or bytes per step — and calls
:meth:`BudgetPublisher.tick` from the training loop after every step. Each tick:

1. the token bucket (:class:`~deltastream.publishing.token_bucket.TokenBucket`) gains
   ``rate × elapsed`` bytes (seconds by the publisher's clock, or steps), up to
   ``burst_bytes``: bursts are bounded, idle time does not pile up;
2. the tracker's delta of every table is read (``get_delta(consumer)``: the rows changed
   since the last tick) with a copy of those rows' current values, and merged into the
   publisher's **pending set** (:mod:`~deltastream.publishing.pending`): each pending row
   keeps its **serving error** ``‖current − served‖`` with ``served`` = the value
   predictors hold (FIRST when the row started pending, or zeros for a row predictors
   never received), updated only for rows that changed — a tick's cost follows the rows
   changed, not the rows pending;
3. errors are made comparable across tables (``scale="table"``: divided by the table's RMS
   row norm, so neither width nor value scale matters) and weighted per table by name
   (``weights``); with ``read_decay`` each row's error is also weighted by how often it is
   read (√ of a decayed count of the hand-offs that changed it,
   :mod:`~deltastream.publishing.read_weights`); the rows of **all tables** are merged and
   taken by decreasing score per
   wire byte (``per_byte``, the default: the most error removed per byte) until the tick's
   tokens are spent (each row costs its wire bytes, each table's message its overhead),
   reading only the heads of orders kept up to date by the merges
   (:mod:`~deltastream.publishing.budget_plan`); the rest stays pending (its served value
   unchanged, so its error keeps accumulating against what predictors hold); rows whose
   error is exactly zero (predictors already hold the current value) are dropped;
4. the chosen rows are published per table and acknowledged by the broker; the bucket is
   charged the bytes actually sent (an estimate short by a message header leaves a small
   debt, repaid next tick). Rows whose delivery fails are pending again.

With ``BudgetPolicy.charge_dense`` the budget is shared with the dense versions of
``dense=``: the bytes of the versions sent since the last hand-off are charged to the bucket
when the next hand-off is merged (a debt the rows repay), so rows and dense weights
together stay within the budget; the versions keep their own cadence.

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

**Threads.** Call :meth:`~BudgetPublisher.tick` from the training loop, after the optimizer
step and ``tracker.step()``. By default (``threaded=True``) the training thread's part of a
tick is only the hand-off (:mod:`~deltastream.publishing.handoff`): the changed rows' ids,
FIRST states and a **copy** of their current values, taken at the step boundary, so the
worker never reads a row the optimizer is writing (on CUDA an asynchronous copy to pinned
memory on a side stream, with no synchronization of the training stream). On the CPU a
table the tracker's C code keeps **owes** its current rows instead: the tick that takes the
hand-off takes the tracker's marks over whole (a swap), and the marks are walked over the
next ticks, a :data:`CAPTURE_BYTES` slice each — the ids, positions and rows written — with
a row copied earlier by its next lookup before the update (exact: a row changes only in a
step that looks it up); the hand-off reaches the worker once complete
(``stats()["capture_ticks"]``). So no tick copies every row changed since the last one. A
hand-off of many tables is read over several ticks, a part of its tables each
(:data:`HANDOFF_PART_S`, ``stats()["part_ticks"]``), the tables not read yet keeping their
changes in the tracker, so no tick pays every table's bookkeeping either. Merging,
scoring, choosing, encoding and sending run on the publisher's worker threads
(:mod:`~deltastream.publishing.budget_worker`); ``tick`` never waits for them or for the
broker and returns ``None``. When the worker falls behind, hand-offs coalesce in the
pending set (the newest value of a row wins; memory is bounded by the rows pending, at most
the tables' rows), nothing is dropped, and the backlog shows in :meth:`~BudgetPublisher.stats`.
A round that fails puts its rows back in the pending set and its ``PublishError`` is raised
by the next ``tick`` or ``flush``. Where the worker runs: a worker's many small numpy and torch calls
need the GIL between them, as does every op the training thread dispatches, and each
hand-over of the GIL makes the training thread wait to be woken. So by default
(``worker="auto"``) the rounds run in a worker process
(:mod:`~deltastream.publishing.budget_process`: one more copy of each hand-off, no GIL
shared) when the publisher can be re-made there and torch's threads leave the process a
core (:func:`~deltastream.cores.spare_cores`), and on threads of this process otherwise
(``BENCHMARKS.md`` compares the two).
``threaded=False`` runs each round
inside ``tick`` (for tests and debugging) and returns its record. The clock decides how many
bytes a round may spend, and ``min_interval_s`` skips ticks that come too soon (they only
refill; nothing is read). ``max_worker_share`` (default 5 % of a core) stretches that gap
while the worker's last round cost more: when rows change faster than the worker merges
them cheaply, hand-offs come less often and rows coalesce in the tracker, so the worker's
CPU (the cores and, for a thread, the GIL it shares with training) stays bounded; the gap
never outlasts the byte bucket's refill, so the bytes sent per second do not drop.

A final :meth:`~BudgetPublisher.flush` on stop waits for every round, then publishes every
pending row whatever the budget (its bytes are counted apart: ``final_bytes``).

**Errors a row can have.** A NaN/Inf row, or one beyond the wire dtype's range (±65504
for f16), is rejected — not published, counted in ``rejected`` / ``out_of_range``, logged —
and never holds up other rows; predictors keep its last good value.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from deltastream import wire
from deltastream.cores import process_cores, spare_cores
from deltastream.publishing.budget_engine import BudgetEngine, BudgetTick, table_specs
from deltastream.publishing.budget_policy import SCALES, BudgetPolicy
from deltastream.publishing.budget_process import ProcessWorker, cannot_spawn
from deltastream.publishing.budget_worker import BudgetWorker
from deltastream.publishing.handoff import (
    Handoff,
    HostCopier,
    TableHandoff,
    owed_storages,
    take_handoff,
)
from deltastream.publishing.round_engine import RoundEngine, engine_for
from deltastream.publishing.rounds import RowPublisher

if TYPE_CHECKING:
    from deltastream.publishing.dense import DensePublisher
    from deltastream.tracking.tracker import DeltaTracker

__all__ = ["BudgetPolicy", "BudgetPublisher", "BudgetTick", "SCALES", "WORKERS",
           "choose_worker"]

#: where a threaded budget publisher runs its rounds
WORKERS = ("auto", "thread", "process")


def choose_worker(publisher: RowPublisher) -> str:
    """``"process"`` when ``publisher`` can be re-made in a worker process and torch's
    threads leave this process a core for it, else ``"thread"`` (why is logged)."""
    why = cannot_spawn(publisher)
    spare = spare_cores()
    if why is None and spare == 0:
        why = (f"torch's {torch.get_num_threads()} threads use every core of this process "
               f"({process_cores()})")
    if why is not None:
        log.info("budget publisher: rounds run on a thread: %s", why)
        return "thread"
    log.info("budget publisher: rounds run in a worker process (%d cores spare)", spare)
    return "process"

#: bytes of owed current rows a tick walks for a hand-off (the tick that takes it counts its
#: rows against them): a walked position costs ~50-100 ns on a cache the step just flushed
#: (its marks, its id, its row: misses), so 4096 rows of 128 B are ~0.3-0.5 ms of the
#: training thread per tick whatever the hand-off's size (BENCHMARKS.md, trainer-cost)
CAPTURE_BYTES = 1 << 19
#: training-thread seconds a tick's part of a hand-off aims at: a hand-off of many tables
#: (all on the CPU, owing their current rows) is read over several ticks, so that no tick
#: pays every table's fixed cost (~40-80 µs of Python and torch calls a table on a cold
#: cache here) at once; a part one table larger or smaller each time the last part took
#: under three quarters of this or over it; the rows reach the worker together once the
#: last table is read (BENCHMARKS.md, trainer-cost)
HANDOFF_PART_S = 0.4e-3
#: tables in a hand-off's first part, before any part was timed
HANDOFF_TABLES = 8
#: a hand-off whose drain took the training thread less than this (s) queues its tables'
#: walks on the lane at once (~10 µs each; half the tick p99 goal of 1 ms, so a drain and
#: its queueing stay under it); a longer one (a model of many tables) leaves them to the
#: next tick, as it leaves the walking
QUEUE_WALKS_S = 0.5e-3

log = logging.getLogger(__name__)


class BudgetPublisher:
    """Publish a tracker consumer's changes continuously within a byte budget.

    Args:
        tracker: a :class:`~deltastream.DeltaTracker` in EMBEDDING mode with ``consumer``.
        publisher: a :class:`~deltastream.DeltaPublisher` (any :class:`RowPublisher`); its
            ``dtype`` is the wire dtype the rows are costed in.
        consumer: the tracker consumer this publisher reads (it must not be read by
            anyone else: the publisher keeps the rows it has not published yet).
        policy: the budget and the ranking (:class:`BudgetPolicy`).
        tables: ``{fqn: module}`` where rows are read; default
            ``tracker.get_tracked_modules()``.
        clock: seconds, monotonic (for ``bytes_per_s`` and ``min_interval_s``).
        start_step: the step before the first tick (per-step budgets refill
            ``step − start_step`` at the first tick).
        threaded: run rounds off the training thread (default) or inside ``tick``
            (``False``: for tests and debugging).
        worker: where rounds run when threaded: ``"process"`` (a worker process: no GIL
            shared with training; needs a :class:`~deltastream.DeltaPublisher`, which it
            owns while the budget publisher is open; see
            :mod:`~deltastream.publishing.budget_process`), ``"thread"`` (threads of this
            process), or ``"auto"`` (default): the process when the publisher can be
            re-made there and torch's threads leave a core spare
            (:func:`~deltastream.cores.spare_cores`), else the thread; ``stats()["worker"]``
            says which, and the log why.
        on_round: called with each round's :class:`BudgetTick` once it is settled (on
            the worker's thread when threaded): per-round records, e.g. the
            ``PublishResult`` s whose offsets a snapshot needs.
        dense: a :class:`~deltastream.publishing.dense.DensePublisher` ticked with every
            :meth:`tick` (its own cadence and worker) and flushed by :meth:`flush` (a final
            full version after the rows); with ``policy.charge_dense`` its bytes are
            charged to the budget.

    See the module docstring for what a tick does, its threads and the bounds it keeps.
    Use it as a context manager, or call :meth:`close`, to stop the worker.
    """

    #: the policy class this publisher takes
    policy_type: type = BudgetPolicy
    #: whether a hand-off of many tables may be read over several ticks (:meth:`_parts`)
    in_parts: bool = True

    def __init__(self, tracker: DeltaTracker, publisher: RowPublisher, consumer: str,
                 policy: BudgetPolicy, *, tables: Optional[Mapping[str, Any]] = None,
                 clock: Callable[[], float] = time.monotonic, start_step: int = 0,
                 threaded: bool = True, worker: str = "auto",
                 on_round: Optional[Callable[[BudgetTick], None]] = None,
                 dense: Optional[DensePublisher] = None) -> None:
        if not isinstance(policy, self.policy_type):
            raise TypeError(f"policy must be a {self.policy_type.__name__}, got "
                            f"{type(policy).__name__}")
        version = getattr(publisher, "wire_version", wire.VERSION)
        if policy.residuals and version < wire.RESIDUAL_VERSION:
            raise ValueError(f"BudgetPolicy(residuals=True) needs a publisher writing wire "
                             f"v{wire.RESIDUAL_VERSION} or later (DeltaPublisher(wire_version="
                             f"{wire.RESIDUAL_VERSION})), this one writes v{version}")
        self.tracker, self.publisher, self.consumer, self.policy = \
            tracker, publisher, consumer, policy
        self.dense = dense
        self._modules = dict(tracker.get_tracked_modules() if tables is None else tables)
        if worker not in WORKERS:
            raise ValueError(f"worker must be one of {WORKERS}, got {worker!r}")
        specs = table_specs(self._modules)
        self._copier = HostCopier()
        owed = owed_storages(tracker, self._modules)
        widest = max((s.shape[1] * s.element_size() for s in owed.values()), default=1)
        self._capture_rows = max(1, CAPTURE_BYTES // max(1, widest))  # positions per tick
        # the tables, in the order a hand-off reads them in parts: all owe their rows
        self._owing = list(owed) if owed.keys() == self._modules.keys() else None
        self._capturing: Optional[Handoff] = None  # taken, its current rows still owed
        # a hand-off read in parts: (it, the parts of its tables still to read)
        self._reading: Optional[tuple[Handoff, list[list[str]]]] = None
        self._part_ticks = 0  # ticks that read a later part of a hand-off
        self._part_tables = HANDOFF_TABLES  # tables in a part (HANDOFF_PART_S)
        self._holding: Optional[Handoff] = None  # complete, the worker still merging the last
        self._capture_ticks = 0  # ticks that copied rows a hand-off owed
        self._mode = (choose_worker(publisher) if worker == "auto" else worker) \
            if threaded else "inline"
        self._worker: Optional[BudgetWorker | ProcessWorker] = None
        if self._mode == "process":  # the engine lives in the child; its reports here
            try:
                self._worker = ProcessWorker(publisher, policy, specs, on_round, consumer)
            except (OSError, RuntimeError) as e:
                if worker != "auto":
                    raise
                log.warning("budget publisher: no worker process (%s; %s); rounds run "
                            "on a thread", e, e.__cause__)
                self._mode = "thread"
        if self._worker is not None:
            self._state: BudgetEngine | RoundEngine | ProcessWorker = self._worker
        else:
            self._engine = self._state = engine_for(publisher, policy, specs, on_round)
            if threaded:
                self._worker = BudgetWorker(self._engine, consumer)
        self._clock = clock
        self._t0 = clock()
        self._last_t = self._t0
        self._last_step = int(start_step)
        self._first_step: Optional[int] = None
        self._last_round_t: Optional[float] = None
        self._last_round_step = int(start_step)  # the step of the last hand-off
        self._busy_mark = 0.0  # the worker's busy seconds at the last hand-off
        self._units = 0.0  # refill units of ticks that only refilled
        self._tick = 0
        self._ticks = 0
        self._skipped = 0  # ticks whose hand-off waited for a busy worker
        self._dense_charged = 0  # the dense publisher's bytes already charged
        self._tick_s: deque = deque(maxlen=policy.window)  # training-thread seconds per tick

    # ------------------------------------------------------------------ public

    def tick(self, step: int, *, ts: Optional[int] = None) -> Optional[BudgetTick]:
        """Hand the rows changed since the last tick to the publisher and refill the budget.

        Threaded (the default): O(rows changed) on this thread, never waits for the worker
        or the broker; returns ``None``. Synchronous: runs the round and returns its
        record, or ``None`` for a tick under ``min_interval_s`` (it only refilled).

        Raises:
            PublishError: a round since the last call failed to deliver (its rows are
                pending again; ``undelivered`` names the messages). This tick's hand-off
                was taken before the error is raised: nothing is lost.
            ValueError: an ID_ONLY delta (nothing is consumed).
        """
        t0 = time.perf_counter()
        now = self._clock()
        units = max(0, int(step) - self._last_step) if self.policy.per_step \
            else max(0.0, now - self._last_t)
        self._last_t, self._last_step = now, max(self._last_step, int(step))
        self._units += units
        self._ticks += 1
        if self._first_step is None:
            self._first_step = int(step)
        too_soon = not self._due(int(step), now)
        out = None
        busy, skipped = self._reading is not None or self._capturing is not None, self._skipped
        if self._reading is not None:  # the hand-off's next tables
            self._part_ticks += 1
            out = self._read_part()
        elif self._capturing is not None:  # the last hand-off's rows are still being copied
            self._capture_ticks += 1
            if self.tracker.capture_rows(self._capture_rows):
                h, self._capturing = self._capturing, None
                out = self._submit_when_merged(h)
        elif self._holding is not None:  # complete: it waits for the worker's last merge
            h, self._holding = self._holding, None
            out = self._submit_when_merged(h)
        elif self._worker is not None and not too_soon and self._worker.behind() \
                and len(self._parts(False)) == 1:
            # the worker has not merged the last hand-off: this tick's rows stay in the
            # tracker (coalescing there, newest value at the next hand-off); one read in
            # parts starts all the same, and waits for that merge once read
            self._skipped += 1
        elif not too_soon:
            self._last_round_t, self._last_round_step = now, self._round_step(int(step))
            if self._worker is not None:
                self._busy_mark = self._worker.busy_s
            out = self._hand_off(int(step), ts, final=False)
        if busy and not too_soon and self._skipped == skipped:
            self._skipped += 1  # due, but the last hand-off is still read or copied
        self._tick_s.append(time.perf_counter() - t0)
        if self.dense is not None:  # its copy time is its own (DensePublisher.stats)
            self.dense.tick(int(step), ts=ts)
        return out

    def flush(self, step: int, *, ts: Optional[int] = None,
              timeout: Optional[float] = None) -> BudgetTick:
        """Wait for every round, then publish every pending row whatever the budget (the
        final flush on stop); returns that round's record.

        Raises:
            PublishError: a round failed to deliver (the rows are pending again: a later
                flush retries them).
            TimeoutError: the worker did not finish within ``timeout`` seconds.
        """
        self._finish_capture()
        out = self._hand_off(int(step), ts, final=True, timeout=timeout)
        if self.dense is not None:
            self.dense.flush(int(step), ts=ts, timeout=timeout)
        return out

    def drain(self, timeout: Optional[float] = None) -> Optional[BudgetTick]:
        """Wait until the worker has run a round for every tick so far (threaded mode);
        returns the last round's record. Raises a round's ``PublishError`` like ``tick``.
        Call it between steps, like ``tick``: a hand-off still copying its rows completes."""
        self._finish_capture()
        if self._worker is not None and not self._worker.wait_idle(self._tick, timeout):
            raise TimeoutError(f"budget publisher: rounds still running after {timeout} s")
        self._raise_worker_error()
        return self.last

    def close(self) -> None:
        """Stop the worker (no final round: call :meth:`flush` first). Safe to call twice."""
        if self._worker is not None:
            self._worker.close()

    def __enter__(self) -> BudgetPublisher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def tokens(self) -> float:
        """Bytes the next round could spend before its refill (negative: a small debt)."""
        return self._state.tokens

    @property
    def last(self) -> Optional[BudgetTick]:
        """The last completed round's record."""
        return self._state.last

    def stats(self) -> dict:
        """Counters, rates, the backlog and the serving-error bound (plain values).

        ``bound`` / ``table_bounds``: p50 / p99 / max / last over the last ``window`` rounds
        (normalized, and in embedding units per table). ``bytes_per_s`` / ``bytes_per_step``:
        bytes sent by rounds (the final flush apart) over the time and steps since the first
        tick; of those, ``8 × tombstones`` were tombstones, not charged to the budget.
        ``pending``: rows waiting to be published; ``backlog``: hand-offs not merged yet;
        ``tick_ms``: p50 / p99 / max of the training thread's time in ``tick``;
        ``deferred_ticks``: ticks that left their rows in the tracker, or held a complete
        hand-off read in parts, because the worker had not merged the previous one yet —
        or, due, because the previous one was still being read or copied;
        ``capture_ticks``: ticks that copied a slice of the current rows a hand-off still
        owed (:mod:`~.handoff`); ``part_ticks``: ticks
        that read a later part of a hand-off of many tables (:data:`HANDOFF_PART_S`);
        ``worker_s`` / ``worker_share``: the worker's busy seconds, and their share of the
        seconds since the first tick.
        """
        st = self._state.stats()
        secs = max(1e-9, self._last_t - self._t0)
        steps = (self._last_step - self._first_step + 1) if self._first_step is not None else 0
        t = np.asarray(self._tick_s, dtype=np.float64) * 1e3
        busy = self._worker.busy_s if self._worker is not None else None
        st.update(
            ticks=self._ticks, policy=self.policy.describe(), seconds=secs, steps=steps,
            bytes_per_s=st["bytes"] / secs, bytes_per_step=st["bytes"] / steps if steps else None,
            threaded=self._worker is not None, deferred_ticks=self._skipped,
            capture_ticks=self._capture_ticks, part_ticks=self._part_ticks,
            worker=self._mode, worker_pid=getattr(self._worker, "pid", None),
            backlog=self._worker.backlog() if self._worker is not None else None,
            worker_s=busy, worker_share=None if busy is None else busy / secs,
            tick_ms={"p50": float(np.quantile(t, 0.5)), "p99": float(np.quantile(t, 0.99)),
                     "max": float(t.max())} if t.size else None)
        return st

    # ------------------------------------------------------------------ internals

    def _raise_worker_error(self) -> None:
        e = self._worker.take_error() if self._worker is not None else None
        if e is not None:
            raise e

    def _due(self, step: int, now: float) -> bool:
        """Whether a tick at ``step`` (``now``: the clock) hands off: ``_gap()`` seconds
        after the last hand-off."""
        return self._last_round_t is None or now - self._last_round_t >= self._gap()

    def _round_step(self, step: int) -> int:
        """The step a hand-off at ``step`` counts the next one from: ``step`` itself."""
        return step

    def _gap(self) -> float:
        """Seconds the next hand-off waits after the last round: ``min_interval_s``, or
        longer while the worker's busy seconds since that hand-off exceed
        ``max_worker_share`` of the gap — unless the byte bucket is full by now (waiting
        longer would lose what it refills)."""
        gap, share = self.policy.min_interval_s, self.policy.max_worker_share
        if self._worker is None or share is None \
                or self._units * self.policy.rate >= self.policy.burst:
            return gap
        return max(gap, (self._worker.busy_s - self._busy_mark) / share)

    def _finish_capture(self) -> None:
        """Read every table a hand-off read in parts has left, copy every row the last
        hand-off still owes and give it to the worker, merged or not its last."""
        if self._reading is not None:
            h, parts = self._reading
            self._take_more(h, [f for part in parts for f in part])
            self._reading, self._capturing = None, h
            self._read_units(h)
        if self._capturing is not None:
            self.tracker.capture_rows(None)
            self._holding, self._capturing = self._capturing, None
        if self._holding is not None:
            h, self._holding = self._holding, None
            self._submit(h)

    def _dense_charge(self) -> int:
        """Bytes of the dense versions sent since the last hand-off, when the policy
        charges them to the budget (0 otherwise)."""
        if self.dense is None or not self.policy.charge_dense:
            return 0
        sent = self.dense.sent_bytes
        out, self._dense_charged = sent - self._dense_charged, sent
        return out

    def _parts(self, final: bool) -> list[Optional[list[str]]]:
        """The tables of a hand-off, a part per tick: one part of every table (None) unless
        more tables than fit in a part (:data:`HANDOFF_PART_S`), all owing their current
        rows, are read by a worker and the tracker can read them in parts."""
        names = self._owing
        if final or not self.in_parts or self._worker is None or names is None \
                or not self.tracker.reads_in_parts(self.consumer):
            return [None]
        k = self._part_tables
        if len(names) <= k:
            return [None]
        return [names[i:i + k] for i in range(0, len(names), k)]

    def _take(self, part: Optional[list[str]]) -> tuple[list[TableHandoff], bool]:
        """:func:`take_handoff` of the tables of ``part`` (None: all), their rows owed where
        they live in a CPU storage (looked up per read: a table may grow), and whether the
        read was short enough to queue its walks on the lane (:data:`QUEUE_WALKS_S`); a
        part's time sizes the next parts (:data:`HANDOFF_PART_S`)."""
        t0 = time.perf_counter()
        modules = self._modules if part is None else {f: self._modules[f] for f in part}
        out = take_handoff(self.tracker, self.consumer, self._modules, self._copier,
                           owe=owed_storages(self.tracker, modules), tables=part)
        took = time.perf_counter() - t0
        if part is not None and len(part) == self._part_tables:
            if took > HANDOFF_PART_S:
                self._part_tables = max(1, self._part_tables - 1)
            elif took < 0.75 * HANDOFF_PART_S:
                self._part_tables += 1
        return out, took < QUEUE_WALKS_S

    def _take_more(self, h: Handoff, part: list[str]) -> bool:
        """A later ``part`` of hand-off ``h``'s tables into it (:meth:`_take`'s lane)."""
        tables, lane = self._take(part)
        h.tables += tables
        # a table moved to a device since: its copies, on the one side stream, end after
        # the earlier parts' (whose event this replaces)
        h.ready = self._copier.finish() or h.ready
        return lane

    def _hand_off(self, step: int, ts: Optional[int], *, final: bool,
                  timeout: Optional[float] = None) -> Optional[BudgetTick]:
        parts = self._parts(final)
        tables, lane = self._take(parts[0])
        self._tick += 1
        h = Handoff(tick=self._tick, step=step, ts=time.time_ns() if ts is None else ts,
                    units=self._units, tables=tables, final=final, ready=self._copier.finish(),
                    charged=self._dense_charge())
        self._units = 0.0
        return self._read_on(h, parts[0], parts[1:], lane, timeout)

    def _read_part(self) -> Optional[BudgetTick]:
        """Read the next part of the hand-off being read in parts."""
        h, parts = self._reading
        lane = self._take_more(h, parts[0])  # (raising, it leaves the hand-off as it was)
        self._reading = None
        if len(parts) == 1:
            self._read_units(h)
        return self._read_on(h, parts[0], parts[1:], lane, None)

    def _read_units(self, h: Handoff) -> None:
        """Hand-off ``h``, read in parts, takes the refill of the ticks since its first
        part as its ``read_units`` (not idle: the bucket keeps them past its burst)."""
        h.units, h.read_units, self._units = h.units + self._units, self._units, 0.0

    def _read_on(self, h: Handoff, part: Optional[list[str]], rest: list[list[str]],
                 lane: bool, timeout: Optional[float]) -> Optional[BudgetTick]:
        """After ``part`` of hand-off ``h`` was read: the ``rest`` of its tables at the next
        ticks (``part``'s walks queued), or, all read, a slice of the rows it owes walked
        now (its drain counts against it) and the rest over the next ticks — all at once
        for a flush or a synchronous publisher — before it goes to the worker."""
        if rest:
            self._reading = (h, rest)
            self.tracker.capture_rows(0, lane=lane, tables=part)
            return None
        budget = None if h.final or self._worker is None \
            else max(0, self._capture_rows - h.rows)
        if not self.tracker.capture_rows(budget, lane=lane):
            self._capturing = h
            return None
        return self._submit(h, timeout) if h.final else self._submit_when_merged(h)

    def _submit_when_merged(self, h: Handoff) -> Optional[BudgetTick]:
        """:meth:`_submit` hand-off ``h`` (complete) once the worker merged the last one
        (a hand-off read in parts starts without waiting for that); held until then."""
        if self._worker is not None and self._worker.behind():
            self._holding = h
            self._skipped += 1
            return None
        return self._submit(h)

    def _submit(self, h: Handoff, timeout: Optional[float] = None) -> Optional[BudgetTick]:
        """Give hand-off ``h`` (its current rows complete) to the worker, or run its round
        here when synchronous (returns the record); a flush waits for its round."""
        if self._worker is None:
            eng = self._engine
            eng.merge(h)
            job = eng.start(h.tick, h.step, h.ts, h.final)
            try:
                eng.send(job)
            except BaseException as e:
                eng.settle(job, e)
                raise
            return eng.settle(job, None)
        fut = self._worker.put(h)  # taken before any error is raised: nothing is lost
        if fut is None:
            self._raise_worker_error()
            return None
        try:
            return fut.result(timeout)
        except TimeoutError as e:
            raise TimeoutError(f"budget publisher: the final round did not finish within "
                               f"{timeout} s") from e
        finally:
            self._worker.take_error()  # the flush's own error was raised (or none)
