"""The Kafka producer behind a :class:`~deltastream.publishing.publisher.DeltaPublisher`:
made, checked, and replaced when it is wedged.

kafka-python's idempotent producer retries with backoff within its delivery timeout, which
rides out a broker that is slow or briefly away. It does not survive a broker that lost
its producer state (a restart of an in-memory broker, or a cluster rebuilt): the next
produce fails with ``UnknownProducerIdError``, the epoch bump that should recover is
refused, and from then on the producer fails every message it is given. So a producer that
failed a delivery, or whose transaction manager reports a fatal error, is replaced by a
fresh one (:meth:`ProducerLink.replace`) — after the topic has been checked through the
admin API, so a publisher never sends to a topic that is gone.

Topics are never created here: every producer goes through
:func:`~deltastream.publishing.topics.forbid_auto_create` before its first metadata request.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

from deltastream.errors import PublishError, TopicError, error_text
from deltastream.publishing.topics import (
    admin_client,
    forbid_auto_create,
    load_kafka,
    partition_count,
)

__all__ = ["ProducerLink"]

log = logging.getLogger(__name__)


class ProducerLink:
    """One ``KafkaProducer`` at a time for ``topic``, replaced when it is wedged.

    Args:
        bootstrap_servers: Kafka bootstrap servers.
        topic: the topic the publisher sends to (never created here).
        config: ``KafkaProducer`` settings (besides ``bootstrap_servers``).
        client_config: the caller's own client settings (security, SASL, …), also used
            for the admin client that checks the topic.

    ``generation`` counts producers made (1 for the first); pass it to :meth:`mark_failed`
    from a delivery errback, so a failure of an old producer does not condemn a new one.
    """

    def __init__(self, bootstrap_servers: Any, topic: str, config: dict,
                 client_config: dict) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.config = dict(config)
        self.client_config = dict(client_config)
        self.producer: Any = None
        self.generation = 0
        #: producers replaced after the first
        self.replacements = 0
        self._failed_generation = -1

    def topic_partitions(self, timeout: float) -> Optional[int]:
        """Partitions of the topic (admin API, never auto-creates), None when it does not
        exist. Raises :class:`PublishError` when the broker cannot be reached in time,
        :class:`TopicError` when it answers with an error."""
        admin = admin_client(self.bootstrap_servers, timeout, self.client_config)
        try:
            return partition_count(admin, self.topic)
        finally:
            admin.close()

    def connect(self, timeout: float) -> Optional[int]:
        """Make a new producer (the old one must be closed) and load the topic's metadata.

        Returns the partition count the producer sees. Raises :class:`PublishError` when
        no broker answers within ``timeout`` seconds, :class:`TopicError` when topic
        auto-creation cannot be turned off.
        """
        kafka = load_kafka()
        ms = max(1, int(timeout * 1000))
        # Only the start-up wait is bounded by what is left of the caller's time; the
        # producer keeps its own max_block_ms for later sends.
        config = dict(self.config, bootstrap_timeout_ms=min(ms, self.config.get(
            "bootstrap_timeout_ms", ms)))
        producer = None
        try:
            producer = kafka.KafkaProducer(bootstrap_servers=self.bootstrap_servers, **config)
            forbid_auto_create(producer)
            seen = producer.partitions_for(self.topic)
        except (kafka.errors.KafkaError, OSError) as e:
            if producer is not None:
                producer.close(timeout=0)
            raise PublishError(f"cannot start a Kafka producer for {self.bootstrap_servers!r}: "
                               f"{error_text(e)}") from e
        except TopicError:  # from forbid_auto_create: never use such a producer
            producer.close(timeout=0)
            raise
        self.producer = producer
        self.generation += 1
        return None if seen is None else len(seen)

    def mark_failed(self, generation: int) -> None:
        """A message of producer ``generation`` failed (called on the sender thread)."""
        self._failed_generation = generation

    def wedged(self) -> bool:
        """True when there is no producer, or it failed a delivery or is in a fatal state."""
        if self.producer is None or self._failed_generation == self.generation:
            return True
        manager = getattr(self.producer, "_transaction_manager", None)
        return manager is not None and bool(manager.has_fatal_error())

    def replace(self, timeout: float, partitions: int, partition: int) -> None:
        """Close the current producer and connect a new one within ``timeout`` seconds,
        once the topic exists and has ``partition`` (``partitions`` when the publisher
        started: another count is logged).

        The caller has let the old producer's messages resolve (a new producer's messages
        must not overtake them). Raises :class:`PublishError` saying why not, leaving the
        link wedged so the next call tries again.
        """
        deadline = time.monotonic() + timeout
        self.close()
        count = self.topic_partitions(max(0.001, deadline - time.monotonic()))
        if count is None:
            raise PublishError(f"topic {self.topic!r} does not exist on "
                               f"{self.bootstrap_servers!r} (was the broker reset?); the "
                               f"publisher never creates it: re-create it with ensure_topic("
                               f"..., {self.topic!r}, partitions={partitions})")
        if count <= partition:
            raise PublishError(f"topic {self.topic!r} has {count} partitions now, the "
                               f"publisher sends to partition {partition} (of {partitions} "
                               "when it started); re-create the topic with that many")
        if count != partitions:
            log.warning("topic %r has %d partitions now, %d when the publisher started",
                        self.topic, count, partitions)
        self.connect(max(0.001, deadline - time.monotonic()))
        self.replacements += 1
        log.info("producer for %r replaced (generation %d)", self.topic, self.generation)

    def close(self, timeout: float = 1.0) -> None:
        """Close the current producer (if any), abandoning what it could not send in
        ``timeout`` seconds (its futures fail)."""
        producer, self.producer = self.producer, None
        if producer is None:
            return
        kafka = load_kafka()
        try:
            producer.close(timeout=timeout)
        except kafka.errors.KafkaError:
            # close() flushes first and raises while a batch is still awaiting its
            # delivery timeout; abandon them (they were reported) and stop the sender.
            sender = getattr(producer, "_sender", None)
            if sender is not None:
                sender.force_close()
            producer._closed = True
            log.warning("producer for %s closed with undelivered messages", self.topic)
