"""StallWatch: why a sync daemon is not syncing, said at WARNING every minute, and its
start-up deadline.

A daemon that cannot sync — no broker answers, the topic does not exist, or the topic holds
only other models' messages (a wrong ``--model``) — keeps retrying: a broker may come up
and a trainer may create the topic later. The first change is logged where it happens (the
broker state change, the first message of another model); this watch then repeats the
reason at WARNING every ``interval`` seconds while it lasts (an operator tailing the log
always sees why nothing is served), and says once at INFO when syncing resumes.

With ``startup_timeout`` > 0 (``--startup-timeout``, for scripts), a daemon that has not
started syncing within that many seconds while such a reason holds raises
:class:`StartupTimeout` out of ``run()``; ``deltastream-sync`` exits 3 (broker or topic
unavailable) or 2 (only other models' messages: a usage error).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Optional

from consumers.errors import ConsumerError

__all__ = ["StallWatch", "StartupTimeout", "stall_reason"]

log = logging.getLogger(__name__)


class StartupTimeout(ConsumerError):
    """The daemon did not start syncing within its ``startup_timeout``. ``kind``:
    ``"unavailable"`` (broker or topic) or ``"model"`` (only other models' messages)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


def stall_reason(stats: Mapping[str, Any], detail: str, servers: str
                 ) -> Optional[tuple[str, str]]:
    """``(kind, why)`` when a daemon with these ``stats()`` cannot sync, else ``None``.

    ``detail``: the broker's last state change reason (e.g. ``connection refused``).
    """
    broker = stats["broker"]
    if broker == "stopped":
        return None
    if broker != "connected":
        return "unavailable", (f"broker {servers}: {broker.replace('_', ' ')}"
                               + (f" ({detail})" if detail else ""))
    if not stats["applied"] and stats["foreign_model"]:
        models = ", ".join(sorted(stats["foreign_models"])) or "?"
        return "model", (f"{stats['foreign_model']} messages of other models ({models}) "
                         f"and none of model {stats['model']!r} (--model)")
    return None


class StallWatch:
    """Feed it ``stats()`` with :meth:`check` (from the daemon's loop, any rate); it logs
    and enforces the deadline (see the module docstring).

    Args:
        startup_timeout: seconds to start syncing (0 = wait forever).
        interval: seconds between two WARNING lines while a reason holds.
        t0: when the daemon started (``time.monotonic()``).
    """

    def __init__(self, startup_timeout: float, t0: float, interval: float = 60.0) -> None:
        self.startup_timeout = float(startup_timeout)
        self.interval = float(interval)
        self._t0 = t0
        self._started = False
        self._since: Optional[float] = None
        self._next = 0.0

    @staticmethod
    def syncing(stats: Mapping[str, Any]) -> bool:
        """Connected and applied a message of its model, or caught up with no other
        model's messages (an empty topic is a start)."""
        return stats["broker"] == "connected" and bool(
            stats["applied"] or (not stats["lag_total"] and not stats["foreign_model"]))

    def check(self, now: float, stats: Mapping[str, Any], detail: str, servers: str) -> None:
        """Log the reason the daemon is not syncing when due; raise
        :class:`StartupTimeout` once the start-up deadline passed with a reason holding."""
        self._started = self._started or self.syncing(stats)
        reason = stall_reason(stats, detail, servers)
        if reason is None:
            if self._since is not None:
                log.info("sync %s: syncing after %.0f s", stats["topic"], now - self._since)
            self._since = None
            return
        kind, why = reason
        if self._since is None:  # the change itself was logged where it happened
            self._since, self._next = now, now + self.interval
        elif now >= self._next:
            self._next = now + self.interval
            log.warning("sync %s: not syncing for %.0f s: %s; retrying", stats["topic"],
                        now - self._since, why)
        if not self._started and self.startup_timeout \
                and now - self._t0 >= self.startup_timeout:
            raise StartupTimeout(f"not syncing after {self.startup_timeout:g} s "
                                 f"(--startup-timeout): {why}", kind)
