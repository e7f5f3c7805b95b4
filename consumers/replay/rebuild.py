"""Rebuild serving tables from a range of a deltas topic, and write them as a snapshot.

:func:`rebuild` feeds records through the same :class:`~consumers.applier.Applier` as the
sync daemon, so the same records in the same order give bit-identical tables. Its snapshot
(:func:`consumers.storage.snapshot.write_snapshot`) records, per partition, the offset a daemon
resuming from it must read next. With ``to_time`` that is the first offset whose message
was held back for being later than ``to_time`` (or the stop offset): a daemon started from
the snapshot re-reads the messages after it, and the seq state in the snapshot makes it skip
those already applied as duplicates — so resuming is exact as long as each trainer shard's
clock is monotonic. Messages before ``from_time`` are left out for good: such a snapshot
holds only the rows written inside the window (meta ``range`` says so). Records that do not
decode have no ``ts``; they go to the Applier anyway, which quarantines and counts them.

Dense chunks go to a :class:`~consumers.dense_assembly.DenseAssembler` (restored from a base
that holds dense state), exactly as in the daemon; the snapshot holds its state (the newest
complete version and one being assembled), and ``to_time`` / ``from_time`` apply to a
chunk's version ``ts`` (the same for every chunk of a version, so a version is in or out
whole). :attr:`RebuildResult.dense` is the assembler.

``to_step`` cuts by trainer step instead of by clock: only messages whose ``step`` is at most
``to_step`` are applied (a dense chunk's step is its version's), and a partition resumes
at its first message past it, as with ``to_time``; exact as long as each trainer shard's
steps never go back along its partition (they are the trainer's global step).

Messages of other models are skipped and counted (``foreign_model``); a range that holds
records but none of ``model`` is refused with :class:`~consumers.errors.ReplayError` naming
the models found (a wrong ``--model`` must not write an empty snapshot). ``out`` is checked
before anything is read: it must not exist, be empty, or hold a deltastream snapshot
(:func:`consumers.files.check_replaceable`); nothing else there is ever replaced.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from consumers.applier import Applier
from consumers.dense_assembly import DenseAssembler
from consumers.errors import ReplayError
from consumers.files import PathLike, check_replaceable
from consumers.replay.plan import (
    ReadPlan,
    check_models,
    check_time_range,
    in_time,
    open_reader,
    plan_read,
    read_records,
)
from consumers.sequencing import SeqTracker
from consumers.serving.dtypes import STORAGE_DTYPES
from consumers.serving.table import ServingTable
from consumers.storage.snapshot import Snapshot, read_snapshot, write_snapshot
from deltastream.dense_wire import decode_dense, is_dense, is_dense_payload
from deltastream.wire import WireError, decode

__all__ = ["REBUILD_KIND", "RebuildResult", "rebuild"]

log = logging.getLogger(__name__)

#: ``meta["kind"]`` of snapshots written by :func:`rebuild`
REBUILD_KIND = "deltastream-replay"


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
        dense: the dense versions assembled (``dense.view()``: the newest complete one).
    """

    tables: dict[str, ServingTable]
    offsets: dict[int, int]
    seqs: dict
    plan: ReadPlan
    counters: dict[str, int]
    meta: dict
    path: Optional[Path] = None
    quarantined: list = field(default_factory=list)
    dense: DenseAssembler = field(default_factory=DenseAssembler)


def rebuild(bootstrap_servers: str, topic: str, *, model: str,
            out: Optional[PathLike] = None, base: Union[PathLike, Snapshot, None] = None,
            partitions: Optional[Iterable[int]] = None,
            from_offsets: Optional[Mapping[int, int]] = None,
            to_offsets: Optional[Mapping[int, int]] = None,
            from_time: Optional[int] = None, to_time: Optional[int] = None,
            to_step: Optional[int] = None,
            table_dims: Optional[Mapping[str, int]] = None,
            shards: Optional[Iterable[int]] = None, dtype: str = "f32",
            progress: bool = False, timeout: float = 10.0,
            kafka_config: Optional[Mapping[str, Any]] = None) -> RebuildResult:
    """Apply a range of the topic into fresh tables (or onto ``base``); write ``out``.

    Args:
        bootstrap_servers, topic: where to read. model: messages of other models are
            skipped and counted (as the daemon does).
        out: snapshot directory to write (atomically); None writes nothing. Refused
            before reading when it holds anything but a deltastream snapshot.
        base: a snapshot (path or :class:`Snapshot`) whose tables, seq state and offsets
            are the starting point; its offsets are the start offsets (so ``from_offsets``
            may not be given too) and its partitions the default partitions.
        partitions, from_offsets, to_offsets: see :func:`plan_read`.
        from_time, to_time: ns; only messages with ``from_time <= ts <= to_time`` are
            applied (see the module docstring for resume offsets).
        to_step: only messages of trainer step ``<= to_step`` are applied (the same
            resume rule as ``to_time``).
        table_dims: ``{name: dim}`` to accept only these tables (as the daemon's
            ``tables=``); None accepts every table of ``model``.
        shards: trainer shards to apply (others skipped); also picks the partitions.
        dtype: storage dtype of created tables (``"f32"`` or ``"f16"``).
        progress: tqdm bar on stderr. timeout: seconds for broker answers.
        kafka_config: kafka-python client settings (TLS, SASL).

    Raises:
        ReplayError: bad arguments; records in the range but none of ``model``.
        ``consumers.topic.TopicError``: broker/topic/offsets.
        ``consumers.errors.SnapshotError``: a damaged base snapshot; ``out`` holds
        something that is not a deltastream snapshot.
    """
    _check_arguments(model, dtype, from_time, to_time, base is not None and bool(from_offsets))
    if to_step is not None and (not isinstance(to_step, int) or isinstance(to_step, bool)
                                or to_step < 0):
        raise ReplayError(f"to_step: expected an int >= 0, got {to_step!r}")
    if out is not None:
        check_replaceable(Path(out))  # before reading: a bad --out must not cost a replay
    tables: dict[str, ServingTable] = {}
    seqs = SeqTracker()
    base_path = None
    dense = DenseAssembler()
    if base is not None:
        snap = base if isinstance(base, Snapshot) else read_snapshot(base)
        base_path, tables, seqs = _base_state(snap, model, topic)
        try:
            dense = DenseAssembler.from_state(snap.dense)
        except ValueError as e:
            raise ReplayError(f"base {base_path}: {e}") from None
        from_offsets = dict(snap.offsets)
        if partitions is None and shards is None and snap.offsets:
            partitions = sorted(snap.offsets)
    try:
        applier = Applier(model, tables, seqs,
                          table_dims=None if table_dims is None else dict(table_dims),
                          shards=None if shards is None else set(shards), dtype=dtype,
                          dense=dense)
    except (TypeError, ValueError) as e:
        raise ReplayError(str(e)) from None
    t0 = time.monotonic()
    with open_reader(bootstrap_servers, topic, timeout, kafka_config) as reader:
        plan = plan_read(reader, partitions=partitions, shards=shards,
                         from_offsets=from_offsets, to_offsets=to_offsets)
        run = _apply_range(reader, plan, applier, (from_time, to_time, to_step), progress)
    resume, quarantined = run.resume, run.quarantined
    check_models(applier.models, model, topic)
    counters = dict(applier.counters)
    counters["outside_time"] = run.outside
    counters["records"] = run.records
    log.info("rebuild of %s: %d records in %.2f s, %s", topic, run.records,
             time.monotonic() - t0, counters)
    meta = {"kind": REBUILD_KIND, "tool": "deltastream-replay rebuild", "model": model,
            "topic": topic, "partitions": plan.partition_count,
            "shards": None if shards is None else sorted(set(shards)),
            "range": _range_meta(plan, from_time, to_time, to_step), "base": base_path,
            "counters": counters, "written_at": time.time()}
    result = RebuildResult(tables=tables, offsets=resume, seqs=seqs.state(), plan=plan,
                           counters=counters, meta=meta, quarantined=quarantined,
                           dense=dense)
    if out is not None:
        write_snapshot(out, tables=tables, offsets=resume, seqs=result.seqs, meta=meta,
                       dense=dense.state() if len(dense.seqs) else None)
        result.path = Path(out)
        log.info("snapshot written to %s (%d tables, offsets %s)", out, len(tables), resume)
    return result



def _check_arguments(model: Any, dtype: Any, from_time: Optional[int], to_time: Optional[int],
                     base_and_offsets: bool) -> None:
    """The arguments :func:`rebuild` checks before it reads anything."""
    if not isinstance(model, str) or not model:
        raise ReplayError(f"model: expected a non-empty str, got {model!r}")
    if dtype not in STORAGE_DTYPES:
        raise ReplayError(f"dtype: expected one of {sorted(STORAGE_DTYPES)}, got {dtype!r}")
    check_time_range(from_time, to_time)
    if base_and_offsets:
        raise ReplayError("from_offsets and base are exclusive: a base snapshot's offsets "
                          "are where the rebuild starts")


def _range_meta(plan: ReadPlan, from_time: Optional[int], to_time: Optional[int],
                to_step: Optional[int]) -> dict:
    """The ``meta["range"]`` of a rebuild snapshot: offsets read, the time and step bounds."""
    return {"start": {str(p): o for p, o in plan.start.items()},
            "stop": {str(p): o for p, o in plan.stop.items()},
            "from_time": from_time, "to_time": to_time, "to_step": to_step}


def _base_state(snap: Snapshot, model: str,
                topic: str) -> tuple[Optional[str], dict[str, ServingTable], SeqTracker]:
    """(path, tables, seq state) of a base snapshot, checked: of ``model``; another topic
    is only warned about."""
    base_path = None if snap.path is None else str(snap.path)
    bmodel = snap.meta.get("model")
    if bmodel is not None and bmodel != model:
        raise ReplayError(f"base {base_path}: a snapshot of model {bmodel!r}, not {model!r}")
    btopic = snap.meta.get("topic")
    if btopic is not None and btopic != topic:
        log.warning("base %s was taken from topic %r; reading %r", base_path, btopic, topic)
    try:
        seqs = SeqTracker.from_state(snap.seqs)
    except ValueError as e:
        raise ReplayError(f"base {base_path}: {e}") from None
    return base_path, dict(snap.tables), seqs


@dataclass
class _Run:
    """What reading a range did: resume offsets, records read, left out by time, and the
    first quarantined ``(partition, offset, reason)``."""

    resume: dict[int, int]
    records: int = 0
    outside: int = 0
    quarantined: list = field(default_factory=list)


def _stamp(rec: Any) -> tuple[Optional[int], Optional[int], Any]:
    """(trainer ts, trainer step, decoded row batch or None) of a record; ts and step None
    when it does not decode (the applier quarantines it and says why). A dense chunk's ts
    and step are its version's."""
    try:
        if is_dense(rec.headers) or is_dense_payload(rec.value):
            chunk = decode_dense(rec.value)
            return chunk.ts, chunk.step, None
        batch = decode(rec.value)  # decoded once: the applier is handed it
        return batch.ts, batch.step, batch
    except WireError:
        return None, None, None


def _apply_range(reader: Any, plan: ReadPlan, applier: Applier,
                 bounds: tuple[Optional[int], Optional[int], Optional[int]],
                 progress: bool) -> _Run:
    """Feed the records of ``plan`` to ``applier``, leaving out those outside ``bounds``
    = ``(from_time, to_time, to_step)`` (a record past ``to_time`` or ``to_step`` is where
    its partition resumes)."""
    from_time, to_time, to_step = bounds
    run = _Run(resume=dict(plan.stop))
    bounded = any(b is not None for b in bounds)
    for rec in read_records(reader, plan, progress, "rebuild"):
        run.records += 1
        batch = None
        if bounded:
            ts, step, batch = _stamp(rec)  # None: does not decode, the applier quarantines
            past = ts is not None and ((to_time is not None and ts > to_time)
                                       or (to_step is not None and step > to_step))
            if past or (ts is not None and not in_time(ts, from_time, to_time)):
                run.outside += 1
                if past:
                    run.resume[rec.partition] = min(run.resume[rec.partition], rec.offset)
                continue
        res = applier.process(rec.value, rec.headers, decoded=batch)
        if res.kind == "quarantined":
            # the first few loudly, the rest only counted (a flood must stay readable)
            log.log(logging.WARNING if len(run.quarantined) < 10 else logging.DEBUG,
                    "partition %d offset %d quarantined: %s", rec.partition, rec.offset,
                    res.reason)
            if len(run.quarantined) < 100:
                run.quarantined.append((rec.partition, rec.offset, res.reason))
    return run
