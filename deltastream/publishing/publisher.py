"""Publish changed embedding rows to Kafka as wire-v1 messages.

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

Torch is never imported here: tensors (CPU or CUDA) are recognised by duck typing
(``.detach()``) and converted on their own device before the copy to host.
"""

from __future__ import annotations

import collections
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import crc32c
import msgpack
import numpy as np

from deltastream import wire
from deltastream.errors import PublishError, TopicError

__all__ = [
    "DeltaPublisher",
    "PublishResult",
    "PublishError",
    "TopicError",
    "Undelivered",
    "ensure_topic",
    "new_epoch",
]

log = logging.getLogger(__name__)

_COMPRESSIONS = (None, "gzip", "snappy", "lz4", "zstd")
# Producer settings the publisher owns: changing them would break its guarantees.
_RESERVED = {"bootstrap_servers", "enable_idempotence", "acks", "key_serializer",
             "value_serializer", "compression_type", "max_request_size"}
# Bytes of Kafka framing around one wire message in a record batch: the v2 batch header
# (61), the record's varints and attributes (< 32) and the header names (< 64); the key and
# header values are added per table. A one-message batch stays within max_message_bytes.
_KAFKA_OVERHEAD = 256
_MIN_MESSAGE_BYTES = 4096
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


@dataclass(frozen=True)
class Undelivered:
    """Messages ``first_seq..last_seq`` of ``table`` (``rows`` rows, ``tombstones`` ids)."""

    table: str
    first_seq: int
    last_seq: int
    rows: int
    tombstones: int
    reason: str

    def __str__(self) -> str:
        return (f"table {self.table!r} seq {self.first_seq}..{self.last_seq} "
                f"({self.rows} rows, {self.tombstones} tombstones: {self.reason})")


class _Sent:
    """One message handed to the producer."""

    __slots__ = ("table", "seq", "rows", "tombstones", "nbytes", "future", "reported")

    def __init__(self, table: str, seq: int, rows: int, tombstones: int, nbytes: int,
                 future: Any) -> None:
        self.table, self.seq, self.rows, self.tombstones = table, seq, rows, tombstones
        self.nbytes, self.future, self.reported = nbytes, future, False


def _describe(records: list[_Sent], reason_of: Any) -> list[Undelivered]:
    """Group consecutive messages of a table with the same reason into ranges."""
    out: list[Undelivered] = []
    for r in sorted(records, key=lambda r: (r.table, r.seq)):
        reason = reason_of(r)
        last = out[-1] if out else None
        if last and last.table == r.table and last.last_seq + 1 == r.seq \
                and last.reason == reason:
            out[-1] = Undelivered(r.table, last.first_seq, r.seq, last.rows + r.rows,
                                  last.tombstones + r.tombstones, reason)
        else:
            out.append(Undelivered(r.table, r.seq, r.seq, r.rows, r.tombstones, reason))
    return out


def _error_reason(record: _Sent) -> str:
    exc = record.future.exception
    text = str(exc)
    if not text.startswith(type(exc).__name__):  # kafka errors already start with it
        text = f"{type(exc).__name__}: {text}"
    if "MessageSizeTooLarge" in text:
        text += (" (raise the topic's max.message.bytes, e.g. with ensure_topic(..., "
                 "max_message_bytes=...), or lower the publisher's max_message_bytes)")
    return text


@dataclass
class PublishResult:
    """What one :meth:`DeltaPublisher.publish` call handed to Kafka.

    Attributes:
        table: table name. partition: Kafka partition of every message. epoch: the
            publisher's epoch.
        messages: messages sent; ``first_seq..last_seq`` their seqs (``last_seq ==
            first_seq - 1`` when nothing was sent).
        rows, tombstones: rows and tombstone ids carried. bytes: wire bytes (values only).
    """

    table: str
    partition: int
    epoch: int
    first_seq: int
    last_seq: int
    messages: int
    rows: int
    tombstones: int
    bytes: int
    _sent: list = field(default_factory=list, repr=False, compare=False)

    @property
    def done(self) -> bool:
        """True once every message is acknowledged or failed."""
        return all(s.future.is_done for s in self._sent)

    @property
    def offsets(self) -> Optional[list[int]]:
        """Kafka offsets of the messages once all are acknowledged (after
        :meth:`DeltaPublisher.flush` or :meth:`wait`), else ``None``."""
        if not all(s.future.is_done and s.future.exception is None for s in self._sent):
            return None
        return [s.future.value.offset for s in self._sent]

    def wait(self, timeout: Optional[float] = None) -> PublishResult:
        """Block until every message is acknowledged; returns ``self`` (with ``offsets``).

        Raises :class:`PublishError` naming the messages that failed or were not
        acknowledged within ``timeout`` seconds (``None``: until the producer's delivery
        timeout resolves each of them).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        for s in self._sent:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            _wait_future(s.future, remaining)
        pending = [s for s in self._sent if not s.future.is_done]
        failed = [s for s in self._sent if s.future.is_done and s.future.exception is not None]
        if failed or pending:
            for s in failed + pending:
                s.reported = True  # the caller knows now: the publisher will not repeat it
            undelivered = _describe(failed, _error_reason) + _describe(
                pending, lambda _: f"not acknowledged within {timeout} s")
            raise PublishError(f"publish of table {self.table!r} was not fully delivered",
                               undelivered)
        return self


def _wait_future(future: Any, timeout: Optional[float]) -> bool:
    """Wait up to ``timeout`` s for a producer future; True when it is done (ok or failed)."""
    if not future.is_done:
        try:
            future.get(timeout=timeout)
        except Exception:  # failures are read from the future itself
            pass
    return future.is_done


def _kafka():
    """kafka-python, imported on first use (its import costs ~0.1 s)."""
    import kafka
    import kafka.errors

    return kafka


def _admin(bootstrap_servers: Any, timeout: float, client_config: dict) -> Any:
    kafka = _kafka()
    common = {k: v for k, v in client_config.items()
              if k in kafka.KafkaAdminClient.DEFAULT_CONFIG and k != "client_id"}
    ms = int(timeout * 1000)
    try:
        return kafka.KafkaAdminClient(bootstrap_servers=bootstrap_servers,
                                      bootstrap_timeout_ms=ms,
                                      request_timeout_ms=max(1000, ms), **common)
    except (kafka.errors.KafkaError, OSError) as e:
        raise PublishError(f"cannot reach Kafka at {bootstrap_servers!r} within "
                           f"{timeout:g} s: {type(e).__name__}: {e}") from e


def _partition_count(admin: Any, topic: str) -> Optional[int]:
    """Partitions of ``topic``, or None when it does not exist (never auto-creates)."""
    kafka = _kafka()
    (desc,) = admin.describe_topics([topic])
    code = desc.get("error_code", 0)
    if code == kafka.errors.UnknownTopicOrPartitionError.errno:
        return None
    if code:
        err = kafka.errors.for_code(code)
        raise TopicError(f"topic {topic!r}: broker answered {err.__name__}")
    return len(desc["partitions"])


def _check_int(what: str, value: Any, lo: int = 0, hi: int = (1 << 63) - 1) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what}: expected an int, got {type(value).__name__}")
    if not lo <= int(value) <= hi:
        raise ValueError(f"{what}: expected {lo} ≤ {what} ≤ {hi}, got {value}")
    return int(value)


def ensure_topic(bootstrap_servers: Any, topic: str, partitions: int, *, timeout: float = 30.0,
                 replication_factor: int = -1, max_message_bytes: int = 1 << 20,
                 configs: Optional[dict] = None, strict: bool = False,
                 **client_config: Any) -> int:
    """Create ``topic`` with ``partitions`` partitions unless it exists; return its count.

    Args:
        bootstrap_servers: Kafka bootstrap servers (``"host:port"`` or a list).
        topic: topic name, e.g. ``"deltas.<model>"``.
        partitions: wanted partition count (≥ 1); one per trainer shard keeps shards apart.
        timeout: seconds to reach the broker and see the topic's metadata.
        replication_factor: replicas per partition; -1 = the broker's default.
        max_message_bytes: the publishers' ``max_message_bytes``; the topic's
            ``max.message.bytes`` is set to at least this (new topics only).
        configs: more topic configs for a new topic (e.g. ``{"retention.ms": "86400000"}``).
        strict: raise :class:`TopicError` when the topic exists with fewer partitions
            (otherwise a warning is logged: shards then share partitions, which keeps each
            shard's order but couples their consumers).
        client_config: kafka-python client settings (security, SASL, …).

    Returns:
        The topic's partition count (may differ from ``partitions`` for an existing topic).
    """
    _check_int("partitions", partitions, 1, 1 << 20)
    if not isinstance(topic, str) or not topic:
        raise ValueError(f"topic: expected a non-empty str, got {topic!r}")
    if timeout <= 0:
        raise ValueError(f"timeout: expected positive seconds, got {timeout!r}")
    kafka = _kafka()
    admin = _admin(bootstrap_servers, timeout, client_config)
    try:
        existing = _partition_count(admin, topic)
        if existing is None:
            topic_configs = {"max.message.bytes": str(max(max_message_bytes, 1048588))}
            topic_configs.update({k: str(v) for k, v in (configs or {}).items()})
            try:
                admin.create_topics({topic: {"num_partitions": partitions,
                                             "replication_factor": replication_factor,
                                             "configs": topic_configs}},
                                    timeout_ms=int(timeout * 1000), wait_for_metadata=True)
                log.info("created topic %r with %d partitions", topic, partitions)
                return partitions
            except kafka.errors.TopicAlreadyExistsError:
                existing = _partition_count(admin, topic)  # another trainer created it
                if existing is None:
                    raise TopicError(f"topic {topic!r}: reported as existing but not "
                                     "visible in metadata") from None
            except kafka.errors.KafkaError as e:
                raise TopicError(f"cannot create topic {topic!r} with {partitions} "
                                 f"partitions: {type(e).__name__}: {e}") from e
        if existing < partitions:
            text = (f"topic {topic!r} exists with {existing} partitions, fewer than the "
                    f"{partitions} asked for: shards s and s+{existing} share a partition. "
                    "Add partitions with kafka-topics --alter --partitions, or use a new topic")
            if strict:
                raise TopicError(text)
            log.warning(text)
        return existing
    finally:
        admin.close()


class _Framer:
    """Frames f32/f16 messages into one reusable buffer, byte-identical to
    :func:`deltastream.wire.encode` of the same piece.

    Rows are cast straight into the message (no temporary array, no join copy) and the
    buffer is reused: ``KafkaProducer.send`` copies the value into its record batch before
    it returns, so the next message may overwrite it.
    """

    def __init__(self, capacity: int) -> None:
        self.buf = bytearray(capacity)
        self.view = memoryview(self.buf)

    def frame(self, b: wire.DeltaBatch) -> Optional[memoryview]:
        """The message of ``b`` (a piece from :func:`wire.split`), or None if it does not
        fit the buffer."""
        n, dim = int(b.ids.shape[0]), int(b.rows.shape[1])
        wire_dt = "<f2" if b.dtype == "f16" else "<f4"
        tomb = b.tombstones
        bins = [("ids", n * 8), ("rows", n * dim * wire.DTYPES[b.dtype])]
        if tomb is not None:
            bins.append(("del", int(tomb.shape[0]) * 8))
        scalars = {"v": wire.VERSION, "model": b.model, "table": b.table, "shard": int(b.shard),
                   "epoch": int(b.epoch), "seq": int(b.seq), "step": int(b.step),
                   "ts": int(b.ts), "n": n, "dim": dim, "dtype": b.dtype, "crc": 0xFFFFFFFF}
        # The CRC is packed last, in as few bytes as its value needs: reserve the widest
        # header and right-align the real one against the bins.
        head_end = 3 + len(msgpack.packb(scalars)) - 1
        # Start where the rows land 64-byte aligned in the buffer (vectorised casts); the
        # message is the slice [start:pos] wherever it sits.
        head_end += -(head_end + 9 + 8 * n + 10) % 64
        pos, regions = head_end, []
        for key, size in bins:
            hdr = msgpack.packb(key) + b"\xc6" + size.to_bytes(4, "big")
            if pos + len(hdr) + size > len(self.buf):
                return None
            self.buf[pos:pos + len(hdr)] = hdr
            regions.append(pos + len(hdr))
            pos += len(hdr) + size
        buf = self.buf
        np.frombuffer(buf, "<i8", n, regions[0])[:] = b.ids
        rows = np.frombuffer(buf, wire_dt, n * dim, regions[1]).reshape(n, dim)
        if b.dtype == "f16":
            _to_f16(b.rows, out=rows)
        else:
            np.copyto(rows, b.rows, casting="same_kind")
        if tomb is not None:
            np.frombuffer(buf, "<i8", tomb.shape[0], regions[2])[:] = tomb
        crc = 0
        for (_, size), at in zip(bins, regions, strict=True):
            crc = crc32c.crc32c(self.view[at:at + size], crc)
        scalars["crc"] = crc
        head = msgpack.packb(scalars)
        start = head_end - 3 - (len(head) - 1)
        buf[start:start + 3] = b"\xde" + (len(scalars) + len(bins)).to_bytes(2, "big")
        buf[start + 3:head_end] = head[1:]
        return self.view[start:pos]


class DeltaPublisher:
    """Send changed rows of one trainer shard to a Kafka topic, in wire format v1.

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
        send_timeout: seconds a ``publish`` may block on a full buffer, a message may take
            to be acknowledged (delivery timeout), and the constructor may take to reach
            the broker.
        allow_nonfinite: publish inf/NaN rows instead of raising (not with dtype i8).
        producer_config: more kafka-python ``KafkaProducer`` settings (``linger_ms``,
            ``batch_size``, security, …). ``buffer_memory`` (bytes, default
            ``max(32 MiB, 4 × max_message_bytes)``) bounds the bytes awaiting
            acknowledgement (one message is always let through).
    """

    def __init__(self, bootstrap_servers: Any, topic: str, *, model: str, shard: int,
                 epoch: Optional[int] = None, dtype: str = "f16",
                 max_message_bytes: int = 1 << 20, compression: Optional[str] = None,
                 send_timeout: float = 30.0, allow_nonfinite: bool = False,
                 **producer_config: Any) -> None:
        wire._check_name("model", model)
        self.shard = _check_int("shard", shard, 0, (1 << 31) - 1)
        self.epoch = new_epoch() if epoch is None else _check_int("epoch", epoch)
        if dtype not in wire.DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(wire.DTYPES)}, got {dtype!r}")
        _check_int("max_message_bytes", max_message_bytes, _MIN_MESSAGE_BYTES, 1 << 30)
        if compression not in _COMPRESSIONS:
            raise ValueError(f"compression: expected one of {_COMPRESSIONS}, got "
                             f"{compression!r}")
        if isinstance(send_timeout, bool) or not isinstance(send_timeout, (int, float)) \
                or not send_timeout > 0:
            raise ValueError(f"send_timeout: expected positive seconds, got {send_timeout!r}")
        if not isinstance(topic, str) or not topic:
            raise ValueError(f"topic: expected a non-empty str, got {topic!r}")
        reserved = sorted(_RESERVED & set(producer_config))
        if reserved:
            raise ValueError(f"producer_config: {reserved} are set by DeltaPublisher "
                             "(use its arguments: compression, max_message_bytes)")
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.model = model
        self.dtype = dtype
        self.max_message_bytes = int(max_message_bytes)
        self.send_timeout = float(send_timeout)
        self.allow_nonfinite = bool(allow_nonfinite)
        self._buffer_bytes = int(producer_config.pop(
            "buffer_memory", max(32 << 20, 4 * self.max_message_bytes)))
        if self._buffer_bytes <= 0:
            raise ValueError(f"buffer_memory: expected positive bytes, got {self._buffer_bytes}")

        kafka = _kafka()
        admin = _admin(bootstrap_servers, self.send_timeout, producer_config)
        try:
            count = _partition_count(admin, topic)
        finally:
            admin.close()
        if count is None:
            raise TopicError(f"topic {topic!r} does not exist on {bootstrap_servers!r}; create "
                             f"it first: ensure_topic({bootstrap_servers!r}, {topic!r}, "
                             f"partitions=<number of trainer shards>)")
        self.partitions = count
        self.partition = self.shard % count

        timeout_ms = int(self.send_timeout * 1000)
        linger = int(producer_config.get("linger_ms", 0))
        config = dict(
            client_id=f"deltastream-{model}-{self.shard}",
            acks="all", enable_idempotence=True, compression_type=compression,
            max_request_size=self.max_message_bytes + _KAFKA_OVERHEAD,
            delivery_timeout_ms=max(timeout_ms, linger + 1),
            request_timeout_ms=max(1, min(30000, timeout_ms - linger)),
            max_block_ms=timeout_ms, bootstrap_timeout_ms=timeout_ms,
            reconnect_backoff_max_ms=1000, allow_auto_create_topics=False,
        )
        config.update(producer_config)
        #: the KafkaProducer settings in use (besides bootstrap_servers)
        self.producer_config = dict(config)
        try:
            self._producer = kafka.KafkaProducer(bootstrap_servers=bootstrap_servers, **config)
            seen = self._producer.partitions_for(topic)
        except (kafka.errors.KafkaError, OSError) as e:
            if getattr(self, "_producer", None) is not None:
                self._producer.close(timeout=0)
            raise PublishError(f"cannot start a Kafka producer for {bootstrap_servers!r}: "
                               f"{type(e).__name__}: {e}") from e
        if seen is not None and len(seen) != count:
            log.warning("topic %r: admin sees %d partitions, producer %d", topic, count,
                        len(seen))

        self._lock = threading.RLock()
        self._closed = False
        self._next_seq: dict[str, int] = {}
        self._dims: dict[str, int] = {}
        self._keys: dict[str, bytes] = {}
        self._pending: collections.deque[_Sent] = collections.deque()
        self._pending_bytes = 0
        self._failed: list[_Sent] = []
        self._fail_lock = threading.Lock()
        # f16/f32 messages are framed in place (bf16/i8 go through wire.encode)
        self._framer = _Framer(self.max_message_bytes + 8192) if dtype in ("f16", "f32") \
            else None
        self._stats = dict(publishes=0, messages=0, rows=0, tombstones=0, bytes=0,
                           acked_messages=0, failed_messages=0, blocked_s=0.0)
        log.info("publisher model=%s shard=%d epoch=%d -> %s partition %d/%d dtype=%s",
                 model, self.shard, self.epoch, topic, self.partition, count, dtype)

    # ------------------------------------------------------------------ helpers

    def max_value_bytes(self, table: str) -> int:
        """Largest wire message (Kafka value, bytes) for ``table``: what is left of
        ``max_message_bytes`` after the key, headers and record-batch framing."""
        names = len(self.model.encode()) + len(table.encode())
        return self.max_message_bytes - _KAFKA_OVERHEAD - 2 * names - 64

    def _on_error(self, record: _Sent, _exc: Any) -> None:  # runs on the sender thread
        with self._fail_lock:
            self._failed.append(record)

    def _reap(self) -> None:
        """Release acknowledged (or failed) messages from the head of the pending queue."""
        while self._pending and self._pending[0].future.is_done:
            s = self._pending.popleft()
            self._pending_bytes -= s.nbytes
            if s.future.exception is None:
                self._stats["acked_messages"] += 1
            else:
                self._stats["failed_messages"] += 1

    def _has_new_failures(self) -> bool:
        return any(not r.reported for r in self._failed)

    def _take_failures(self) -> list[_Sent]:
        with self._fail_lock:
            failed, self._failed = self._failed, []
        return [s for s in failed if not s.reported]

    def _raise_failures(self, extra: Optional[list[Undelivered]] = None,
                        what: str = "earlier messages failed") -> None:
        failed = self._take_failures()
        if failed or extra:
            for s in failed:
                s.reported = True
            raise PublishError(f"{self.topic} partition {self.partition}: {what}",
                               _describe(failed, _error_reason) + list(extra or []))

    def _reserve(self, nbytes: int, deadline: float) -> bool:
        """Wait until ``nbytes`` more fit in the buffer; False at the deadline."""
        self._reap()
        if self._pending_bytes + nbytes <= self._buffer_bytes or not self._pending:
            return True
        t0 = time.monotonic()
        try:
            while self._pending and self._pending_bytes + nbytes > self._buffer_bytes:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                _wait_future(self._pending[0].future, remaining)
                self._reap()
                if self._has_new_failures():  # frees space, but must surface now
                    return True
            return True
        finally:
            self._stats["blocked_s"] += time.monotonic() - t0

    def _check_open(self) -> None:
        if self._closed:
            raise PublishError("publisher is closed")

    # ------------------------------------------------------------------ arguments

    @staticmethod
    def _host_ids(x: Any, what: str) -> np.ndarray:
        if hasattr(x, "detach"):  # torch tensor, CPU or CUDA (duck-typed: no torch import)
            x = x.detach().cpu().numpy()
        arr = np.asarray(x)
        if arr.ndim != 1:
            raise ValueError(f"{what}: expected a 1-D array of int64 ids, got shape {arr.shape}")
        if arr.dtype.kind not in "iu":
            raise TypeError(f"{what}: expected integer ids (int64), got dtype {arr.dtype}")
        if arr.dtype.kind == "u" and arr.size and arr.dtype.itemsize >= 8 \
                and int(arr.max()) > (1 << 63) - 1:
            raise ValueError(f"{what}: id {int(arr.max())} does not fit in int64")
        return arr.astype(np.int64, copy=False)

    def _host_rows(self, x: Any, n: int, table: str) -> np.ndarray:
        """Validate rows ``[n, dim]`` and bring them to host memory.

        For wire dtype f16, accelerator tensors are cast on their device (half the copy);
        float32 host rows stay as they are and are cast message by message in
        :meth:`publish`, while the piece is hot in cache.
        """
        tensor = hasattr(x, "detach")
        if tensor:
            x = x.detach()
            if not x.is_floating_point():
                raise TypeError(f"rows: expected a float tensor, got {x.dtype}")
            if x.device.type == "cpu":
                # Host tensors continue as numpy views: numpy's single-threaded reductions
                # beat torch's thread pool when the trainer keeps the cores busy.
                if str(x.dtype) not in ("torch.float32", "torch.float64", "torch.float16"):
                    x = x.float()  # bfloat16 has no numpy dtype
                x, tensor = x.numpy(), False
        if tensor:
            shape = tuple(x.shape)
        else:
            x = np.asarray(x)
            if x.dtype.kind != "f":
                raise TypeError(f"rows: expected a float array, got dtype {x.dtype}")
            shape = x.shape
        if len(shape) != 2 or shape[0] != n:
            raise ValueError(f"rows: expected shape [{n}, dim] (one row per id), got "
                             f"{list(shape)}")
        dim = shape[1]
        if not 1 <= dim <= wire.MAX_DIM:
            raise ValueError(f"rows: expected 1 ≤ dim ≤ {wire.MAX_DIM}, got {dim}")
        known = self._dims.get(table)
        if known is not None and known != dim:
            raise ValueError(f"rows: table {table!r} has dim {known} in this epoch, got {dim}")
        lo = hi = 0.0
        if n:
            if tensor:
                mn, mx = x.aminmax()  # one pass on the tensor's device, no temporary
                lo, hi = float(mn), float(mx)
            else:
                lo, hi = float(np.min(x)), float(np.max(x))
        finite = bool(np.isfinite(lo) and np.isfinite(hi))
        if not finite and (not self.allow_nonfinite or self.dtype == "i8"):
            host = x.float().cpu().numpy() if tensor else x
            bad = ~np.isfinite(host).all(axis=1)
            hint = ("dtype i8 cannot carry them" if self.allow_nonfinite
                    else "pass allow_nonfinite=True to publish them anyway")
            raise ValueError(f"rows: {int(bad.sum())} of {n} rows of table {table!r} hold "
                             f"inf/NaN (first row index {int(np.argmax(bad))}); {hint}")
        if self.dtype == "f16":
            top = max(-lo, hi)
            if not finite:
                host = x.float().cpu().numpy() if tensor else x
                top = wire._max_abs_finite(host)[0]
            if top > 65504.0:
                raise ValueError(f"rows: value {top:g} of table {table!r} exceeds the f16 "
                                 "range (±65504); use dtype='bf16' or 'f32'")
            if tensor:
                return x.half().cpu().numpy()
            return x
        if tensor:
            if str(x.dtype) != "torch.float32":
                x = x.float()
            return x.cpu().numpy()
        return x

    # ------------------------------------------------------------------ public

    def publish(self, table: str, ids: Any, rows: Any, *, step: int,
                tombstones: Any = None, ts: Optional[int] = None) -> PublishResult:
        """Send ``rows`` of ``ids`` (and evicted ``tombstones``) of ``table``.

        Args:
            table: table name (non-empty, no ``/``).
            ids: int64 ``[n]`` global ids (numpy array or torch tensor); unique.
            rows: float ``[n, dim]`` current values (numpy or torch, CPU or CUDA).
            step: trainer global step (≥ 0).
            tombstones: int64 ``[m]`` ids the trainer evicted, or ``None``.
            ts: wall clock in ns when the rows were read; default now.

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
        wire._check_name("table", table)
        step = _check_int("step", step)
        ts = time.time_ns() if ts is None else _check_int("ts", ts)
        ids_np = self._host_ids(ids, "ids")
        tomb_np = None if tombstones is None else self._host_ids(tombstones, "tombstones")
        rows_np = self._host_rows(rows, ids_np.shape[0], table)
        with self._lock:
            self._check_open()
            self._reap()
            self._raise_failures()
            first = self._next_seq.get(table, 0)
            batch = wire.DeltaBatch(model=self.model, table=table, shard=self.shard,
                                    epoch=self.epoch, seq=first, step=step, ts=ts,
                                    ids=ids_np, rows=rows_np, dtype=self.dtype,
                                    tombstones=tomb_np)
            limit = self.max_value_bytes(table)
            pieces = wire.split(batch, limit)  # validates; views, no copies
            key = self._keys.setdefault(table, wire.message_key(self.model, table, self.shard))
            result = PublishResult(table=table, partition=self.partition, epoch=self.epoch,
                                   first_seq=first, last_seq=first - 1, messages=0, rows=0,
                                   tombstones=0, bytes=0)
            deadline = time.monotonic() + self.send_timeout
            kafka = _kafka()
            for i, piece in enumerate(pieces):
                value = None if self._framer is None else self._framer.frame(piece)
                if value is None:
                    (value,) = wire.encode(piece, max_message_bytes=limit)
                n_tomb = 0 if piece.tombstones is None else int(piece.tombstones.shape[0])
                reason = None
                if not self._reserve(len(value), deadline):
                    reason = (f"buffer of {self._buffer_bytes} bytes still full after "
                              f"{self.send_timeout:g} s (broker slow or down)")
                elif self._has_new_failures():
                    reason = "not sent after an earlier message failed"
                else:
                    try:
                        fut = self._producer.send(self.topic, value=value, key=key,
                                                  headers=wire.kafka_headers(piece),
                                                  partition=self.partition)
                    except (kafka.errors.KafkaError, ValueError, TypeError) as e:
                        reason = f"{type(e).__name__}: {e}"
                if reason is not None:
                    rest = pieces[i:]
                    unsent = Undelivered(
                        table, rest[0].seq, rest[-1].seq, sum(p.n for p in rest),
                        sum(0 if p.tombstones is None else p.tombstones.shape[0]
                            for p in rest), reason)
                    try:
                        self._raise_failures([unsent], f"publish of table {table!r} step "
                                             f"{step} stopped after {i} of {len(pieces)} "
                                             "messages")
                    except PublishError as e:
                        e.result = result  # what this call did send
                        raise
                record = _Sent(table, piece.seq, piece.n, n_tomb, len(value), fut)
                fut.add_errback(self._on_error, record)
                self._pending.append(record)
                self._pending_bytes += len(value)
                result._sent.append(record)
                self._next_seq[table] = piece.seq + 1
                self._dims[table] = rows_np.shape[1]
                result.last_seq = piece.seq
                result.messages += 1
                result.rows += piece.n
                result.tombstones += n_tomb
                result.bytes += len(value)
                st = self._stats
                st["messages"] += 1
                st["rows"] += piece.n
                st["tombstones"] += n_tomb
                st["bytes"] += len(value)
            self._stats["publishes"] += 1
            return result

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
        kafka = _kafka()
        deadline = time.monotonic() + timeout
        try:
            self._producer.flush(timeout=max(timeout, 0.001))
        except kafka.errors.KafkaTimeoutError:
            pass  # what is still pending is reported below
        for s in list(self._pending):
            _wait_future(s.future, max(0.0, deadline - time.monotonic()))
        self._reap()
        pending = [s for s in self._pending if not s.future.is_done and not s.reported]
        for s in pending:
            # Fate unknown (it may still arrive); reported once, here, not again on failure.
            s.reported = True
        extra = _describe(pending, lambda _: f"not acknowledged within {timeout:g} s")
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
                self._close_producer()

    def _close_producer(self) -> None:
        kafka = _kafka()
        try:
            self._producer.close(timeout=1.0)
        except kafka.errors.KafkaError:
            # close() flushes first and raises while a batch is still awaiting its
            # delivery timeout; abandon them (they were reported) and stop the sender.
            sender = getattr(self._producer, "_sender", None)
            if sender is not None:
                sender.force_close()
            self._producer._closed = True
            log.warning("producer for %s closed with undelivered messages", self.topic)

    def stats(self) -> dict:
        """Counters: publishes, messages, rows, tombstones, bytes (wire values), acked and
        failed messages, pending messages/bytes (awaiting acknowledgement), blocked_s
        (seconds publish waited on a full buffer), epoch, partition, next seq per table."""
        with self._lock:
            self._reap()
            return dict(self._stats, pending_messages=len(self._pending),
                        pending_bytes=self._pending_bytes, buffer_bytes=self._buffer_bytes,
                        epoch=self.epoch, partition=self.partition,
                        partitions=self.partitions, next_seq=dict(self._next_seq))

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
        pending = sum(not s.future.is_done for s in getattr(self, "_pending", ()))
        if pending:
            log.warning("DeltaPublisher(%s, shard %s) was not closed: %d messages may not be "
                        "delivered; call close() or use it as a context manager",
                        getattr(self, "topic", "?"), getattr(self, "shard", "?"), pending)

    def __repr__(self) -> str:
        return (f"DeltaPublisher(topic={self.topic!r}, model={self.model!r}, "
                f"shard={self.shard}, epoch={self.epoch}, partition={self.partition})")


# Elements per torch cast call: below torch's parallel grain size (32768), so each call
# runs in this thread instead of waking the intra-op thread pool, which on a machine whose
# cores are busy (training, the producer's sender thread) costs 10-50x.
_CAST_CHUNK = 32767


def _to_f16(rows: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
    """float ``[n, dim]`` -> float16 (range already checked), round to nearest even, into
    ``out`` (a C-contiguous float16 array of the same shape) when given.

    Uses torch's vectorised cast when the trainer has already imported torch (5-10x
    numpy's, which has no SIMD path for it); never imports torch itself.
    """
    torch = sys.modules.get("torch")
    if torch is None or rows.dtype not in (np.float32, np.float64):
        if out is None:
            return rows.astype(np.float16)
        np.copyto(out, rows, casting="same_kind")
        return out
    if out is None:
        out = np.empty(rows.shape, dtype=np.float16)
    src = torch.from_numpy(np.ascontiguousarray(rows)).view(-1)
    dst = torch.from_numpy(out).view(-1)
    for a in range(0, src.numel(), _CAST_CHUNK):
        dst[a:a + _CAST_CHUNK].copy_(src[a:a + _CAST_CHUNK])
    return out
