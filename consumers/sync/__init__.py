"""SyncDaemon: keep a predictor's serving tables in sync with a deltas topic.

One loop, one thread (the caller's of :meth:`SyncDaemon.run`):

1. **connect** — a ``KafkaConsumer`` with ``assign()`` + ``seek()`` only (no consumer groups:
   they do not work on the embedded broker, and a predictor needs every row of its shards),
   on all partitions of the topic or on those holding ``shards`` (``shard % partitions``);
2. **seek** to the next offset per partition from the last checkpoint (earliest when none);
3. **poll** and hand each record, partition by partition in offset order (apply order is
   partition order), to :class:`~consumers.applier.Applier`, which decodes, validates,
   sequence-checks and applies it atomically; bad records go to the quarantine file;
4. **checkpoint** tables + next offset per partition + seq state atomically every
   ``checkpoint_interval`` seconds or ``checkpoint_messages`` records, and on :meth:`stop`,
   with a :class:`~consumers.storage.checkpoint.CheckpointStore`: each checkpoint writes only the
   rows changed since the previous one (a delta segment), plus a new full base when the
   segments grow large next to it; a small manifest replaced atomically commits it.

Exactly once in effect: offsets, tables and seq state are written together, between two
records, by the only thread that applies. After a crash at any instant the daemon reloads
the last complete checkpoint and re-reads from its offsets, so it ends in the same state as
a run without the crash (re-applying a message is deterministic, and the seq state in the
checkpoint matches the tables in it).

Broker trouble: the daemon never stops serving lookups (tables live in memory). A failed
request closes the consumer; reconnects back off exponentially (capped at
``backoff_max``), and each state change (connected / disconnected / topic missing) is logged
once. Positions are the daemon's own, so a reconnect resumes exactly where applying stopped.
When a stored offset no longer exists on the broker — below the earliest offset (retention),
beyond the end of the log, or a topic whose id changed (deleted and recreated; an in-memory
broker that restarted) — the daemon logs the range, counts it in ``stats()["offsets_lost"]``
and continues from the earliest available offset. Messages lost that way also show up as
seq gaps once newer messages of the same stream arrive.

End offsets: the embedded broker (Tansu) answers ListOffsets(latest) with the base offset of
the last record batch + 1, an undercount when producers batch; lag uses the larger of that
and the fetch high watermark, and :meth:`SyncDaemon.caught_up` measures exact end offsets.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Optional, Union

from consumers.applier import Applier, Outcome
from consumers.quarantine import Quarantine
from consumers.sequencing import SeqTracker
from consumers.serving_table import STORAGE_DTYPES, ServingTable
from consumers.storage.checkpoint import CheckpointStore
from consumers.storage.snapshot import read_snapshot, snapshot_exists
from consumers.sync.metrics import (
    FreshnessWindow,
    MetricsServer,
    partition_lag,
    summary_line,
    total_lag,
)

__all__ = ["SyncDaemon", "CHECKPOINT_DIR", "QUARANTINE_FILE", "BROKER_STATES"]

log = logging.getLogger(__name__)

#: sub-paths of ``state_dir``
CHECKPOINT_DIR = "checkpoint"
QUARANTINE_FILE = "quarantine.jsonl"
#: values of ``stats()["broker"]``
BROKER_STATES = ("connecting", "connected", "disconnected", "topic_missing", "stopped")
_CHECKPOINT_KIND = "deltastream-sync"
_MAX_LOST_EVENTS = 100
_QUARANTINE_WARNINGS = 100  # quarantined records logged at WARNING before going quiet

PathLike = Union[str, os.PathLike]


def _positive(name: str, value: Any, *, integer: bool = False) -> Any:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0:
        what = "a positive int" if integer else "a positive number"
        raise ValueError(f"{name}: expected {what}, got {value!r}")
    return value


def _kafka_errors() -> Any:
    import kafka.errors as errors

    return errors


class SyncDaemon:
    """Consume a deltas topic into serving tables, with atomic checkpoints.

    Args:
        bootstrap_servers: ``"host:port[,host:port]"`` of the Kafka cluster.
        topic: the deltas topic (``deltas.<model>`` by convention).
        model: messages of other models are quarantined.
        state_dir: directory for ``checkpoint/`` and ``quarantine.jsonl`` (created).
        tables: ``{name: dim}`` to serve only these tables (messages of other tables are
            quarantined); None serves every table of ``model`` (created on first message).
        shards: trainer shards to serve (their partitions are ``shard % partitions``; other
            shards' messages in those partitions are skipped); None serves all.
        dtype: storage dtype of the serving tables, ``"f32"`` or ``"f16"``.
        checkpoint_interval: seconds between checkpoints while there are new records.
        checkpoint_messages: records after which a checkpoint is written regardless of time.
        checkpoint_max_segments: delta segments chained on one base before a checkpoint
            rewrites the base in full.
        checkpoint_segment_fraction: rewrite the base when the segments' bytes exceed this
            fraction of the base's bytes.
        base: snapshot directory (a checkpoint or one ``ServingTable.save`` dir) to start
            from when ``state_dir`` holds no checkpoint: its tables, offsets and seq state.
        poll_timeout_ms: longest wait of one poll for new records (ms).
        max_poll_records: most records handed over per poll.
        quarantine_max_bytes: size bound of the quarantine file (rotated once to ``.1``).
        request_timeout: seconds a broker request may take before the broker counts as down.
        backoff_max: cap of the exponential reconnect backoff, seconds.
        probe_interval: seconds between end-offset refreshes (lag, liveness).
        summary_interval: seconds between one-line INFO summaries (0 disables them).
        freshness_window: seconds of history of the freshness p50/p99.
        metrics_port: serve Prometheus metrics on this port (0 = any free port; see
            :attr:`metrics_port`); None serves none. metrics_addr: address to bind.
        on_apply: called as ``on_apply(outcome, partition, offset)`` in the loop thread after
            every record (any ``outcome.kind``; ``outcome.ts`` is the trainer's ns timestamp),
            e.g. to record freshness over a whole run. Keep it quick: it delays applying.
            An exception from it is logged (once per kind of error) and ignored.
        **consumer_config: extra ``KafkaConsumer`` settings (security options, …).

    Raises:
        ValueError/TypeError: a bad argument, or a checkpoint in ``state_dir`` written for
            another model or topic (or with tables of other dims).
        consumers.storage.snapshot.SnapshotError: a damaged checkpoint or base snapshot.
    """

    #: Seconds to sleep after each record (tests use it to land kills mid-stream).
    debug_apply_delay: float = 0.0

    def __init__(self, bootstrap_servers: str, topic: str, *, model: str, state_dir: PathLike,
                 tables: Optional[Mapping[str, int]] = None,
                 shards: Optional[Iterable[int]] = None, dtype: str = "f32",
                 checkpoint_interval: float = 5.0, checkpoint_messages: int = 1000,
                 checkpoint_max_segments: int = 128, checkpoint_segment_fraction: float = 0.5,
                 base: Optional[PathLike] = None, poll_timeout_ms: int = 200,
                 max_poll_records: int = 500, quarantine_max_bytes: int = 64 << 20,
                 request_timeout: float = 5.0, backoff_max: float = 5.0,
                 probe_interval: float = 1.0, summary_interval: float = 30.0,
                 freshness_window: float = 60.0, metrics_port: Optional[int] = None,
                 metrics_addr: str = "0.0.0.0",
                 on_apply: Optional[Callable[[Outcome, int, int], None]] = None,
                 **consumer_config: Any) -> None:
        if not isinstance(bootstrap_servers, str) or not bootstrap_servers.strip():
            raise ValueError("bootstrap_servers: expected 'host:port[,host:port]', got "
                             f"{bootstrap_servers!r}")
        for name, v in (("topic", topic), ("model", model)):
            if not isinstance(v, str) or not v:
                raise ValueError(f"{name}: expected a non-empty str, got {v!r}")
        if dtype not in STORAGE_DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(STORAGE_DTYPES)}, got {dtype!r}")
        table_dims = None
        if tables is not None:
            if not isinstance(tables, Mapping) or not tables:
                raise ValueError(f"tables: expected a non-empty mapping name -> dim, got "
                                 f"{tables!r}")
            table_dims = {}
            for name, dim in tables.items():
                if not isinstance(name, str) or not name:
                    raise ValueError(f"tables: table names must be non-empty str, got {name!r}")
                _positive(f"tables[{name!r}]", dim, integer=True)
                table_dims[name] = int(dim)
        shard_set = None
        if shards is not None:
            shard_set = set()
            for s in shards:
                if isinstance(s, bool) or not isinstance(s, int) or s < 0:
                    raise ValueError(f"shards: expected non-negative ints, got {s!r}")
                shard_set.add(s)
            if not shard_set:
                raise ValueError("shards: expected at least one shard (None serves all)")
        _positive("checkpoint_interval", checkpoint_interval)
        _positive("checkpoint_messages", checkpoint_messages, integer=True)
        _positive("poll_timeout_ms", poll_timeout_ms, integer=True)
        _positive("max_poll_records", max_poll_records, integer=True)
        _positive("request_timeout", request_timeout)
        _positive("backoff_max", backoff_max)
        _positive("probe_interval", probe_interval)
        _positive("freshness_window", freshness_window)
        if isinstance(summary_interval, bool) or not isinstance(summary_interval, (int, float)) \
                or summary_interval < 0:
            raise ValueError(f"summary_interval: expected seconds ≥ 0, got {summary_interval!r}")
        if on_apply is not None and not callable(on_apply):
            raise TypeError(f"on_apply: expected a callable(outcome, partition, offset) or "
                            f"None, got {type(on_apply).__name__}")
        from kafka import KafkaConsumer

        unknown = set(consumer_config) - set(KafkaConsumer.DEFAULT_CONFIG)
        if unknown:
            raise TypeError(f"unknown SyncDaemon/KafkaConsumer settings: {sorted(unknown)}")

        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.model = model
        self.state_dir = Path(state_dir)
        self.checkpoint_path = self.state_dir / CHECKPOINT_DIR
        # validates its arguments; nothing is read or written before load/write
        self._store = CheckpointStore(self.checkpoint_path,
                                      max_segment_fraction=checkpoint_segment_fraction,
                                      max_segments=checkpoint_max_segments)
        self._last_ckpt: Optional[dict] = None  # kind, bytes, rows, seconds of the last one
        self.shards = shard_set
        self.dtype = dtype
        self.checkpoint_interval = float(checkpoint_interval)
        self.checkpoint_messages = int(checkpoint_messages)
        self.poll_timeout_ms = int(poll_timeout_ms)
        self.max_poll_records = int(max_poll_records)
        self.request_timeout = float(request_timeout)
        self.backoff_max = float(backoff_max)
        self.probe_interval = float(probe_interval)
        self.summary_interval = float(summary_interval)
        self._consumer_config = dict(consumer_config)
        self._on_apply = on_apply
        self._hook_errors: set[str] = set()

        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()  # counters, positions, end offsets
        self._tables: dict[str, ServingTable] = {}
        self._offsets: dict[int, int] = {}  # partition -> next offset (all ever seen)
        self._topic_id: Optional[str] = None
        self._checkpoints_total = 0  # across restarts (kept in the checkpoint meta)
        self._last_ckpt_wall: Optional[float] = None  # wall time of the last checkpoint
        self._partitions_total: Optional[int] = None  # partitions of the topic
        self.source = "empty"  #: where the state came from: checkpoint | base | empty
        seqs = self._load_state(base, table_dims)
        for name, dim in (table_dims or {}).items():
            if name not in self._tables:
                self._tables[name] = ServingTable(name, dim, dtype=dtype)
        self._seqs = seqs
        self._applier = Applier(model, self._tables, seqs, table_dims=table_dims,
                                shards=shard_set, dtype=dtype)
        self._quarantine = Quarantine(self.state_dir / QUARANTINE_FILE, quarantine_max_bytes)
        self._fresh = FreshnessWindow(freshness_window)
        self._quarantine_logged = 0

        # loop state (owned by the loop thread)
        self._consumer: Any = None
        self._tps: list[Any] = []
        self._backoff = 0.0
        self._next_connect = 0.0
        self._next_probe = 0.0
        self._pending = 0  # records read since the last checkpoint
        self._dirty = self.source == "base"
        self._last_ckpt_mono = time.monotonic()
        self._next_summary = time.monotonic() + self.summary_interval
        self._prev_summary: Optional[tuple[float, dict]] = None

        # shared with other threads
        self._positions: dict[int, int] = {}  # assigned partition -> next offset
        self._ends: dict[int, int] = {}
        self._state = "connecting"
        self._lost: deque = deque(maxlen=_MAX_LOST_EVENTS)
        self._last_gap: Optional[dict] = None
        self._c = dict.fromkeys(("offsets_lost", "checkpoints", "checkpoint_errors",
                                 "disconnects", "internal_errors"), 0)
        self._started = time.monotonic()
        self._stop_event = threading.Event()
        self._loop_lock = threading.Lock()
        self._loop_thread: Optional[int] = None
        self._closed = False

        self.metrics_port: Optional[int] = None  #: bound port of the metrics endpoint
        self._metrics: Optional[MetricsServer] = None
        if metrics_port is not None:
            self._metrics = MetricsServer(self.stats, metrics_port, metrics_addr)
            self.metrics_port = self._metrics.port

    # ------------------------------------------------------------------ state on disk

    def _load_state(self, base: Optional[PathLike],
                    table_dims: Optional[dict[str, int]]) -> SeqTracker:
        if self._store.exists():
            snap = self._store.load()
            assert snap is not None
            meta = snap.meta
            if meta.get("kind") == _CHECKPOINT_KIND:
                for key, mine in (("model", self.model), ("topic", self.topic)):
                    if meta.get(key) != mine:
                        raise ValueError(
                            f"{self.checkpoint_path} is a checkpoint of {key} "
                            f"{meta.get(key)!r}, this daemon syncs {key} {mine!r}; use "
                            "another state_dir")
            self.source = "checkpoint"
            self._topic_id = meta.get("topic_id")
            self._checkpoints_total = int(meta.get("checkpoints", 0))
            if isinstance(meta.get("partitions"), int):
                self._partitions_total = meta["partitions"]
            written = meta.get("written_at")
            if isinstance(written, (int, float)):
                self._last_ckpt_wall = float(written)
        elif base is not None:
            if not snapshot_exists(base):
                raise ValueError(f"base: {base} holds no snapshot (expected a directory "
                                 "written by a checkpoint, the replay tool or "
                                 "ServingTable.save)")
            snap = read_snapshot(base)
            self.source = "base"
            # a base from another broker/topic incarnation: offsets are trusted, ids are not
            self._topic_id = None
        else:
            return SeqTracker()
        for name, t in snap.tables.items():
            want = (table_dims or {}).get(name)
            if want is not None and t.dim != want:
                raise ValueError(f"table {name!r} has dim {t.dim} in {snap.path}, but "
                                 f"tables= says dim {want}")
        self._tables.update(snap.tables)
        self._offsets = dict(snap.offsets)
        seqs = SeqTracker.from_state(snap.seqs)
        log.info("state from %s %s: %d tables (%s rows), offsets %s, %d seq streams",
                 self.source, snap.path, len(self._tables),
                 sum(len(t) for t in self._tables.values()), self._offsets, len(seqs))
        return seqs

    def _checkpoint_locked(self) -> bool:
        """Write the checkpoint now (loop thread, between records). True when written."""
        n = self._checkpoints_total + 1
        with self._lock:
            offsets = dict(self._offsets)
            offsets.update(self._positions)
        meta = {"kind": _CHECKPOINT_KIND, "model": self.model, "topic": self.topic,
                "topic_id": self._topic_id, "partitions": self._partitions_total,
                "shards": None if self.shards is None else sorted(self.shards),
                "checkpoints": n, "written_at": time.time()}
        t0 = time.monotonic()
        tables = dict(self._tables)
        log.debug("checkpoint %d begin (%s): offsets %s", n, self._store.plan(tables), offsets)
        try:
            res = self._store.write(tables=tables, offsets=offsets, seqs=self._seqs.state(),
                                    meta=meta)
        except Exception as e:  # a full disk must not stop serving; retried next interval
            with self._lock:
                self._c["checkpoint_errors"] += 1
            log.error("checkpoint %d to %s failed: %s", n, self.checkpoint_path, e)
            self._last_ckpt_mono = time.monotonic()
            return False
        self._checkpoints_total = n
        self._pending = 0
        self._dirty = False
        self._last_ckpt_mono = time.monotonic()
        self._last_ckpt_wall = time.time()
        with self._lock:
            self._c["checkpoints"] += 1
            self._last_ckpt = {"kind": res.kind, "bytes": res.bytes, "rows": res.upserts,
                               "deleted": res.deletes, "seconds": res.seconds}
        log.debug("checkpoint %d written in %.1f ms (%s: %d rows, %d deleted, %d bytes)", n,
                  (time.monotonic() - t0) * 1e3, res.kind, res.upserts, res.deletes,
                  res.bytes)
        return True

    def checkpoint(self) -> bool:
        """Write a checkpoint now. True when written.

        Raises ``RuntimeError`` while :meth:`run` works in another thread (the loop
        checkpoints on its own schedule) or after :meth:`stop`.
        """
        self._enter("checkpoint")
        try:
            return self._checkpoint_locked()
        finally:
            self._loop_thread = None
            self._loop_lock.release()

    # ------------------------------------------------------------------ broker connection

    def _set_state(self, state: str, detail: str = "") -> None:
        with self._lock:
            old, self._state = self._state, state
            if state == "disconnected" and old != "disconnected":
                self._c["disconnects"] += 1
        if old == state:
            return
        level = logging.INFO if state == "connected" else logging.WARNING
        log.log(level, "broker %s: %s -> %s%s", self.bootstrap_servers, old, state,
                f" ({detail})" if detail else "")

    def _schedule_reconnect(self) -> None:
        self._backoff = min(self.backoff_max, max(0.1, self._backoff * 2))
        self._next_connect = time.monotonic() + self._backoff

    def _close_consumer(self) -> None:
        c, self._consumer = self._consumer, None
        self._tps = []
        if c is not None:
            try:
                c.close(autocommit=False, timeout_ms=1000)
            except Exception:  # closing a broken connection must not raise out of the loop
                log.debug("closing the consumer failed", exc_info=True)

    def _disconnect(self, reason: str) -> None:
        self._close_consumer()
        self._set_state("disconnected", reason)
        self._schedule_reconnect()

    def _consumer_settings(self) -> dict:
        ms = int(self.request_timeout * 1000)
        cfg = dict(
            bootstrap_servers=self.bootstrap_servers.split(","), group_id=None,
            enable_auto_commit=False,
            # Out-of-range offsets must surface (OffsetOutOfRangeError) so they are
            # counted as lost, never silently jumped over.
            auto_offset_reset="none",
            # A consumer must never create the topic (with the broker's default partition
            # count) after an in-memory broker restarted; the publisher creates it.
            allow_auto_create_topics=False,
            bootstrap_timeout_ms=ms, request_timeout_ms=max(ms, 1000),
            fetch_max_wait_ms=min(500, max(10, self.poll_timeout_ms)),
            max_poll_records=self.max_poll_records,
            reconnect_backoff_ms=50, reconnect_backoff_max_ms=int(self.backoff_max * 1000),
            client_id=f"deltastream-sync-{self.model}",
        )
        cfg.update(self._consumer_config)
        return cfg

    def _topic_id_of(self, consumer: Any) -> Optional[str]:
        cluster = getattr(consumer, "_cluster", None)  # kafka-python keeps ids there
        getter = getattr(cluster, "topic_id", None)
        if getter is None:
            return None
        tid = getter(self.topic)
        return None if tid is None else str(tid)

    def _lost_range(self, partition: int, start: int, end: Optional[int], resume: int,
                    reason: str) -> None:
        event = {"partition": partition, "from": start, "to": end, "resume": resume,
                 "reason": reason, "time": time.time()}
        with self._lock:
            self._c["offsets_lost"] += 1
            self._lost.append(event)
        span = f"[{start}, {end})" if end is not None else f"from {start} on (count unknown)"
        log.warning("partition %d: offsets %s are no longer on the broker (%s); continuing "
                    "from offset %d", partition, span, reason, resume)

    def _connect(self) -> bool:
        """Create the consumer, assign, check the log identity and seek. True when ready."""
        from kafka import KafkaConsumer, TopicPartition

        errors = _kafka_errors()
        try:
            consumer = KafkaConsumer(**self._consumer_settings())
        except (errors.KafkaError, OSError) as e:
            self._set_state("disconnected", f"{type(e).__name__}: {e}")
            self._schedule_reconnect()
            return False
        ms = int(self.request_timeout * 1000)
        try:
            parts = consumer.partitions_for_topic(self.topic)
            if not parts:
                consumer.close(autocommit=False, timeout_ms=1000)
                self._set_state("topic_missing", f"topic {self.topic!r} does not exist")
                self._schedule_reconnect()
                return False
            nparts = len(parts)
            if self._partitions_total not in (None, nparts):
                log.warning("topic %s now has %d partitions (was %d): shards move between "
                            "partitions", self.topic, nparts, self._partitions_total)
            if self.shards is None:
                chosen = sorted(parts)
            else:
                chosen = sorted({s % nparts for s in self.shards} & set(parts))
            tps = [TopicPartition(self.topic, p) for p in chosen]
            consumer.assign(tps)
            tid = self._topic_id_of(consumer)
            begin = consumer.beginning_offsets(tps, timeout_ms=ms)
            listed = consumer.end_offsets(tps, timeout_ms=ms)
        except (errors.KafkaError, OSError) as e:
            try:
                consumer.close(autocommit=False, timeout_ms=1000)
            except Exception:
                log.debug("closing the consumer failed", exc_info=True)
            self._set_state("disconnected", f"{type(e).__name__}: {e}")
            self._schedule_reconnect()
            return False
        recreated = self._topic_id is not None and tid is not None and tid != self._topic_id
        positions = {}
        for tp in tps:
            p = tp.partition
            stored = self._positions.get(p, self._offsets.get(p))
            first = int(begin[tp])
            if stored is None:
                start = first
            elif recreated:
                start = first
                self._lost_range(p, stored, None, start,
                                 f"topic id changed from {self._topic_id} to {tid}: the topic "
                                 "was recreated or the broker lost its log")
            elif stored < first:
                start = first
                self._lost_range(p, stored, first, start,
                                 "below the earliest available offset (retention)")
            else:
                start = stored  # beyond the end is caught by the first fetch's high watermark
            consumer.seek(tp, start)
            positions[p] = start
        with self._lock:
            self._offsets.update(self._positions)  # keep partitions no longer assigned
            self._positions = positions
            for tp in tps:
                self._ends[tp.partition] = int(listed[tp])
        if tid is not None:
            if tid != self._topic_id:
                self._dirty = True  # the checkpoint must learn the new log identity
            self._topic_id = tid
        self._partitions_total = nparts
        self._consumer = consumer
        self._tps = tps
        self._backoff = 0.0
        self._next_probe = time.monotonic() + self.probe_interval
        self._set_state("connected", f"partitions {chosen} of {nparts}, from offsets "
                                     f"{positions}")
        return True

    def _probe(self) -> None:
        """Refresh end offsets (lag) and notice a dead broker or a recreated topic."""
        errors = _kafka_errors()
        try:
            listed = self._consumer.end_offsets(self._tps,
                                                timeout_ms=int(self.request_timeout * 1000))
        except (errors.KafkaError, OSError) as e:
            self._disconnect(f"end offsets: {type(e).__name__}: {e}")
            return
        with self._lock:
            for tp in self._tps:
                hw = self._consumer.highwater(tp)
                end = int(listed[tp]) if hw is None else max(int(listed[tp]), int(hw))
                self._ends[tp.partition] = end
        self._next_probe = time.monotonic() + self.probe_interval

    def _check_log(self) -> bool:
        """After a poll: False (and reconnect scheduled) when the log under us changed."""
        tid = self._topic_id_of(self._consumer)
        if tid is not None and self._topic_id is not None and tid != self._topic_id:
            # reconnect: _connect sees the new id and resets every partition
            self._close_consumer()
            self._set_state("connecting", "topic id changed")
            return False
        for tp in list(self._tps):
            if self._consumer is None:  # a reset below found the broker gone
                return False
            hw = self._consumer.highwater(tp)
            pos = self._positions.get(tp.partition)
            if hw is not None and pos is not None and hw < pos:
                self._reset_partition(tp, pos, f"position {pos} is beyond the end of the log "
                                               f"({hw}): the broker lost its log")
        return self._consumer is not None

    def _reset_partition(self, tp: Any, pos: int, reason: str) -> None:
        errors = _kafka_errors()
        try:
            first = int(self._consumer.beginning_offsets(
                [tp], timeout_ms=int(self.request_timeout * 1000))[tp])
        except (errors.KafkaError, OSError) as e:
            self._disconnect(f"beginning offsets: {type(e).__name__}: {e}")
            return
        if first > pos:  # retention deleted [pos, first)
            self._lost_range(tp.partition, pos, first, first,
                             f"{reason}: below the earliest available offset (retention)")
        else:
            self._lost_range(tp.partition, pos, None, first, reason)
        self._consumer.seek(tp, first)
        with self._lock:
            self._positions[tp.partition] = first
        self._dirty = True

    def _out_of_range(self, exc: Any) -> None:
        parts = getattr(exc, "args", [None])[0]
        tps = list(parts) if isinstance(parts, (dict, list, set, tuple)) else list(self._tps)
        for tp in tps:
            if tp in self._tps:
                pos = self._positions.get(tp.partition, 0)
                self._reset_partition(tp, pos, "offset out of range on the broker")
                if self._consumer is None:
                    return

    # ------------------------------------------------------------------ the loop

    def _record(self, partition: int, rec: Any) -> Outcome:
        try:
            out = self._applier.process(rec.value, rec.headers)
        except Exception as e:  # a bug must not kill serving; the record is kept aside
            with self._lock:
                self._c["internal_errors"] += 1
            log.exception("partition %d offset %d: applying failed", partition, rec.offset)
            out = Outcome("quarantined", reason=f"internal error: {type(e).__name__}: {e}")
        if out.kind == "quarantined":
            self._quarantine.add(partition, rec.offset, out.reason, rec.value)
            # a producer spewing garbage must not flood the log: the file has every record
            self._quarantine_logged += 1
            level = logging.WARNING if self._quarantine_logged <= _QUARANTINE_WARNINGS \
                else logging.DEBUG
            log.log(level, "partition %d offset %d quarantined: %s", partition, rec.offset,
                    out.reason)
            if self._quarantine_logged == _QUARANTINE_WARNINGS:
                log.warning("%d records quarantined; further ones are logged at DEBUG only "
                            "(all are in %s)", _QUARANTINE_WARNINGS, self._quarantine.path)
        elif out.kind == "applied":
            if out.ts is not None:
                self._fresh.add_ts(out.ts)
            if out.gap is not None:
                with self._lock:
                    self._last_gap = {"table": out.table, "shard": out.shard,
                                      "epoch": out.epoch, "missing": list(out.gap),
                                      "partition": partition, "offset": rec.offset}
        with self._lock:
            self._positions[partition] = rec.offset + 1
        self._pending += 1
        self._dirty = True
        if self._on_apply is not None:
            try:
                self._on_apply(out, partition, rec.offset)
            except Exception as e:  # a monitoring hook must not stop syncing
                kind = type(e).__name__
                if kind not in self._hook_errors:
                    self._hook_errors.add(kind)
                    log.exception("on_apply hook failed (further %s errors not logged)", kind)
        if self.debug_apply_delay > 0:
            time.sleep(self.debug_apply_delay)
        return out

    def _step(self, max_records: int) -> int:
        """One poll + apply + housekeeping round. Returns records read."""
        now = time.monotonic()
        if self._consumer is None:
            if now < self._next_connect:
                self._stop_event.wait(min(self._next_connect - now, 0.2))
                self._housekeeping()
                return 0
            if not self._connect():
                self._housekeeping()
                return 0
        errors = _kafka_errors()
        try:
            batches = self._consumer.poll(timeout_ms=self.poll_timeout_ms,
                                          max_records=max_records)
        except errors.OffsetOutOfRangeError as e:
            self._out_of_range(e)
            return 0
        except (errors.KafkaError, OSError) as e:
            self._disconnect(f"poll: {type(e).__name__}: {e}")
            return 0
        n = 0
        debug = log.isEnabledFor(logging.DEBUG)
        for tp in sorted(batches, key=lambda t: t.partition):
            p = tp.partition
            for rec in batches[tp]:
                if rec.offset < self._positions.get(p, 0):
                    continue  # a fetch may start inside a batch that began earlier
                out = self._record(p, rec)
                n += 1
                if debug:
                    log.debug("partition %d offset %d: %s %s/%s epoch %s seq %s", p, rec.offset,
                              out.kind, out.table, out.shard, out.epoch, out.seq)
                if self._pending >= self.checkpoint_messages:
                    self._checkpoint_locked()
                if self._stop_event.is_set():
                    break
            if self._stop_event.is_set():
                break
        if self._stop_event.is_set() and n:
            return n  # the consumer is closed right after; no need to re-seek
        if self._consumer is not None and self._check_log() \
                and time.monotonic() >= self._next_probe:
            self._probe()
        self._housekeeping()
        return n

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if self._dirty and (self._pending >= self.checkpoint_messages
                            or now - self._last_ckpt_mono >= self.checkpoint_interval):
            self._checkpoint_locked()
        if self.summary_interval and now >= self._next_summary:
            s = self.stats()
            prev = self._prev_summary
            log.info("sync %s: %s", self.topic, summary_line(
                s, prev[1] if prev else None, now - prev[0] if prev else None))
            self._prev_summary = (now, s)
            self._next_summary = now + self.summary_interval

    def _enter(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what}: the daemon was stopped")
        if not self._loop_lock.acquire(blocking=False):
            raise RuntimeError(f"{what}: the daemon is already running in another thread")
        self._loop_thread = threading.get_ident()

    def _leave(self) -> None:
        try:
            if self._stop_event.is_set():
                self._shutdown_locked()
        finally:
            self._loop_thread = None
            self._loop_lock.release()

    def _shutdown_locked(self) -> None:
        if self._closed:
            return
        self._close_consumer()
        if self._dirty or not self._store.exists():
            self._checkpoint_locked()
        self._closed = True
        with self._lock:
            self._state = "stopped"
        if self._metrics is not None:
            self._metrics.close()
        log.info("sync %s stopped: %s", self.topic, summary_line(self.stats()))

    def run(self) -> None:
        """Sync until :meth:`stop`; then close the consumer and write a final checkpoint."""
        self._enter("run")
        try:
            while not self._stop_event.is_set():
                self._step(self.max_poll_records)
        finally:
            self._stop_event.set()
            self._leave()

    def run_for(self, seconds: Optional[float] = None, messages: Optional[int] = None) -> int:
        """Sync for ``seconds`` or until ``messages`` records were read (whichever first).

        Checkpoints happen on their schedule meanwhile; call :meth:`stop` for the final
        one. Returns the number of records read.
        """
        if seconds is None and messages is None:
            raise ValueError("run_for: give seconds, messages or both")
        if seconds is not None:
            _positive("seconds", seconds)
        if messages is not None:
            _positive("messages", messages, integer=True)
        self._enter("run_for")
        deadline = None if seconds is None else time.monotonic() + seconds
        done = 0
        try:
            while not self._stop_event.is_set():
                if messages is not None and done >= messages:
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    break
                room = self.max_poll_records if messages is None else \
                    min(self.max_poll_records, messages - done)
                done += self._step(room)
        finally:
            self._leave()
        return done

    def catch_up(self, timeout: float = 60.0) -> bool:
        """Sync in this thread until every assigned partition reaches the end offsets
        measured now (see :meth:`end_offsets`). True when caught up within ``timeout`` s."""
        _positive("timeout", timeout)
        deadline = time.monotonic() + timeout
        target = None
        while time.monotonic() < deadline and not self._stop_event.is_set():
            if target is None:
                try:
                    target = self.end_offsets()
                except Exception as e:  # broker down: keep syncing, measure later
                    log.debug("end offsets not measured yet: %s", e)
            if target is not None and self._reached(target):
                return True
            left = deadline - time.monotonic()
            if left > 0:
                self.run_for(seconds=min(left, 0.5))
        return target is not None and self._reached(target)

    def _reached(self, target: Mapping[int, int]) -> bool:
        with self._lock:
            pos = dict(self._positions)
        if not pos:
            return False
        return all(pos.get(p, -1) >= end for p, end in target.items() if p in pos) \
            and all(p in target for p in pos)

    def end_offsets(self) -> dict[int, int]:
        """Exact end offset of each partition this daemon assigns, measured now.

        Uses its own short-lived reader (safe from any thread). Raises
        ``consumers.topic.TopicError`` when the broker or topic is unavailable.
        """
        from consumers.topic import TopicReader

        with TopicReader(self.bootstrap_servers, self.topic,
                         timeout=self.request_timeout) as reader:
            parts = reader.partitions
            if self.shards is not None:
                parts = sorted({s % len(parts) for s in self.shards})
            return reader.end_offsets(parts)

    def caught_up(self) -> bool:
        """True when the position of every assigned partition is at the end offsets
        measured now (so everything published before this call has been read). Safe from
        any thread; False while disconnected."""
        try:
            target = self.end_offsets()
        except Exception as e:
            log.debug("caught_up: end offsets unavailable: %s", e)
            return False
        if self._state != "connected":
            return False
        return self._reached(target)

    def wait_caught_up(self, timeout: float = 30.0, interval: float = 0.1) -> bool:
        """Wait (while :meth:`run` works in another thread) until :meth:`caught_up`."""
        _positive("timeout", timeout)
        deadline = time.monotonic() + timeout
        target = None
        while time.monotonic() < deadline:
            if target is None:
                try:
                    target = self.end_offsets()
                except Exception as e:
                    log.debug("end offsets unavailable: %s", e)
            if target is not None and self._state == "connected" and self._reached(target):
                return True
            time.sleep(interval)
        return False

    def request_stop(self) -> None:
        """Ask the loop to stop and return at once (safe in signal handlers and before
        :meth:`run` starts: :meth:`run` then returns right away, after the final
        checkpoint)."""
        self._stop_event.set()

    def stop(self, timeout: float = 60.0) -> None:
        """Stop syncing: close the consumer and write the final checkpoint.

        Thread-safe. Called from another thread while :meth:`run` works, it waits up to
        ``timeout`` s for the loop to finish its record and checkpoint. From a signal
        handler in the loop's own thread it only asks the loop to stop (the loop then
        checkpoints before :meth:`run` returns). Idempotent.
        """
        self._stop_event.set()
        if self._loop_thread == threading.get_ident():
            return  # signal handler inside the loop: the loop finishes the job
        if not self._loop_lock.acquire(timeout=timeout):
            log.error("stop: the sync loop did not finish within %g s", timeout)
            return
        try:
            self._shutdown_locked()
        finally:
            self._loop_lock.release()

    close = stop

    def __enter__(self) -> SyncDaemon:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------ serving

    def table(self, name: str) -> ServingTable:
        """The serving table ``name`` (lookups are safe while the daemon applies)."""
        t = self._tables.get(name)
        if t is None:
            raise KeyError(f"no table {name!r} (tables: {sorted(self._tables)})")
        return t

    def tables(self) -> dict[str, ServingTable]:
        """name -> :class:`ServingTable` (a new dict; the tables are the live ones)."""
        return dict(self._tables)

    @property
    def running(self) -> bool:
        """True while :meth:`run` or :meth:`run_for` works."""
        return self._loop_thread is not None

    def stats(self) -> dict:
        """Counters and gauges (safe from any thread).

        Keys: ``messages`` (records read), ``applied``, ``rows``, ``deleted``, ``bytes``
        (applied), ``duplicates``, ``gaps``, ``gap_messages`` (seqs missing), ``last_gap``,
        ``new_epochs``, ``stale``, ``skipped``, ``quarantined``, ``offsets_lost`` (ranges),
        ``lost_ranges`` (recent ranges: partition, from, to (None = unknown), resume,
        reason), ``positions`` / ``end_offsets`` / ``lag`` (per partition), ``lag_total``,
        ``freshness_p50_s`` / ``freshness_p99_s`` (None before any apply),
        ``checkpoints``, ``checkpoints_total`` (across restarts), ``checkpoint_age_s``
        (None before the first), ``checkpoint_last`` (kind ``base``/``segment``, bytes,
        rows, deleted, seconds of the last checkpoint; None before the first), ``checkpoint_pending``, ``checkpoint_errors``, ``broker``
        (one of :data:`BROKER_STATES`), ``disconnects``, ``tables`` (rows per table),
        ``source``, ``uptime_s``.
        """
        a = self._applier.counters
        p50, p99 = self._fresh.quantiles((0.5, 0.99))
        with self._lock:
            positions = dict(self._positions)
            ends = {p: e for p, e in self._ends.items() if p in positions}
            lag = partition_lag(positions, ends)
            out = {
                "model": self.model, "topic": self.topic, "broker": self._state,
                "source": self.source,
                "messages": a["messages"], "applied": a["applied"], "rows": a["rows"],
                "deleted": a["deleted"], "bytes": a["bytes"],
                "duplicates": a["duplicates"], "gaps": a["gaps"],
                "gap_messages": a["missing_seqs"], "last_gap": self._last_gap,
                "new_epochs": a["new_epochs"], "stale": a["stale"], "skipped": a["skipped"],
                "quarantined": a["quarantined"] + self._c["internal_errors"],
                "offsets_lost": self._c["offsets_lost"], "lost_ranges": list(self._lost),
                "positions": positions, "end_offsets": ends, "lag": lag,
                "lag_total": total_lag(lag.values()),
                "freshness_p50_s": p50, "freshness_p99_s": p99,
                "checkpoints": self._c["checkpoints"],
                "checkpoints_total": self._checkpoints_total,
                "checkpoint_age_s": None if self._last_ckpt_wall is None
                else max(0.0, time.time() - self._last_ckpt_wall),
                "checkpoint_pending": self._pending,
                "checkpoint_last": None if self._last_ckpt is None else dict(self._last_ckpt),
                "checkpoint_errors": self._c["checkpoint_errors"],
                "disconnects": self._c["disconnects"],
                "internal_errors": self._c["internal_errors"],
                "uptime_s": time.monotonic() - self._started,
            }
        out["tables"] = {name: len(t) for name, t in list(self._tables.items())}
        return out

    def __repr__(self) -> str:
        return (f"SyncDaemon({self.topic!r} on {self.bootstrap_servers}, model={self.model!r}, "
                f"state_dir={str(self.state_dir)!r}, {self._state})")
