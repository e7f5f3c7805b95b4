"""FailureLog: count failures by kind and log them without flooding the log.

The sync daemon keeps serving when its state disk is full or read-only: a failed quarantine
or checkpoint write is counted (``stats()["write_errors"]``, the Prometheus counter
``deltastream_sync_write_errors_total{what=...}``) and logged — the first failure of a kind
at once at ERROR, then at most one line per ``interval`` seconds saying how many more
failed meanwhile, and one INFO line when that kind works again.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

__all__ = ["FailureLog"]

log = logging.getLogger(__name__)


class FailureLog:
    """Failure counts by kind (``what``), logged rate-limited. Thread-safe.

    Args:
        kinds: the kinds reported by :meth:`counts` even before they fail.
        interval: seconds between two log lines of one kind while it keeps failing.
        logger: where to log (default: this module's).
    """

    def __init__(self, kinds: tuple[str, ...] = (), interval: float = 60.0,
                 logger: Optional[logging.Logger] = None) -> None:
        if not interval > 0:
            raise ValueError(f"interval: expected positive seconds, got {interval!r}")
        self.interval = float(interval)
        self._log = logger or log
        self._counts = dict.fromkeys(kinds, 0)
        self._failing: dict[str, int] = {}  # kind -> failures since it last worked
        self._next_line: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def failed(self, what: str, message: str) -> None:
        """Count one failure of ``what``; ``message`` says what failed and why."""
        now = time.monotonic()
        with self._lock:
            self._counts[what] = self._counts.get(what, 0) + 1
            self._failing[what] = self._failing.get(what, 0) + 1
            if now < self._next_line.get(what, 0.0):
                self._suppressed[what] = self._suppressed.get(what, 0) + 1
                return
            more = self._suppressed.pop(what, 0)
            self._next_line[what] = now + self.interval
        extra = f" ({more} more {what} failures since the last report)" if more else ""
        self._log.error("%s%s; counted in write_errors[%r], retried later, serving "
                        "continues", message, extra, what)

    def recovered(self, what: str, message: str) -> None:
        """``what`` worked again: log ``message`` once if it had been failing."""
        with self._lock:
            failures = self._failing.pop(what, 0)
            self._suppressed.pop(what, None)
            self._next_line.pop(what, None)
        if failures:
            self._log.info("%s (after %d failures)", message, failures)

    def failing(self, what: str) -> bool:
        """True while ``what`` failed and has not worked since."""
        with self._lock:
            return what in self._failing

    def counts(self) -> dict[str, int]:
        """kind -> failures counted (a copy)."""
        with self._lock:
            return dict(self._counts)
