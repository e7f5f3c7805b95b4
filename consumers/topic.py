"""Read a Kafka topic in bounded offset ranges, without consumer groups (torch-free).

The replay tool and tests read deltas topics with :class:`TopicReader`: list the
partitions, find the earliest and end offsets, and iterate the records of chosen
partitions from start offsets up to (excluding) stop offsets. Reading uses
``KafkaConsumer.assign`` + ``seek`` only: consumer groups do not work on the embedded
broker, and a replay needs every record anyway.

Records come partition by partition in ascending partition order, each partition in
offset order: the order a predictor applies them in (apply order is partition order).

End offsets are taken as the larger of the broker's ListOffsets answer and the high
watermark of a fetch response. The embedded broker (Tansu) answers ListOffsets(latest)
with the base offset of the last record *batch* + 1, which undercounts when producers
send several records per batch; the fetch high watermark is exact on both brokers.

Errors are :class:`TopicError` subclasses with one-line messages fit for a CLI:
:class:`BrokerUnavailable` (nothing answers at the bootstrap address),
:class:`TopicNotFound` (checked before any request that could auto-create the topic),
:class:`OffsetError` (a start offset that retention already deleted, a bad range, or a
partition that stops delivering records before its stop offset).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Optional

from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaError, KafkaTimeoutError, OffsetOutOfRangeError

from consumers.errors import BrokerUnavailable, OffsetError, TopicError, TopicNotFound
from deltastream.kafka_compat import forbid_auto_create
from deltastream.kafka_config import bootstrap_list, check_bootstrap_servers, tls_probe

__all__ = [
    "TopicError",
    "BrokerUnavailable",
    "TopicNotFound",
    "OffsetError",
    "Record",
    "TopicReader",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Record:
    """One Kafka record.

    Attributes:
        partition, offset: where it lies in the topic.
        timestamp: broker/producer timestamp in ms since the epoch (-1 when absent). The
            replay tool positions in time by the message's own ``ts`` field, not by this.
        key: record key bytes or ``None``. headers: list of ``(name, bytes)``.
        value: the record payload (a wire message for deltas topics).
    """

    partition: int
    offset: int
    timestamp: int
    key: Optional[bytes]
    headers: list
    value: bytes


def _check_positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}: expected positive seconds, got {value!r}")
    return float(value)


class TopicReader:
    """A bounded reader of one topic (context manager).

    Args:
        bootstrap_servers: ``"host:port[,host:port]"`` of the Kafka cluster.
        topic: topic name; :class:`TopicNotFound` if it does not exist.
        timeout: seconds to wait for the broker to answer at connect, and for a
            partition to deliver its next records while reading (then :class:`OffsetError`).
        **consumer_config: extra ``KafkaConsumer`` settings (e.g. security options).

    Raises:
        BrokerUnavailable: nothing answered at ``bootstrap_servers`` within ``timeout``.
        TopicNotFound: ``topic`` is not on the broker.
    """

    def __init__(self, bootstrap_servers: str, topic: str, *, timeout: float = 10.0,
                 **consumer_config: Any) -> None:
        check_bootstrap_servers(bootstrap_servers)
        if not isinstance(topic, str) or not topic:
            raise ValueError(f"topic: expected a non-empty str, got {topic!r}")
        self.timeout = _check_positive("timeout", timeout)
        self.topic = topic
        self.bootstrap_servers = bootstrap_servers
        timeout_ms = max(1000, int(self.timeout * 1000))
        config = dict(
            bootstrap_servers=bootstrap_list(bootstrap_servers),
            group_id=None,
            enable_auto_commit=False,
            # An offset that retention deleted mid-read must fail loudly, never jump.
            auto_offset_reset="none",
            allow_auto_create_topics=False,
            bootstrap_timeout_ms=timeout_ms,
            request_timeout_ms=max(timeout_ms, 5000),
            # Short broker-side waits: a bounded read knows when it is done, so waiting
            # for more data on an idle partition only delays the end.
            fetch_max_wait_ms=100,
            client_id="deltastream-replay",
        )
        config.update(consumer_config)
        # kafka-python would wait forever on a TLS handshake with a plaintext listener
        problem = tls_probe(bootstrap_servers, config, self.timeout)
        if problem:
            raise BrokerUnavailable(f"cannot connect to {bootstrap_servers}: {problem}")
        try:
            self._consumer = KafkaConsumer(**config)
            forbid_auto_create(self._consumer)  # kafka-python ignores the config flag
        except KafkaTimeoutError as e:
            raise BrokerUnavailable(
                f"no Kafka broker answered at {bootstrap_servers} within {self.timeout:g} s "
                f"({type(e).__name__})") from None
        except (KafkaError, OSError, ValueError) as e:
            raise BrokerUnavailable(f"cannot connect to {bootstrap_servers}: {e}") from None
        try:
            parts = self._consumer.partitions_for_topic(topic)
        except KafkaError as e:
            self.close()
            raise BrokerUnavailable(f"metadata request to {bootstrap_servers} failed: "
                                    f"{e}") from None
        if not parts:
            self.close()
            raise TopicNotFound(f"topic {topic!r} does not exist on {bootstrap_servers}")
        self._partitions = sorted(int(p) for p in parts)

    # ------------------------------------------------------------------ metadata

    @property
    def partitions(self) -> list[int]:
        """Partition numbers of the topic, ascending."""
        return list(self._partitions)

    def _tps(self, partitions: Optional[Iterable[int]]) -> list[TopicPartition]:
        if partitions is None:
            return [TopicPartition(self.topic, p) for p in self._partitions]
        out = []
        for p in partitions:
            if isinstance(p, bool) or not isinstance(p, int) or p not in self._partitions:
                raise OffsetError(f"partition {p!r} is not a partition of topic {self.topic!r} "
                                  f"(it has {self._partitions})")
            out.append(TopicPartition(self.topic, p))
        return sorted(set(out), key=lambda tp: tp.partition)

    def beginning_offsets(self, partitions: Optional[Iterable[int]] = None) -> dict[int, int]:
        """Earliest available offset per partition (``{partition: offset}``)."""
        tps = self._tps(partitions)
        try:
            got = self._consumer.beginning_offsets(tps, timeout_ms=int(self.timeout * 1000))
        except KafkaError as e:
            raise BrokerUnavailable(f"ListOffsets(earliest) for {self.topic!r} failed: {e}") \
                from None
        return {tp.partition: int(got[tp]) for tp in tps}

    def end_offsets(self, partitions: Optional[Iterable[int]] = None) -> dict[int, int]:
        """Offset one past the last record per partition (``{partition: offset}``).

        Exact on Kafka and on the embedded broker (see the module docstring): the
        ListOffsets answer is checked against a fetch's high watermark.
        """
        tps = self._tps(partitions)
        ms = int(self.timeout * 1000)
        try:
            listed = self._consumer.end_offsets(tps, timeout_ms=ms)
            begin = self._consumer.beginning_offsets(tps, timeout_ms=ms)
        except KafkaError as e:
            raise BrokerUnavailable(f"ListOffsets for {self.topic!r} failed: {e}") from None
        out = {tp.partition: int(listed[tp]) for tp in tps}
        # Fetch at the last listed record of each partition: the response carries the
        # true high watermark. Fresh assignment so no stale watermark is read back.
        c = self._consumer
        c.unsubscribe()
        c.assign(tps)
        for tp in tps:
            c.seek(tp, max(int(listed[tp]) - 1, int(begin[tp])))
        deadline = time.monotonic() + self.timeout
        pending = set(tps)
        while pending:
            try:
                c.poll(timeout_ms=100, max_records=1, update_offsets=False)
            except KafkaError as e:
                raise BrokerUnavailable(f"fetch from {self.topic!r} failed: {e}") from None
            for tp in list(pending):
                hw = c.highwater(tp)
                if hw is not None:
                    out[tp.partition] = max(out[tp.partition], int(hw))
                    pending.discard(tp)
            if pending and time.monotonic() > deadline:
                raise BrokerUnavailable(
                    f"no fetch answer for partitions {sorted(tp.partition for tp in pending)} "
                    f"of {self.topic!r} within {self.timeout:g} s")
        c.unsubscribe()
        return out

    # ------------------------------------------------------------------ reading

    def resolve(self, start: Optional[Mapping[int, int]] = None,
                stop: Optional[Mapping[int, int]] = None,
                partitions: Optional[Iterable[int]] = None,
                ) -> tuple[dict[int, int], dict[int, int]]:
        """Concrete ``(start, stop)`` offsets for a read.

        ``partitions`` defaults to the keys of ``start`` when given, else all partitions.
        A partition missing from ``start`` starts at its earliest offset; one missing from
        ``stop`` stops at its end. A stop beyond the end is lowered to the end (logged).

        Raises:
            OffsetError: a start below the earliest available offset (deleted by
                retention), a start beyond the end, or a start after the stop.
        """
        start = dict(start or {})
        stop = dict(stop or {})
        if partitions is None:
            partitions = sorted(start) if start else self._partitions
        parts = [tp.partition for tp in self._tps(partitions)]
        for name, given in (("start", start), ("stop", stop)):
            for p, off in given.items():
                if isinstance(off, bool) or not isinstance(off, int) or off < 0:
                    raise OffsetError(f"{name} offset of partition {p}: expected an int ≥ 0, "
                                      f"got {off!r}")
        begin = self.beginning_offsets(parts)
        end = self.end_offsets(parts)
        s_out, e_out = {}, {}
        for p in parts:
            s = start.get(p, begin[p])
            e = stop.get(p, end[p])
            if s < begin[p]:
                raise OffsetError(f"partition {p}: start offset {s} is below the earliest "
                                  f"available offset {begin[p]} (deleted by retention)")
            if s > end[p]:
                raise OffsetError(f"partition {p}: start offset {s} is beyond the end "
                                  f"offset {end[p]}")
            if e > end[p]:
                log.warning("partition %d: stop offset %d is beyond the end %d; reading to "
                            "the end", p, e, end[p])
                e = end[p]
            if e < s:
                raise OffsetError(f"partition {p}: stop offset {e} is before start offset {s}")
            s_out[p], e_out[p] = s, e
        return s_out, e_out

    def read(self, start: Mapping[int, int], stop: Mapping[int, int]) -> Iterator[Record]:
        """Records of each partition in ``start`` from its start offset up to (excluding)
        its stop offset, partition by partition in ascending order.

        Use :meth:`resolve` to get the offsets. Offsets missing from a partition (a
        compacted topic, transaction markers) are skipped. Raises :class:`OffsetError` when
        a partition delivers nothing for ``timeout`` seconds before reaching its stop.
        """
        c = self._consumer
        for p in sorted(start):
            s, e = int(start[p]), int(stop[p])
            if e <= s:
                continue
            tp = TopicPartition(self.topic, p)
            c.unsubscribe()
            c.assign([tp])
            c.seek(tp, s)
            last_progress = time.monotonic()
            done = False
            while not done:
                try:
                    got = c.poll(timeout_ms=200).get(tp, [])
                except OffsetOutOfRangeError:
                    raise OffsetError(f"partition {p}: offset {c.position(tp)} is no longer "
                                      "available (deleted by retention while reading)") from None
                except KafkaError as ex:
                    raise BrokerUnavailable(f"fetch from {self.topic!r} partition {p} "
                                            f"failed: {ex}") from None
                if got:
                    last_progress = time.monotonic()
                for m in got:
                    if m.offset >= e:
                        done = True
                        break
                    if m.offset < s:  # a fetch may start inside a batch
                        continue
                    yield Record(p, m.offset, m.timestamp, m.key, list(m.headers or ()),
                                 m.value)
                    if m.offset + 1 >= e:
                        done = True
                        break
                if not done and c.position(tp) >= e:
                    done = True
                if not done and time.monotonic() - last_progress > self.timeout:
                    raise OffsetError(
                        f"partition {p}: no records after offset {c.position(tp)} for "
                        f"{self.timeout:g} s although the stop offset is {e}")
        c.unsubscribe()

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close the consumer's connections. Safe to call twice."""
        consumer = getattr(self, "_consumer", None)
        if consumer is not None:
            self._consumer = None
            try:
                consumer.close()
            except Exception:  # closing must never mask the error that led here
                log.debug("closing the consumer failed", exc_info=True)

    def __enter__(self) -> TopicReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TopicReader({self.topic!r} on {self.bootstrap_servers})"
