"""CheckpointWriter: write a daemon's checkpoints in a background thread.

The thread that applies calls :meth:`CheckpointWriter.submit` between two applies: the
:class:`~consumers.storage.checkpoint.CheckpointStore` freezes views of the tables there
(O(changes), no row copied) together with the offsets, and the writing — gathering rows,
hashing, fsync, the commit — runs in a background thread while the tables keep applying
and serving. So a base rewrite of a 10M-row table costs the applying thread a few
milliseconds, not the seconds the I/O takes.

One checkpoint in flight at a time: :meth:`submit` returns False (and freezes nothing)
while the previous one is still being written — call it again later; the next one then
covers everything since. A checkpoint is durable once it appears in :meth:`results` — or,
when :meth:`submit` was given ``on_done``, once that is called with it instead: in the
writing thread, right after the commit (e.g. to publish the offsets it holds elsewhere only
once they are on disk).

The writing thread lowers its own CPU priority (``nice``, 10 by default): it mostly hashes
and writes without the GIL, and readers of the tables should win the CPU when they want
it. (The applying thread is left alone: lowering the priority of a thread that holds the
GIL would make in-process readers wait for it.)
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Optional, Union

from consumers.serving.table import ServingTable
from consumers.storage.checkpoint import CheckpointResult, CheckpointStore, PreparedCheckpoint

__all__ = ["CheckpointWriter", "Outcome"]

log = logging.getLogger(__name__)

#: what a background write ends with: its result, or the exception it raised
Outcome = Union[CheckpointResult, BaseException]


class CheckpointWriter:
    """Background writer of the checkpoints of ``store`` (its only user meanwhile).

    Args:
        store: the checkpoint directory's store.
        nice: niceness the writing thread adds to itself (0: none).
    """

    def __init__(self, store: CheckpointStore, *, nice: int = 10) -> None:
        if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
            raise ValueError(f"nice: expected an int in [0, 19], got {nice!r}")
        self.store = store
        self.nice = nice
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._done: list[Outcome] = []

    @property
    def busy(self) -> bool:
        """True while a checkpoint is being written."""
        with self._cond:
            return self._thread is not None

    def submit(self, *, tables: dict[str, ServingTable], offsets: dict[int, int], seqs: dict,
               meta: dict, on_done: Optional[Callable[[Outcome], None]] = None,
               dense: Optional[bytes] = None) -> bool:
        """Freeze a checkpoint of ``tables`` + offsets + seqs + meta now and write it in the
        background; False (nothing frozen) while the previous one is still being written.
        Call from the thread that applies. ``on_done(outcome)`` runs in the writing thread
        once the write ended (committed and durable, or failed), before :meth:`wait`
        returns, instead of :meth:`results`; a failure is then the caller's to report
        (logged here at DEBUG only). Without ``on_done`` a failure is logged at ERROR.
        ``dense``: the dense versions' state (see :meth:`CheckpointStore.write`).
        Raises what :meth:`CheckpointStore.prepare` raises (bad arguments)."""
        with self._cond:
            if self._thread is not None:
                return False
            prep = self.store.prepare(tables=tables, offsets=offsets, seqs=seqs, meta=meta,
                                      dense=dense)
            self._thread = threading.Thread(target=self._run, args=(prep, on_done),
                                            name=f"checkpoint {self.store.path}", daemon=True)
            self._thread.start()
            return True

    def _run(self, prep: PreparedCheckpoint,
             on_done: Optional[Callable[[Outcome], None]]) -> None:
        if self.nice:
            try:  # this thread only (Linux: a thread is a task)
                tid = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, tid,
                               os.getpriority(os.PRIO_PROCESS, tid) + self.nice)
            except (AttributeError, OSError):
                pass
        out: Outcome
        try:
            out = self.store.finish(prep)
        except BaseException as e:  # reported through results(); the next one is a base
            log.log(logging.DEBUG if on_done else logging.ERROR, "checkpoint to %s failed: "
                    "%s: %s", self.store.path, type(e).__name__, e)
            out = e
        finally:
            prep.release()  # finish() released them; a failure before it must too
        if on_done is not None:
            try:
                on_done(out)
            except Exception:  # a bug in the hook must not wedge the writer
                log.exception("checkpoint to %s: on_done failed", self.store.path)
        with self._cond:
            if on_done is None:
                self._done.append(out)
            self._thread = None
            self._cond.notify_all()

    def results(self) -> list[Outcome]:
        """Checkpoints finished since the last call: results, or the exception a failed
        one raised (nothing of it was committed)."""
        with self._cond:
            out, self._done = self._done, []
            return out

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait until no checkpoint is being written; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._thread is None, timeout)

    def close(self, timeout: Optional[float] = None) -> bool:
        """Wait for the checkpoint in flight (if any); False (logged) on timeout."""
        if self.wait(timeout):
            return True
        log.error("checkpoint to %s still being written after %s s", self.store.path, timeout)
        return False
