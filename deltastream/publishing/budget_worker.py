"""The thread that runs a budget publisher's rounds off the training loop.

:class:`BudgetWorker` takes hand-offs from the training thread (:meth:`~BudgetWorker.put`,
O(1), never blocks) and runs the :class:`~.budget_engine.BudgetEngine` steps on its own
threads:

* the **worker thread** merges every hand-off into the pending rows as it arrives and,
  when no send is in flight, starts the next round (choose, take);
* the **sender thread** publishes a round and waits for the broker's acknowledgement, so a
  slow or absent broker holds up sends only: merging goes on, and hand-offs that arrive
  meanwhile coalesce in the pending set (a row's newest value replaces its older one,
  memory stays bounded by the rows pending) and are published by the next round.

A round that fails puts its rows back in the pending set (:meth:`.BudgetEngine.settle`)
and its error is kept for the training thread, which raises it at its next ``tick`` or
``flush`` (:meth:`~BudgetWorker.take_error`). Later rounds keep trying. A flush is a final
hand-off: the worker runs it after the send in flight and resolves the flush's future with
its record.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

from deltastream.publishing.budget_engine import BudgetEngine, RoundJob
from deltastream.publishing.handoff import Handoff

__all__ = ["BudgetWorker", "first_error"]

log = logging.getLogger(__name__)


def first_error(errors: list[BaseException]) -> Optional[BaseException]:
    """The first of the rounds' ``errors`` (the training thread raises it); the others are
    logged."""
    for e in errors[1:]:
        log.warning("budget publisher: another round failed too: %s", e)
    return errors[0] if errors else None


class BudgetWorker:
    """Runs ``engine``'s rounds on two daemon threads (see the module docstring)."""

    def __init__(self, engine: BudgetEngine, name: str = "budget") -> None:
        self._engine = engine
        self._cond = threading.Condition()
        self._mailbox: deque[Handoff] = deque()
        self._mailbox_rows = 0
        self._errors: list[BaseException] = []
        self._flushes: dict[int, Future] = {}
        self._stopping = False
        self._merged = 0  # newest tick merged
        self._settled = 0  # newest tick a round has settled for
        self._job: Optional[tuple[RoundJob, Future, int]] = None
        self._final: Optional[Handoff] = None
        self._last: Optional[Handoff] = None  # the newest hand-off merged
        self._running = False  # the worker thread is in a step
        self.busy_s = 0.0  #: seconds the worker thread spent merging and choosing
        self.max_backlog = 0  #: most hand-offs waiting at once
        self._sender = ThreadPoolExecutor(1, thread_name_prefix=f"deltastream-{name}-send")
        self._thread = threading.Thread(target=self._run, name=f"deltastream-{name}",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ training thread

    def put(self, h: Handoff) -> Optional[Future]:
        """Queue a hand-off (O(1)); for a final one, a future of its round's record."""
        fut: Optional[Future] = Future() if h.final else None
        with self._cond:
            if self._stopping:
                raise RuntimeError("the budget publisher is closed")
            if fut is not None:
                self._flushes[h.tick] = fut
            self._mailbox.append(h)
            self._mailbox_rows += h.rows
            self.max_backlog = max(self.max_backlog, len(self._mailbox))
            self._cond.notify_all()
        return fut

    def behind(self) -> bool:
        """True while an earlier hand-off waits to be merged: the next one can wait too
        (its rows stay in the tracker, where they coalesce at no cost)."""
        with self._cond:
            return bool(self._mailbox)

    def take_error(self) -> Optional[BaseException]:
        """The first error of the rounds since the last call (the others are logged)."""
        with self._cond:
            errors, self._errors = self._errors, []
        return first_error(errors)

    def wait_idle(self, tick: int, timeout: Optional[float] = None) -> bool:
        """Wait until every hand-off up to ``tick`` is merged and its round has settled."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._settled < tick or self._job is not None or self._mailbox \
                    or self._running:
                if not self._thread.is_alive():
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def backlog(self) -> dict:
        """Hand-offs and rows waiting to be merged, and whether a send is in flight."""
        with self._cond:
            job = self._job
            return {"handoffs": len(self._mailbox), "rows": self._mailbox_rows,
                    "in_flight_rows": job[0].rows if job else 0,
                    "max_handoffs": self.max_backlog}

    def close(self, timeout: Optional[float] = None) -> None:
        """Stop after the hand-offs queued so far (no final round); safe to call twice."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)
        self._sender.shutdown(wait=False)

    # ------------------------------------------------------------------ worker thread

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._mailbox and not self._stopping and not self._job_done():
                    self._cond.wait()
                if self._stopping and not self._mailbox and self._job is None:
                    return
                batch = list(self._mailbox)
                self._mailbox.clear()
                self._mailbox_rows = 0
                self._running = True
            t0 = time.monotonic()
            try:
                self._step(batch)
            except BaseException as e:  # a bug must not end the thread silently
                log.exception("budget publisher worker failed")
                for h in batch:  # those not merged: their buffers are free all the same
                    h.release()
                with self._cond:
                    self._errors.append(e)
                    for fut in self._flushes.values():
                        fut.set_exception(e)
                    self._flushes.clear()
                    self._job, self._final = None, None
                    # the batch counts as settled even where its merge failed: drain and
                    # flush wait for its ticks, then raise the error
                    self._merged = max([self._merged] + [h.tick for h in batch])
                    self._settled = self._merged
                    self._cond.notify_all()
            with self._cond:  # counted before an idle waiter (drain) wakes
                self.busy_s += time.monotonic() - t0
                self._running = False
                self._cond.notify_all()

    def _job_done(self) -> bool:
        return self._job is not None and self._job[1].done()

    def _step(self, batch: list[Handoff]) -> None:
        eng = self._engine
        for h in batch:
            eng.merge(h)
            h.release()  # a merge that raised is released by _run
            self._merged, self._last = h.tick, h
            if h.final:
                self._final = h
        if self._job is not None and self._job[1].done():
            job, fut, tick = self._job
            error = fut.exception()
            record = eng.settle(job, error)
            with self._cond:
                self._job = None
                if error is not None:
                    self._errors.append(error)
                self._settled = tick
                waiter = self._flushes.pop(tick, None) if job.final else None
                self._cond.notify_all()
            if waiter is not None:
                if error is not None:
                    waiter.set_exception(error)
                else:
                    waiter.set_result(record)
        if self._job is None and (self._merged > self._settled or self._final is not None):
            final, self._final = self._final, None
            src = final or self._last
            job = eng.start(src.tick, src.step, src.ts, final is not None)
            fut = self._sender.submit(eng.send, job)
            with self._cond:
                self._job = (job, fut, self._merged)
            fut.add_done_callback(self._wake)

    def _wake(self, _fut: Future) -> None:
        with self._cond:
            self._cond.notify_all()

