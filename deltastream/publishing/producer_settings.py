"""The Kafka producer settings of a :class:`~deltastream.DeltaPublisher`, and the checks of
the arguments they are made from.

The publisher owns the settings its guarantees rest on (idempotence, ``acks="all"``, the
request size its messages need, no topic auto-creation: ``RESERVED``); the timeouts follow
``send_timeout``; anything else given as ``producer_config`` passes through to kafka-python.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

__all__ = ["check_int", "check_settings", "kafka_settings", "KAFKA_OVERHEAD",
           "MIN_MESSAGE_BYTES", "COMPRESSIONS", "RESERVED"]

COMPRESSIONS = (None, "gzip", "snappy", "lz4", "zstd")
#: producer settings the publisher owns: changing them would break its guarantees
RESERVED = {"bootstrap_servers", "enable_idempotence", "acks", "key_serializer",
            "value_serializer", "compression_type", "max_request_size"}
# Bytes of Kafka framing around one wire message in a record batch: the v2 batch header
# (61), the record's varints and attributes (< 32) and the header names (< 64); the key and
# header values are added per table. A one-message batch stays within max_message_bytes.
KAFKA_OVERHEAD = 256
MIN_MESSAGE_BYTES = 4096


def check_int(what: str, value: Any, lo: int = 0, hi: int = (1 << 63) - 1) -> int:
    """``value`` as an int in ``[lo, hi]``; TypeError/ValueError naming ``what`` if not."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what}: expected an int, got {type(value).__name__}")
    if not lo <= int(value) <= hi:
        raise ValueError(f"{what}: expected {lo} ≤ {what} ≤ {hi}, got {value}")
    return int(value)


def check_settings(compression: Optional[str], send_timeout: Any, topic: Any,
                   producer_config: dict[str, Any]) -> None:
    """Raise ``ValueError`` for a bad compression, ``send_timeout`` (seconds), topic, or a
    ``producer_config`` key the publisher owns."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression: expected one of {COMPRESSIONS}, got "
                         f"{compression!r}")
    if isinstance(send_timeout, bool) or not isinstance(send_timeout, (int, float)) \
            or not send_timeout > 0:
        raise ValueError(f"send_timeout: expected positive seconds, got {send_timeout!r}")
    if not isinstance(topic, str) or not topic:
        raise ValueError(f"topic: expected a non-empty str, got {topic!r}")
    reserved = sorted(RESERVED & set(producer_config))
    if reserved:
        raise ValueError(f"producer_config: {reserved} are set by DeltaPublisher "
                         "(use its arguments: compression, max_message_bytes)")


def kafka_settings(client_id: str, max_message_bytes: int, compression: Optional[str],
                   send_timeout: float, producer_config: dict[str, Any]) -> tuple[int, dict]:
    """(buffer bytes, ``KafkaProducer`` settings but ``bootstrap_servers``).

    The buffer is ``producer_config``'s ``buffer_memory`` (taken out of it: the publisher
    bounds its messages itself), default ``max(32 MiB, 4 × max_message_bytes)``; ValueError
    when not positive. ``send_timeout`` in seconds bounds delivery, blocking and start-up.
    """
    buffer_bytes = int(producer_config.pop("buffer_memory",
                                           max(32 << 20, 4 * max_message_bytes)))
    if buffer_bytes <= 0:
        raise ValueError(f"buffer_memory: expected positive bytes, got {buffer_bytes}")
    timeout_ms = int(send_timeout * 1000)
    linger = int(producer_config.get("linger_ms", 0))
    config = dict(
        client_id=client_id,
        acks="all", enable_idempotence=True, compression_type=compression,
        max_request_size=max_message_bytes + KAFKA_OVERHEAD,
        delivery_timeout_ms=max(timeout_ms, linger + 1),
        request_timeout_ms=max(1, min(30000, timeout_ms - linger)),
        max_block_ms=timeout_ms, bootstrap_timeout_ms=timeout_ms,
        reconnect_backoff_max_ms=1000, allow_auto_create_topics=False,
    )
    config.update(producer_config)
    return buffer_bytes, config
