"""Replay a deltas topic: rebuild tables, dump messages, count stats, diff snapshots.

The library behind ``deltastream-replay`` (see :mod:`consumers.replay.cli`). Torch-free.
One module per job, all names re-exported here:

* :mod:`~consumers.replay.plan` — time / offset / seq-range parsing and bounded read plans
  (point in time is by each message's own ``ts``; see there);
* :mod:`~consumers.replay.rebuild` — apply a range into tables through the sync daemon's
  :class:`~consumers.applier.Applier` and write a snapshot a daemon can resume from;
* :mod:`~consumers.replay.inspect` — :func:`dump` decoded messages, per-stream :func:`stats`;
* :mod:`~consumers.replay.diff` — compare snapshots, or a snapshot with a rebuild;
* :mod:`~consumers.replay.options` — the command's flags, each spelled once as a dataclass
  field.
"""

from __future__ import annotations

import logging

from consumers.errors import ReplayError
from consumers.replay.diff import (
    DiffReport,
    TableDiff,
    diff_snapshots,
    diff_tables,
    diff_with_rebuild,
)
from consumers.replay.inspect import ShardStats, TopicStats, dump, dumps_line, stats
from consumers.replay.plan import (
    ReadPlan,
    format_time,
    parse_offsets,
    parse_seq_range,
    parse_time,
    plan_read,
)
from consumers.replay.rebuild import REBUILD_KIND, RebuildResult, rebuild  # noqa: F401

__all__ = [
    "ReplayError",
    "parse_time",
    "format_time",
    "parse_offsets",
    "parse_seq_range",
    "ReadPlan",
    "plan_read",
    "RebuildResult",
    "rebuild",
    "dump",
    "ShardStats",
    "TopicStats",
    "stats",
    "TableDiff",
    "DiffReport",
    "diff_tables",
    "diff_snapshots",
    "diff_with_rebuild",
    "dumps_line",
]

log = logging.getLogger(__name__)
