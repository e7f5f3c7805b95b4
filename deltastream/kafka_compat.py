"""Work-arounds for kafka-python behaviour that both the trainer and the predictor side need.

Torch-free and kafka-free at import time (it only touches client objects it is given).
"""

from __future__ import annotations

from typing import Any

from deltastream.errors import TopicError

__all__ = ["forbid_auto_create"]


def forbid_auto_create(client: Any) -> None:
    """Make every metadata request of a kafka-python ``KafkaProducer`` or ``KafkaConsumer``
    say ``allow_auto_topic_creation=False``.

    kafka-python 3.0 accepts ``allow_auto_create_topics=False`` but does not hand it to the
    cluster metadata object that builds the requests, so they ask the broker to create a
    missing topic — with the broker's default partition count (4 on the embedded broker),
    e.g. when a broker restart lost the topic. This sets the flag where the requests read
    it. Raises :class:`TopicError` when that object cannot be found (kafka-python internals
    moved: then the client is not known to be safe).
    """
    cluster = getattr(client, "_metadata", None)  # KafkaProducer
    if cluster is None:
        cluster = getattr(getattr(client, "_client", None), "cluster", None)  # KafkaConsumer
    config = getattr(cluster, "config", None)
    if not isinstance(config, dict) or "allow_auto_create_topics" not in config:
        raise TopicError(f"cannot turn off topic auto-creation of {type(client).__name__} "
                         "(kafka-python internals changed); refusing to use it")
    config["allow_auto_create_topics"] = False
