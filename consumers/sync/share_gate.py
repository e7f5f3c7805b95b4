"""When a restarted daemon may share its tables: never taking readers back in time.

A daemon killed with SIGKILL leaves its shared tables in place (readers go on serving
them), and their state may be newer than its last checkpoint. A new daemon that shared its
own tables at once, from that checkpoint, would take every reader back. :class:`ShareGate`
holds sharing back while such tables exist, until the daemon has read every assigned
partition up to its end offset measured once connected: every state the killed daemon
published was made from records before those offsets, so from then on the new state is at
least as new, partition by partition.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from consumers.sync.metrics import reached

__all__ = ["ShareGate"]

log = logging.getLogger(__name__)


class ShareGate:
    """``open(source)`` says whether tables may be shared now (see the module docstring).

    Args:
        waiting: True when an earlier daemon left shared tables behind.
    """

    def __init__(self, waiting: bool) -> None:
        self.waiting = waiting
        self._target: Optional[dict[int, int]] = None
        if waiting:
            log.info("shared tables of an earlier daemon were left behind: readers keep "
                     "them until this daemon has caught up with the topic")

    def open(self, source: Any) -> bool:
        """True once sharing cannot take readers back in time; ``source``: the daemon's
        :class:`~consumers.sync.source.KafkaSource`."""
        if not self.waiting:
            return True
        if source.state != "connected":
            return False
        if self._target is None:
            try:
                self._target = source.measure_end_offsets()
            except Exception as e:  # the broker went away again: next round
                log.debug("end offsets unavailable: %s", e)
                return False
        if not reached(source.positions(), self._target):
            return False
        self.waiting = False
        log.info("caught up with the topic up to %s: sharing the tables now", self._target)
        return True
