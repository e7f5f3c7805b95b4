"""Every exception deltastream raises, under one root: :class:`DeltastreamError`.

Torch-free, so the predictor package (``consumers``) shares the Kafka-level errors
(:class:`TopicError` and its subclasses) and :class:`WireError` with the trainer side. Each
error's text is one line that names the bad value and what was expected, fit for a CLI.

Hierarchy::

    DeltastreamError
    ├── WireError (ValueError)          a message or batch breaks the wire format
    ├── PublishError (RuntimeError)     rows not (or not confirmed) delivered
    ├── TopicError (RuntimeError)       a topic cannot be created, found or read
    │   ├── BrokerUnavailable           no broker answered in time
    │   ├── TopicNotFound               the topic does not exist
    │   └── OffsetError                 an offset range cannot be read as asked
    ├── BrokerError (RuntimeError)      the embedded broker cannot be found or started
    ├── KafkaConfigError (ValueError)   bad Kafka client settings (bootstrap, TLS, SASL)
    └── PlanError (ValueError)          a sharding plan has gaps, overlaps or bad ranks

``consumers.errors.ConsumerError`` (the predictor package's root) derives from
:class:`DeltastreamError` too, so ``except DeltastreamError`` catches everything.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = [
    "DeltastreamError",
    "WireError",
    "PublishError",
    "TopicError",
    "BrokerUnavailable",
    "TopicNotFound",
    "OffsetError",
    "BrokerError",
    "KafkaConfigError",
    "error_text",
    "PlanError",
]


class DeltastreamError(Exception):
    """Root of every exception raised by deltastream (trainer and predictor side)."""


class WireError(DeltastreamError, ValueError):
    """A message or batch that does not follow the wire format; the text names the field."""


class PublishError(DeltastreamError, RuntimeError):
    """Rows were not (or not confirmed) delivered to Kafka.

    Attributes:
        undelivered: one ``Undelivered`` per run of consecutive messages of a table that was
            not sent or not acknowledged; the caller should keep those rows (e.g.
            ``DeltaTracker.retain``) and publish them again.
        result: for an error raised by ``DeltaPublisher.publish`` part-way, the
            ``PublishResult`` of the messages that call did send; else ``None``.
    """

    def __init__(self, message: str, undelivered: Optional[list[Any]] = None) -> None:
        self.undelivered: list[Any] = list(undelivered or [])
        self.result: Optional[Any] = None
        if self.undelivered:
            message += "; not delivered: " + ", ".join(map(str, self.undelivered))
        super().__init__(message)


class TopicError(DeltastreamError, RuntimeError):
    """A topic could not be created, found or read; one line naming what and where."""


class BrokerUnavailable(TopicError):
    """No broker answered at the bootstrap address in time."""


class TopicNotFound(TopicError):
    """The topic does not exist on the broker."""


class OffsetError(TopicError):
    """A requested offset range cannot be read as asked."""


class BrokerError(DeltastreamError, RuntimeError):
    """The embedded broker could not be found or started."""


class KafkaConfigError(DeltastreamError, ValueError):
    """Bad Kafka client settings (a security setting, a properties file); names the key."""


def error_text(e: BaseException) -> str:
    """``"<ErrorType>: <message>"`` for a one-line report, without the doubled type name
    kafka-python's errors would give (their ``str()`` already starts with it)."""
    name = type(e).__name__
    text = str(e)
    if text == name or text.startswith(name + ":"):
        return text
    return f"{name}: {text}" if text else name


class PlanError(DeltastreamError, ValueError):
    """A sharding plan that cannot be executed; the text names the table and the range."""
