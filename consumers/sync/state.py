"""Where a sync daemon starts from: its own checkpoint, else a base snapshot, else nothing.

:func:`load_start_state` reads (and verifies) the checkpoint in the daemon's state directory
through its :class:`~consumers.storage.checkpoint.CheckpointStore`, or, when there is none,
the ``base`` snapshot (a checkpoint, a ``deltastream-replay rebuild`` output or a
``ServingTable.save`` directory), or the union of several (:mod:`consumers.sync.base_snapshot`). A checkpoint written for another model or topic, or with
tables of other dims than configured, is refused with ``ValueError``; a damaged one raises
:class:`~consumers.errors.SnapshotError` — also when its manifest is missing or a file
stands where its directory should be: only an absent or empty checkpoint directory is a
fresh start (see :mod:`consumers.storage.checkpoint_dir`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

from consumers.sequencing import SeqTracker
from consumers.serving.table import ServingTable
from consumers.storage.checkpoint import CheckpointStore
from consumers.sync.base_snapshot import BaseArg, read_base

__all__ = ["CHECKPOINT_KIND", "StartState", "load_start_state"]

log = logging.getLogger(__name__)

#: ``meta["kind"]`` of the daemon's checkpoints
CHECKPOINT_KIND = "deltastream-sync"


@dataclass
class StartState:
    """What a daemon starts from.

    Attributes:
        source: ``"checkpoint"``, ``"base"`` or ``"empty"``.
        tables: name -> table loaded. offsets: partition -> next offset to read.
        seqs: the sequence state of the loaded tables.
        topic_id: id of the topic the offsets refer to (None: unknown, trusted).
        partitions: partition count when the checkpoint was written (None: unknown).
        checkpoints: checkpoints written before (across restarts).
        written_at: wall time of the loaded checkpoint (None: unknown or no checkpoint).
        dense: the dense versions' state of the checkpoint (None: none kept).
    """

    source: str = "empty"
    tables: dict[str, ServingTable] = field(default_factory=dict)
    offsets: dict[int, int] = field(default_factory=dict)
    seqs: SeqTracker = field(default_factory=SeqTracker)
    topic_id: Optional[str] = None
    partitions: Optional[int] = None
    checkpoints: int = 0
    written_at: Optional[float] = None
    dense: Optional[bytes] = None


def load_start_state(store: CheckpointStore, base: Optional[BaseArg], *, model: str,
                     topic: str, table_dims: Optional[dict[str, int]],
                     base_any_topic: bool = False) -> StartState:
    """Load the checkpoint of ``store`` (else ``base``); see the module docstring."""
    out = StartState()
    snap = store.load()  # None for a fresh start; SnapshotError for damaged state
    if snap is not None:
        meta = snap.meta
        if meta.get("kind") == CHECKPOINT_KIND:
            for key, mine in (("model", model), ("topic", topic)):
                if meta.get(key) != mine:
                    raise ValueError(
                        f"{store.path} is a checkpoint of {key} {meta.get(key)!r}, this "
                        f"daemon syncs {key} {mine!r}; use another state_dir")
        out.source = "checkpoint"
        out.topic_id = meta.get("topic_id")
        out.checkpoints = int(meta.get("checkpoints", 0))
        if isinstance(meta.get("partitions"), int):
            out.partitions = meta["partitions"]
        written = meta.get("written_at")
        if isinstance(written, (int, float)):
            out.written_at = float(written)
    elif base is not None:
        snap = read_base(base, model=model, topic=topic, any_topic=base_any_topic)
        out.source = "base"
        # a base from another broker/topic incarnation: offsets are trusted, ids are not
        out.topic_id = None
    else:
        return out
    for name, t in snap.tables.items():
        want = (table_dims or {}).get(name)
        if want is not None and t.dim != want:
            raise ValueError(f"table {name!r} has dim {t.dim} in {snap.path or base}, but "
                             f"tables= says dim {want}")
    out.tables = dict(snap.tables)
    out.offsets = dict(snap.offsets)
    out.seqs = SeqTracker.from_state(snap.seqs)
    out.dense = snap.dense
    log.info("state from %s %s: %d tables (%s rows), offsets %s, %d seq streams",
             out.source, snap.path or base, len(out.tables),
             sum(len(t) for t in out.tables.values()), out.offsets, len(out.seqs))
    return out
