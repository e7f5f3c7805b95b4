"""RecordStep: one record of the sync loop applied, and what applying taught the daemon.

The :class:`~consumers.applier.Applier` decodes, checks and applies a record; around it this
keeps what the daemon reports in its stats: freshness (window and histogram), the last seq
gap seen, internal errors (a bug while applying: the record is quarantined, serving goes on)
and whether the host had no room for the last record (a full shm tmpfs: the partition waits
at that record and the loop retries it). Moving the source on, checkpoint bookkeeping and
reporting stay with the loop (:class:`~consumers.sync.daemon.SyncDaemon`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional

from consumers.applier import Applier, Outcome
from consumers.sync.dense import DenseSide
from consumers.sync.failures import FailureLog
from consumers.sync.metrics import FreshnessHistogram, FreshnessWindow

__all__ = ["RecordStep"]

log = logging.getLogger(__name__)


class RecordStep:
    """Applies records for one daemon (its loop thread calls :meth:`apply`; the counters are
    read from any thread).

    Args:
        applier: decodes, checks and applies one record.
        dense: the daemon's dense side (told when a dense version became served).
        failures: where "no room to apply" is reported (``"apply"``) and its recovery.
        freshness_window: seconds of freshness samples the quantiles cover.
    """

    def __init__(self, applier: Applier, dense: DenseSide, failures: FailureLog,
                 freshness_window: float) -> None:
        self.applier = applier
        self._dense = dense
        self._failures = failures
        self.fresh = FreshnessWindow(freshness_window)
        self.fresh_hist = FreshnessHistogram()
        self._lock = threading.Lock()  # last_gap and internal_errors, read by stats()
        self._last_gap: Optional[dict] = None
        self._internal_errors = 0
        self.no_room = False  #: the last apply failed for want of memory (retried)

    def counters(self) -> tuple[Optional[dict], int]:
        """(the last seq gap seen or None, internal errors so far)."""
        with self._lock:
            return self._last_gap, self._internal_errors

    def apply(self, partition: int, rec: Any) -> Optional[Outcome]:
        """Apply one record (``.value``, ``.headers``, ``.offset``); None when the host has
        no room for it now (the record is not done: the partition waits at it)."""
        try:
            out = self.applier.process(rec.value, rec.headers)
        except (OSError, MemoryError) as e:  # a full shm tmpfs: not the record's fault
            self.no_room = True
            self._failures.failed("apply", f"partition {partition} offset {rec.offset}: "
                                  f"no room to apply it ({type(e).__name__}: {e})")
            return None
        except Exception as e:  # a bug must not kill serving; the record is kept aside
            with self._lock:
                self._internal_errors += 1
            log.exception("partition %d offset %d: applying failed", partition, rec.offset)
            out = Outcome("quarantined", reason=f"internal error: {type(e).__name__}: {e}")
        if self.no_room:
            self.no_room = False
            self._failures.recovered("apply", f"partition {partition} offset {rec.offset}: "
                                     "applying works again")
        if out.dense == "served":
            self._dense.served(out.shard)
        if out.kind == "applied":
            if out.ts is not None:
                self.fresh_hist.observe(self.fresh.add_ts(out.ts))
            if out.gap is not None:
                with self._lock:
                    self._last_gap = {"table": out.table, "shard": out.shard,
                                      "epoch": out.epoch, "missing": list(out.gap),
                                      "partition": partition, "offset": rec.offset}
        return out
