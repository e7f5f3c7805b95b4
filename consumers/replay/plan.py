"""Where a replay reads: time, offset and seq-range parsing, and bounded read plans.

Records are read with :class:`consumers.topic.TopicReader` (assign + seek, no consumer
group), partition by partition in offset order, between start offsets (default: the
earliest available) and stop offsets (default: the end at the time of the call).

Point in time is by each message's own ``ts`` (the trainer's wall clock, ns), never by the
broker's timestamps or ListOffsets-by-time: trainers stamp rows when they read them, and
one partition interleaves several shards whose clocks need not agree, so ``ts`` is not
monotonic along a partition. A time bound therefore never stops a read early: the whole
offset range is read and exactly the messages with ``from_time <= ts <= to_time`` are used
(both bounds inclusive).

A read for one model that finds records of other models only is refused
(:func:`check_models`): a wrong ``--model`` must not look like an empty topic.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Optional, Union

import numpy as np

from consumers.errors import ReplayError
from consumers.topic import Record, TopicReader

__all__ = [
    "parse_time",
    "format_time",
    "parse_offsets",
    "parse_seq_range",
    "check_time_range",
    "check_models",
    "in_time",
    "ReadPlan",
    "plan_read",
    "read_records",
    "open_reader",
]

log = logging.getLogger(__name__)


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


def check_time_range(from_time: Optional[int], to_time: Optional[int]) -> None:
    """Refuse time bounds that are not int ns ≥ 0 or that end before they start
    (:class:`ReplayError`)."""
    for name, v in (("from_time", from_time), ("to_time", to_time)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer))
                              or v < 0):
            raise ReplayError(f"{name}: expected int ns ≥ 0 (see parse_time), got {v!r}")
    if from_time is not None and to_time is not None and to_time < from_time:
        raise ReplayError(f"to_time {format_time(to_time)} is before from_time "
                          f"{format_time(from_time)}")


def check_models(models: Mapping[str, int], model: str, topic: str, *,
                 warn: bool = True) -> None:
    """Refuse a read that found records of other models but none of ``model``
    (:class:`ReplayError` naming the models found); with ``warn``, log once when some
    were skipped.

    ``models``: model name -> records decoded of it."""
    others = {m: k for m, k in models.items() if m != model}
    if not others:
        return
    found = ", ".join(f"{m!r} ({k} records)" for m, k in sorted(others.items()))
    if not models.get(model):
        hint = f"; did you mean --model {next(iter(sorted(others)))}?" if len(others) == 1 \
            else ""
        raise ReplayError(f"topic {topic} holds no records of model {model!r} in the range "
                          f"read, only of {found}{hint}")
    if warn:
        log.warning("skipped %d records of other models in topic %s: %s (this replay reads "
                    "model %r)", sum(others.values()), topic, found, model)


def in_time(ts: int, from_time: Optional[int], to_time: Optional[int]) -> bool:
    """True when ``from_time <= ts <= to_time`` (None bounds are open)."""
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


def read_records(reader: TopicReader, plan: ReadPlan, progress: bool,
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


def open_reader(bootstrap_servers: str, topic: str, timeout: float,
                kafka_config: Optional[Mapping[str, Any]] = None) -> TopicReader:
    """A :class:`TopicReader` of ``topic`` (``timeout``: seconds for broker answers;
    ``kafka_config``: kafka-python client settings such as TLS/SASL)."""
    return TopicReader(bootstrap_servers, topic, timeout=timeout, **dict(kafka_config or {}))
