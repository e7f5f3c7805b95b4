"""Look at a range of a deltas topic: decoded messages (:func:`dump`) and per-stream
figures (:func:`stats`).

Both read like :mod:`consumers.replay.plan` says and filter by model, tables, shards (and
``dump`` by seq range), and by ``ts`` between ``from_time`` and ``to_time`` (inclusive).
A record that does not decode is shown by :func:`dump` as an error line and counted by
:func:`stats` as undecodable. With ``model`` given, a range holding records of other models
only raises :class:`~consumers.errors.ReplayError` naming them (after ``dump`` yielded
whatever it found: nothing of ``model``).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from consumers.replay.plan import (
    ReadPlan,
    check_models,
    check_time_range,
    format_time,
    in_time,
    open_reader,
    plan_read,
    read_records,
)
from deltastream import dense_wire
from deltastream.dense_wire import DenseChunk, decode_dense
from deltastream.wire import WireError, decode, parse_headers

__all__ = ["dump", "dumps_line", "ShardStats", "TopicStats", "stats"]

log = logging.getLogger(__name__)

_HEAD_BYTES = 32  # bytes of an undecodable record shown in hex


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
         timeout: float = 10.0,
         kafka_config: Optional[Mapping[str, Any]] = None) -> Iterator[dict]:
    """Decoded messages of a topic range as JSON-able dicts, in read order.

    Each message gives ``partition, offset, timestamp_ms, key, bytes, model, table, shard,
    epoch, seq, step, ts, n, dim, col, width, dtype, tombstones`` (count; ``col``/``width``:
    the rows are columns ``[col, col + dim)`` of rows ``width`` wide, a column-wise shard);
    with ``rows`` also ``ids``, ``rows`` (float32 values of those columns, dequantized) and
    ``deleted`` (tombstone ids). Every line has ``kind``: ``rows``, or ``dense`` for a
    dense-weights chunk (:mod:`deltastream.dense_wire`), whose line gives ``model, table``
    (:data:`~deltastream.dense_wire.STREAM`), ``shard, epoch, seq, step, ts, full,
    base_step, tensors, chunks, index, name, shape, offset, n, dtype`` (and ``values``
    with ``rows``); the ``tables`` filter keeps them when it names that stream. A record that
    does not decode gives ``partition, offset, bytes, error, head`` (first bytes in hex) and
    whatever its headers say (``model, table, shard, epoch, seq``).

    Filters (all optional, combined with AND): ``model``, ``tables`` (names), ``shards``,
    ``seq_range`` (inclusive ``(first, last)``, None = open), ``from_time``/``to_time``
    (inclusive, on ``ts``). An undecodable record is shown unless its headers place it
    outside the filters (it has no ``ts``, so time bounds do not hide it). Raises
    ``ReplayError`` at the end when ``model`` is given and the range holds records of other
    models only. ``kafka_config``: kafka-python client settings (TLS, SASL).
    """
    check_time_range(from_time, to_time)
    table_set = None if tables is None else set(tables)
    shard_set = None if shards is None else {int(s) for s in shards}
    lo, hi = seq_range if seq_range is not None else (None, None)

    def wanted(m: Optional[str], t: Optional[str], s: Optional[int], q: Optional[int]) -> bool:
        return ((model is None or m is None or m == model)
                and (table_set is None or t is None or t in table_set)
                and (shard_set is None or s is None or s in shard_set)
                and (q is None or ((lo is None or q >= lo) and (hi is None or q <= hi))))

    models: dict[str, int] = {}
    with open_reader(bootstrap_servers, topic, timeout, kafka_config) as reader:
        plan = plan_read(reader, partitions=partitions, from_offsets=from_offsets,
                         to_offsets=to_offsets)
        for rec in read_records(reader, plan, progress, "dump"):
            base = {"partition": rec.partition, "offset": rec.offset,
                    "timestamp_ms": rec.timestamp,
                    "key": None if rec.key is None else rec.key.decode("utf-8", "replace"),
                    "bytes": len(rec.value) if rec.value is not None else 0}
            if dense_wire.is_dense(rec.headers) or dense_wire.is_dense_payload(rec.value):
                try:
                    c = decode_dense(rec.value)
                except WireError as e:
                    yield {**base, "kind": dense_wire.KIND, "error": str(e),
                           "head": bytes(rec.value[:_HEAD_BYTES]).hex()}
                    continue
                models[c.model] = models.get(c.model, 0) + 1
                if wanted(c.model, dense_wire.STREAM, c.shard, c.seq) \
                        and in_time(c.ts, from_time, to_time):
                    yield _dense_line(base, c, rows)
                continue
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
            models[b.model] = models.get(b.model, 0) + 1
            if not wanted(b.model, b.table, b.shard, b.seq) \
                    or not in_time(b.ts, from_time, to_time):
                continue
            line = {**base, "kind": "rows", "model": b.model, "table": b.table, "shard": b.shard,
                    "epoch": b.epoch, "seq": b.seq, "step": b.step, "ts": b.ts,
                    "n": b.n, "dim": b.dim, "col": b.col, "width": b.width, "dtype": b.dtype,
                    "tombstones": 0 if b.tombstones is None else int(b.tombstones.shape[0])}
            if rows:
                line["ids"] = b.ids.tolist()
                line["rows"] = _finite_list(b.rows_f32())
                if b.additive:  # r1: what predictors add to the rows they hold
                    line["additive"] = True
                line["deleted"] = [] if b.tombstones is None else b.tombstones.tolist()
            yield line
    if model is not None:
        check_models(models, model, topic, warn=False)


def _dense_line(base: dict, c: DenseChunk, values: bool) -> dict:
    """A dense chunk's dump line: its version, tensor and chunk (``values``: float32)."""
    line = {**base, "kind": dense_wire.KIND, "model": c.model, "table": dense_wire.STREAM,
            "shard": c.shard, "epoch": c.epoch, "seq": c.seq, "step": c.step, "ts": c.ts,
            "full": c.full, "base_step": c.base_step, "tensors": c.tensors,
            "chunks": c.chunks, "index": c.index, "name": c.name, "shape": list(c.shape),
            "offset": c.offset, "n": int(c.values.shape[0]), "dtype": c.dtype}
    if values:
        line["values"] = _finite_list(c.values_f32()[None, :])[0]
    return line


def dumps_line(obj: dict) -> str:
    """One JSON line (no NaN/inf tokens; those are strings already)."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False)


# ----------------------------------------------------------------------------- stats


@dataclass
class ShardStats:
    """Figures of one (model, table, shard) stream in a topic range; the dense-weights
    stream of a shard is listed as table ``/dense`` (:data:`deltastream.dense_wire.STREAM`).

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
    #: column ranges ``[col, col + dim, width]`` seen (one ``[0, dim, dim]`` for whole rows)
    columns: list = field(default_factory=list)
    dtypes: list = field(default_factory=list)
    #: the dense stream (table ``/dense``): versions begun (their first chunk seen), and
    #: how many of them full; 0 for row streams
    versions: int = 0
    full_versions: int = 0

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
        # a "cols" column only when some stream carries column slices (column-wise shards)
        sliced = any(c[0] != 0 or c[1] != c[2] for s in self.streams for c in s.columns)
        head = (["model"] if multi else []) + ["table", "shard"] + (["cols"] if sliced else []) + [
            "part", "msgs", "rows", "unique", "del", "bytes", "epochs",
            "gaps", "missing", "dups", "stale", "first ts", "last ts"]
        lines = []
        for s in self.streams:
            cols = [",".join(f"{c[0]}-{c[1]}/{c[2]}" for c in s.columns)] if sliced else []
            lines.append(([s.model] if multi else []) + [s.table, str(s.shard)] + cols + [
                str(s.partition), str(s.messages), str(s.rows),
                str(s.unique_ids), str(s.tombstones), _human_bytes(s.bytes),
                ",".join(map(str, s.epochs)), str(s.gaps), str(s.missing_seqs),
                str(s.duplicates), str(s.stale), format_time(s.ts_min),
                format_time(s.ts_max)])
        widths = [max(len(r[i]) for r in [head] + lines) for i in range(len(head))]
        num = set(range(len(head))) - {0, len(head) - 1, len(head) - 2} - (
            {1} if multi else set()) - ({head.index("cols")} if sliced else set())
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
          timeout: float = 10.0,
          kafka_config: Optional[Mapping[str, Any]] = None) -> TopicStats:
    """Per (model, table, shard): messages, rows, unique ids, bytes, epochs, seq gaps,
    duplicates, time span — over a topic range, optionally filtered (see :func:`dump`).

    Seq analysis follows the message order in the partition: per epoch, a seq above the
    highest seen + 1 is a gap, one at or below it a duplicate; a message of an epoch lower
    than the newest seen for the stream is stale. Raises ``ReplayError`` when ``model``
    is given and the range holds records of other models only.
    """
    check_time_range(from_time, to_time)
    table_set = None if tables is None else set(tables)
    shard_set = None if shards is None else {int(s) for s in shards}
    accs: dict[tuple[str, str, int], _Acc] = {}
    models: dict[str, int] = {}
    with open_reader(bootstrap_servers, topic, timeout, kafka_config) as reader:
        plan = plan_read(reader, partitions=partitions, from_offsets=from_offsets,
                         to_offsets=to_offsets)
        result = TopicStats(plan=plan, streams=[])
        for rec in read_records(reader, plan, progress, "stats"):
            result.records += 1
            dense = dense_wire.is_dense(rec.headers) or dense_wire.is_dense_payload(rec.value)
            try:
                b = decode_dense(rec.value) if dense else decode(rec.value)
            except WireError as e:
                result.undecodable += 1
                if len(result.undecodable_offsets) < 100:
                    result.undecodable_offsets.append((rec.partition, rec.offset, str(e)))
                continue
            models[b.model] = models.get(b.model, 0) + 1
            table = dense_wire.STREAM if dense else b.table
            if (model is not None and b.model != model) \
                    or (table_set is not None and table not in table_set) \
                    or (shard_set is not None and b.shard not in shard_set):
                result.filtered += 1
                continue
            if not in_time(b.ts, from_time, to_time):
                result.outside_time += 1
                continue
            key = (b.model, table, b.shard)
            acc = accs.get(key)
            if acc is None:
                acc = _Acc(ShardStats(b.model, table, b.shard, rec.partition),
                           plan.start[rec.partition] <= plan.begin[rec.partition])
                accs[key] = acc
            (_account_dense if dense else _account)(acc, b, len(rec.value))
    for acc in accs.values():
        acc.merge()
        acc.st.unique_ids = int(acc.uniq.size)
        acc.st.epochs = sorted(acc.last)
    result.streams = [accs[k].st for k in sorted(accs)]
    if model is not None:
        check_models(models, model, topic, warn=False)
    return result


def _account(acc: _Acc, b: Any, size: int) -> None:
    """Count a row message ``b`` of ``size`` bytes."""
    st = acc.st
    st.rows += b.n
    if b.tombstones is not None:
        st.tombstones += int(b.tombstones.shape[0])
    acc.add_ids(b.ids)
    if b.dim not in st.dims:
        st.dims.append(b.dim)
    cols = [b.col, b.col + b.dim, b.dim if b.width is None else b.width]
    if cols not in st.columns:
        st.columns.append(cols)
    _sequence(acc, b, size)


def _account_dense(acc: _Acc, c: DenseChunk, size: int) -> None:
    """Count a dense chunk ``c`` of ``size`` bytes (a version's first chunk counts it)."""
    acc.st.versions += int(c.index == 0)
    acc.st.full_versions += int(c.index == 0 and c.full)
    _sequence(acc, c, size)


def _sequence(acc: _Acc, b: Any, size: int) -> None:
    """What every message kind counts: messages, bytes, time and step span, dtypes and
    the seq analysis (gaps, duplicates, stale epochs)."""
    st = acc.st
    st.messages += 1
    st.bytes += size
    st.ts_min = b.ts if st.ts_min is None else min(st.ts_min, b.ts)
    st.ts_max = b.ts if st.ts_max is None else max(st.ts_max, b.ts)
    st.step_min = b.step if st.step_min is None else min(st.step_min, b.step)
    st.step_max = b.step if st.step_max is None else max(st.step_max, b.step)
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
