"""Waiting until a sync daemon has read everything published so far.

The target is the end offset of each assigned partition, measured once when the wait
starts (retried until the broker answers); the wait is over when every assigned position
reached it (:func:`consumers.sync.metrics.reached`). :func:`wait_for_end` serves both
``SyncDaemon.catch_up`` (doing the sync work itself between checks) and
``SyncDaemon.wait_caught_up`` (sleeping while another thread runs the daemon).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from consumers.sync.metrics import reached

__all__ = ["wait_for_end"]

log = logging.getLogger(__name__)


def wait_for_end(measure: Callable[[], dict[int, int]], positions: Callable[[], dict[int, int]],
                 *, timeout: float, step: Callable[[float], Any],
                 ready: Callable[[], bool] = lambda: True,
                 stopped: Callable[[], bool] = lambda: False) -> bool:
    """True when ``positions()`` reached the end offsets ``measure()`` returned (measured
    once) within ``timeout`` seconds while ``ready()``.

    ``step(seconds)`` is called between checks with the time left (at most 0.5 s): sync
    work, or a sleep. Stops early (False unless reached) once ``stopped()``.
    """
    deadline = time.monotonic() + timeout
    target = None
    while True:
        if target is None:
            try:
                target = measure()
            except Exception as e:  # broker down: keep going, measure later
                log.debug("end offsets not measured yet: %s", e)
        if target is not None and ready() and reached(positions(), target):
            return True
        left = deadline - time.monotonic()
        if left <= 0 or stopped():
            return False
        step(min(left, 0.5))
