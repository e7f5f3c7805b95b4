"""Merge disjoint snapshots into one: the per-shard snapshots of a sharded trainer.

A trainer with W shards writes one snapshot per shard (each holds the rows of its own ids,
the next offset of its own partition and the seq state of its own streams). A predictor that
serves all shards starts from their union. :func:`merge_snapshots` builds it in memory and
refuses anything that does not add up — the same id in two snapshots of a table, a
(table, shard) seq stream in two, two different offsets for one partition, a table with two
widths or dtypes, different models or topics — with a ``SnapshotError`` naming both paths.

The dense versions' state (``Snapshot.dense``) is kept: the one snapshot's that holds it
as it is, several joined by the ``merge_dense`` the caller gives
(:func:`consumers.dense_assembly.merge_states`: this layer does not read that format).
Without one, snapshots of which more than one holds dense state are refused rather than
merged without it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np

from consumers.errors import SnapshotError
from consumers.serving.table import ServingTable
from consumers.storage.full_format import Snapshot

__all__ = ["merge_snapshots"]

log = logging.getLogger(__name__)


def _label(s: Snapshot, i: int) -> str:
    return str(s.path) if s.path is not None else f"snapshot #{i}"


def _same_meta(snaps: Sequence[Snapshot], key: str) -> Any:
    """The value of ``meta[key]`` the snapshots agree on (None when none records it)."""
    seen: dict[Any, str] = {}
    for i, s in enumerate(snaps):
        v = s.meta.get(key)
        if v is not None:
            seen.setdefault(v, _label(s, i))
    if len(seen) > 1:
        (a, pa), (b, pb) = list(seen.items())[:2]
        raise SnapshotError(f"cannot merge snapshots of different {key}s: {pa} is of {key} "
                            f"{a!r}, {pb} of {b!r}")
    return next(iter(seen), None)


#: joins the dense states of several snapshots, ``[(path, state bytes)]`` -> state bytes;
#: ``ValueError`` when they overlap
DenseMerge = Callable[[list[tuple[str, bytes]]], bytes]


def _merged_dense(snaps: Sequence[Snapshot], merge_dense: Optional[DenseMerge]
                  ) -> Optional[bytes]:
    """The dense state of the union (see the module docstring)."""
    held = [(_label(s, i), s.dense) for i, s in enumerate(snaps) if s.dense is not None]
    if len(held) <= 1:
        return held[0][1] if held else None
    names = ", ".join(label for label, _ in held)
    if merge_dense is None:
        raise SnapshotError(f"cannot merge: {names} each hold dense versions' state, and no "
                            "merge_dense was given to join them")
    try:
        return merge_dense(held)
    except ValueError as e:
        raise SnapshotError(f"cannot merge the dense state of {names}: {e}") from None


def merge_snapshots(snaps: Sequence[Snapshot], *,
                    merge_dense: Optional[DenseMerge] = None) -> Snapshot:
    """The union of disjoint snapshots (tables, offsets, seq state, dense state) as one
    in-memory :class:`Snapshot` (``path`` None; ``meta["sources"]`` lists the paths).

    ``merge_dense`` joins the dense states when several snapshots hold one.
    Raises ``SnapshotError`` when two snapshots overlap (see the module docstring).
    """
    if not snaps:
        raise SnapshotError("no snapshots to merge")
    if len(snaps) == 1:
        return snaps[0]
    dense = _merged_dense(snaps, merge_dense)
    model = _same_meta(snaps, "model")
    topic = _same_meta(snaps, "topic")
    offsets: dict[int, int] = {}
    owner_of_partition: dict[int, str] = {}
    streams: dict[tuple, dict] = {}
    owner_of_stream: dict[tuple, str] = {}
    parts: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    shape: dict[str, tuple[int, str, str]] = {}  # name -> (dim, dtype, first path)
    for i, s in enumerate(snaps):
        label = _label(s, i)
        for p, off in s.offsets.items():
            if p in offsets and offsets[p] != off:
                raise SnapshotError(f"cannot merge: partition {p} is at offset "
                                    f"{offsets[p]} in {owner_of_partition[p]} but at {off} "
                                    f"in {label}")
            offsets[p] = off
            owner_of_partition.setdefault(p, label)
        for st in (s.seqs or {}).get("streams", []):
            key = (st.get("table"), st.get("shard"))
            if key in streams:
                raise SnapshotError(f"cannot merge: table {key[0]!r} shard {key[1]} has seq "
                                    f"state in both {owner_of_stream[key]} and {label}")
            streams[key] = dict(st)
            owner_of_stream[key] = label
        for name, t in s.tables.items():
            dim, dtype, first = shape.setdefault(name, (t.dim, t.dtype, label))
            if (t.dim, t.dtype) != (dim, dtype):
                raise SnapshotError(f"cannot merge: table {name!r} is {dim} wide {dtype} in "
                                    f"{first} but {t.dim} wide {t.dtype} in {label}")
            parts.setdefault(name, []).append(t.items())
    tables: dict[str, ServingTable] = {}
    for name, chunks in parts.items():
        dim, dtype, _ = shape[name]
        ids = np.concatenate([a for a, _ in chunks]).astype(np.int64, copy=False)
        uniq, counts = np.unique(ids, return_counts=True)
        if (counts > 1).any():
            dup = uniq[counts > 1]
            raise SnapshotError(f"cannot merge: table {name!r} holds {dup.size} ids in more "
                                f"than one snapshot (e.g. id {int(dup[0])}); merge only the "
                                "snapshots of disjoint shards")
        rows = np.concatenate([b for _, b in chunks]).reshape(-1, dim)
        tables[name] = (ServingTable.from_arrays(name, ids, rows, dtype=dtype) if ids.size
                        else ServingTable(name, dim, dtype=dtype))
    seqs = {"version": 1, "streams": [streams[k] for k in sorted(streams, key=str)]} \
        if streams else {}
    meta = {"kind": "deltastream-merged", "model": model, "topic": topic,
            "sources": [_label(s, i) for i, s in enumerate(snaps)]}
    log.info("merged %d snapshots: %d tables, %d rows, offsets %s", len(snaps), len(tables),
             sum(len(t) for t in tables.values()), offsets)
    return Snapshot(tables=tables, offsets=offsets, seqs=seqs, meta=meta, dense=dense)
