"""What a publish handed to Kafka, and what was not delivered.

:class:`PublishResult` is what :meth:`DeltaPublisher.publish` returns: the seq range, rows
and bytes sent, with the producer futures of its messages (:class:`SentMessage`) to wait on.
:class:`Undelivered` names a run of messages that was not sent or not acknowledged; a
:class:`~deltastream.errors.PublishError` carries a list of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import numpy as np

from deltastream import wire
from deltastream.errors import PublishError

__all__ = [
    "PublishResult",
    "Undelivered",
    "SentMessage",
    "SettledFuture",
    "describe_undelivered",
    "error_reason",
    "wait_future",
]


_NO_IDS = np.zeros(0, dtype=np.int64)
_NO_IDS.flags.writeable = False


@dataclass(frozen=True)
class Undelivered:
    """Messages ``first_seq..last_seq`` of ``table``'s ``shard`` stream that were not
    delivered: ``rows`` rows (global ``ids``, int64 ``[rows]``) and ``tombstones`` evicted
    ids (``tombstone_ids``, int64 ``[tombstones]``), columns ``[col, col + width)`` of the
    table (``width`` ``None``: whole rows). What a trainer needs to send them again: read
    the current rows of ``ids`` and publish them under ``table`` and ``shard``. No row
    values are kept: the trainer's table holds the newest ones."""

    table: str
    first_seq: int
    last_seq: int
    rows: int
    tombstones: int
    reason: str
    shard: int = 0
    ids: np.ndarray = field(default_factory=lambda: _NO_IDS, repr=False, compare=False)
    tombstone_ids: np.ndarray = field(default_factory=lambda: _NO_IDS, repr=False, compare=False)
    col: int = 0
    width: Optional[int] = None

    def __str__(self) -> str:
        return (f"table {self.table!r} shard {self.shard} seq {self.first_seq}.."
                f"{self.last_seq} ({self.rows} rows, {self.tombstones} tombstones: "
                f"{self.reason})")


class SentMessage:
    """One message handed to the producer: its table, shard, seq, ids and tombstone ids
    (views of what the publish call was given, not copies), column range, size in bytes,
    the producer's future, and whether its failure was reported to the caller."""

    __slots__ = ("table", "shard", "seq", "ids", "tombstone_ids", "col", "width", "nbytes",
                 "future", "reported")

    def __init__(self, table: str, shard: int, seq: int, ids: np.ndarray,
                 tombstone_ids: Optional[np.ndarray], col: int, width: Optional[int],
                 nbytes: int, future: Any) -> None:
        self.table, self.shard, self.seq, self.ids = table, shard, seq, ids
        self.tombstone_ids = _NO_IDS if tombstone_ids is None else tombstone_ids
        self.col, self.width = col, width
        self.nbytes, self.future, self.reported = nbytes, future, False

    @classmethod
    def of(cls, piece: Any, label: str, nbytes: int, future: Any) -> SentMessage:
        """The message of ``piece`` under ``label``: a row batch's (its ids are views of the
        piece's) or a dense chunk's (no ids)."""
        if not isinstance(piece, wire.DeltaBatch):
            return cls(label, piece.shard, piece.seq, _NO_IDS, None, 0, None, nbytes, future)
        return cls(label, piece.shard, piece.seq, piece.ids, piece.tombstones, piece.col,
                   piece.width, nbytes, future)

    @property
    def rows(self) -> int:
        return int(self.ids.shape[0])

    @property
    def tombstones(self) -> int:
        return int(self.tombstone_ids.shape[0])


def describe_undelivered(records: Iterable[SentMessage],
                         reason_of: Callable[[SentMessage], str]) -> list[Undelivered]:
    """Group consecutive messages of a ``(table, shard)`` stream with the same reason into
    one :class:`Undelivered` each (their ids concatenated)."""
    runs: list[list[SentMessage]] = []
    reasons: list[str] = []
    for r in sorted(records, key=lambda r: (r.table, r.shard, r.seq)):
        reason = reason_of(r)
        last = runs[-1][-1] if runs else None
        if last is not None and (last.table, last.shard, last.seq + 1, reasons[-1]) == \
                (r.table, r.shard, r.seq, reason):
            runs[-1].append(r)
        else:
            runs.append([r])
            reasons.append(reason)
    return [undelivered_run(run, reason) for run, reason in zip(runs, reasons, strict=True)]


def undelivered_run(run: list[Any], reason: str) -> Undelivered:
    """One :class:`Undelivered` for ``run``, consecutive messages of one stream (anything
    with ``table``, ``shard``, ``seq``, ``ids``, ``tombstone_ids``, ``col``, ``width``)."""
    first = run[0]
    ids = first.ids if len(run) == 1 else np.concatenate([r.ids for r in run])
    tombs = first.tombstone_ids if len(run) == 1 else np.concatenate(
        [r.tombstone_ids for r in run])
    return Undelivered(first.table, first.seq, run[-1].seq, int(ids.shape[0]),
                       int(tombs.shape[0]), reason, shard=first.shard, ids=ids,
                       tombstone_ids=tombs, col=first.col, width=first.width)


def error_reason(record: SentMessage) -> str:
    """Why the (failed) ``record`` was not delivered, with a hint for oversized messages."""
    exc = record.future.exception
    text = str(exc)
    if not text.startswith(type(exc).__name__):  # kafka errors already start with it
        text = f"{type(exc).__name__}: {text}"
    if "MessageSizeTooLarge" in text:
        text += (" (raise the topic's max.message.bytes, e.g. with ensure_topic(..., "
                 "max_message_bytes=...), or lower the publisher's max_message_bytes)")
    return text


def wait_future(future: Any, timeout: Optional[float]) -> bool:
    """Wait up to ``timeout`` s for a producer future; True when it is done (ok or failed)."""
    if not future.is_done:
        try:
            future.get(timeout=timeout)
        except Exception:  # failures are read from the future itself
            pass
    return future.is_done


class SettledFuture:
    """A producer future's outcome, as a plain object that crosses processes: what
    :class:`PublishResult` reads of one (``is_done``, ``exception``, ``value.offset``,
    ``get``)."""

    __slots__ = ("exception", "value")
    is_done = True

    def __init__(self, future: Any) -> None:
        self.exception = future.exception if future.is_done else PublishError(
            "not acknowledged when its round was settled")
        self.value = _Acked(future.value.offset) if self.exception is None else None

    def get(self, timeout: Optional[float] = None) -> Any:
        if self.exception is not None:
            raise self.exception
        return self.value


@dataclass(frozen=True)
class _Acked:
    offset: int


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

    def add(self, record: SentMessage) -> None:
        """Count ``record``, the next message of this call, and wait on it in :meth:`wait`."""
        self._sent.append(record)
        self.last_seq = record.seq
        self.messages += 1
        self.rows += record.rows
        self.tombstones += record.tombstones
        self.bytes += record.nbytes

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

    def settled(self) -> PublishResult:
        """A copy whose messages' futures are :class:`SettledFuture` s (picklable: a worker
        process sends it to the training process with its offsets)."""
        sent = []
        for s in self._sent:
            c = SentMessage(s.table, s.shard, s.seq, s.ids, s.tombstone_ids, s.col, s.width,
                            s.nbytes, SettledFuture(s.future))
            c.reported = s.reported
            sent.append(c)
        return replace(self, _sent=sent)

    def wait(self, timeout: Optional[float] = None) -> PublishResult:
        """Block until every message is acknowledged; returns ``self`` (with ``offsets``).

        Raises :class:`PublishError` naming the messages that failed or were not
        acknowledged within ``timeout`` seconds (``None``: until the producer's delivery
        timeout resolves each of them).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        for s in self._sent:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            wait_future(s.future, remaining)
        pending = [s for s in self._sent if not s.future.is_done]
        failed = [s for s in self._sent if s.future.is_done and s.future.exception is not None]
        if failed or pending:
            for s in failed + pending:
                s.reported = True  # the caller knows now: the publisher will not repeat it
            undelivered = describe_undelivered(failed, error_reason) + describe_undelivered(
                pending, lambda _: f"not acknowledged within {timeout} s")
            raise PublishError(f"publish of table {self.table!r} was not fully delivered",
                               undelivered)
        return self
