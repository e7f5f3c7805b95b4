"""Compare serving tables: two snapshots, or a snapshot with a fresh rebuild of the topic.

A row differs when any element differs by more than the tolerance (absolute; 0 means
exactly equal values, NaN equal to NaN); values are compared as float32 whatever the
storage dtype. The dense versions both sides serve are compared too
(:mod:`consumers.replay.dense_diff`). :class:`DiffReport` renders as text or JSON
(``deltastream-replay diff``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np

from consumers.errors import ReplayError
from consumers.files import PathLike
from consumers.replay.dense_diff import DenseDiff, diff_dense
from consumers.replay.rebuild import rebuild
from consumers.serving.table import ServingTable
from consumers.storage.snapshot import Snapshot, read_snapshot

__all__ = ["TableDiff", "DiffReport", "diff_tables", "diff_snapshots", "diff_with_rebuild"]

log = logging.getLogger(__name__)

_SAMPLE = 10  # ids listed per category in a diff
_DIFF_CHUNK = 1 << 16  # rows compared per step (bounds temporary memory)


@dataclass
class TableDiff:
    """How one table differs between snapshot A and B.

    ``only_in_a`` / ``only_in_b``: ids present in one side only. ``differing``: common ids
    whose rows differ by more than the tolerance in some element. ``max_abs_diff``: largest
    element difference over the common ids (0.0 when none; None when dims differ).
    ``in_a`` / ``in_b``: whether the table exists on each side (a missing table compares as
    an empty one). ``sample_*``: first ids of each kind.
    """

    table: str
    in_a: bool
    in_b: bool
    dim_a: Optional[int]
    dim_b: Optional[int]
    ids_a: int
    ids_b: int
    common: int
    only_in_a: int
    only_in_b: int
    differing: int
    max_abs_diff: Optional[float]
    sample_only_a: list = field(default_factory=list)
    sample_only_b: list = field(default_factory=list)
    sample_differing: list = field(default_factory=list)

    @property
    def dim_mismatch(self) -> bool:
        return self.in_a and self.in_b and self.dim_a != self.dim_b

    @property
    def equal(self) -> bool:
        return not (self.dim_mismatch or self.only_in_a or self.only_in_b or self.differing)

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["equal"] = self.equal
        d["dim_mismatch"] = self.dim_mismatch
        return d


@dataclass
class DiffReport:
    """All tables of A and B compared, and their dense versions (``dense``: None when
    neither holds any). ``equal`` when nothing differs."""

    a: str
    b: str
    tolerance: float
    tables: list
    offsets_a: Optional[dict] = None
    offsets_b: Optional[dict] = None
    dense: Optional[DenseDiff] = None

    @property
    def equal(self) -> bool:
        return all(t.equal for t in self.tables) and (self.dense is None or self.dense.equal)

    def to_json(self) -> dict:
        return {"a": self.a, "b": self.b, "tolerance": self.tolerance, "equal": self.equal,
                "offsets_a": None if self.offsets_a is None
                else {str(k): v for k, v in self.offsets_a.items()},
                "offsets_b": None if self.offsets_b is None
                else {str(k): v for k, v in self.offsets_b.items()},
                "tables": [t.to_json() for t in self.tables],
                "dense": None if self.dense is None else self.dense.to_json()}

    def format_text(self) -> str:
        out = [f"A = {self.a}", f"B = {self.b}"]
        if self.offsets_a is not None and self.offsets_b is not None \
                and self.offsets_a != self.offsets_b:
            out.append(f"note: offsets differ: A {self.offsets_a}, B {self.offsets_b}")
        for t in self.tables:
            if not t.in_a or not t.in_b:
                where = "A" if t.in_a else "B"
                prefix = f"table {t.table}: only in {where} ({t.ids_a or t.ids_b} ids)"
            else:
                prefix = f"table {t.table}:"
            if t.dim_mismatch:
                out.append(f"{prefix} DIFFERENT dims: A {t.dim_a}, B {t.dim_b}")
                continue
            if t.equal:
                out.append(f"{prefix} equal ({t.common} ids, max abs diff "
                           f"{t.max_abs_diff:g})")
                continue
            out.append(f"{prefix} DIFFERENT: {t.only_in_a} ids only in A, {t.only_in_b} only "
                       f"in B, {t.differing} of {t.common} common rows differ (max abs diff "
                       f"{t.max_abs_diff:g}, tolerance {self.tolerance:g})")
            for label, sample, count in (
                    ("only in A", t.sample_only_a, t.only_in_a),
                    ("only in B", t.sample_only_b, t.only_in_b),
                    ("differing", t.sample_differing, t.differing)):
                if sample:
                    out.append(f"  {label}: {', '.join(map(str, sample))}"
                               + (" ..." if count > len(sample) else ""))
        if self.dense is not None:
            out.append(self.dense.format_text())
        n_diff = sum(not t.equal for t in self.tables)
        out.append("no differences" if self.equal else
                   f"{n_diff} of {len(self.tables)} tables differ"
                   + ("" if self.dense is None or self.dense.equal else ", dense differs"))
        return "\n".join(out)


def _diff_one(name: str, a: Optional[ServingTable], b: Optional[ServingTable],
              tolerance: float) -> TableDiff:
    empty = np.zeros(0, np.int64)
    ida, rowa = a.items() if a is not None else (empty, None)
    idb, rowb = b.items() if b is not None else (empty, None)
    dim_a = None if a is None else a.dim
    dim_b = None if b is None else b.dim
    common, ia, ib = np.intersect1d(ida, idb, assume_unique=True, return_indices=True)
    only_a = np.setdiff1d(ida, idb, assume_unique=True)
    only_b = np.setdiff1d(idb, ida, assume_unique=True)
    differing = 0
    max_abs: Optional[float] = 0.0
    sample_diff: list = []
    if a is not None and b is not None and dim_a != dim_b:
        max_abs = None
    elif common.size:
        for lo in range(0, common.size, _DIFF_CHUNK):
            ra = rowa[ia[lo:lo + _DIFF_CHUNK]]
            rb = rowb[ib[lo:lo + _DIFF_CHUNK]]
            with np.errstate(invalid="ignore", over="ignore"):
                d = np.abs(ra.astype(np.float64) - rb.astype(np.float64))
            nan_mismatch = np.isnan(ra) != np.isnan(rb)
            d = np.where(np.isnan(d), np.where(nan_mismatch, np.inf, 0.0), d)
            row_max = d.max(axis=1)
            bad = row_max > tolerance
            differing += int(np.count_nonzero(bad))
            max_abs = max(max_abs, float(row_max.max()))
            if len(sample_diff) < _SAMPLE:
                sample_diff += common[lo:lo + _DIFF_CHUNK][bad][:_SAMPLE - len(sample_diff)] \
                    .tolist()
    return TableDiff(
        table=name, in_a=a is not None, in_b=b is not None, dim_a=dim_a, dim_b=dim_b,
        ids_a=int(ida.size), ids_b=int(idb.size), common=int(common.size),
        only_in_a=int(only_a.size), only_in_b=int(only_b.size), differing=differing,
        max_abs_diff=max_abs, sample_only_a=only_a[:_SAMPLE].tolist(),
        sample_only_b=only_b[:_SAMPLE].tolist(), sample_differing=sample_diff)


def diff_tables(a: Mapping[str, ServingTable], b: Mapping[str, ServingTable], *,
                tolerance: float = 0.0, a_label: str = "A", b_label: str = "B") -> DiffReport:
    """Compare two sets of tables (name -> :class:`ServingTable`).

    A row differs when any element differs by more than ``tolerance`` (absolute; 0 means
    exactly equal values, NaN equal to NaN). Values are compared as float32 whatever the
    storage dtype.
    """
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) \
            or not tolerance >= 0 or math.isinf(tolerance):
        raise ReplayError(f"tolerance: expected a finite number ≥ 0, got {tolerance!r}")
    names = sorted(set(a) | set(b))
    return DiffReport(a=a_label, b=b_label, tolerance=float(tolerance),
                      tables=[_diff_one(n, a.get(n), b.get(n), float(tolerance))
                              for n in names])


def diff_snapshots(a: Union[PathLike, Snapshot], b: Union[PathLike, Snapshot], *,
                   tolerance: float = 0.0) -> DiffReport:
    """Compare two snapshots (paths or :class:`Snapshot`). Raises ``SnapshotError`` for a
    damaged one."""
    sa = a if isinstance(a, Snapshot) else read_snapshot(a)
    sb = b if isinstance(b, Snapshot) else read_snapshot(b)
    rep = diff_tables(sa.tables, sb.tables, tolerance=tolerance,
                      a_label=str(sa.path if sa.path is not None else "A"),
                      b_label=str(sb.path if sb.path is not None else "B"))
    rep.offsets_a, rep.offsets_b = dict(sa.offsets), dict(sb.offsets)
    rep.dense = diff_dense(sa.dense, sb.dense, tolerance=rep.tolerance, a_label=rep.a,
                           b_label=rep.b)
    return rep


def diff_with_rebuild(snapshot: Union[PathLike, Snapshot], *,
                      bootstrap_servers: str, topic: Optional[str] = None,
                      model: Optional[str] = None, tolerance: float = 0.0,
                      progress: bool = False, timeout: float = 10.0,
                      kafka_config: Optional[Mapping[str, Any]] = None) -> DiffReport:
    """Compare a snapshot with a fresh rebuild of the topic from the earliest offsets up to
    the snapshot's offsets (same partitions, shards, storage dtype).

    ``topic`` and ``model`` default to the snapshot's meta. A snapshot that was itself
    started from a base (not from the topic's beginning), or whose topic lost messages to
    retention, differs from the rebuild by design.
    """
    snap = snapshot if isinstance(snapshot, Snapshot) else read_snapshot(snapshot)
    label = str(snap.path if snap.path is not None else "snapshot")
    topic = topic or snap.meta.get("topic")
    model = model or snap.meta.get("model")
    if not topic or not model:
        raise ReplayError(f"{label}: its meta names no topic/model; give them")
    if not snap.offsets:
        raise ReplayError(f"{label}: holds no offsets (a single-table save?), so there is "
                          "no point of the topic to rebuild up to")
    dtypes = {t.dtype for t in snap.tables.values()}
    dtype = dtypes.pop() if len(dtypes) == 1 else "f32"
    shards = snap.meta.get("shards")
    res = rebuild(bootstrap_servers, topic, model=model, partitions=sorted(snap.offsets),
                  to_offsets=snap.offsets, shards=shards, dtype=dtype, progress=progress,
                  timeout=timeout, kafka_config=kafka_config)
    if res.plan.stop != {p: snap.offsets[p] for p in res.plan.partitions}:
        log.warning("the topic ends before the snapshot's offsets: rebuilt up to %s, "
                    "snapshot at %s", res.plan.stop, snap.offsets)
    rep = diff_tables(snap.tables, res.tables, tolerance=tolerance, a_label=label,
                      b_label=f"rebuild of {topic} up to {snap.offsets}")
    rep.offsets_a, rep.offsets_b = dict(snap.offsets), dict(res.offsets)
    rep.dense = diff_dense(snap.dense, res.dense, tolerance=rep.tolerance, a_label=label,
                           b_label=rep.b)
    return rep
