"""Predictor side of deltastream: serving tables, the sync daemon and the replay tool.

Imports no torch: predictor hosts are CPU boxes with numpy only.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

log = logging.getLogger(__name__)
log.addHandler(logging.NullHandler())  # library: the application configures logging

_EXPORTS = {
    "ServingTable": "serving.table",
    "ApplyResult": "serving.table",
    "ApplyError": "errors",
    "Snapshot": "storage.snapshot",
    "SnapshotError": "errors",
    "read_snapshot": "storage.snapshot",
    "write_snapshot": "storage.snapshot",
    "snapshot_exists": "storage.snapshot",
    "SeqTracker": "sequencing",
    "Applier": "applier",
    "Outcome": "applier",
    "Quarantine": "quarantine",
    "CheckpointStore": "storage.checkpoint",
    "CheckpointWriter": "storage.background",
    "TableReader": "serving.reader",
    "ReadInfo": "serving.reader",
    "open_table": "serving.reader",
    "read_checkpoint": "storage.checkpoint",
    "SyncDaemon": "sync.daemon",
    "ConsumerError": "errors",
    "ReplayError": "errors",
    "TopicReader": "topic",
    "rebuild": "replay.rebuild",
    "diff_snapshots": "replay.diff",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'consumers' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
