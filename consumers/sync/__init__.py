"""The sync daemon: keep a predictor's serving tables in sync with a deltas topic.

One module per job, the public names re-exported here:

* :mod:`~consumers.sync.daemon` — :class:`SyncDaemon`: the loop (poll → apply →
  checkpoint), its state on disk, its public API (run, stop, tables, stats);
* :mod:`~consumers.sync.source` — the Kafka side: connect, seek, poll, reconnect with
  backoff, offsets the broker no longer has, end offsets;
* :mod:`~consumers.sync.options` — the daemon's settings, validated once;
* :mod:`~consumers.sync.base_snapshot` — the base snapshot(s) a new predictor starts from;
* :mod:`~consumers.sync.state` — where a daemon starts from (checkpoint, base, empty;
  damaged state refused);
* :mod:`~consumers.sync.checkpointer` — when to checkpoint (written in the background),
  never past an unwritten quarantine line; write failures counted and retried, never
  fatal; the loop's checkpoint bookkeeping;
* :mod:`~consumers.sync.failures` — failure counts by kind, logged rate-limited;
* :mod:`~consumers.sync.group_offsets` — next offsets committed to a consumer group
  (without joining it) for Kafka lag tools;
* :mod:`~consumers.sync.record_step` — one record applied, with what it teaches the
  daemon (freshness, the last seq gap, internal errors, no room to apply);
* :mod:`~consumers.sync.outcomes` — what is written and logged per record (quarantine,
  other models once, the ``on_apply`` hook);
* :mod:`~consumers.sync.daemon_stats` — the daemon's stats dict and what each key means;
* :mod:`~consumers.sync.metrics` — freshness (window and histogram), lag, Prometheus
  endpoint, summary lines;
* :mod:`~consumers.sync.cli` — the ``deltastream-sync`` command.
"""

from __future__ import annotations

import logging

from consumers.sync.daemon import CHECKPOINT_DIR, QUARANTINE_FILE, SyncDaemon
from consumers.sync.options import SyncOptions
from consumers.sync.source import BROKER_STATES

__all__ = ["SyncDaemon", "CHECKPOINT_DIR", "QUARANTINE_FILE", "BROKER_STATES", "SyncOptions"]

log = logging.getLogger(__name__)
