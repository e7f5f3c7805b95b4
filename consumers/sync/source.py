"""KafkaSource: the sync daemon's connection to its topic — connect, poll, reconnect, and
notice a log that is no longer the one the positions refer to.

* **connect** — a ``KafkaConsumer`` with ``assign()`` + ``seek()`` only (no consumer
  groups: they do not work on the embedded broker, and a predictor needs every row of its
  shards), on all partitions of the topic or on those holding ``shards``
  (``shard % partitions``), seeked to the stored next offset per partition (earliest when
  none).
* **broker trouble** — a failed request closes the consumer; reconnects back off
  exponentially (capped at ``backoff_max``), and each state change (connected /
  disconnected / topic missing) is logged once. Positions are kept here, so a reconnect
  resumes exactly where applying stopped.
* **lost offsets** — when a stored offset no longer exists on the broker (below the
  earliest offset (retention), beyond the end of the log, or a topic whose id changed:
  deleted and recreated, an in-memory broker that restarted) the range is logged, counted
  and kept in :meth:`KafkaSource.view`, and reading continues from the earliest available
  offset. A partition without a stored offset (a fresh start, or a partition new to the
  state) whose earliest offset is above 0 counts the range ``[0, earliest)`` as lost too:
  retention deleted records that state built from this topic never saw.
* **end offsets** — the embedded broker (Tansu) answers ListOffsets(latest) with the base
  offset of the last record batch + 1, an undercount when producers batch; lag uses the
  larger of that and the fetch high watermark, and :meth:`KafkaSource.measure_end_offsets`
  measures exact end offsets with a reader of its own.

One thread (the daemon's loop) calls the methods that talk to the broker; positions,
end offsets, the state and the counters are read from any thread through a lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Optional

from consumers.errors import TopicError
from consumers.sync.options import SyncOptions
from deltastream.errors import error_text
from deltastream.kafka_compat import forbid_auto_create
from deltastream.kafka_config import bootstrap_list, tls_probe

__all__ = ["KafkaSource", "BROKER_STATES"]

log = logging.getLogger(__name__)

#: values of :attr:`KafkaSource.state` (the daemon's ``stats()["broker"]``)
BROKER_STATES = ("connecting", "connected", "disconnected", "topic_missing", "stopped")
_MAX_LOST_EVENTS = 100


def _kafka_errors() -> Any:
    """``kafka.errors``, imported on first use (``import consumers.sync`` stays kafka-free)."""
    import kafka.errors as errors

    return errors


class KafkaSource:
    """Records of the daemon's partitions, in offset order, from the last applied position.

    Args:
        options: the daemon's settings (servers, topic, shards, timeouts, consumer config).
        offsets: partition -> next offset to read, from the stored state.
        topic_id: the topic id the stored offsets refer to (None: unknown, trusted).
        partitions: partition count of the topic when the state was stored (None: unknown).
        on_moved: called (loop thread) when the position or the log identity changed
            without a record being applied, so the state must be checkpointed again.
        on_reset: called (loop thread) with a partition whose log was replaced (offsets
            start over: the topic was recreated or the broker lost its log).
    """

    def __init__(self, options: SyncOptions, *, offsets: Mapping[int, int],
                 topic_id: Optional[str], partitions: Optional[int],
                 on_moved: Callable[[], None],
                 on_reset: Optional[Callable[[int], None]] = None) -> None:
        self.options = options
        self.topic = options.topic
        self.topic_id = topic_id  #: id of the topic the positions refer to
        self.partitions_total = partitions  #: partitions of the topic
        self._on_moved = on_moved
        self._on_reset = on_reset
        self._lock = threading.RLock()  # positions, end offsets, state, counters
        self._offsets: dict[int, int] = dict(offsets)  # partition -> next (all ever seen)
        # loop state (owned by the loop thread)
        self._consumer: Any = None
        self._tps: list[Any] = []
        self._backoff = 0.0
        self._next_connect = 0.0
        self._next_probe = 0.0
        # shared with other threads
        self._positions: dict[int, int] = {}  # assigned partition -> next offset
        self._ends: dict[int, int] = {}
        self._state = "connecting"
        self._detail = ""
        self._wrapped_noted: Optional[int] = None  # partition count of the last shard note
        self._lost: deque = deque(maxlen=_MAX_LOST_EVENTS)
        self._c = dict.fromkeys(("offsets_lost", "disconnects"), 0)

    # ------------------------------------------------------------------ positions

    @property
    def state(self) -> str:
        """One of :data:`BROKER_STATES`."""
        return self._state

    def position(self, partition: int) -> int:
        """Next offset to apply of an assigned ``partition`` (0 when unknown)."""
        return self._positions.get(partition, 0)

    def advance(self, partition: int, next_offset: int) -> None:
        """Record that everything before ``next_offset`` of ``partition`` was applied."""
        with self._lock:
            self._positions[partition] = next_offset

    def rewind(self, partition: int) -> None:
        """Fetch ``partition`` again from its position (its record there could not be
        applied yet); a no-op while disconnected (a reconnect seeks to the positions)."""
        for tp in self._tps:
            if tp.partition == partition and self._consumer is not None:
                self._consumer.seek(tp, self.position(partition))

    def positions(self) -> dict[int, int]:
        """Assigned partition -> next offset (a copy)."""
        with self._lock:
            return dict(self._positions)

    def resume_offsets(self) -> dict[int, int]:
        """Partition -> next offset for a checkpoint: every partition ever seen (those no
        longer assigned keep their last offset)."""
        with self._lock:
            offsets = dict(self._offsets)
            offsets.update(self._positions)
        return offsets

    def view(self) -> dict:
        """One consistent look for ``stats()``: ``positions``, ``end_offsets`` (of assigned
        partitions), ``broker`` (state), ``offsets_lost``, ``lost_ranges``,
        ``disconnects``."""
        with self._lock:
            positions = dict(self._positions)
            return {"positions": positions,
                    "end_offsets": {p: e for p, e in self._ends.items() if p in positions},
                    "broker": self._state, "offsets_lost": self._c["offsets_lost"],
                    "lost_ranges": list(self._lost), "disconnects": self._c["disconnects"]}

    def measure_end_offsets(self) -> dict[int, int]:
        """Exact end offset of each partition this source assigns, measured now.

        Uses its own short-lived reader (safe from any thread). Raises
        ``consumers.topic.TopicError`` when the broker or topic is unavailable.
        """
        # kafka-python (under consumers.topic) is imported only once a broker is used
        from consumers.topic import TopicReader

        o = self.options
        with TopicReader(o.bootstrap_servers, self.topic, timeout=o.request_timeout,
                         **o.consumer_config) as reader:
            parts = reader.partitions
            if o.shards is not None:
                parts = sorted({s % len(parts) for s in o.shards})
            return reader.end_offsets(parts)

    # ------------------------------------------------------------------ the loop's calls

    def ready(self, wait: Callable[[float], Any]) -> bool:
        """True when connected (connecting now when a reconnect is due); else ``wait``
        (seconds, at most 0.2) for the next try and False."""
        if self._consumer is not None:
            return True
        now = time.monotonic()
        if now < self._next_connect:
            wait(min(self._next_connect - now, 0.2))
            return False
        return self._connect()

    def poll(self, max_records: int) -> Optional[list[tuple[int, list[Any]]]]:
        """One fetch: ``[(partition, records in offset order)]`` by partition; None when
        the poll failed (the consumer is then closed or the lost range handled)."""
        errors = _kafka_errors()
        try:
            batches = self._consumer.poll(timeout_ms=self.options.poll_timeout_ms,
                                          max_records=max_records)
        except errors.OffsetOutOfRangeError as e:
            self._out_of_range(e)
            return None
        except (errors.KafkaError, OSError) as e:
            self._disconnect(f"poll: {error_text(e)}")
            return None
        return [(tp.partition, batches[tp]) for tp in sorted(batches, key=lambda t: t.partition)]

    def refresh(self) -> None:
        """After a poll: check the log is still ours, and refresh end offsets when due."""
        if self._consumer is not None and self._check_log() \
                and time.monotonic() >= self._next_probe:
            self._probe()

    def close(self) -> None:
        """Close the consumer (positions are kept; the next :meth:`ready` reconnects)."""
        c, self._consumer = self._consumer, None
        self._tps = []
        if c is not None:
            try:
                c.close(autocommit=False, timeout_ms=1000)
            except Exception:  # closing a broken connection must not raise out of the loop
                log.debug("closing the consumer failed", exc_info=True)

    def mark_stopped(self) -> None:
        """The daemon stopped: state ``"stopped"`` (not logged; the daemon says so)."""
        with self._lock:
            self._state = "stopped"

    # ------------------------------------------------------------------ connection

    @property
    def detail(self) -> str:
        """Why the broker state last changed (e.g. ``connection refused``), or ``""``."""
        return self._detail

    def _set_state(self, state: str, detail: str = "") -> None:
        with self._lock:
            old, self._state = self._state, state
            self._detail = detail
            if state == "disconnected" and old != "disconnected":
                self._c["disconnects"] += 1
        if old == state:
            return
        level = logging.INFO if state == "connected" else logging.WARNING
        log.log(level, "broker %s: %s -> %s%s", self.options.bootstrap_servers, old, state,
                f" ({detail})" if detail else "")

    def _schedule_reconnect(self) -> None:
        self._backoff = min(self.options.backoff_max, max(0.1, self._backoff * 2))
        self._next_connect = time.monotonic() + self._backoff

    def _disconnect(self, reason: str) -> None:
        self.close()
        self._set_state("disconnected", reason)
        self._schedule_reconnect()

    def _consumer_settings(self) -> dict:
        o = self.options
        ms = int(o.request_timeout * 1000)
        cfg = dict(
            bootstrap_servers=bootstrap_list(o.bootstrap_servers), group_id=None,
            enable_auto_commit=False,
            # Out-of-range offsets must surface (OffsetOutOfRangeError) so they are
            # counted as lost, never silently jumped over.
            auto_offset_reset="none",
            # A consumer must never create the topic (with the broker's default partition
            # count) after an in-memory broker restarted; the publisher creates it.
            allow_auto_create_topics=False,
            bootstrap_timeout_ms=ms, request_timeout_ms=max(ms, 1000),
            fetch_max_wait_ms=min(500, max(10, o.poll_timeout_ms)),
            max_poll_records=o.max_poll_records,
            reconnect_backoff_ms=50, reconnect_backoff_max_ms=int(o.backoff_max * 1000),
            client_id=f"deltastream-sync-{o.model}",
        )
        cfg.update(o.consumer_config)
        return cfg

    def _note_wrapped(self, shards: list[int], nparts: int) -> None:
        """Say once per partition count that shards beyond it share partitions: shard
        ``s`` is published to partition ``s % partitions``, so ``--shards 5`` on 2
        partitions reads partition 1 and applies shard 5's messages only (none, when no
        trainer publishes as shard 5)."""
        wrapped = [s for s in shards if s >= nparts]
        if not wrapped or self._wrapped_noted == nparts:
            return
        self._wrapped_noted = nparts
        log.warning("topic %s has %d partitions: %s read from %s (shard s is published to "
                    "partition s %% %d); only these shards' messages are applied — is "
                    "--shards right?", self.topic, nparts,
                    ", ".join(f"shard {s}" for s in wrapped),
                    ", ".join(f"partition {s % nparts}" for s in wrapped), nparts)

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
        if resume <= start and self._on_reset is not None:
            self._on_reset(partition)  # a new log: its offsets start over
        span = f"[{start}, {end})" if end is not None else f"from {start} on (count unknown)"
        log.warning("partition %d: offsets %s are no longer on the broker (%s); continuing "
                    "from offset %d", partition, span, reason, resume)

    def _connect(self) -> bool:
        """Create the consumer, assign, check the log identity and seek. True when ready."""
        from kafka import KafkaConsumer, TopicPartition

        errors = _kafka_errors()
        settings = self._consumer_settings()
        # kafka-python would wait forever (unstoppable) on a TLS handshake with a
        # plaintext listener: try one handshake with a deadline first
        problem = tls_probe(self.options.bootstrap_servers, settings,
                            self.options.request_timeout)
        if problem:
            self._set_state("disconnected", problem)
            self._schedule_reconnect()
            return False
        try:
            consumer = KafkaConsumer(**settings)
            # kafka-python ignores allow_auto_create_topics: without this, the metadata
            # request below re-creates a vanished topic with the broker's default partitions
            forbid_auto_create(consumer)
        except (errors.KafkaError, OSError, TopicError) as e:
            self._set_state("disconnected", error_text(e))
            self._schedule_reconnect()
            return False
        ms = int(self.options.request_timeout * 1000)
        shards = self.options.shards
        try:
            parts = consumer.partitions_for_topic(self.topic)
            if not parts:
                consumer.close(autocommit=False, timeout_ms=1000)
                self._set_state("topic_missing", f"topic {self.topic!r} does not exist")
                self._schedule_reconnect()
                return False
            nparts = len(parts)
            if self.partitions_total not in (None, nparts):
                log.warning("topic %s now has %d partitions (was %d): shards move between "
                            "partitions", self.topic, nparts, self.partitions_total)
            if shards is None:
                chosen = sorted(parts)
            else:
                chosen = sorted({s % nparts for s in shards} & set(parts))
                self._note_wrapped(sorted(shards), nparts)
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
            self._set_state("disconnected", f"{error_text(e)}")
            self._schedule_reconnect()
            return False
        recreated = self.topic_id is not None and tid is not None and tid != self.topic_id
        positions = {}
        for tp in tps:
            positions[tp.partition] = self._start_offset(tp.partition, int(begin[tp]),
                                                         tid if recreated else None)
            consumer.seek(tp, positions[tp.partition])
        with self._lock:
            self._offsets.update(self._positions)  # keep partitions no longer assigned
            self._positions = positions
            for tp in tps:
                self._ends[tp.partition] = int(listed[tp])
        if tid is not None:
            if tid != self.topic_id:
                self._on_moved()  # the checkpoint must learn the new log identity
            self.topic_id = tid
        self.partitions_total = nparts
        self._consumer = consumer
        self._tps = tps
        self._backoff = 0.0
        self._next_probe = time.monotonic() + self.options.probe_interval
        self._set_state("connected", f"partitions {chosen} of {nparts}, from offsets "
                                     f"{positions}")
        return True

    def _start_offset(self, p: int, first: int, new_topic_id: Any) -> int:
        """Where partition ``p`` starts: its stored offset, else (or when the broker no
        longer has it, or the topic was recreated: ``new_topic_id``) its earliest available
        offset, the skipped range reported as lost."""
        stored = self._positions.get(p, self._offsets.get(p))
        if stored is None:
            if first > 0:  # nothing stored: state never saw [0, first)
                self._lost_range(p, 0, first, first, "no stored offset and the earliest "
                                 "available offset is above 0 (retention deleted older "
                                 "records)")
            return first
        if new_topic_id is not None:
            self._lost_range(p, stored, None, first,
                             f"topic id changed from {self.topic_id} to {new_topic_id}: the "
                             "topic was recreated or the broker lost its log")
            return first
        if stored < first:
            self._lost_range(p, stored, first, first,
                             "below the earliest available offset (retention)")
            return first
        return stored  # beyond the end is caught by the first fetch's high watermark

    def _probe(self) -> None:
        """Refresh end offsets (lag) and notice a dead broker or a recreated topic."""
        errors = _kafka_errors()
        try:
            listed = self._consumer.end_offsets(
                self._tps, timeout_ms=int(self.options.request_timeout * 1000))
        except (errors.KafkaError, OSError) as e:
            self._disconnect(f"end offsets: {error_text(e)}")
            return
        with self._lock:
            for tp in self._tps:
                hw = self._consumer.highwater(tp)
                end = int(listed[tp]) if hw is None else max(int(listed[tp]), int(hw))
                self._ends[tp.partition] = end
        self._next_probe = time.monotonic() + self.options.probe_interval

    def _check_log(self) -> bool:
        """After a poll: False (and reconnect scheduled) when the log under us changed."""
        tid = self._topic_id_of(self._consumer)
        if tid is not None and self.topic_id is not None and tid != self.topic_id:
            # reconnect: _connect sees the new id and resets every partition
            self.close()
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
                [tp], timeout_ms=int(self.options.request_timeout * 1000))[tp])
        except (errors.KafkaError, OSError) as e:
            self._disconnect(f"beginning offsets: {error_text(e)}")
            return
        if first > pos:  # retention deleted [pos, first)
            self._lost_range(tp.partition, pos, first, first,
                             f"{reason}: below the earliest available offset (retention)")
        else:
            self._lost_range(tp.partition, pos, None, first, reason)
        self._consumer.seek(tp, first)
        with self._lock:
            self._positions[tp.partition] = first
        self._on_moved()

    def _out_of_range(self, exc: Any) -> None:
        parts = getattr(exc, "args", [None])[0]
        tps = list(parts) if isinstance(parts, (dict, list, set, tuple)) else list(self._tps)
        for tp in tps:
            if tp in self._tps:
                pos = self._positions.get(tp.partition, 0)
                self._reset_partition(tp, pos, "offset out of range on the broker")
                if self._consumer is None:
                    return
