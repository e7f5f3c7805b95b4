"""One configuration of ``bench trainer-cost`` on the shared model: its tracker, its
publishing (a budget, ``publish_delta``'s rounds on or off the training thread, or none),
what the bench records of it, and the untimed steps that set it up (a ``--pending`` prefill,
a warm-up chunk) with every other configuration's tracker paused.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Optional

import torch

from bench.train_step import TableCTR
from deltastream import wire
from deltastream.publishing.budget import BudgetPolicy, BudgetPublisher
from deltastream.publishing.round_publisher import RoundPolicy, RoundPublisher
from deltastream.publishing.rounds import SelectionPolicy, publish_delta
from deltastream.tracking.tracker import DeltaTracker
from deltastream.types import TrackingMode

__all__ = ["Run", "paused", "prefill", "warm"]


class Run:
    """One configuration on the shared model: its tracker and publishing."""

    def __init__(self, name: str, model: TableCTR, servers: str, topic: str,
                 budget: float | None = None, threaded: bool = True,
                 delta_every: int | None = None, worker: str = "auto",
                 residuals: bool = False, rounds_every: int | None = None,
                 reads_every: int | None = 10, snapshot_every: int = 0,
                 **policy: object) -> None:
        from deltastream import DeltaPublisher

        self.name, self.delta_every, self.reads_every = name, delta_every, reads_every
        #: steps between reads of a second consumer, "snapshot" (0: none), as the demo's
        self.snapshot_every = snapshot_every
        # the snapshot reads ids (it writes the rows' current values), as the demo's does
        self.tracker = DeltaTracker(model, consumers=["p"] + ["snapshot"] * bool(snapshot_every),
                                    mode=TrackingMode.EMBEDDING, id_only_consumers=["snapshot"]
                                    * bool(snapshot_every))
        self.pub = DeltaPublisher(servers, topic, model="bench", shard=0,
                                  wire_version=5 if residuals else 2) \
            if budget or delta_every or rounds_every else None
        if residuals:
            policy.update(residuals=True, wide_dtype="i8")
        #: the publisher ticked after every step (a budget, or publish_delta's rounds)
        self.budget: BudgetPublisher | None = BudgetPublisher(
            self.tracker, self.pub, "p", BudgetPolicy(bytes_per_s=budget, **policy),
            threaded=threaded, worker=worker) if budget else None
        if rounds_every:
            self.budget = RoundPublisher(
                self.tracker, self.pub, "p",
                RoundPolicy(SelectionPolicy(fraction=0.5), every=rounds_every),
                threaded=threaded, worker=worker)
        self.times: list[float] = []
        self.alone: list[float] = []
        #: per timed pair: the mean step with deltastream (its chunk and tail; s), in wall
        #: and in the training thread's CPU time, and its alone chunk's place among all
        #: alone chunks of the run (their means: ``_measure``'s ``alones``)
        self.with_s: list[tuple[float, float]] = []
        self.alone_at: list[int] = []
        #: the training thread's minor page faults in the measured steps (chunks and tails)
        #: and in the alone chunks
        self.faults = self.faults_alone = 0
        #: seconds in the step's forward, backward and optimizer: over the alone chunks,
        #: and over the chunks with deltastream and their tails
        self.phases_alone = [0.0, 0.0, 0.0]
        self.phases_with = [0.0, 0.0, 0.0]
        self.tail_steps: list[int] = []  # per pair: steps until the worker settled
        self.tail_s: list[float] = []  # per pair: their seconds
        self.tick_s: list[float] = []
        self.measured_s = 0.0
        self.bytes0 = 0
        #: the budget's bytes and worker seconds before its first timed tick (the prefill's
        #: are not the timed run's), and that tick's and the last's time
        self.worker_s0: float | None = None
        self.rate: float | None = None  # bytes/s of the steady phase (budgets)
        self.tombstone_rate: float | None = None  # of which tombstones (8 bytes an id)

    def after_step(self, step: int) -> None:
        if self.budget is not None:
            t0 = time.perf_counter()
            self.budget.tick(step)
            self.tick_s.append(time.perf_counter() - t0)
        elif self.delta_every is not None:
            if step % self.delta_every == 0:
                t0 = time.perf_counter()
                publish_delta(self.tracker, self.pub, "p", SelectionPolicy(fraction=0.5),
                              step=step)
                self.tick_s.append(time.perf_counter() - t0)
            else:
                self.tick_s.append(0.0)
        elif self.reads_every is not None and step % self.reads_every == 0:
            self.tracker.get_delta("p")
        if self.snapshot_every and step % self.snapshot_every == 0:
            self.tracker.get_delta("snapshot")

    def prefills(self) -> bool:
        """Whether ``--pending`` rows are made pending before timing: a budget's. Not
        ``rounds-10``'s: publish_delta's rounds take a fraction of their candidates, so a
        prefill would go out in halves, round after round; they start empty."""
        return self.budget is not None and not isinstance(self.budget, RoundPublisher)

    def idle(self) -> None:
        if self.budget is not None:
            self.budget.drain()
            if self.worker_s0 is None:  # before the first timed chunk, drained
                self.worker_s0 = self.budget.stats()["worker_s"] or 0.0

    def steady_rate(self, step: Callable[[int], None], k: int, seconds: float,
                    min_rounds: int = 2, most_s: float = 120.0) -> int:
        """Bytes/s the budget sends while it alone runs for ``seconds`` after a warm-up
        second that empties its bucket's burst (drained at both ends: each round counted
        once); returns the next step number. The chunks cannot give it: between a
        configuration's chunks the bucket refills by at most one second's burst, so bytes
        over a span with other configurations' chunks in it understate the rate.

        The span also lasts until ``min_rounds`` rounds have published in it (``most_s``
        at most): a budget whose worker is slow hands off only once per bucket refill (a
        second at the default burst), ``rounds-10`` once per ten steps, so a short span on
        a loaded machine can hold no round and read 0 B/s."""
        b = self.budget
        spans = []
        for secs, rounds in ((1.0, 0), (seconds, min_rounds)):
            t0, r0 = time.perf_counter(), b.stats()["rounds"]
            while True:
                step(k)
                self.tracker.step()
                b.tick(k)
                k += 1
                took = time.perf_counter() - t0
                if took >= secs and (took >= most_s or b.stats()["rounds"] - r0 >= rounds):
                    break
            b.drain()
            st = b.stats()
            spans.append((time.perf_counter(), int(st["bytes"]), int(st["tombstones"])))
        (t0, b0, m0), (t1, b1, m1) = spans
        self.rate = (b1 - b0) / max(1e-9, t1 - t0)
        self.tombstone_rate = wire.TOMBSTONE_BYTES * (m1 - m0) / max(1e-9, t1 - t0)
        return k

    def settled(self) -> bool:
        """Whether the budget's worker has run every round handed to it (no wait)."""
        try:
            self.budget.drain(timeout=0.0)
        except TimeoutError:
            return False
        return True

    def acked_bytes(self) -> int:
        return 0 if self.pub is None else int(self.pub.stats()["bytes"])

    def close(self) -> None:
        if self.budget is not None:
            self.budget.close()
        if self.pub is not None:
            self.pub.close()
        self.tracker.close()


@contextlib.contextmanager
def paused(runs: list[Run], but: Optional[Run] = None) -> Iterator[None]:
    """Every run's tracker paused except ``but``'s."""
    with contextlib.ExitStack() as stack:
        for other in runs:
            if other is not but:
                stack.enter_context(other.tracker.pause())
        yield


def prefill(run: Run, runs: list[Run], model: TableCTR, n: int, step: int) -> None:
    """Make ``n`` fresh user rows pending in ``run``'s budget (not timed); the other runs'
    trackers do not see these lookups (each would otherwise hold, and read, ``n`` rows)."""
    base = (1 << 61) + step * (n + 1)
    with torch.no_grad(), paused(runs, but=run):
        for start in range(0, n, 1 << 18):
            ids = torch.arange(base + start, base + min(n, start + (1 << 18)),
                               device=model.user.device)
            model.user(ids)
    run.budget.tick(step)
    run.budget.drain()
    # the next read releases the prefill read's buffers (O(n), once): untimed too
    time.sleep(run.budget.policy.min_interval_s)
    run.budget.tick(step)
    run.budget.drain()


def warm(run: Run, runs: list[Run], step: Callable[[int], None], k: int,
          chunk: int) -> int:
    """``chunk`` untimed steps and ticks of ``run``'s budget: its first hand-offs' one-time
    costs (the worker's first rounds; on CUDA the side stream, and pinned host memory
    allocated as the hand-offs reach their size: up to 0.45 s for the first on an H200)
    are a run's, not a step's. Returns the next step number."""
    with paused(runs, but=run):
        for _ in range(chunk):
            step(k)
            run.tracker.step()
            run.budget.tick(k)
            k += 1
    run.budget.drain()
    return k
