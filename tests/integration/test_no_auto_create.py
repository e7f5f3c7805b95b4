"""Predictor-side Kafka clients never create a topic: a daemon or replay pointed at a missing
topic (a typo, or a broker restart that lost it) must not make one with the broker's default
partition count, which would silently re-shard the stream."""

from __future__ import annotations

import uuid

import pytest

from consumers.errors import TopicNotFound
from consumers.sync import SyncDaemon
from consumers.topic import TopicReader
from deltastream.publishing.topics import admin_client, partition_count

pytestmark = pytest.mark.integration


def _partitions(servers: str, topic: str):
    admin = admin_client(servers, 10.0, {})
    try:
        return partition_count(admin, topic)
    finally:
        admin.close()


def test_topic_reader_on_a_missing_topic_creates_nothing(broker):
    topic = f"deltas.missing-{uuid.uuid4().hex[:8]}"
    with pytest.raises(TopicNotFound, match=topic):
        TopicReader(broker.bootstrap_servers, topic, timeout=5.0)
    assert _partitions(broker.bootstrap_servers, topic) is None


def test_sync_daemon_on_a_missing_topic_waits_and_creates_nothing(broker, tmp_path):
    topic = f"deltas.missing-{uuid.uuid4().hex[:8]}"
    daemon = SyncDaemon(broker.bootstrap_servers, topic, model="m", state_dir=tmp_path,
                        group_id="")
    try:
        daemon.run_for(seconds=2.0)
        assert daemon.stats()["broker"] == "topic_missing"
    finally:
        daemon.stop()
    assert _partitions(broker.bootstrap_servers, topic) is None


def test_sync_daemon_across_a_broker_restart_does_not_recreate_the_topic(own_broker, tmp_path):
    """The embedded broker is in memory: a restart loses the topic while the daemon is
    assigned to its partitions and polling. Its fetches must not bring the topic back (with
    the broker's default 4 partitions instead of the operator's 2)."""
    from deltastream.publishing.topics import ensure_topic

    servers = own_broker.bootstrap_servers
    topic = f"deltas.restart-{uuid.uuid4().hex[:8]}"
    ensure_topic(servers, topic, 2)
    daemon = SyncDaemon(servers, topic, model="m", state_dir=tmp_path, group_id="")
    try:
        daemon.run_for(seconds=1.5)
        assert daemon.stats()["broker"] == "connected"
        own_broker.stop()
        own_broker.start()  # same port, empty
        daemon.run_for(seconds=6.0)
        assert _partitions(servers, topic) is None
    finally:
        daemon.stop()
