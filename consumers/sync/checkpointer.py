"""Checkpointer: when and how the sync daemon checkpoints, and what it does when it can't.

A checkpoint (tables + next offset per partition + seq state, written atomically by a
:class:`~consumers.storage.checkpoint.CheckpointStore`) is due when records were read
and ``checkpoint_interval`` seconds or ``checkpoint_messages`` records passed since the
last one started, and on stop. It is **written in the background**
(:class:`~consumers.storage.background.CheckpointWriter`): :meth:`Checkpointer.start`, in
the loop thread between two records, freezes views of the tables with the offsets and
seq state of that instant (O(changes), no row copied); a writing thread writes and
commits them while the loop keeps applying and readers keep reading. One checkpoint is in
flight at a time. Meanwhile the next one is due only once ``checkpoint_messages`` records
are pending — then the loop waits for the one in flight (backpressure: what a crash makes
the daemon re-read stays bounded); otherwise the next one comes later and covers
everything since. Then:

* **quarantine first** — the quarantine file is flushed and fsynced before the freeze: a
  checkpoint's offsets never pass a record whose quarantine line is not on disk. While
  the quarantine cannot be written, no checkpoint is started (after a restart such records
  are read and quarantined again); the records still count as quarantined in memory.
* **write failures are not fatal** — a failed write (``ENOSPC``, ``EROFS``, ``EIO`` ...)
  is counted under ``write_errors`` (``"checkpoint"`` or ``"quarantine"``), logged
  rate-limited (:class:`~consumers.sync.failures.FailureLog`) and retried with backoff:
  after the k-th failure in a row, not before ``min(60 s, interval × 2^(k-1))``. Serving
  goes on from memory meanwhile; the next try writes a full base.
* **consumer group** — once a checkpoint is durable (in the writing thread, right after
  its commit, so never before and never blocking the loop), its offsets of the assigned
  partitions are committed to the consumer group
  (:class:`~consumers.sync.group_offsets.GroupCommitter`) for lag tools; the checkpoint
  stays the source of truth.
* **the loop's bookkeeping** — records pending since the last checkpoint
  (:meth:`Checkpointer.note`), whether anything changed (``dirty``), the count across
  restarts (``total``, in the checkpoint's meta) and when the last one was written live
  here and change in the loop thread only: :meth:`Checkpointer.checkpoint` starts one
  and takes the pending records off; :meth:`Checkpointer.settle` (called by the loop)
  counts what the writer finished and gives a failed checkpoint's records back.

The lower level — :meth:`Checkpointer.start` with a ``tag``, :meth:`Checkpointer.finished`
— is what :meth:`Checkpointer.checkpoint` / :meth:`Checkpointer.settle` are built on;
:meth:`Checkpointer.write` is start + wait for a single caller (tests).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any, Optional

from consumers.quarantine import Quarantine
from consumers.serving.table import ServingTable
from consumers.storage.background import CheckpointWriter, Outcome
from consumers.storage.checkpoint import CheckpointResult, CheckpointStore
from consumers.sync.failures import FailureLog
from consumers.sync.group_offsets import GroupCommitter

__all__ = ["Checkpointer", "RETRY_MAX_S"]

log = logging.getLogger(__name__)

RETRY_MAX_S = 60.0  #: longest wait between two tries of a failing checkpoint


class Checkpointer:
    """The daemon's checkpoint writer: called from its loop thread only, except the
    counters (``written``, ``last``, ``total``, ``pending``, ...) and :attr:`busy`, which
    may be read from any thread.

    Args:
        store: where checkpoints go. quarantine: flushed before each checkpoint.
        failures: counts and logs write failures (``"checkpoint"``, ``"quarantine"``).
        committer: commits offsets to a consumer group after each checkpoint (None: off).
        interval: seconds between checkpoints while records arrive (also the first retry
            delay). messages: records after which a checkpoint is due regardless of time.
        nice: CPU niceness of the writing thread (see
            :class:`~consumers.storage.background.CheckpointWriter`).
        total: checkpoints written before (across restarts). written_at: wall time of the
            last one (None: unknown). dirty: there is something to checkpoint already
            (e.g. state loaded from a base snapshot).
    """

    def __init__(self, store: CheckpointStore, quarantine: Quarantine, failures: FailureLog,
                 committer: Optional[GroupCommitter], *, interval: float,
                 messages: int, nice: int = 10, total: int = 0,
                 written_at: Optional[float] = None, dirty: bool = False) -> None:
        self.store = store
        self.quarantine = quarantine
        self.failures = failures
        self.committer = committer
        self.interval = interval
        self.messages = messages
        #: the background writer
        self.writer = CheckpointWriter(store, nice=nice)
        self.written = 0  #: checkpoints written by this process
        self.last: Optional[dict] = None  #: kind, bytes, rows, deleted, seconds of the last
        self._lock = threading.Lock()  # backoff state: set by the writing thread
        self._failed_in_row = 0
        self._last_mono = time.monotonic()
        self._next_try = 0.0  # monotonic; a failing checkpoint is not retried before it
        self._finished: list[tuple[Any, Optional[CheckpointResult]]] = []
        # the loop's bookkeeping (changed by the loop thread only)
        self.pending = 0  #: records read and not in a checkpoint written or in flight
        self.dirty = bool(dirty)  #: something to checkpoint: records, or the position moved
        self.total = int(total)  #: checkpoints written, across restarts
        self.written_at = written_at  #: wall time of the last checkpoint written

    def note(self, records: int = 1) -> None:
        """``records`` were read (loop thread); with 0, only the position moved."""
        self.pending += records
        self.dirty = True

    def due_now(self, now: Optional[float] = None) -> bool:
        """:meth:`due` for the records noted here."""
        return self.due(self.pending, self.dirty, now)

    def checkpoint(self, tables: dict[str, ServingTable], offsets: dict[int, int],
                   seqs: dict, meta: dict, *, commit: Optional[Mapping[int, int]] = None,
                   wait: bool = True, dense: Optional[bytes] = None) -> bool:
        """Start checkpoint number ``total + 1`` (loop thread, between records; call
        :meth:`ready` first, and number ``meta`` after it). ``wait``: until it is durable —
        True when written; else True when started. Failures are counted and logged, never
        raised; its records are pending again when it fails. ``dense``: the dense
        versions' state of the same instant."""
        n = self.total + 1
        log.debug("checkpoint %d begin (%s): offsets %s", n, self.store.plan(tables), offsets)
        if not self.start(tables, offsets, seqs, meta, commit=commit, dense=dense,
                          tag=(n, self.pending, time.monotonic())):
            return False
        self.pending, self.dirty = 0, False  # in flight; given back if it fails
        return not wait or (self.wait() and self.settle() == n)

    def ready(self, wait: bool = True) -> bool:
        """:meth:`settle`; then True when no checkpoint is in flight — after waiting for
        the one in flight (and settling it) with ``wait``, or when ``messages`` records
        are pending: that many records not in any checkpoint make the loop wait
        (backpressure, like a synchronous write; readers are not affected)."""
        self.settle()
        if not self.busy:
            return True
        if wait or self.pending >= self.messages:
            self.wait()
            self.settle()
            return True
        return False

    def settle(self) -> Optional[int]:
        """Account for the checkpoints the writer finished (loop thread): count those
        written, give a failed one's records back. Returns the number of the last one
        written, if any. Cheap when there is nothing to settle (call it per record)."""
        if not self._finished:  # read without the lock: the writer only ever adds
            return None
        last = None
        for (n, pending, t0), res in self.finished():
            if res is None:  # nothing committed: its records are pending again
                self.pending += pending
                self.dirty = True
                continue
            self.total = last = n
            self.written_at = time.time()
            log.debug("checkpoint %d written in %.1f ms (%s: %d rows, %d deleted, %d bytes)",
                      n, (time.monotonic() - t0) * 1e3, res.kind, res.upserts, res.deletes,
                      res.bytes)
        return last

    @property
    def retry_at(self) -> Optional[float]:
        """Monotonic time before which a failed checkpoint is not retried (None: no
        failure pending)."""
        with self._lock:
            return self._next_try if self._failed_in_row else None

    @property
    def busy(self) -> bool:
        """True while a checkpoint is being written."""
        return self.writer.busy

    def due(self, pending: int, dirty: bool, now: Optional[float] = None) -> bool:
        """True when a checkpoint should be started now: ``pending`` records read (or the
        position moved, ``dirty``) and the interval reached with none in flight, or the
        record count reached (then :meth:`ready` waits for the one in flight), and no
        failed try backing off."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if not dirty or now < self._next_try:
                return False
            if pending >= self.messages:
                return True
            if now - self._last_mono < self.interval:
                return False
        return not self.writer.busy

    def _failed(self, what: str, message: str) -> None:
        with self._lock:
            self._failed_in_row += 1
            delay = min(RETRY_MAX_S, self.interval * 2 ** min(self._failed_in_row - 1, 16))
            self._last_mono = time.monotonic()
            self._next_try = self._last_mono + delay
        self.failures.failed(what, message)

    def start(self, tables: dict[str, ServingTable], offsets: dict[int, int], seqs: dict,
              meta: dict, *, commit: Optional[Mapping[int, int]] = None,
              tag: Any = None, dense: Optional[bytes] = None) -> bool:
        """Flush the quarantine, then freeze one checkpoint and write it in the background;
        once durable, commit ``commit`` (partition -> next offset) to the consumer group.
        False when nothing was started: one is in flight, or the quarantine could not be
        written (counted and logged; retried later). Its outcome comes back with ``tag``
        from :meth:`finished`."""
        if self.writer.busy:
            return False
        q = self.quarantine
        if not q.flush(sync=True):
            why = q.last_error if q.last_error is not None else (
                f"{q.dropped} lines did not fit the in-memory backlog; restart the daemon "
                "once the disk is writable")
            self._failed("quarantine", f"quarantine {q.path}: {q.backlog} lines not written "
                         f"({why}); checkpoint {self.store.path} held back so its offsets "
                         "do not pass them")
            return False
        self.failures.recovered("quarantine", f"quarantine {q.path} writable again")
        commit = dict(commit) if commit else None
        with self._lock:
            self._last_mono = time.monotonic()
        return self.writer.submit(tables=tables, offsets=offsets, seqs=seqs, meta=meta,
                                  on_done=lambda out: self._done(out, tag, commit),
                                  dense=dense)

    def _done(self, out: Outcome, tag: Any, commit: Optional[dict[int, int]]) -> None:
        """In the writing thread, once the write ended: count it, commit the offsets."""
        if not isinstance(out, CheckpointResult):
            self._failed("checkpoint", f"checkpoint to {self.store.path} failed: "
                         f"{type(out).__name__}: {out}")
            with self._lock:
                self._finished.append((tag, None))
            return
        self.failures.recovered("checkpoint", f"checkpoint to {self.store.path} written "
                                "again")
        with self._lock:
            self._failed_in_row = 0
            self._next_try = 0.0
            self.written += 1
            self.last = {"kind": out.kind, "bytes": out.bytes, "rows": out.upserts,
                         "deleted": out.deletes, "seconds": out.seconds}
            self._finished.append((tag, out))
        if self.committer is not None and commit:  # durable now: lag tools may see it
            errors = self.committer.errors
            if not self.committer.commit(commit) and self.committer.errors > errors:
                log.log(logging.WARNING if self.committer.errors == 1 else logging.DEBUG,
                        "committing offsets to consumer group %r failed: %s (counted in "
                        "group_commit_errors; the checkpoint is the source of truth)",
                        self.committer.group_id, self.committer.last_error)

    def finished(self) -> list[tuple[Any, Optional[CheckpointResult]]]:
        """``(tag, result)`` of each checkpoint ended since the last call, in order;
        result None for one that failed (nothing of it committed)."""
        with self._lock:
            out, self._finished = self._finished, []
        return out

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait until no checkpoint is being written (its group commit included); False
        on timeout."""
        return self.writer.wait(timeout)

    def write(self, tables: dict[str, ServingTable], offsets: dict[int, int], seqs: dict,
              meta: dict, *, commit: Optional[Mapping[int, int]] = None
              ) -> Optional[CheckpointResult]:
        """:meth:`start` one checkpoint (after the one in flight) and wait for it. Returns
        its result, or None when nothing was written (counted and logged; retried
        later). Outcomes of earlier starts are dropped: use :meth:`finished` first."""
        self.wait()
        self.finished()
        tag = object()
        if not self.start(tables, offsets, seqs, meta, commit=commit, tag=tag):
            return None
        self.wait()
        return next((res for t, res in self.finished() if t is tag), None)

    def close(self, timeout: Optional[float] = None) -> None:
        """Wait for the checkpoint in flight (its outcome stays for :meth:`finished`),
        then release the consumer-group client."""
        if self.writer.close(timeout) and self.committer is not None:
            self.committer.close()
