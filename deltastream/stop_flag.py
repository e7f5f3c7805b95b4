"""A stop request that a signal handler may raise.

``threading.Event.set`` takes the event's lock, and so does ``Event.wait`` while it checks
the flag. A SIGTERM handler runs in the main thread between two bytecodes — possibly while
that same thread is inside ``wait`` holding the lock — and its ``set()`` then waits forever
for a lock its own thread holds: the process ignores SIGTERM until it is killed. (The
foreground broker did so in one full run of the test suite on a slow machine.)

:class:`StopFlag` takes no lock: ``set`` stores a flag and writes one byte to a pipe, and
``wait`` polls the pipe's other end, so a ``set`` between the check and the poll still wakes
it. Safe from signal handlers and from any thread.
"""

from __future__ import annotations

import os
import select
import weakref
from typing import Optional

__all__ = ["StopFlag"]


def _close(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class StopFlag:
    """A one-way flag (set once, never cleared) with a wait that a set wakes, with the
    interface of ``threading.Event`` less ``clear``."""

    def __init__(self) -> None:
        self._set = False
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)  # a second set must not block on a full pipe
        weakref.finalize(self, _close, self._r, self._w)

    def set(self) -> None:
        """Raise the flag and wake every waiter (no lock taken)."""
        self._set = True
        try:
            os.write(self._w, b"\0")
        except OSError:  # the pipe is full (waiters are awake already) or closed
            pass

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait until the flag is set or ``timeout`` seconds passed (None: no limit);
        returns whether it is set."""
        if self._set:
            return True
        poller = select.poll()  # one per call: a poll object refuses concurrent waits
        poller.register(self._r, select.POLLIN)
        poller.poll(None if timeout is None else max(0.0, timeout) * 1e3)
        return self._set
