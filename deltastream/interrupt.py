"""Ctrl-C for one-shot CLIs: exit 130 with one line, even when a library drops the interrupt.

The first SIGINT raises ``KeyboardInterrupt`` as Python's own handler does: the command
unwinds, its ``except KeyboardInterrupt`` says the one line (:meth:`Interrupt.say`) and it
exits :data:`~deltastream.cliargs.EXIT_INTERRUPTED`. That fails when a library catches the
exception — kafka-python's event loop logs and drops any exception raised inside one of its
tasks, and then goes on waiting for the broker up to the command's ``--timeout``. So the
first SIGINT also starts a watchdog: if the command has not returned ``grace`` seconds
later, the watchdog says the line (once) and ends the process with the same code. A second SIGINT does that at once, as users
expect of a stuck tool. Ending without unwinding is safe for the read-only and
atomic-writing commands this guards; it is what a ``kill -9`` would do anyway. Leaving the
``with`` block stops the watchdog, so a caller of ``main()`` in its own process lives on.

Usage, in a CLI's ``main``::

    with Interrupt(f"{PROG} {cmd}: interrupted") as intr:
        try:
            return run(args)
        except KeyboardInterrupt:
            return intr.say()
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import Any, Optional

from deltastream.cliargs import EXIT_INTERRUPTED

__all__ = ["Interrupt", "GRACE_S"]

#: seconds the process may take to unwind after the first SIGINT before it is ended
GRACE_S = 5.0


class Interrupt:
    """Context manager installing the SIGINT handler above (main thread only; elsewhere, and
    where SIGINT was ignored, it leaves the handler alone), restoring the previous one on
    exit. ``line``: what to say on stderr, once; ``grace``: seconds (> 0)."""

    def __init__(self, line: str, grace: float = GRACE_S) -> None:
        if not isinstance(line, str) or not line:
            raise ValueError(f"interrupt: line must be a non-empty str, got {line!r}")
        if not grace > 0:
            raise ValueError(f"interrupt: grace must be > 0 seconds, got {grace!r}")
        self.line, self.grace = line, float(grace)
        self._lock = threading.RLock()  # the handler may run while the main thread says it
        self._said = False
        self._signalled = False
        self._left = threading.Event()
        self._previous: Any = None

    def say(self) -> int:
        """Write the line to stderr unless it was written already; returns
        :data:`EXIT_INTERRUPTED`."""
        with self._lock:
            if not self._said:
                self._said = True
                print(self.line, file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED

    def _end(self) -> None:
        self.say()
        os._exit(EXIT_INTERRUPTED)  # no unwinding: whatever held the exit up stays put

    def _watch(self) -> None:
        if not self._left.wait(self.grace):
            self._end()

    def _on_sigint(self, signum: int, frame: Optional[FrameType]) -> None:
        if self._signalled:
            self._end()
        self._signalled = True
        threading.Thread(target=self._watch, name="interrupt-watchdog", daemon=True).start()
        raise KeyboardInterrupt

    def __enter__(self) -> Interrupt:
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if previous is not signal.SIG_IGN:  # started in the background: stay deaf
                self._previous = previous
                signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc: object) -> None:
        self._left.set()
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
