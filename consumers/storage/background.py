"""CheckpointWriter: write a daemon's checkpoints in a background thread.

The thread that applies calls :meth:`CheckpointWriter.submit` between two applies: the
:class:`~consumers.storage.checkpoint.CheckpointStore` freezes views of the tables there
(O(changes), no row copied) together with the offsets, and the writing — gathering rows,
hashing, fsync, the commit — runs in a background thread while the tables keep applying
and serving. So a base rewrite of a 10M-row table costs the applying thread a few
milliseconds, not the seconds the I/O takes.

One checkpoint in flight at a time: :meth:`submit` returns False (and freezes nothing)
while the previous one is still being written — call it again later; the next one then
covers everything since. A checkpoint is durable once it appears in :meth:`results`.

The writing thread lowers its own CPU priority (``nice``, 10 by default): it mostly hashes
and writes without the GIL, and readers of the tables should win the CPU when they want
it. (The applying thread is left alone: lowering the priority of a thread that holds the
GIL would make in-process readers wait for it.)
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Optional, Union

from consumers.serving_table import ServingTable
from consumers.storage.checkpoint import CheckpointResult, CheckpointStore, PreparedCheckpoint

__all__ = ["CheckpointWriter"]

log = logging.getLogger(__name__)


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
        self._done: list[Union[CheckpointResult, BaseException]] = []

    @property
    def busy(self) -> bool:
        """True while a checkpoint is being written."""
        with self._cond:
            return self._thread is not None

    def submit(self, *, tables: dict[str, ServingTable], offsets: dict[int, int], seqs: dict,
               meta: dict) -> bool:
        """Freeze a checkpoint of ``tables`` + offsets + seqs + meta now and write it in the
        background; False (nothing frozen) while the previous one is still being written.
        Call from the thread that applies. Raises what
        :meth:`CheckpointStore.prepare` raises (bad arguments)."""
        with self._cond:
            if self._thread is not None:
                return False
            prep = self.store.prepare(tables=tables, offsets=offsets, seqs=seqs, meta=meta)
            self._thread = threading.Thread(target=self._run, args=(prep,),
                                            name=f"checkpoint {self.store.path}", daemon=True)
            self._thread.start()
            return True

    def _run(self, prep: PreparedCheckpoint) -> None:
        if self.nice:
            try:  # this thread only (Linux: a thread is a task)
                tid = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, tid,
                               os.getpriority(os.PRIO_PROCESS, tid) + self.nice)
            except (AttributeError, OSError):
                pass
        try:
            out: Union[CheckpointResult, BaseException] = self.store.finish(prep)
        except BaseException as e:  # reported through results(); the next one is a base
            log.error("checkpoint to %s failed: %s", self.store.path, e)
            out = e
        with self._cond:
            self._done.append(out)
            self._thread = None
            self._cond.notify_all()

    def results(self) -> list[Union[CheckpointResult, BaseException]]:
        """Checkpoints finished since the last call: results, or the exception a failed
        one raised (nothing of it was committed)."""
        with self._cond:
            out, self._done = self._done, []
            return out

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait until no checkpoint is being written; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._thread is None, timeout)

    def close(self, timeout: Optional[float] = None) -> None:
        """Wait for the checkpoint in flight (if any)."""
        if not self.wait(timeout):
            log.error("checkpoint to %s still being written after %s s", self.store.path,
                      timeout)
