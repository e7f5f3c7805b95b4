"""InFlight: the messages a :class:`~deltastream.DeltaPublisher` handed to the producer and
that are not resolved yet (acknowledged or failed).

It bounds their bytes (``buffer_bytes``: :meth:`InFlight.reserve` waits for room, which is
the publisher's backpressure; one message is always let through), releases them from the
head of the queue as they resolve (counting ``acked_messages`` and ``failed_messages``),
keeps the failures the producer reports from its sender thread until the publisher raises
them, and says which are still unresolved at a flush.
"""

from __future__ import annotations

import collections
import threading
import time

from deltastream.publishing.results import SentMessage, wait_future

__all__ = ["InFlight"]


class InFlight:
    """Messages awaiting acknowledgement, at most ``buffer_bytes`` of them (bytes).

    ``counts`` is the publisher's stats dict: ``acked_messages``, ``failed_messages`` and
    ``blocked_s`` (seconds :meth:`reserve` waited) are counted there. Every method but
    :meth:`failed` is called under the publisher's lock.
    """

    def __init__(self, buffer_bytes: int, counts: dict) -> None:
        self.buffer_bytes = buffer_bytes
        self.pending_bytes = 0  #: bytes of the messages not released yet
        self._counts = counts
        self._pending: collections.deque[SentMessage] = collections.deque()
        self._failed: list[SentMessage] = []
        self._fail_lock = threading.Lock()  # failed() runs on the producer's sender thread

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, record: SentMessage) -> None:
        """``record`` was handed to the producer."""
        self._pending.append(record)
        self.pending_bytes += record.nbytes

    def failed(self, record: SentMessage) -> None:
        """The producer failed to deliver ``record`` (its sender thread)."""
        with self._fail_lock:
            self._failed.append(record)

    def reap(self) -> None:
        """Release acknowledged (or failed) messages from the head of the queue."""
        while self._pending and self._pending[0].future.is_done:
            s = self._pending.popleft()
            self.pending_bytes -= s.nbytes
            if s.future.exception is None:
                self._counts["acked_messages"] += 1
            else:
                self._counts["failed_messages"] += 1

    def has_new_failures(self) -> bool:
        """A failure not reported to the caller yet is waiting."""
        return any(not r.reported for r in self._failed)

    def take_failures(self) -> list[SentMessage]:
        """The failures not reported yet (forgotten here; the caller reports them)."""
        with self._fail_lock:
            failed, self._failed = self._failed, []
        return [s for s in failed if not s.reported]

    def reserve(self, nbytes: int, deadline: float) -> bool:
        """Wait until ``nbytes`` more fit in the buffer (or a new failure frees room and
        must surface now); False at ``deadline`` (monotonic seconds)."""
        self.reap()
        if self.pending_bytes + nbytes <= self.buffer_bytes or not self._pending:
            return True
        t0 = time.monotonic()
        try:
            while self._pending and self.pending_bytes + nbytes > self.buffer_bytes:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                wait_future(self._pending[0].future, remaining)
                self.reap()
                if self.has_new_failures():  # frees space, but must surface now
                    return True
            return True
        finally:
            self._counts["blocked_s"] += time.monotonic() - t0

    def resolve_all(self, deadline: float) -> bool:
        """Wait for every message until ``deadline``; False when one is still unresolved
        then (stops at the first)."""
        return all(wait_future(s.future, max(0.0, deadline - time.monotonic()))
                   for s in list(self._pending))

    def wait_all(self, deadline: float) -> None:
        """Wait for every message until ``deadline`` (each gets what is left of it)."""
        for s in list(self._pending):
            wait_future(s.future, max(0.0, deadline - time.monotonic()))

    def unresolved(self) -> list[SentMessage]:
        """Messages not resolved and not reported yet."""
        return [s for s in self._pending if not s.future.is_done and not s.reported]

    def not_done(self) -> int:
        """How many messages have no outcome yet."""
        return sum(not s.future.is_done for s in self._pending)
