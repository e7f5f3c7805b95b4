"""RecordReport: what the sync daemon writes and says about each record it read.

* a quarantined record goes to the quarantine file
  (:class:`~consumers.quarantine.Quarantine`: once, also across a crash; a failed write is
  kept in memory and retried, and reported to the :class:`~consumers.sync.failures.FailureLog`
  at once) and is logged — the first ``QUARANTINE_WARNINGS`` at WARNING,
  the rest at DEBUG (a producer spewing garbage must not flood the log; the file has every
  record);
* a record of another model is not corrupt: it is skipped and counted by the
  :class:`~consumers.applier.Applier`; here one WARNING per model name says which model was
  seen, which one the daemon serves, and how to fix a wrong ``--model``;
* the ``on_apply`` hook is called; an exception from it is logged once per kind and ignored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Optional

from consumers.applier import Outcome
from consumers.quarantine import Quarantine
from consumers.sync.failures import FailureLog

__all__ = ["RecordReport", "QUARANTINE_WARNINGS"]

log = logging.getLogger(__name__)

QUARANTINE_WARNINGS = 100  #: quarantined records logged at WARNING before going quiet


class RecordReport:
    """Reports records for one daemon (its loop thread calls :meth:`report`).

    Args:
        topic, model: what the daemon reads and serves (for the log lines).
        quarantine: where quarantined records go.
        on_apply: the daemon's ``on_apply(outcome, partition, offset)`` hook, or None.
        failures: where a failed quarantine write is reported (``"quarantine"``).
        logger: where to log (the daemon's logger).
    """

    def __init__(self, topic: str, model: str, quarantine: Quarantine,
                 on_apply: Optional[Callable[[Outcome, int, int], None]] = None,
                 failures: Optional[FailureLog] = None,
                 logger: Optional[logging.Logger] = None) -> None:
        self.topic, self.model, self.quarantine = topic, model, quarantine
        self._failures = failures
        self._on_apply = on_apply
        self._log = logger or log
        self._quarantined = 0
        self._foreign_warned: set[str] = set()
        self._hook_errors: set[str] = set()

    def report(self, out: Outcome, partition: int, offset: int, value: Any) -> None:
        """Quarantine / log / hand to the hook the outcome of the record at
        (``partition``, ``offset``) whose raw value is ``value``."""
        if out.kind == "quarantined":
            q = self.quarantine
            if not q.add(partition, offset, out.reason, value) and self._failures is not None:
                self._failures.failed("quarantine", f"quarantine {q.path}: {q.backlog} lines "
                                      f"not written ({q.last_error}); kept in memory, "
                                      "checkpoints wait for them")
            self._quarantined += 1
            level = logging.WARNING if self._quarantined <= QUARANTINE_WARNINGS \
                else logging.DEBUG
            self._log.log(level, "partition %d offset %d quarantined: %s", partition, offset,
                          out.reason)
            if self._quarantined == QUARANTINE_WARNINGS:
                self._log.warning("%d records quarantined; further ones are logged at DEBUG "
                                  "only (all are in %s)", QUARANTINE_WARNINGS,
                                  self.quarantine.path)
        elif out.kind == "skipped" and out.model not in (None, self.model) \
                and out.model not in self._foreign_warned:
            self._foreign_warned.add(out.model)
            self._log.warning(
                "topic %s holds messages of model %r; this daemon serves --model %r and "
                "skips them (counted in foreign_models, logged once per model); if model %r "
                "is the one to serve, restart with --model %s", self.topic, out.model,
                self.model, out.model, out.model)
        if self._on_apply is not None:
            try:
                self._on_apply(out, partition, offset)
            except Exception as e:  # a monitoring hook must not stop syncing
                kind = type(e).__name__
                if kind not in self._hook_errors:
                    self._hook_errors.add(kind)
                    self._log.exception("on_apply hook failed (further %s errors not "
                                        "logged)", kind)
