"""The base a new predictor starts from: one snapshot, or the union of per-shard snapshots.

:func:`read_base` reads every directory given (a checkpoint, a ``deltastream-replay
rebuild`` output, a trainer's snapshot or a ``ServingTable.save`` directory), checks that
each belongs to the daemon's model and topic, and merges several into one
(:func:`consumers.storage.merge.merge_snapshots`: disjoint ids, shards and partitions; the
dense versions' states of disjoint trainer shards joined by
:func:`consumers.dense_assembly.merge_states`).

A snapshot records the topic it was taken from (``meta["topic"]``). One of another topic is
refused (``ValueError`` naming both) unless ``any_topic`` — its offsets would point into a
different log. One that records no topic (a ``ServingTable.save`` directory, or a snapshot
written before topics were recorded) is accepted with a warning.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Union

from consumers.dense_assembly import merge_states
from consumers.files import PathLike
from consumers.storage.full_format import Snapshot
from consumers.storage.merge import merge_snapshots
from consumers.storage.snapshot import read_snapshot, snapshot_exists

__all__ = ["read_base", "base_paths", "BaseArg"]

log = logging.getLogger(__name__)

#: one snapshot directory, or several to merge
BaseArg = Union[PathLike, Sequence[PathLike]]


def base_paths(base: BaseArg) -> list[PathLike]:
    """The directories of a ``base`` argument (one path, or a list of them)."""
    if isinstance(base, (str, os.PathLike)):
        return [base]
    paths = list(base) if isinstance(base, (list, tuple)) else []
    if not paths or not all(isinstance(p, (str, os.PathLike)) for p in paths):
        raise ValueError(f"base: expected a snapshot directory or a non-empty list of them, "
                         f"got {base!r}")
    return paths


def read_base(base: BaseArg, *, model: str, topic: str, any_topic: bool = False) -> Snapshot:
    """Read (and merge) the base snapshot(s); see the module docstring.

    Raises ``ValueError`` for a path without a snapshot or one of another model or topic,
    :class:`~consumers.errors.SnapshotError` for a damaged one or snapshots that overlap.
    """
    snaps = []
    for path in base_paths(base):
        if not snapshot_exists(path):
            raise ValueError(f"base: {path} holds no snapshot (expected a directory written "
                             "by a checkpoint, the replay tool, a trainer or "
                             "ServingTable.save)")
        snap = read_snapshot(path)
        bmodel, btopic = snap.meta.get("model"), snap.meta.get("topic")
        if bmodel is not None and bmodel != model:
            raise ValueError(f"base: {path} is a snapshot of model {bmodel!r}, this daemon "
                             f"syncs model {model!r}")
        if btopic is None:
            log.warning("base %s records no topic (a ServingTable.save directory or an older "
                        "snapshot); assuming its offsets refer to topic %r", path, topic)
        elif btopic != topic:
            if not any_topic:
                raise ValueError(f"base: {path} is a snapshot of topic {btopic!r}, but this "
                                 f"daemon reads topic {topic!r}; its offsets refer to the "
                                 "other topic (pass --base-any-topic / base_any_topic=True "
                                 "to start from it anyway)")
            log.warning("base %s is a snapshot of topic %r; starting from it on topic %r as "
                        "asked (its offsets are used as they are)", path, btopic, topic)
        snaps.append(snap)
    return merge_snapshots(snaps, merge_dense=merge_states)
