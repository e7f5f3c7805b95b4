"""Publish changed embedding rows to Kafka as wire messages (format v2 or v3).

:class:`DeltaPublisher` is the trainer-side end of the transport: one publisher per trainer
shard, on kafka-python's idempotent producer (``acks="all"``). Every message of
``(model, table, shard)`` goes to partition ``shard % partitions`` with key
:func:`deltastream.wire.message_key` and headers :func:`deltastream.wire.kafka_headers`,
so one shard's messages stay in order. ``seq`` counts messages per table from 0 within an
``epoch`` (a new epoch on every publisher start).

Nothing is lost silently:

* a broker that cannot be reached at start-up, or a topic that does not exist, is an error
  from the constructor;
* memory is bounded: at most ``buffer_memory`` bytes of messages wait for acknowledgement;
  when the broker is slow :meth:`DeltaPublisher.publish` blocks (backpressure) up to
  ``send_timeout`` seconds and then raises :class:`PublishError` naming the table, the seq
  range and the rows that were not sent;
* a message the producer fails to deliver (within ``send_timeout``) raises
  :class:`PublishError` from the next :meth:`~DeltaPublisher.publish`,
  :meth:`~DeltaPublisher.flush` or :meth:`PublishResult.wait`.

It recovers by itself and never creates topics: the producer retries with backoff within
``send_timeout``; a producer that failed a delivery (e.g. the broker restarted and lost its
producer state) is replaced before the next message is sent, once the old one's messages
are resolved and the topic is seen to exist (:mod:`.producer_link`). The epoch and seq
stream continue: consumers see a seq gap exactly where a message reported in a
:class:`PublishError` was lost.

Torch is never imported here: tensors (CPU or CUDA) are recognised by duck typing
(``.detach()``) and converted on their own device before the copy to host.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Optional

import numpy as np

from deltastream import dense_wire, wire
from deltastream.errors import PublishError, TopicError, error_text
from deltastream.kafka_config import check_bootstrap_servers
from deltastream.publishing.host_arrays import host_ids, host_rows
from deltastream.publishing.in_flight import InFlight
from deltastream.publishing.producer_link import ProducerLink
from deltastream.publishing.producer_settings import (
    KAFKA_OVERHEAD,
    MIN_MESSAGE_BYTES,
    check_int,
    check_settings,
    kafka_settings,
)
from deltastream.publishing.results import (
    PublishResult,
    SentMessage,
    Undelivered,
    describe_undelivered,
    error_reason,
    undelivered_run,
)
from deltastream.publishing.topics import ensure_topic, load_kafka

# ensure_topic, PublishResult and Undelivered live in .topics and .results; they are
# re-exported here, where users have always imported them from.
__all__ = [
    "DeltaPublisher",
    "PublishResult",
    "PublishError",
    "TopicError",
    "Undelivered",
    "ensure_topic",
    "new_epoch",
    "DENSE_STREAM",
]

log = logging.getLogger(__name__)

#: the dense stream's name in :meth:`DeltaPublisher.stats` ``next_seq`` and in results and
#: errors (:data:`deltastream.dense_wire.STREAM`)
DENSE_STREAM = dense_wire.STREAM
_epoch_lock = threading.Lock()
_last_epoch = 0


def new_epoch() -> int:
    """A fresh trainer epoch: wall clock in µs, strictly increasing within the process.

    Unique across restarts as long as the clock does not step back by more than the
    restart takes.
    """
    global _last_epoch
    with _epoch_lock:
        _last_epoch = max(time.time_ns() // 1000, _last_epoch + 1)
        return _last_epoch


class DeltaPublisher:
    """Send changed rows of one trainer shard to a Kafka topic, in wire format v2 (or v3).

    Example::

        ensure_topic(servers, "deltas.ranker", partitions=4)
        with DeltaPublisher(servers, "deltas.ranker", model="ranker", shard=rank) as pub:
            pub.publish("user_emb", ids, rows, step=step)

    Args:
        bootstrap_servers: Kafka bootstrap servers.
        topic: an existing topic (see :func:`ensure_topic`).
        model: model name carried in every message. shard: this trainer's shard (≥ 0);
            messages go to partition ``shard % partitions``.
        epoch: trainer incarnation; default :func:`new_epoch` (new on every start).
        dtype: wire dtype of rows: ``"f32"``, ``"f16"``, ``"bf16"`` or ``"i8"``.
        max_message_bytes: upper bound of one Kafka record batch holding one message
            (value, key, headers and framing); the wire message is ~300 bytes smaller. The
            default fits Kafka's default topic limit (1048588 bytes).
        compression: ``None``, ``"gzip"``, ``"snappy"``, ``"lz4"`` or ``"zstd"``.
        send_timeout: seconds a ``publish`` may block on a full buffer or on replacing a
            failed producer, a message may take to be acknowledged (delivery timeout), and
            the constructor may take to reach the broker.
        allow_nonfinite: publish inf/NaN rows instead of raising (not with dtype i8).
        wire_version: 2; 3: ids as sorted varint gaps when shorter (1–2 bytes for dense
            ids instead of 8); 4: also one-byte int keys (~50 bytes less per message).
            Every consumer must read the version first (v3: deltastream ≥ issue 29, v4:
            ≥ stop 40 of issue 29).
        producer_config: more kafka-python ``KafkaProducer`` settings (``linger_ms``,
            ``batch_size``, security, …). ``buffer_memory`` (bytes, default
            ``max(32 MiB, 4 × max_message_bytes)``) bounds the bytes awaiting
            acknowledgement (one message is always let through).
    """

    def __init__(self, bootstrap_servers: Any, topic: str, *, model: str, shard: int,
                 epoch: Optional[int] = None, dtype: str = "f16",
                 max_message_bytes: int = 1 << 20, compression: Optional[str] = None,
                 send_timeout: float = 30.0, allow_nonfinite: bool = False,
                 wire_version: int = wire.VERSION, **producer_config: Any) -> None:
        # the arguments as given (spawn_args; the epoch is added there)
        self._args = {k: v for k, v in locals().items() if k not in (
            "self", "epoch", "producer_config")} | producer_config
        wire.check_name("model", model)
        self.shard = check_int("shard", shard, 0, (1 << 31) - 1)
        self.epoch = new_epoch() if epoch is None else check_int("epoch", epoch)
        wire.check_dtype(dtype)
        self.wire_version = check_int("wire_version", wire_version, 2, max(wire.VERSIONS))
        check_int("max_message_bytes", max_message_bytes, MIN_MESSAGE_BYTES, 1 << 30)
        check_settings(compression, send_timeout, topic, producer_config)
        self.bootstrap_servers = check_bootstrap_servers(bootstrap_servers)
        self.topic = topic
        self.model = model
        self.dtype = dtype
        self.max_message_bytes = int(max_message_bytes)
        self.send_timeout = float(send_timeout)
        self.allow_nonfinite = bool(allow_nonfinite)
        buffer_bytes, config = kafka_settings(f"deltastream-{model}-{self.shard}",
                                              self.max_message_bytes, compression,
                                              self.send_timeout, producer_config)
        #: the KafkaProducer settings in use (besides bootstrap_servers)
        self.producer_config = dict(config)
        self._link = ProducerLink(bootstrap_servers, topic, config, producer_config)
        count = self._link.topic_partitions(self.send_timeout)
        if count is None:
            raise TopicError(f"topic {topic!r} does not exist on {bootstrap_servers!r}; create "
                             f"it first: ensure_topic({bootstrap_servers!r}, {topic!r}, "
                             f"partitions=<number of trainer shards>)")
        self.partitions = count
        self.partition = self.shard % count
        seen = self._link.connect(self.send_timeout)
        if seen is not None and seen != count:
            log.warning("topic %r: admin sees %d partitions, producer %d", topic, count, seen)

        self._lock = threading.RLock()
        self._closed = False
        self._lent: Optional[str] = None  # who publishes this one's streams meanwhile
        self._next_seq: dict[str, int] = {}
        self._dims: dict[str, int] = {}
        self._keys: dict[str, bytes] = {}
        # f16/f32 messages are framed in place (bf16/i8 go through wire.encode)
        self._framer = wire.Framer(self.max_message_bytes + 8192, self.wire_version) \
            if dtype in ("f16", "f32") else None
        self._stats = dict(publishes=0, messages=0, rows=0, tombstones=0, bytes=0,
                           acked_messages=0, failed_messages=0, blocked_s=0.0,
                           dense_versions=0)
        self._flight = InFlight(buffer_bytes, self._stats)
        log.info("publisher model=%s shard=%d epoch=%d -> %s partition %d/%d dtype=%s",
                 model, self.shard, self.epoch, topic, self.partition, count, dtype)

    # ------------------------------------------------------------------ helpers

    def max_value_bytes(self, table: str) -> int:
        """Largest wire message (Kafka value, bytes) for ``table``: what is left of
        ``max_message_bytes`` after the key, headers and record-batch framing."""
        names = len(self.model.encode()) + len(table.encode())
        return self.max_message_bytes - KAFKA_OVERHEAD - 2 * names - 64

    def _on_error(self, record: SentMessage, generation: int, _exc: Any) -> None:
        # runs on the sender thread
        self._flight.failed(record)
        self._link.mark_failed(generation)

    def _recover(self, deadline: float) -> Optional[str]:
        """Replace a wedged producer; None when one can take messages, else why not."""
        if not self._link.wedged():
            return None
        # Every message of the old producer must be resolved before a new one sends: a
        # later seq must never reach the partition before an earlier one.
        if not self._flight.resolve_all(deadline):
            return (f"the producer is being replaced after a failure, and earlier "
                    f"messages are still unresolved after {self.send_timeout:g} s")
        self._flight.reap()
        try:
            self._link.replace(max(0.001, deadline - time.monotonic()), self.partitions,
                               self.partition)
        except (PublishError, TopicError) as e:
            return f"cannot replace the failed producer: {e}"
        return None

    def _raise_failures(self, extra: Optional[list[Undelivered]] = None,
                        what: str = "earlier messages failed") -> None:
        failed = self._flight.take_failures()
        if failed or extra:
            for s in failed:
                s.reported = True
            raise PublishError(f"{self.topic} partition {self.partition}: {what}",
                               describe_undelivered(failed, error_reason) + list(extra or []))

    def _check_open(self, rows: bool = False) -> None:
        """Raise when closed, or (``rows``) when the row streams are lent (:meth:`lend`)."""
        if self._closed:
            raise PublishError("publisher is closed")
        if rows and self._lent is not None:
            raise RuntimeError(f"this DeltaPublisher is lent to {self._lent}, which sends "
                               "its row streams: a message sent here would reuse its seqs; "
                               "publish after closing that (BudgetPublisher.close()), or "
                               "keep the rounds in this process (BudgetPublisher(..., "
                               "worker=\"thread\"))")

    # ------------------------------------------------------------------ public

    def publish(self, table: str, ids: Any, rows: Any, *, step: int,
                tombstones: Any = None, ts: Optional[int] = None, col: int = 0,
                width: Optional[int] = None, shard: Optional[int] = None,
                dtype: Optional[str] = None, fresh: Any = None) -> PublishResult:
        """Send ``rows`` of ``ids`` (and evicted ``tombstones``) of ``table``.

        Args:
            table: table name (non-empty, no ``/``).
            ids: int64 ``[n]`` global ids (numpy array or torch tensor); unique.
            rows: float ``[n, dim]`` current values (numpy or torch, CPU or CUDA).
            step: trainer global step (≥ 0).
            tombstones: int64 ``[m]`` ids the trainer evicted, or ``None``.
            ts: wall clock in ns when the rows were read; default now.
            col, width: ``rows`` are columns ``[col, col + dim)`` of rows ``width`` wide (a
                column-wise shard; wire v2 ``col``/``width``). Default: whole rows.
            shard: the shard these rows belong to, default this publisher's ``shard``. A
                rank holding several shards of one table (column shards) publishes each
                under its own shard id: every ``(table, shard)`` is its own seq stream,
                Kafka key and partition (``shard % partitions``).
            dtype: this call's wire dtype, default the publisher's ``dtype``; ``"r1"``
                (wire v4): ``rows`` are residuals that predictors *add* to what they hold
                (:mod:`deltastream.wire_values`).
            fresh: with ``"r1"``, bool ``[n]`` or None: rows predictors start from zeros.

        Returns:
            A :class:`PublishResult`; its ``offsets`` are known after :meth:`flush` or
            :meth:`PublishResult.wait`.

        Raises:
            ValueError / TypeError: bad arguments (nothing sent).
            PublishError: an earlier message failed, or the buffer stayed full for
                ``send_timeout`` seconds; ``undelivered`` names what was not sent. The
                seqs of messages that were never handed to the producer are reused by the
                next publish, so consumers see a seq gap only where a sent message failed.
        """
        wire.check_name("table", table)
        dtype = self._call_dtype(dtype)
        step = check_int("step", step)
        ts = time.time_ns() if ts is None else check_int("ts", ts)
        # Own copies (8 bytes an id): undelivered messages name their ids from them, so a
        # caller reusing its id buffer cannot change what a PublishError reports.
        ids_np = np.array(host_ids(ids, "ids"))
        tomb_np = None if tombstones is None else np.array(host_ids(tombstones, "tombstones"))
        shard = self.shard if shard is None else check_int("shard", shard, 0, (1 << 31) - 1)
        # one seq stream per (table, shard); '/' never occurs in a table name
        stream = table if shard == self.shard else f"{table}/{shard}"
        partition = self.partition if shard == self.shard else shard % self.partitions
        rows_np = host_rows(rows, ids_np.shape[0], stream, dtype=dtype,
                            allow_nonfinite=self.allow_nonfinite,
                            known_dim=self._dims.get(stream))
        col = check_int("col", col, 0, wire.MAX_DIM - 1)
        width = None if width is None else check_int("width", width, 1, wire.MAX_DIM)
        with self._lock:
            self._check_open(rows=True)
            self._flight.reap()
            self._raise_failures()
            first = self._next_seq.get(stream, 0)
            batch = wire.DeltaBatch(model=self.model, table=table, shard=shard,
                                    epoch=self.epoch, seq=first, step=step, ts=ts,
                                    ids=ids_np, rows=rows_np, dtype=dtype,
                                    tombstones=tomb_np, col=col, width=width,
                                    fresh=None if fresh is None else np.asarray(fresh))
            limit = self.max_value_bytes(table)
            pieces = wire.split(batch, limit)  # validates; views, no copies
            frame = functools.partial(self._frame, limit=limit)
            key = self._keys.setdefault(stream, wire.message_key(self.model, table, shard))
            result = PublishResult(table=table, partition=partition, epoch=self.epoch,
                                   first_seq=first, last_seq=first - 1, messages=0, rows=0,
                                   tombstones=0, bytes=0)
            try:
                self._send_pieces(table, stream, pieces, frame, wire.kafka_headers, key,
                                  partition, result)
            finally:
                if result.messages:
                    self._dims[stream] = rows_np.shape[1]
            self._stats["publishes"] += 1
            return result

    def _call_dtype(self, dtype: Optional[str]) -> str:
        """A publish call's wire dtype (default the publisher's), checked: a residual dtype
        needs wire v4 (``ValueError`` before anything is sent)."""
        dtype = self.dtype if dtype is None else dtype
        wire.check_dtype(dtype, residual=True)
        if dtype in wire.RESIDUAL_DTYPES and self.wire_version < wire.RESIDUAL_VERSION:
            raise ValueError(f"dtype: {dtype} (residuals) needs wire_version "
                             f"{wire.RESIDUAL_VERSION} or later, this publisher writes "
                             f"v{self.wire_version}")
        return dtype

    def _frame(self, piece: wire.DeltaBatch, limit: int) -> Any:
        """The message of ``piece``: framed in place when in the publisher's own dtype (and
        it fits the framer's buffer), else encoded."""
        value = self._framer.frame(piece) if self._framer and piece.dtype == self.dtype \
            else None
        return value if value is not None else wire.encode(
            piece, max_message_bytes=limit, version=self.wire_version)[0]

    def publish_dense(self, tensors: Mapping[str, Any], *, step: int,
                      base_step: Optional[int] = None, ts: Optional[int] = None,
                      dtype: str = "f32") -> PublishResult:
        """Send one dense version (wire kind dense, :mod:`deltastream.dense_wire`).

        Args:
            tensors: ``{state_dict key: float array}`` (numpy, any shape), in sending
                order: every tensor of a full version, or the changed ones.
            step: trainer global step; the version is ``(epoch, step)``.
            base_step: the version a partial one builds on; ``None``: a full version.
            ts: wall clock in ns when the tensors were copied; default now.
            dtype: ``"f32"``, ``"bf16"`` or ``"f16"``.

        The version's chunks go out in order, on this shard's partition, with their own
        seq stream (:data:`DENSE_STREAM` in :meth:`stats`); the result's ``table`` is
        ``DENSE_STREAM``, its ``rows``/``tombstones`` 0. Raises like :meth:`publish`
        (``WireError``: values the dtype cannot carry, nothing sent).
        """
        step = check_int("step", step)
        ts = time.time_ns() if ts is None else check_int("ts", ts)
        with self._lock:
            self._check_open()
            self._flight.reap()
            self._raise_failures()
            first = self._next_seq.get(DENSE_STREAM, 0)
            chunks = dense_wire.chunk_version(
                tensors, model=self.model, shard=self.shard, epoch=self.epoch, seq=first,
                step=step, ts=ts, base_step=base_step, dtype=dtype,
                max_message_bytes=self.max_value_bytes(DENSE_STREAM))
            result = PublishResult(table=DENSE_STREAM, partition=self.partition,
                                   epoch=self.epoch, first_seq=first, last_seq=first - 1,
                                   messages=0, rows=0, tombstones=0, bytes=0)
            self._send_pieces(DENSE_STREAM, DENSE_STREAM, chunks,
                              lambda c: dense_wire.encode_dense([c])[0],
                              dense_wire.dense_headers,
                              dense_wire.dense_key(self.model, self.shard), self.partition,
                              result)
            self._stats["dense_versions"] += 1
            return result

    def _send_pieces(self, label: str, stream: str, pieces: list, frame: Callable[[Any], Any],
                     headers: Callable[[Any], list], key: bytes, partition: int,
                     result: PublishResult) -> None:
        """Hand ``pieces`` (row batches or dense chunks with consecutive seqs) to the
        producer in order, under the lock; ``frame(piece)`` gives a message's bytes.

        On a failure raises :class:`PublishError` naming ``label`` and the seqs not sent
        (``result``: what was); ``stream``'s next seq follows the last one sent."""
        deadline = time.monotonic() + self.send_timeout
        kafka = load_kafka()
        for i, piece in enumerate(pieces):
            value = frame(piece)
            reason = self._recover(deadline)
            if reason is not None:
                pass
            elif not self._flight.reserve(len(value), deadline):
                reason = (f"buffer of {self._flight.buffer_bytes} bytes still full after "
                          f"{self.send_timeout:g} s (broker slow or down)")
            elif self._flight.has_new_failures():
                reason = "not sent after an earlier message failed"
            else:
                try:
                    fut = self._link.producer.send(self.topic, value=value, key=key,
                                                   headers=headers(piece),
                                                   partition=partition)
                except (kafka.errors.KafkaError, ValueError, TypeError) as e:
                    reason = f"{error_text(e)}"
            if reason is not None:
                unsent = undelivered_run([SentMessage.of(p, label, 0, None) for p in pieces[i:]],
                                         reason)
                try:
                    what = "dense stream" if label == DENSE_STREAM else "table"
                    self._raise_failures([unsent], f"publish of {what} {label!r} step "
                                         f"{piece.step} stopped after {i} of {len(pieces)} "
                                         "messages")
                except PublishError as e:
                    e.result = result  # what this call did send
                    raise
            record = SentMessage.of(piece, label, len(value), fut)
            fut.add_errback(self._on_error, record, self._link.generation)
            self._flight.add(record)
            result.add(record)
            self._next_seq[stream] = piece.seq + 1
            st = self._stats
            st["messages"] += 1
            st["rows"] += record.rows
            st["tombstones"] += record.tombstones
            st["bytes"] += len(value)

    def flush(self, timeout: Optional[float] = None) -> None:
        """Send everything buffered and wait for the broker's acknowledgements.

        Args:
            timeout: seconds; ``None`` = ``send_timeout``.

        Raises:
            PublishError: a message failed, or was not acknowledged within ``timeout``.
        """
        timeout = self.send_timeout if timeout is None else float(timeout)
        with self._lock:
            self._check_open()
            self._flush_locked(timeout)

    def _flush_locked(self, timeout: float) -> None:
        kafka = load_kafka()
        deadline = time.monotonic() + timeout
        producer = self._link.producer
        try:
            if producer is not None:
                producer.flush(timeout=max(timeout, 0.001))
        except kafka.errors.KafkaTimeoutError:
            pass  # what is still pending is reported below
        self._flight.wait_all(deadline)
        self._flight.reap()
        pending = self._flight.unresolved()
        for s in pending:
            # Fate unknown (it may still arrive); reported once, here, not again on failure.
            s.reported = True
        extra = describe_undelivered(pending, lambda _: f"not acknowledged within {timeout:g} s")
        self._raise_failures(extra, "flush found undelivered messages")

    def close(self, timeout: Optional[float] = None) -> None:
        """Flush (see :meth:`flush`) and close the producer. Safe to call twice.

        Raises :class:`PublishError` after closing if messages were not delivered.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            timeout = self.send_timeout if timeout is None else float(timeout)
            try:
                self._flush_locked(timeout)
            finally:
                self._link.close()

    def stats(self) -> dict:
        """Counters: publishes, messages, rows, tombstones, bytes (wire values), acked and
        failed messages, pending messages/bytes (awaiting acknowledgement), blocked_s
        (seconds publish waited on a full buffer), reconnects (failed producers replaced),
        epoch, partition, next seq per table (``"<table>/<shard>"`` for rows published with
        another ``shard``; ``"/dense"`` for the dense stream), dense_versions (versions
        :meth:`publish_dense` sent; their messages and bytes count in the totals)."""
        with self._lock:
            self._flight.reap()
            return dict(self._stats, pending_messages=len(self._flight),
                        reconnects=self._link.replacements,
                        pending_bytes=self._flight.pending_bytes,
                        buffer_bytes=self._flight.buffer_bytes,
                        epoch=self.epoch, partition=self.partition,
                        partitions=self.partitions, next_seq=dict(self._next_seq))

    def spawn_args(self) -> dict[str, Any]:
        """Keyword arguments that make an equal publisher in another process: same topic,
        model, shard, **epoch** and settings (call :meth:`resume_seqs` on it with
        :meth:`next_seqs` so its messages continue this one's seqs)."""
        return dict(self._args, epoch=self.epoch)

    def lend(self, holder: Optional[str]) -> None:
        """Mark this publisher's row streams lent to ``holder`` (e.g. ``"budget worker
        process 123"``, publishing rows with the same epoch elsewhere), or back with None.
        Meanwhile :meth:`publish` raises ``RuntimeError``: a message sent here would reuse
        the holder's seqs, and predictors drop one of two messages with the same seq
        (:meth:`publish_dense` goes on: the dense stream stays this publisher's)."""
        with self._lock:
            self._lent = holder

    def next_seqs(self) -> dict[str, int]:
        """The seq the next message of each stream (``"<table>"`` or ``"<table>/<shard>"``)
        gets."""
        with self._lock:
            return dict(self._next_seq)

    def resume_seqs(self, next_seqs: Mapping[str, int]) -> None:
        """Continue the seqs of a publisher of the same epoch that published for this one
        (a worker process; see :meth:`spawn_args`): a stream's next seq only moves forward."""
        with self._lock:
            for stream, seq in next_seqs.items():
                self._next_seq[stream] = max(self._next_seq.get(stream, 0), int(seq))

    def __enter__(self) -> DeltaPublisher:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # do not mask the exception that is propagating
            self.close()
        except Exception as e:
            log.error("closing publisher after %s: %s", exc_type.__name__, e)

    def __del__(self) -> None:
        # The producer's own exit hook closes it with a 1 s timeout: say what may be lost.
        if getattr(self, "_closed", True):
            return
        flight = getattr(self, "_flight", None)
        pending = 0 if flight is None else flight.not_done()
        if pending:
            log.warning("DeltaPublisher(%s, shard %s) was not closed: %d messages may not be "
                        "delivered; call close() or use it as a context manager",
                        getattr(self, "topic", "?"), getattr(self, "shard", "?"), pending)

    def __repr__(self) -> str:
        return (f"DeltaPublisher(topic={self.topic!r}, model={self.model!r}, "
                f"shard={self.shard}, epoch={self.epoch}, partition={self.partition})")
