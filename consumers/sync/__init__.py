"""The sync daemon: keep a predictor's serving tables in sync with a deltas topic.

One module per job, the public names re-exported here:

* :mod:`~consumers.sync.daemon` — :class:`SyncDaemon`: the loop (poll → apply →
  checkpoint), its state on disk, its public API (run, stop, tables, stats);
* :mod:`~consumers.sync.source` — the Kafka side: connect, seek, poll, reconnect with
  backoff, offsets the broker no longer has, end offsets;
* :mod:`~consumers.sync.options` — the daemon's settings, validated once;
* :mod:`~consumers.sync.metrics` — freshness, lag, Prometheus endpoint, summary lines;
* :mod:`~consumers.sync.cli` — the ``deltastream-sync`` command.
"""

from __future__ import annotations

import logging

from consumers.sync.daemon import CHECKPOINT_DIR, QUARANTINE_FILE, SyncDaemon
from consumers.sync.options import SyncOptions
from consumers.sync.source import BROKER_STATES

__all__ = ["SyncDaemon", "CHECKPOINT_DIR", "QUARANTINE_FILE", "BROKER_STATES", "SyncOptions"]

log = logging.getLogger(__name__)
