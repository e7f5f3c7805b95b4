"""Replay a deltas topic: rebuild tables, dump messages, count stats, diff snapshots.

The library behind ``deltastream-replay`` (see :mod:`consumers.replay.cli`). Torch-free.

Reading
-------
Records are read with :class:`consumers.topic.TopicReader` (assign + seek, no consumer
group), partition by partition in offset order, between start offsets (default: the
earliest available) and stop offsets (default: the end at the time of the call).

Point in time is by each message's own ``ts`` (the trainer's wall clock, ns), never by the
broker's timestamps or ListOffsets-by-time: trainers stamp rows when they read them, and
one partition interleaves several shards whose clocks need not agree, so ``ts`` is not
monotonic along a partition. A time bound therefore never stops a read early: the whole
offset range is read and exactly the messages with ``from_time <= ts <= to_time`` are used
(both bounds inclusive). Records that do not decode have no ``ts``; :func:`rebuild` hands
them to the :class:`~consumers.applier.Applier` anyway (which quarantines and counts them)
and :func:`dump` prints them as error lines.

Rebuild
-------
:func:`rebuild` feeds records through the same :class:`~consumers.applier.Applier` as the
sync daemon, so the same records in the same order give bit-identical tables. Its snapshot
(:func:`consumers.storage.snapshot.write_snapshot`) records, per partition, the offset a daemon
resuming from it must read next. With ``to_time`` that is the first offset whose message
was held back for being later than ``to_time`` (or the stop offset): a daemon started from
the snapshot re-reads the messages after it, and the seq state in the snapshot makes it skip
those already applied as duplicates — so resuming is exact as long as each trainer shard's
clock is monotonic. Messages before ``from_time`` are left out for good: such a snapshot
holds only the rows written inside the window (meta ``range`` says so).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from consumers.applier import Applier
from consumers.errors import ReplayError
from consumers.sequencing import SeqTracker
from consumers.serving_table import STORAGE_DTYPES, ServingTable
from consumers.storage.snapshot import Snapshot, read_snapshot, write_snapshot
from consumers.topic import Record, TopicReader
from deltastream.wire import WireError, decode, parse_headers

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

PathLike = Union[str, os.PathLike]

#: ``meta["kind"]`` of snapshots written by :func:`rebuild`
REBUILD_KIND = "deltastream-replay"
_SAMPLE = 10  # ids listed per category in a diff
_DIFF_CHUNK = 1 << 16  # rows compared per step (bounds temporary memory)
_HEAD_BYTES = 32  # bytes of an undecodable record shown in hex


# ----------------------------------------------------------------------------- parsing


def parse_time(text: Union[str, int]) -> int:
    """A point in time as int ns since the Unix epoch.

    Accepts an int (ns), a string of digits (ns), or ISO-8601 (``2024-05-01T12:00:00Z``,
    ``2024-05-01 12:00:00.250+02:00``; a time without zone is UTC). Raises ``ValueError``.
    """
    if isinstance(text, bool):
        raise ValueError(f"time: expected ns or ISO-8601, got {text!r}")
    if isinstance(text, (int, np.integer)):
        if text < 0:
            raise ValueError(f"time: expected ns ≥ 0, got {text}")
        return int(text)
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"time: expected ns or ISO-8601, got {text!r}")
    s = text.strip()
    if s.isdigit():
        return int(s)
    iso = s[:-1] + "+00:00" if s[-1] in "zZ" else s
    try:
        dt = datetime.fromisoformat(iso)
    except ValueError:
        raise ValueError(f"time: expected integer ns or ISO-8601 like "
                         f"'2024-05-01T12:00:00Z', got {text!r}") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    delta = dt - datetime(1970, 1, 1, tzinfo=UTC)
    # integer arithmetic: exact to the microsecond datetime holds
    ns = (delta.days * 86400 + delta.seconds) * 10**9 + delta.microseconds * 1000
    if ns < 0:
        raise ValueError(f"time: {text!r} is before 1970")
    return ns


def format_time(ns: Optional[int]) -> str:
    """ns since the epoch as ISO-8601 UTC with microseconds (``""`` for None)."""
    if ns is None:
        return ""
    s, rem = divmod(int(ns), 10**9)
    dt = datetime.fromtimestamp(s, tz=UTC).replace(microsecond=rem // 1000)
    return dt.isoformat(timespec="microseconds").replace("+00:00", "Z")


def parse_offsets(text: str) -> dict[int, int]:
    """``"0=10,1=5"`` -> ``{0: 10, 1: 5}`` (partition=offset pairs). Raises ``ValueError``."""
    out: dict[int, int] = {}
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"offsets: expected 'PARTITION=OFFSET[,...]' like '0=10,1=5', "
                         f"got {text!r}")
    for part in text.split(","):
        p, sep, o = part.strip().partition("=")
        if not sep or not p.strip().isdigit() or not o.strip().isdigit():
            raise ValueError(f"offsets: expected 'PARTITION=OFFSET[,...]' like '0=10,1=5', "
                             f"got {text!r}")
        if int(p) in out:
            raise ValueError(f"offsets: partition {int(p)} listed twice in {text!r}")
        out[int(p)] = int(o)
    return out


def parse_seq_range(text: str) -> tuple[Optional[int], Optional[int]]:
    """``"a:b"`` -> ``(a, b)``, both inclusive; either side may be empty (open).

    A single number ``"a"`` means ``a:a``. Raises ``ValueError``.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"seq range: expected 'FIRST:LAST' like '10:20', got {text!r}")
    s = text.strip()
    lo_s, sep, hi_s = s.partition(":")
    if not sep:
        hi_s = lo_s
    lo_s, hi_s = lo_s.strip(), hi_s.strip()
    if (lo_s and not lo_s.isdigit()) or (hi_s and not hi_s.isdigit()):
        raise ValueError(f"seq range: expected 'FIRST:LAST' with non-negative ints (either "
                         f"may be left out), got {text!r}")
    lo = int(lo_s) if lo_s else None
    hi = int(hi_s) if hi_s else None
    if lo is not None and hi is not None and hi < lo:
        raise ValueError(f"seq range: last {hi} is before first {lo} in {text!r}")
    return lo, hi


def _check_time_range(from_time: Optional[int], to_time: Optional[int]) -> None:
    for name, v in (("from_time", from_time), ("to_time", to_time)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer))
                              or v < 0):
            raise ReplayError(f"{name}: expected int ns ≥ 0 (see parse_time), got {v!r}")
    if from_time is not None and to_time is not None and to_time < from_time:
        raise ReplayError(f"to_time {format_time(to_time)} is before from_time "
                          f"{format_time(from_time)}")


def _in_time(ts: int, from_time: Optional[int], to_time: Optional[int]) -> bool:
    return (from_time is None or ts >= from_time) and (to_time is None or ts <= to_time)


# ----------------------------------------------------------------------------- reading


@dataclass
class ReadPlan:
    """Offsets of one bounded read: ``start`` / ``stop`` (exclusive) per partition, and the
    earliest available offset per partition at planning time (``begin``)."""

    topic: str
    partitions: list[int]
    start: dict[int, int]
    stop: dict[int, int]
    begin: dict[int, int]
    partition_count: int

    @property
    def total(self) -> int:
        """Records (offsets) in the plan."""
        return sum(self.stop[p] - self.start[p] for p in self.partitions)

    def to_json(self) -> dict:
        return {"topic": self.topic,
                "partitions": {str(p): [self.start[p], self.stop[p]] for p in self.partitions}}


def plan_read(reader: TopicReader, *, partitions: Optional[Iterable[int]] = None,
              shards: Optional[Iterable[int]] = None,
              from_offsets: Optional[Mapping[int, int]] = None,
              to_offsets: Optional[Mapping[int, int]] = None) -> ReadPlan:
    """Resolve which partitions and offsets to read.

    ``partitions``: explicit partition numbers; else those of ``shards``
    (``shard % partitions``); else the keys of ``from_offsets``; else all. Partitions not in
    ``from_offsets`` start at the earliest offset, those not in ``to_offsets`` stop at the
    end. Raises ``consumers.topic.TopicError`` for offsets that cannot be read.
    """
    count = len(reader.partitions)
    if partitions is None and shards is not None:
        partitions = sorted({int(s) % count for s in shards})
    if partitions is None and from_offsets:
        partitions = sorted(from_offsets)
    if partitions is not None:
        partitions = sorted(set(partitions))
        if not partitions:
            raise ReplayError("partitions: expected at least one partition")
    start = {p: o for p, o in (from_offsets or {}).items()
             if partitions is None or p in partitions}
    stop = {p: o for p, o in (to_offsets or {}).items()
            if partitions is None or p in partitions}
    s, e = reader.resolve(start, stop, partitions)
    parts = sorted(s)
    return ReadPlan(reader.topic, parts, s, e, reader.beginning_offsets(parts), count)


def _records(reader: TopicReader, plan: ReadPlan, progress: bool,
             desc: str) -> Iterator[Record]:
    """Records of ``plan`` with a tqdm bar on stderr when ``progress``."""
    if not progress or plan.total == 0:
        yield from reader.read(plan.start, plan.stop)
        return
    from tqdm import tqdm

    with tqdm(total=plan.total, desc=desc, unit="msg", leave=False,
              dynamic_ncols=True) as bar:
        # Offsets may be skipped (compaction, markers): advance by offset, not by count.
        last = dict(plan.start)
        for rec in reader.read(plan.start, plan.stop):
            bar.update(rec.offset + 1 - last[rec.partition])
            last[rec.partition] = rec.offset + 1
            yield rec


def _open(bootstrap_servers: str, topic: str, timeout: float) -> TopicReader:
    return TopicReader(bootstrap_servers, topic, timeout=timeout)


# ----------------------------------------------------------------------------- rebuild


@dataclass
class RebuildResult:
    """What :func:`rebuild` built.

    Attributes:
        tables: name -> :class:`ServingTable`.
        offsets: partition -> next offset a daemon resuming from this state reads.
        seqs: ``SeqTracker.state()`` of the applied messages.
        plan: the offsets read. counters: the Applier's counters plus ``outside_time``
            (messages left out by the time bounds) and ``records`` (records read).
        meta: the snapshot meta. path: the snapshot written, or None.
        quarantined: ``(partition, offset, reason)`` of the first 100 quarantined records.
    """

    tables: dict[str, ServingTable]
    offsets: dict[int, int]
    seqs: dict
    plan: ReadPlan
    counters: dict[str, int]
    meta: dict
    path: Optional[Path] = None
    quarantined: list = field(default_factory=list)


def rebuild(bootstrap_servers: str, topic: str, *, model: str,
            out: Optional[PathLike] = None, base: Union[PathLike, Snapshot, None] = None,
            partitions: Optional[Iterable[int]] = None,
            from_offsets: Optional[Mapping[int, int]] = None,
            to_offsets: Optional[Mapping[int, int]] = None,
            from_time: Optional[int] = None, to_time: Optional[int] = None,
            table_dims: Optional[Mapping[str, int]] = None,
            shards: Optional[Iterable[int]] = None, dtype: str = "f32",
            progress: bool = False, timeout: float = 10.0) -> RebuildResult:
    """Apply a range of the topic into fresh tables (or onto ``base``); write ``out``.

    Args:
        bootstrap_servers, topic: where to read. model: messages of other models are
            quarantined (as the daemon does).
        out: snapshot directory to write (atomically); None writes nothing.
        base: a snapshot (path or :class:`Snapshot`) whose tables, seq state and offsets
            are the starting point; its offsets are the start offsets (so ``from_offsets``
            may not be given too) and its partitions the default partitions.
        partitions, from_offsets, to_offsets: see :func:`plan_read`.
        from_time, to_time: ns; only messages with ``from_time <= ts <= to_time`` are
            applied (see the module docstring for resume offsets).
        table_dims: ``{name: dim}`` to accept only these tables (as the daemon's
            ``tables=``); None accepts every table of ``model``.
        shards: trainer shards to apply (others skipped); also picks the partitions.
        dtype: storage dtype of created tables (``"f32"`` or ``"f16"``).
        progress: tqdm bar on stderr. timeout: seconds for broker answers.

    Raises:
        ReplayError: bad arguments. ``consumers.topic.TopicError``: broker/topic/offsets.
        ``consumers.serving_table.SnapshotError``: a damaged base snapshot.
    """
    if not isinstance(model, str) or not model:
        raise ReplayError(f"model: expected a non-empty str, got {model!r}")
    if dtype not in STORAGE_DTYPES:
        raise ReplayError(f"dtype: expected one of {sorted(STORAGE_DTYPES)}, got {dtype!r}")
    _check_time_range(from_time, to_time)
    if base is not None and from_offsets:
        raise ReplayError("from_offsets and base are exclusive: a base snapshot's offsets "
                          "are where the rebuild starts")
    tables: dict[str, ServingTable] = {}
    seqs = SeqTracker()
    base_path = None
    if base is not None:
        snap = base if isinstance(base, Snapshot) else read_snapshot(base)
        base_path = None if snap.path is None else str(snap.path)
        bmodel = snap.meta.get("model")
        if bmodel is not None and bmodel != model:
            raise ReplayError(f"base {base_path}: a snapshot of model {bmodel!r}, not "
                              f"{model!r}")
        btopic = snap.meta.get("topic")
        if btopic is not None and btopic != topic:
            log.warning("base %s was taken from topic %r; reading %r", base_path, btopic,
                        topic)
        tables = dict(snap.tables)
        try:
            seqs = SeqTracker.from_state(snap.seqs)
        except ValueError as e:
            raise ReplayError(f"base {base_path}: {e}") from None
        from_offsets = dict(snap.offsets)
        if partitions is None and shards is None and snap.offsets:
            partitions = sorted(snap.offsets)
    try:
        applier = Applier(model, tables, seqs,
                          table_dims=None if table_dims is None else dict(table_dims),
                          shards=None if shards is None else set(shards), dtype=dtype)
    except (TypeError, ValueError) as e:
        raise ReplayError(str(e)) from None
    with _open(bootstrap_servers, topic, timeout) as reader:
        plan = plan_read(reader, partitions=partitions, shards=shards,
                         from_offsets=from_offsets, to_offsets=to_offsets)
        resume = dict(plan.stop)
        outside = other_model = 0
        quarantined: list = []
        timed = from_time is not None or to_time is not None
        t0 = time.monotonic()
        n = 0
        for rec in _records(reader, plan, progress, "rebuild"):
            n += 1
            if timed:
                try:
                    ts = decode(rec.value).ts
                except WireError:
                    ts = None  # the applier quarantines it and says why
                if ts is not None and not _in_time(ts, from_time, to_time):
                    outside += 1
                    if to_time is not None and ts > to_time:
                        resume[rec.partition] = min(resume[rec.partition], rec.offset)
                    continue
            res = applier.process(rec.value, rec.headers)
            if res.kind == "quarantined":
                if res.reason.startswith("model:"):
                    other_model += 1
                # the first few loudly, the rest only counted (a flood must stay readable)
                log.log(logging.WARNING if len(quarantined) < 10 else logging.DEBUG,
                        "partition %d offset %d quarantined: %s", rec.partition,
                        rec.offset, res.reason)
                if len(quarantined) < 100:
                    quarantined.append((rec.partition, rec.offset, res.reason))
    if other_model:
        log.warning("%d of %d records are messages of other models (quarantined); this "
                    "rebuild applies only model %r", other_model, n, model)
    counters = dict(applier.counters)
    counters["outside_time"] = outside
    counters["records"] = n
    log.info("rebuild of %s: %d records in %.2f s, %s", topic, n, time.monotonic() - t0,
             counters)
    meta = {
        "kind": REBUILD_KIND, "tool": "deltastream-replay rebuild", "model": model,
        "topic": topic, "partitions": plan.partition_count,
        "shards": None if shards is None else sorted(set(shards)),
        "range": {"start": {str(p): o for p, o in plan.start.items()},
                  "stop": {str(p): o for p, o in plan.stop.items()},
                  "from_time": from_time, "to_time": to_time},
        "base": base_path, "counters": counters, "written_at": time.time(),
    }
    result = RebuildResult(tables=tables, offsets=resume, seqs=seqs.state(), plan=plan,
                           counters=counters, meta=meta, quarantined=quarantined)
    if out is not None:
        write_snapshot(out, tables=tables, offsets=resume, seqs=result.seqs, meta=meta)
        result.path = Path(out)
        log.info("snapshot written to %s (%d tables, offsets %s)", out, len(tables), resume)
    return result


# ----------------------------------------------------------------------------- dump


def _finite_list(a: np.ndarray) -> list:
    """``a.tolist()`` with NaN/inf as strings, so every line is valid JSON."""
    if a.size == 0 or bool(np.isfinite(a).all()):
        return a.tolist()
    return [[v if math.isfinite(v) else str(v) for v in row] for row in a.tolist()]


def dump(bootstrap_servers: str, topic: str, *, partitions: Optional[Iterable[int]] = None,
         from_offsets: Optional[Mapping[int, int]] = None,
         to_offsets: Optional[Mapping[int, int]] = None,
         from_time: Optional[int] = None, to_time: Optional[int] = None,
         model: Optional[str] = None, tables: Optional[Iterable[str]] = None,
         shards: Optional[Iterable[int]] = None,
         seq_range: Optional[tuple[Optional[int], Optional[int]]] = None,
         rows: bool = False, progress: bool = False,
         timeout: float = 10.0) -> Iterator[dict]:
    """Decoded messages of a topic range as JSON-able dicts, in read order.

    Each message gives ``partition, offset, timestamp_ms, key, bytes, model, table, shard,
    epoch, seq, step, ts, n, dim, dtype, tombstones`` (count); with ``rows`` also ``ids``,
    ``rows`` (float32 values, dequantized) and ``deleted`` (tombstone ids). A record that
    does not decode gives ``partition, offset, bytes, error, head`` (first bytes in hex) and
    whatever its headers say (``model, table, shard, epoch, seq``).

    Filters (all optional, combined with AND): ``model``, ``tables`` (names), ``shards``,
    ``seq_range`` (inclusive ``(first, last)``, None = open), ``from_time``/``to_time``
    (inclusive, on ``ts``). An undecodable record is shown unless its headers place it
    outside the filters (it has no ``ts``, so time bounds do not hide it).
    """
    _check_time_range(from_time, to_time)
    table_set = None if tables is None else set(tables)
    shard_set = None if shards is None else {int(s) for s in shards}
    lo, hi = seq_range if seq_range is not None else (None, None)

    def wanted(m: Optional[str], t: Optional[str], s: Optional[int], q: Optional[int]) -> bool:
        return ((model is None or m is None or m == model)
                and (table_set is None or t is None or t in table_set)
                and (shard_set is None or s is None or s in shard_set)
                and (q is None or ((lo is None or q >= lo) and (hi is None or q <= hi))))

    with _open(bootstrap_servers, topic, timeout) as reader:
        plan = plan_read(reader, partitions=partitions, from_offsets=from_offsets,
                         to_offsets=to_offsets)
        for rec in _records(reader, plan, progress, "dump"):
            base = {"partition": rec.partition, "offset": rec.offset,
                    "timestamp_ms": rec.timestamp,
                    "key": None if rec.key is None else rec.key.decode("utf-8", "replace"),
                    "bytes": len(rec.value) if rec.value is not None else 0}
            try:
                b = decode(rec.value)
            except WireError as e:
                try:
                    hdr = parse_headers(rec.headers)
                except WireError:
                    hdr = {}
                if not wanted(hdr.get("model"), hdr.get("table"), hdr.get("shard"),
                              hdr.get("seq")):
                    continue
                head = bytes(rec.value[:_HEAD_BYTES]).hex() if rec.value else ""
                yield {**base, "error": str(e), "head": head, **hdr}
                continue
            if not wanted(b.model, b.table, b.shard, b.seq) \
                    or not _in_time(b.ts, from_time, to_time):
                continue
            line = {**base, "model": b.model, "table": b.table, "shard": b.shard,
                    "epoch": b.epoch, "seq": b.seq, "step": b.step, "ts": b.ts,
                    "n": b.n, "dim": b.dim, "dtype": b.dtype,
                    "tombstones": 0 if b.tombstones is None else int(b.tombstones.shape[0])}
            if rows:
                line["ids"] = b.ids.tolist()
                line["rows"] = _finite_list(b.rows_f32())
                line["deleted"] = [] if b.tombstones is None else b.tombstones.tolist()
            yield line


# ----------------------------------------------------------------------------- stats


@dataclass
class ShardStats:
    """Figures of one (model, table, shard) stream in a topic range.

    ``gap_ranges``: ``[epoch, first_missing, last_missing]`` per gap (inclusive). A stream
    whose first message in the range has seq > 0 counts a leading gap only when the read
    started at the partition's earliest offset (else earlier seqs lie before the range).
    ``duplicates``: messages whose seq was already seen in the same epoch.
    ``stale``: messages of an epoch older than one already seen.
    """

    model: str
    table: str
    shard: int
    partition: int
    messages: int = 0
    rows: int = 0
    tombstones: int = 0
    unique_ids: int = 0
    bytes: int = 0
    epochs: list = field(default_factory=list)
    gaps: int = 0
    missing_seqs: int = 0
    gap_ranges: list = field(default_factory=list)
    duplicates: int = 0
    stale: int = 0
    ts_min: Optional[int] = None
    ts_max: Optional[int] = None
    step_min: Optional[int] = None
    step_max: Optional[int] = None
    dims: list = field(default_factory=list)
    dtypes: list = field(default_factory=list)

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["ts_min_iso"] = format_time(self.ts_min)
        d["ts_max_iso"] = format_time(self.ts_max)
        return d


@dataclass
class TopicStats:
    """What :func:`stats` found: per-stream figures plus totals."""

    plan: ReadPlan
    streams: list
    records: int = 0
    undecodable: int = 0
    undecodable_offsets: list = field(default_factory=list)
    outside_time: int = 0
    filtered: int = 0

    @property
    def gaps(self) -> int:
        return sum(s.gaps for s in self.streams)

    def to_json(self) -> dict:
        return {**self.plan.to_json(), "records": self.records,
                "undecodable": self.undecodable,
                "undecodable_offsets": [list(x) for x in self.undecodable_offsets],
                "outside_time": self.outside_time, "filtered": self.filtered,
                "messages": sum(s.messages for s in self.streams),
                "rows": sum(s.rows for s in self.streams),
                "bytes": sum(s.bytes for s in self.streams),
                "gaps": self.gaps, "duplicates": sum(s.duplicates for s in self.streams),
                "streams": [s.to_json() for s in self.streams]}

    def format_table(self) -> str:
        """A human-readable table (one line per stream) plus a summary."""
        multi = len({s.model for s in self.streams}) > 1
        head = (["model"] if multi else []) + [
            "table", "shard", "part", "msgs", "rows", "unique", "del", "bytes", "epochs",
            "gaps", "missing", "dups", "stale", "first ts", "last ts"]
        lines = []
        for s in self.streams:
            lines.append(([s.model] if multi else []) + [
                s.table, str(s.shard), str(s.partition), str(s.messages), str(s.rows),
                str(s.unique_ids), str(s.tombstones), _human_bytes(s.bytes),
                ",".join(map(str, s.epochs)), str(s.gaps), str(s.missing_seqs),
                str(s.duplicates), str(s.stale), format_time(s.ts_min),
                format_time(s.ts_max)])
        widths = [max(len(r[i]) for r in [head] + lines) for i in range(len(head))]
        num = set(range(len(head))) - {0, len(head) - 1, len(head) - 2} - (
            {1} if multi else set())
        out = []
        for r in [head] + lines:
            out.append("  ".join(c.rjust(w) if i in num else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip())
        ranges = ", ".join(f"{p}:[{self.plan.start[p]},{self.plan.stop[p]})"
                           for p in self.plan.partitions)
        out.append("")
        out.append(f"topic {self.plan.topic}, partitions {ranges}: {self.records} records, "
                   f"{sum(s.messages for s in self.streams)} messages in "
                   f"{len(self.streams)} streams, {self.undecodable} undecodable, "
                   f"{self.gaps} seq gaps, {sum(s.duplicates for s in self.streams)} "
                   "duplicates")
        for s in self.streams:
            for e, a, b in s.gap_ranges[:20]:
                out.append(f"  gap: table {s.table} shard {s.shard} epoch {e}: seqs {a}..{b} "
                           "missing")
        if self.undecodable_offsets:
            shown = ", ".join(f"{p}@{o}" for p, o, _ in self.undecodable_offsets[:10])
            out.append(f"  undecodable at partition@offset: {shown}")
        return "\n".join(out)


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


class _Acc:
    """Running figures of one stream; unique ids merged in bulk (vectorized)."""

    __slots__ = ("st", "pending", "pending_n", "uniq", "last", "cur_epoch", "started_at_begin")

    def __init__(self, st: ShardStats, started_at_begin: bool) -> None:
        self.st = st
        self.pending: list = []
        self.pending_n = 0
        self.uniq = np.zeros(0, np.int64)
        self.last: dict[int, int] = {}  # epoch -> highest seq seen
        self.cur_epoch: Optional[int] = None
        self.started_at_begin = started_at_begin

    def add_ids(self, ids: np.ndarray) -> None:
        if ids.size:
            self.pending.append(np.array(ids, dtype=np.int64))
            self.pending_n += ids.size
            if self.pending_n > (1 << 20):
                self.merge()

    def merge(self) -> None:
        if self.pending:
            self.uniq = np.unique(np.concatenate([self.uniq] + self.pending))
            self.pending, self.pending_n = [], 0


def stats(bootstrap_servers: str, topic: str, *, partitions: Optional[Iterable[int]] = None,
          from_offsets: Optional[Mapping[int, int]] = None,
          to_offsets: Optional[Mapping[int, int]] = None,
          from_time: Optional[int] = None, to_time: Optional[int] = None,
          model: Optional[str] = None, tables: Optional[Iterable[str]] = None,
          shards: Optional[Iterable[int]] = None, progress: bool = False,
          timeout: float = 10.0) -> TopicStats:
    """Per (model, table, shard): messages, rows, unique ids, bytes, epochs, seq gaps,
    duplicates, time span — over a topic range, optionally filtered (see :func:`dump`).

    Seq analysis follows the message order in the partition: per epoch, a seq above the
    highest seen + 1 is a gap, one at or below it a duplicate; a message of an epoch lower
    than the newest seen for the stream is stale.
    """
    _check_time_range(from_time, to_time)
    table_set = None if tables is None else set(tables)
    shard_set = None if shards is None else {int(s) for s in shards}
    accs: dict[tuple[str, str, int], _Acc] = {}
    with _open(bootstrap_servers, topic, timeout) as reader:
        plan = plan_read(reader, partitions=partitions, from_offsets=from_offsets,
                         to_offsets=to_offsets)
        result = TopicStats(plan=plan, streams=[])
        for rec in _records(reader, plan, progress, "stats"):
            result.records += 1
            try:
                b = decode(rec.value)
            except WireError as e:
                result.undecodable += 1
                if len(result.undecodable_offsets) < 100:
                    result.undecodable_offsets.append((rec.partition, rec.offset, str(e)))
                continue
            if (model is not None and b.model != model) \
                    or (table_set is not None and b.table not in table_set) \
                    or (shard_set is not None and b.shard not in shard_set):
                result.filtered += 1
                continue
            if not _in_time(b.ts, from_time, to_time):
                result.outside_time += 1
                continue
            key = (b.model, b.table, b.shard)
            acc = accs.get(key)
            if acc is None:
                acc = _Acc(ShardStats(b.model, b.table, b.shard, rec.partition),
                           plan.start[rec.partition] <= plan.begin[rec.partition])
                accs[key] = acc
            _account(acc, b, len(rec.value))
    for acc in accs.values():
        acc.merge()
        acc.st.unique_ids = int(acc.uniq.size)
        acc.st.epochs = sorted(acc.last)
    result.streams = [accs[k].st for k in sorted(accs)]
    return result


def _account(acc: _Acc, b: Any, size: int) -> None:
    st = acc.st
    st.messages += 1
    st.rows += b.n
    st.bytes += size
    if b.tombstones is not None:
        st.tombstones += int(b.tombstones.shape[0])
    acc.add_ids(b.ids)
    st.ts_min = b.ts if st.ts_min is None else min(st.ts_min, b.ts)
    st.ts_max = b.ts if st.ts_max is None else max(st.ts_max, b.ts)
    st.step_min = b.step if st.step_min is None else min(st.step_min, b.step)
    st.step_max = b.step if st.step_max is None else max(st.step_max, b.step)
    if b.dim not in st.dims:
        st.dims.append(b.dim)
    if b.dtype not in st.dtypes:
        st.dtypes.append(b.dtype)
    if acc.cur_epoch is not None and b.epoch < acc.cur_epoch:
        st.stale += 1
        return
    acc.cur_epoch = b.epoch if acc.cur_epoch is None else max(acc.cur_epoch, b.epoch)
    last = acc.last.get(b.epoch)
    if last is None:
        # An epoch's first message: seqs before it are missing only if the range
        # covers the start of the log (or an earlier epoch was seen in it).
        if b.seq > 0 and (acc.started_at_begin or len(acc.last) > 0):
            _gap(st, b.epoch, 0, b.seq - 1)
        acc.last[b.epoch] = b.seq
    elif b.seq <= last:
        st.duplicates += 1
    else:
        if b.seq > last + 1:
            _gap(st, b.epoch, last + 1, b.seq - 1)
        acc.last[b.epoch] = b.seq


def _gap(st: ShardStats, epoch: int, lo: int, hi: int) -> None:
    st.gaps += 1
    st.missing_seqs += hi - lo + 1
    if len(st.gap_ranges) < 1000:
        st.gap_ranges.append([epoch, lo, hi])


# ----------------------------------------------------------------------------- diff


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
    """All tables of A and B compared. ``equal`` when no table differs."""

    a: str
    b: str
    tolerance: float
    tables: list
    offsets_a: Optional[dict] = None
    offsets_b: Optional[dict] = None

    @property
    def equal(self) -> bool:
        return all(t.equal for t in self.tables)

    def to_json(self) -> dict:
        return {"a": self.a, "b": self.b, "tolerance": self.tolerance, "equal": self.equal,
                "offsets_a": None if self.offsets_a is None
                else {str(k): v for k, v in self.offsets_a.items()},
                "offsets_b": None if self.offsets_b is None
                else {str(k): v for k, v in self.offsets_b.items()},
                "tables": [t.to_json() for t in self.tables]}

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
        n_diff = sum(not t.equal for t in self.tables)
        out.append("no differences" if self.equal else
                   f"{n_diff} of {len(self.tables)} tables differ")
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
    return rep


def diff_with_rebuild(snapshot: Union[PathLike, Snapshot], *,
                      bootstrap_servers: str, topic: Optional[str] = None,
                      model: Optional[str] = None, tolerance: float = 0.0,
                      progress: bool = False, timeout: float = 10.0) -> DiffReport:
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
                  timeout=timeout)
    if res.plan.stop != {p: snap.offsets[p] for p in res.plan.partitions}:
        log.warning("the topic ends before the snapshot's offsets: rebuilt up to %s, "
                    "snapshot at %s", res.plan.stop, snap.offsets)
    rep = diff_tables(snap.tables, res.tables, tolerance=tolerance, a_label=label,
                      b_label=f"rebuild of {topic} up to {snap.offsets}")
    rep.offsets_a, rep.offsets_b = dict(snap.offsets), dict(res.offsets)
    return rep


def dumps_line(obj: dict) -> str:
    """One JSON line (no NaN/inf tokens; those are strings already)."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False)
