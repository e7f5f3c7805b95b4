"""Every exception the predictor package raises, under one root: :class:`ConsumerError`.

:class:`ConsumerError` derives from :class:`deltastream.errors.DeltastreamError`; the
Kafka-level errors (:class:`TopicError` and its subclasses) and :class:`WireError` are the
shared ones of :mod:`deltastream.errors`, re-exported here so predictor code imports its
errors from one place. Each text is one line naming the bad value and what was expected.

Hierarchy (this package)::

    ConsumerError (DeltastreamError)
    ├── ApplyError (ValueError)      a batch was refused; the table is unchanged
    ├── SnapshotError (ValueError)   a snapshot or checkpoint is missing, damaged or refused
    └── ReplayError (ValueError)     bad input to a replay (arguments, ranges, snapshots)
"""

from __future__ import annotations

from deltastream.errors import (
    BrokerUnavailable,
    DeltastreamError,
    OffsetError,
    TopicError,
    TopicNotFound,
    WireError,
)

__all__ = [
    "ConsumerError",
    "ApplyError",
    "SnapshotError",
    "ReplayError",
    "TopicError",
    "BrokerUnavailable",
    "TopicNotFound",
    "OffsetError",
    "WireError",
]


class ConsumerError(DeltastreamError):
    """Root of the exceptions raised by the predictor package."""


class ApplyError(ConsumerError, ValueError):
    """A batch was refused (wrong table, dim, dtype, shapes, non-finite values); the table
    is unchanged. The text says what was wrong and what was expected."""


class SnapshotError(ConsumerError, ValueError):
    """A snapshot is missing, damaged, truncated or half-written; the text names the file."""


class ReplayError(ConsumerError, ValueError):
    """Bad input to a replay: arguments, ranges, snapshots that do not fit together."""
