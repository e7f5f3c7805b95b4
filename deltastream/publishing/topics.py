"""Kafka topic admin for publishers: create the deltas topic, count its partitions.

:func:`ensure_topic` creates a topic unless it exists (never through broker auto-creation)
and returns its partition count; :func:`partition_count` reads it without creating anything;
:func:`forbid_auto_create` keeps a kafka-python producer or consumer from creating topics.
kafka-python is imported on first use (:func:`load_kafka`), so importing deltastream stays
cheap.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any, Optional

import numpy as np

from deltastream.errors import PublishError, TopicError, error_text
from deltastream.kafka_compat import forbid_auto_create
from deltastream.kafka_config import check_bootstrap_servers, tls_probe

__all__ = ["ensure_topic", "partition_count", "admin_client", "load_kafka",
           "forbid_auto_create"]

log = logging.getLogger(__name__)

#: the broker's default ``max.message.bytes``: a new topic never gets less
_KAFKA_DEFAULT_MESSAGE_BYTES = 1048588


def load_kafka() -> ModuleType:
    """kafka-python (with ``kafka.errors``), imported on first use (its import costs ~0.1 s)."""
    import kafka
    import kafka.errors

    return kafka


def admin_client(bootstrap_servers: Any, timeout: float, client_config: dict) -> Any:
    """A ``KafkaAdminClient`` reaching ``bootstrap_servers`` within ``timeout`` seconds.

    ``client_config`` may hold any kafka-python client settings; those the admin client
    knows (security, SASL, …) are passed on, except ``client_id``. Raises
    :class:`PublishError` when no broker answers in time.
    """
    kafka = load_kafka()
    common = {k: v for k, v in client_config.items()
              if k in kafka.KafkaAdminClient.DEFAULT_CONFIG and k != "client_id"}
    ms = int(timeout * 1000)
    # kafka-python would wait forever on a TLS handshake with a plaintext listener
    problem = tls_probe(bootstrap_servers, common, timeout)
    if problem:
        raise PublishError(f"cannot reach Kafka at {bootstrap_servers!r}: {problem}")
    try:
        return kafka.KafkaAdminClient(bootstrap_servers=bootstrap_servers,
                                      bootstrap_timeout_ms=ms,
                                      request_timeout_ms=max(1000, ms), **common)
    except (kafka.errors.KafkaError, OSError) as e:
        raise PublishError(f"cannot reach Kafka at {bootstrap_servers!r} within "
                           f"{timeout:g} s: {error_text(e)}") from e


def partition_count(admin: Any, topic: str) -> Optional[int]:
    """Partitions of ``topic``, or None when it does not exist (never auto-creates).

    Raises :class:`TopicError` when the broker answers with another error.
    """
    kafka = load_kafka()
    (desc,) = admin.describe_topics([topic])
    code = desc.get("error_code", 0)
    if code == kafka.errors.UnknownTopicOrPartitionError.errno:
        return None
    if code:
        err = kafka.errors.for_code(code)
        raise TopicError(f"topic {topic!r}: broker answered {err.__name__}")
    return len(desc["partitions"])


def _check_args(bootstrap_servers: Any, topic: Any, partitions: Any, timeout: Any) -> None:
    check_bootstrap_servers(bootstrap_servers)
    if isinstance(partitions, (bool, np.bool_)) or not isinstance(partitions, (int, np.integer)):
        raise TypeError(f"partitions: expected an int, got {type(partitions).__name__}")
    if not 1 <= int(partitions) <= 1 << 20:
        raise ValueError(f"partitions: expected 1 ≤ partitions ≤ {1 << 20}, got {partitions}")
    if not isinstance(topic, str) or not topic:
        raise ValueError(f"topic: expected a non-empty str, got {topic!r}")
    if timeout <= 0:
        raise ValueError(f"timeout: expected positive seconds, got {timeout!r}")


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
    _check_args(bootstrap_servers, topic, partitions, timeout)
    kafka = load_kafka()
    admin = admin_client(bootstrap_servers, timeout, client_config)
    try:
        existing = partition_count(admin, topic)
        if existing is None:
            topic_configs = {"max.message.bytes": str(max(max_message_bytes,
                                                          _KAFKA_DEFAULT_MESSAGE_BYTES))}
            topic_configs.update({k: str(v) for k, v in (configs or {}).items()})
            try:
                admin.create_topics({topic: {"num_partitions": partitions,
                                             "replication_factor": replication_factor,
                                             "configs": topic_configs}},
                                    timeout_ms=int(timeout * 1000), wait_for_metadata=True)
                log.info("created topic %r with %d partitions", topic, partitions)
                return partitions
            except kafka.errors.TopicAlreadyExistsError:
                existing = partition_count(admin, topic)  # another trainer created it
                if existing is None:
                    raise TopicError(f"topic {topic!r}: reported as existing but not "
                                     "visible in metadata") from None
            except kafka.errors.KafkaError as e:
                raise TopicError(f"cannot create topic {topic!r} with {partitions} "
                                 f"partitions: {error_text(e)}") from e
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
