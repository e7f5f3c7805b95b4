"""A budget publisher's rounds in a worker **process**: no GIL shared with training.

:class:`~.budget_worker.BudgetWorker` runs rounds on threads of the training process. Its
merging, scoring and encoding are many small numpy/torch calls; each needs the GIL
between calls, and so does every op the training thread dispatches, so the two threads
take turns and the training step slows by a share of the worker's work even when a core is
free (BENCHMARKS.md, "trainer-cost"). :class:`ProcessWorker` has the same interface and
runs the same :class:`~.budget_worker.BudgetWorker` in a child process (a new interpreter,
one thread of torch), with its own :class:`~deltastream.DeltaPublisher` made from the user's
(:meth:`~deltastream.DeltaPublisher.spawn_args`: same topic, shard and epoch; its seqs
continue the user's and are handed back on :meth:`close`). The child is started with
``python -c`` importing :mod:`~.budget_child` (its side), not by multiprocessing's spawn,
which re-runs the user's ``__main__`` in the child: a training script without an ``if
__name__ == "__main__":`` guard would start its whole job again there. The publisher's
class must therefore be importable by name (not defined in ``__main__``). Its steps, in
order:

1. the training thread queues a hand-off (:meth:`ProcessWorker.put`, O(1), never blocks);
2. the parent's *shipper* thread waits for the hand-off's device copies (CUDA), packs its
   tensors into one shared-memory segment (a file under ``/dev/shm``, mode 0600, its room
   reserved up front, unlinked as soon as the child mapped it; one C call copies them
   all without the GIL, :func:`~.handoff_pack.pack`), gives the row buffers back to the
   tracker for its next interval, and sends their layout through the socket; when the
   tmpfs has no room for it (a container's 64 MB ``/dev/shm``), the packed bytes follow
   the layout through the socket instead (slower;
   ``stats()["backlog"]["inline_handoffs"]`` counts them, the log says so);
3. the child's worker merges them where they lie (the segment's pages, no copy), and then
   the child says the segment is free;
4. the child reports every settled round (a snapshot of the engine's ``stats()``, and the
   round's record when there is an ``on_round``; else it keeps the last one until
   :attr:`ProcessWorker.last` asks), every failed round, each flush's record and each
   drain through the socket; the parent's *reader* thread keeps them for ``tick`` /
   ``flush`` / ``stats`` / ``last`` (a record unpickled only when read: the reader holds
   the GIL the training thread needs as little as it can),
   moves the user's publisher's seqs to the child's (its ``stats()["next_seq"]`` is
   current), and calls ``on_round`` (a round record's ``TableRound.result`` is a settled
   copy: :meth:`~deltastream.PublishResult.settled`, offsets included).

One hand-off is in flight at a time, until it is merged (:meth:`behind` is True meanwhile;
the tick leaves its rows in the tracker, where they coalesce). A child that dies (killed,
out of memory) is an error at the next ``tick`` / ``flush``: the rows it held pending are
lost to this publisher and must be republished (e.g. a full ``publish_delta``); nothing is
silently dropped.
"""

from __future__ import annotations

import json
import logging
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any, Optional

from deltastream.errors import PublishError
from deltastream.publishing.budget_child import record_from
from deltastream.publishing.budget_engine import BudgetTick, TableSpec
from deltastream.publishing.budget_policy import BudgetPolicy
from deltastream.publishing.budget_worker import first_error
from deltastream.publishing.handoff import Handoff
from deltastream.publishing.handoff_pack import Segment, describe, layout, pack, shm_dir
from deltastream.publishing.round_engine import RoundPolicy

__all__ = ["ProcessWorker", "cannot_spawn"]

log = logging.getLogger(__name__)

def cannot_spawn(publisher: Any) -> Optional[str]:
    """Why ``publisher`` cannot be re-made in a worker process, or None when it can."""
    if not callable(getattr(publisher, "spawn_args", None)):
        return (f"a worker process needs a DeltaPublisher (with spawn_args), got "
                f"{type(publisher).__name__}")
    if type(publisher).__module__ == "__main__":
        return (f"a worker process imports the publisher's class by name: "
                f"{type(publisher).__name__} is defined in __main__; define it in a module")
    return None


class ProcessWorker:
    """Runs a budget publisher's rounds in a child process (see the module docstring);
    the interface of :class:`~.budget_worker.BudgetWorker` plus :meth:`stats` / ``last``
    snapshots of the child's engine."""

    def __init__(self, publisher: Any, policy: BudgetPolicy | RoundPolicy,
                 specs: Mapping[str, TableSpec],
                 on_round: Optional[Callable[[BudgetTick], None]] = None,
                 name: str = "budget", start_timeout: float = 120.0) -> None:
        why = cannot_spawn(publisher)
        if why is not None:
            raise TypeError(f"{why}; use the thread worker")
        self._publisher, self._on_round = publisher, on_round
        self._send_lock = threading.Lock()
        self._conn, self._proc = _start_child()
        try:
            self._send(("start", type(publisher), publisher.spawn_args(),
                        publisher.next_seqs(), policy, dict(specs), name,
                        on_round is not None))
        except BaseException:  # not started: the child must not outlive this call
            self._proc.kill()
            self._proc.wait()
            self._conn.close()
            raise
        publisher.lend(f"budget worker process {self._proc.pid}")
        self._cond = threading.Condition()
        self._queue: deque[Handoff] = deque()
        self._in_flight = False  # a hand-off shipped, not yet copied out by the child
        self._errors: list[BaseException] = []
        self._flushes: dict[int, Future] = {}
        self._settled = 0
        self._drained = 0
        self._dead: Optional[str] = None
        self._death: Optional[PublishError] = None
        self._closed = False
        self._seqs: Optional[dict] = None
        self._stats: dict = {}
        #: the last round's record as of round ``_last_round`` of the ``_rounds`` the child
        #: reported: pickled as the child sent it, unpickled when read (:attr:`last`). The
        #: child sends each round's record only for ``on_round``; else :attr:`last` asks
        #: for it (``_asked``, ``_answered``: the requests sent and answered)
        self._last: Optional[bytes | BudgetTick] = None
        self._rounds = self._last_round = self._asked = self._answered = 0
        self.busy_s = 0.0
        self.max_backlog = 0
        self.inline_handoffs = 0  #: hand-offs sent through the socket: no shm room
        self._seg = Segment()
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name=f"deltastream-{name}-reader")
        self._shipper = threading.Thread(target=self._ship, daemon=True,
                                         name=f"deltastream-{name}-shipper")
        self._reader.start()
        with self._cond:  # the child built its publisher (or failed to)
            if not self._cond.wait_for(lambda: self._stats or self._dead, start_timeout):
                self._dead = f"did not start within {start_timeout} s"
        if self._dead is not None:
            first = self.take_error()
            self._seqs = publisher.next_seqs()  # nothing was handed over: nothing sent
            self.close()
            raise RuntimeError(f"budget worker process: {self._dead}") from first
        self._shipper.start()

    # ------------------------------------------------------------------ training thread

    def put(self, h: Handoff) -> Optional[Future]:
        """Queue a hand-off (O(1)); for a final one, a future of its round's record."""
        fut: Optional[Future] = Future() if h.final else None
        with self._cond:
            if self._death is not None:
                raise self._death
            if self._closed:
                raise RuntimeError("the budget publisher is closed")
            if fut is not None:
                self._flushes[h.tick] = fut
            self._queue.append(h)
            self.max_backlog = max(self.max_backlog, len(self._queue))
            self._cond.notify_all()
        return fut

    def behind(self) -> bool:
        """True while an earlier hand-off is not yet merged by the child (False once the
        child died: the next hand-off raises why)."""
        with self._cond:
            return (bool(self._queue) or self._in_flight) and self._dead is None

    def take_error(self) -> Optional[BaseException]:
        """The first error since the last call (the others are logged)."""
        with self._cond:
            errors, self._errors = self._errors, []
        return first_error(errors)

    def wait_idle(self, tick: int, timeout: Optional[float] = None) -> bool:
        """Wait until every hand-off up to ``tick`` is merged and its round has settled."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if not self._cond.wait_for(lambda: not self._queue and not self._in_flight
                                       or self._dead is not None, timeout):
                return False
            if self._dead is not None:
                return False
        self._send(("drain", tick))
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        with self._cond:
            return self._cond.wait_for(lambda: self._drained >= tick or self._dead is not None,
                                       left) and self._dead is None

    def backlog(self) -> dict:
        """Hand-offs waiting to be shipped, rows among them, and the child's backlog."""
        with self._cond:
            rows = sum(h.rows for h in self._queue)
            child = self._stats.get("backlog") or {}
            return {"handoffs": len(self._queue) + int(self._in_flight), "rows": rows,
                    "in_flight_rows": child.get("in_flight_rows", 0),
                    "max_handoffs": self.max_backlog,
                    "inline_handoffs": self.inline_handoffs}

    def stats(self) -> dict:
        """The child engine's ``stats()`` as of its last report."""
        with self._cond:
            return dict(self._stats.get("engine", {}))

    @property
    def last(self) -> Optional[BudgetTick]:
        """The last settled round's record (None before the first); asked of the child
        when it has settled rounds since the last one it sent (waits up to 30 s)."""
        with self._cond:
            ask = self._last_round < self._rounds and self._dead is None \
                and self._seqs is None
            if ask:
                self._asked += 1
                n = self._asked
        if ask:
            try:
                self._send(("last", n))
            except OSError:  # the child is gone: what it sent last
                pass
            else:
                with self._cond:
                    self._cond.wait_for(lambda: self._answered >= n or self._dead is not None
                                        or self._seqs is not None, 30.0)  # or it closed
        with self._cond:
            rec = self._last
        if not isinstance(rec, bytes):
            return rec
        out = record_from(rec)  # not under the lock a tick's behind() takes
        with self._cond:
            if self._last is rec:
                self._last = out
        return out

    @property
    def pid(self) -> Optional[int]:
        """The worker process's pid."""
        return self._proc.pid

    @property
    def tokens(self) -> float:
        return float(self.stats().get("tokens", 0.0))

    def close(self, timeout: Optional[float] = 30.0) -> None:
        """Stop the child after the hand-offs queued so far (no final round), take its
        seqs back into the user's publisher; safe to call twice."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.wait_for(lambda: not self._queue and not self._in_flight
                                or self._dead is not None, timeout)
            self._cond.notify_all()
        _join(self._shipper, timeout)
        if self._dead is None:
            _ = self.last  # fetched while the child can still send it: read after close too
            try:
                self._send(("close",))
            except OSError:
                pass
            with self._cond:
                self._cond.wait_for(lambda: self._seqs is not None or self._dead is not None,
                                    timeout)
        if self._seqs is not None:
            self._publisher.resume_seqs(self._seqs)
            self._publisher.lend(None)
        else:  # it died: messages past its last report may exist with any seq
            self._publisher.lend(f"the budget worker process {self._proc.pid}, which died "
                                 "(the seqs it used are unknown); publish with a new "
                                 "DeltaPublisher (a new epoch)")
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        # The child is gone: the reader sees EOF. Neither thread may outlive close: one
        # still dropping a hand-off at interpreter exit frees a tensor holding a Python
        # hook after finalization began, which aborts the process (torch's hook destructor
        # takes the GIL; a daemon thread that does then exits by unwinding through it).
        _join(self._reader, timeout)
        self._conn.close()
        self._seg.close()

    # ------------------------------------------------------------------ parent threads

    def _send(self, msg: tuple, payload: Optional[bytearray] = None) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:  # a payload follows its message, nothing between them
            self._conn.send_bytes(data)
            if payload is not None:
                self._conn.send_bytes(payload)

    def _room(self, nbytes: int) -> tuple[bool, Optional[bytearray]]:
        """Room for a hand-off of ``nbytes``: ``(new file, None)`` in the segment, or
        ``(False, buffer)``, a buffer sent through the socket, when the shared-memory
        directory has no room for it (slower, nothing lost; counted and logged)."""
        try:
            return self._seg.fit(nbytes), None
        except OSError as e:
            self.inline_handoffs += 1
            if self.inline_handoffs == 1 or self.inline_handoffs % 100 == 0:
                log.warning("budget publisher: no room for a %d-byte hand-off in %s (%s); "
                            "sent through the socket instead (%d so far)", nbytes,
                            shm_dir(), e, self.inline_handoffs)
            return False, bytearray(nbytes)

    def _ship(self) -> None:
        """Pack queued hand-offs into the segment, one at a time."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: (self._queue and not self._in_flight)
                                    or self._closed or self._dead is not None)
                if not self._queue or self._dead is not None:
                    if self._closed or self._dead is not None:
                        return
                    continue
                h = self._queue.popleft()
                self._in_flight = True
            try:
                h.wait()
                places, nbytes = layout(h)
                new, payload = self._room(nbytes)
                pack(h, places, self._seg.map if payload is None else payload)
                for th in h.tables:
                    th.rows_read()
                meta = dict(describe(h, places), nbytes=nbytes, inline=payload is not None)
                self._send(("handoff", self._seg.path if new else None, meta), payload)
            except BaseException as e:  # a bug here must not stall ticks forever
                log.exception("budget publisher: shipping a hand-off to the worker failed")
                self._fail(f"shipping a hand-off failed: {e}", e)
                return

    def _read(self) -> None:
        while True:
            try:
                msg = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                try:
                    code = self._proc.wait(5.0)
                except subprocess.TimeoutExpired:
                    code = None
                if not (self._closed and self._seqs is not None):
                    self._fail(f"exited (code {code})", None)
                return
            kind = msg[0]
            if kind == "flush":
                msg = (kind, msg[1], record_from(msg[2]))
            if kind == "error":
                with self._cond:
                    self._errors.append(msg[1])
                continue
            with self._cond:
                if kind == "free":
                    self._in_flight = False
                    if msg[1]:  # the child mapped the new file: no one needs its name
                        self._seg.unlink()
                elif kind == "round":
                    _, rec, snap = msg
                    self._stats = snap
                    self._rounds += 1
                    if rec is not None:
                        self._last, self._last_round = rec, self._rounds
                    self.busy_s = float(snap.get("busy_s", self.busy_s))
                    # the user's publisher reports the seqs the child has used so far
                    self._publisher.resume_seqs(snap["next_seq"])
                elif kind == "flush":
                    fut = self._flushes.pop(msg[1], None)
                    if fut is not None:
                        (fut.set_exception if isinstance(msg[2], BaseException)
                         else fut.set_result)(msg[2])
                elif kind == "last":  # the child's last record, after its rounds so far
                    self._answered = max(self._answered, msg[1])
                    if msg[2] is not None:
                        self._last = msg[2]
                    self._last_round = self._rounds
                elif kind == "drained":
                    self._drained = max(self._drained, msg[1])
                    self._stats = msg[2]
                elif kind == "ready":
                    self._stats = msg[1]
                elif kind == "closed":
                    self._seqs = msg[1]
                self._cond.notify_all()
            if kind == "round" and self._on_round is not None:
                try:
                    self._on_round(self.last)
                except Exception:  # the user's callback must not stop the reader
                    log.exception("budget publisher: on_round callback failed")

    def _fail(self, why: str, cause: Optional[BaseException]) -> None:
        err = PublishError(f"budget publisher: the worker process {why}; rows it held "
                           "pending were not delivered and are lost to this publisher "
                           "(republish them with a new DeltaPublisher, a new epoch: the "
                           "worker's last seqs are unknown; e.g. a full publish_delta)")
        err.__cause__ = cause
        with self._cond:
            self._dead, self._death = why, err
            self._errors.append(err)
            for fut in self._flushes.values():
                fut.set_exception(err)
            self._flushes.clear()
            self._cond.notify_all()


def _join(t: threading.Thread, timeout: Optional[float]) -> None:
    """Join ``t`` if it started and is not the caller (``close`` from ``on_round``)."""
    if t.ident is not None and t is not threading.current_thread():
        t.join(timeout)
        if t.is_alive():
            log.warning("budget publisher: thread %s still running after %s s", t.name,
                        timeout)


def _start_child() -> tuple[Any, subprocess.Popen]:
    """A connection to a new worker interpreter (``python -c``: nothing of the user's
    ``__main__`` runs there), and its process. The child gets this interpreter's
    ``sys.path`` and one end of a socket pair; it waits for a ``("start", ...)`` message."""
    mine, theirs = socket.socketpair()
    code = ("import sys, json; sys.path[:0] = json.loads(sys.argv[2]); "
            "from deltastream.publishing.budget_child import child_entry; "
            "child_entry(int(sys.argv[1]))")
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, str(theirs.fileno()),
             json.dumps([p for p in sys.path if p])],
            stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),))
    except BaseException:
        mine.close()
        raise
    finally:
        theirs.close()
    return Connection(mine.detach()), proc
