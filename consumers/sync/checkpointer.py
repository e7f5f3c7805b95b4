"""Checkpointer: when and how the sync daemon checkpoints, and what it does when it can't.

A checkpoint (tables + next offset per partition + seq state, written atomically by a
:class:`~consumers.storage.checkpoint.CheckpointStore`) is written when records were read
and ``checkpoint_interval`` seconds or ``checkpoint_messages`` records passed since the
last one, and on stop. Then:

* **quarantine first** — the quarantine file is flushed and fsynced before the checkpoint:
  a checkpoint's offsets never pass a record whose quarantine line is not on disk. While
  the quarantine cannot be written, no checkpoint is written (after a restart such records
  are read and quarantined again); the records still count as quarantined in memory.
* **write failures are not fatal** — a failed write (``ENOSPC``, ``EROFS``, ``EIO`` ...)
  is counted under ``write_errors`` (``"checkpoint"`` or ``"quarantine"``), logged
  rate-limited (:class:`~consumers.sync.failures.FailureLog`) and retried with backoff:
  after the k-th failure in a row, not before ``min(60 s, interval × 2^(k-1))``. Serving
  goes on from memory meanwhile.
* **consumer group** — after a checkpoint, its offsets of the assigned partitions are
  committed to the consumer group (:class:`~consumers.sync.group_offsets.GroupCommitter`)
  for lag tools; the checkpoint stays the source of truth.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Optional

from consumers.quarantine import Quarantine
from consumers.serving_table import ServingTable
from consumers.storage.checkpoint import CheckpointResult, CheckpointStore
from consumers.sync.failures import FailureLog
from consumers.sync.group_offsets import GroupCommitter

__all__ = ["Checkpointer", "RETRY_MAX_S"]

log = logging.getLogger(__name__)

RETRY_MAX_S = 60.0  #: longest wait between two tries of a failing checkpoint


class Checkpointer:
    """The daemon's checkpoint writer (called from its loop thread only).

    Args:
        store: where checkpoints go. quarantine: flushed before each checkpoint.
        failures: counts and logs write failures (``"checkpoint"``, ``"quarantine"``).
        committer: commits offsets to a consumer group after each checkpoint (None: off).
        interval: seconds between checkpoints while records arrive (also the first retry
            delay). messages: records after which a checkpoint is due regardless of time.
    """

    def __init__(self, store: CheckpointStore, quarantine: Quarantine, failures: FailureLog,
                 committer: Optional[GroupCommitter], *, interval: float,
                 messages: int) -> None:
        self.store = store
        self.quarantine = quarantine
        self.failures = failures
        self.committer = committer
        self.interval = interval
        self.messages = messages
        self.written = 0  #: checkpoints written by this process
        self.last: Optional[dict] = None  #: kind, bytes, rows, deleted, seconds of the last
        self._failed_in_row = 0
        self._last_mono = time.monotonic()
        self._next_try = 0.0  # monotonic; a failing checkpoint is not retried before it

    @property
    def retry_at(self) -> Optional[float]:
        """Monotonic time before which a failed checkpoint is not retried (None: no
        failure pending)."""
        return self._next_try if self._failed_in_row else None

    def due(self, pending: int, dirty: bool, now: Optional[float] = None) -> bool:
        """True when a checkpoint should be written now: ``pending`` records read (or the
        position moved, ``dirty``) and the interval or record count reached, and no
        failed try is backing off."""
        now = time.monotonic() if now is None else now
        if not dirty or now < self._next_try:
            return False
        return pending >= self.messages or now - self._last_mono >= self.interval

    def _failed(self, what: str, message: str) -> None:
        self._failed_in_row += 1
        delay = min(RETRY_MAX_S, self.interval * 2 ** min(self._failed_in_row - 1, 16))
        self._last_mono = time.monotonic()
        self._next_try = self._last_mono + delay
        self.failures.failed(what, message)

    def write(self, tables: dict[str, ServingTable], offsets: dict[int, int], seqs: dict,
              meta: dict, *, commit: Optional[Mapping[int, int]] = None
              ) -> Optional[CheckpointResult]:
        """Flush the quarantine, then write one checkpoint; on success commit ``commit``
        (partition -> next offset) to the consumer group. Returns the result, or None when
        nothing was written (counted and logged; retried later)."""
        q = self.quarantine
        if not q.flush(sync=True):
            why = q.last_error if q.last_error is not None else (
                f"{q.dropped} lines did not fit the in-memory backlog; restart the daemon "
                "once the disk is writable")
            self._failed("quarantine", f"quarantine {q.path}: {q.backlog} lines not written "
                         f"({why}); checkpoint {self.store.path} held back so its offsets "
                         "do not pass them")
            return None
        self.failures.recovered("quarantine", f"quarantine {q.path} writable again")
        try:
            res = self.store.write(tables=tables, offsets=offsets, seqs=seqs, meta=meta)
        except Exception as e:  # a full disk must not stop serving; retried with backoff
            self._failed("checkpoint", f"checkpoint to {self.store.path} failed: "
                         f"{type(e).__name__}: {e}")
            return None
        self.failures.recovered("checkpoint", f"checkpoint to {self.store.path} written "
                                "again")
        self._failed_in_row = 0
        self._next_try = 0.0
        self._last_mono = time.monotonic()
        self.written += 1
        self.last = {"kind": res.kind, "bytes": res.bytes, "rows": res.upserts,
                     "deleted": res.deletes, "seconds": res.seconds}
        if self.committer is not None and commit:
            errors = self.committer.errors
            if not self.committer.commit(commit) and self.committer.errors > errors:
                log.log(logging.WARNING if self.committer.errors == 1 else logging.DEBUG,
                        "committing offsets to consumer group %r failed: %s (counted in "
                        "group_commit_errors; the checkpoint is the source of truth)",
                        self.committer.group_id, self.committer.last_error)
        return res

    def close(self) -> None:
        """Release the consumer-group client."""
        if self.committer is not None:
            self.committer.close()
