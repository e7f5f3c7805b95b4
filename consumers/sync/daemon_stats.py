"""The sync daemon's stats: one dict of counters and gauges gathered from its parts.

Keys: ``messages`` (records read), ``applied``, ``rows``, ``deleted``, ``bytes``
(applied), ``duplicates``, ``gaps``, ``gap_messages`` (seqs missing), ``last_gap``,
``new_epochs``, ``stale``, ``skipped`` (other shards and models),
``foreign_model`` / ``foreign_models`` (messages of other models, total / by
model), ``quarantined`` (counted in memory, also while the file cannot be
written), ``quarantine_backlog`` (lines waiting for the disk),
``offsets_lost`` (ranges), ``lost_ranges`` (recent ranges: partition, from, to
(None = unknown), resume, reason), ``positions`` / ``end_offsets`` / ``lag`` (dicts
partition -> offsets / messages behind), ``lag_total``, ``freshness_p50_s`` /
``freshness_p99_s`` (None before any apply), ``freshness_histogram`` (buckets,
count, sum since start), ``checkpoints``, ``checkpoints_total`` (across restarts),
``checkpoint_age_s`` (None before the first), ``checkpoint_last`` (kind
``base``/``segment``, bytes, rows, deleted, seconds of the last checkpoint; None
before the first), ``checkpoint_pending``, ``checkpoint_writing`` (one in flight),
``write_errors`` (``{"quarantine": n, "checkpoint": n, "apply": n}``; ``apply``:
records that found no memory, e.g. a full shm tmpfs, retried), ``checkpoint_errors``,
``group_id``, ``group_commits``, ``group_commit_errors``, ``broker`` (one of
:data:`~consumers.sync.source.BROKER_STATES`), ``disconnects``, ``tables`` (rows/table),
``source``, ``share_waiting`` (True while the tables are not shared yet because an earlier
daemon's shared tables may be newer: see ``share_tables``), ``uptime_s``; the ``dense_*``
keys of :meth:`consumers.sync.dense.DenseSide.stats`.
"""

from __future__ import annotations

import time
from typing import Any

from consumers.quarantine import Quarantine
from consumers.sync.checkpointer import Checkpointer
from consumers.sync.failures import FailureLog
from consumers.sync.metrics import partition_lag, total_lag
from consumers.sync.record_step import RecordStep

__all__ = ["daemon_stats"]


def daemon_stats(*, model: str, topic: str, source: str, records: RecordStep,
                 kafka: dict[str, Any], ckpt: Checkpointer, quarantine: Quarantine,
                 failures: FailureLog, group_id: Any, share_waiting: bool,
                 uptime_s: float) -> dict:
    """The stats of the module docstring but ``tables`` and ``dense_*`` (the daemon adds
    them); ``kafka`` is ``KafkaSource.view()``, ``uptime_s`` seconds since the start."""
    a = records.applier.counters
    p50, p99 = records.fresh.quantiles((0.5, 0.99))
    positions, ends = kafka["positions"], kafka["end_offsets"]
    lag = partition_lag(positions, ends)
    errors = {"quarantine": quarantine.write_errors,
              "checkpoint": failures.counts().get("checkpoint", 0),
              "apply": failures.counts().get("apply", 0)}
    committer = ckpt.committer
    last_gap, internal_errors = records.counters()
    return {
        "model": model, "topic": topic, "broker": kafka["broker"], "source": source,
        "messages": a["messages"], "applied": a["applied"], "rows": a["rows"],
        "deleted": a["deleted"], "bytes": a["bytes"],
        "duplicates": a["duplicates"], "gaps": a["gaps"],
        "gap_messages": a["missing_seqs"], "last_gap": last_gap,
        "new_epochs": a["new_epochs"], "stale": a["stale"], "skipped": a["skipped"],
        "foreign_model": a["foreign_model"],
        "foreign_models": {m: n for m, n in dict(records.applier.models).items()
                           if m != model},
        "quarantined": a["quarantined"] + internal_errors,
        "quarantine_backlog": quarantine.backlog,
        "offsets_lost": kafka["offsets_lost"], "lost_ranges": kafka["lost_ranges"],
        "positions": positions, "end_offsets": ends, "lag": lag,
        "lag_total": total_lag(lag.values()),
        "freshness_p50_s": p50, "freshness_p99_s": p99,
        "freshness_histogram": records.fresh_hist.snapshot(),
        "checkpoints": ckpt.written, "checkpoints_total": ckpt.total,
        "checkpoint_age_s": None if ckpt.written_at is None
        else max(0.0, time.time() - ckpt.written_at),
        "checkpoint_pending": ckpt.pending, "checkpoint_writing": ckpt.busy,
        "checkpoint_last": None if ckpt.last is None else dict(ckpt.last),
        "write_errors": errors,
        "checkpoint_errors": errors.get("checkpoint", 0),
        "group_id": group_id or None,
        "group_commits": 0 if committer is None else committer.commits,
        "group_commit_errors": 0 if committer is None else committer.errors,
        "disconnects": kafka["disconnects"],
        "internal_errors": internal_errors,
        "share_waiting": share_waiting,
        "uptime_s": uptime_s,
    }
