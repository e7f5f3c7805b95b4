"""DeltaPublisher across a real broker restart: it recovers by itself, never creates the
topic, and every seq it handed out is either delivered in order or named in a PublishError —
so a predictor's SeqTracker sees a gap exactly where a reported message was lost.

The embedded broker keeps data in memory: after the restart the topic is gone until the
operator re-creates it (``ensure_topic``), as one would after rebuilding a cluster.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from consumers.applier import Applier
from consumers.sequencing import SeqTracker
from deltastream import wire
from deltastream.errors import PublishError, TopicError
from deltastream.publishing.publisher import DeltaPublisher, ensure_topic
from deltastream.publishing.topics import admin_client, forbid_auto_create, partition_count
from tests.integration.test_publisher import read_all

pytestmark = pytest.mark.integration

logging.getLogger("kafka").setLevel(logging.CRITICAL)

SEND_TIMEOUT = 2.0
SHARDS = (0, 1)


def _partitions(servers: str, topic: str):
    admin = admin_client(servers, 10.0, {})
    try:
        return partition_count(admin, topic)
    finally:
        admin.close()


class Shard:
    """One publisher and what became of every seq it handed out."""

    def __init__(self, servers: str, topic: str, shard: int) -> None:
        self.pub = DeltaPublisher(servers, topic, model="m", shard=shard,
                                  send_timeout=SEND_TIMEOUT, dtype="f32")
        self.shard = shard
        self.reported: set[int] = set()
        self.errors: list[PublishError] = []
        self.ok_steps: list[int] = []

    def _note(self, e: PublishError) -> None:
        assert e.undelivered, f"a PublishError that names nothing: {e}"
        self.errors.append(e)
        for u in e.undelivered:
            self.reported.update(range(u.first_seq, u.last_seq + 1))

    def publish(self, step: int) -> float:
        """Publish one batch; seconds the call took."""
        ids = np.arange(10) * 2 + self.shard
        t0 = time.monotonic()
        try:
            self.pub.publish("t", ids, np.full((10, 4), float(step)), step=step)
            self.ok_steps.append(step)
        except PublishError as e:
            self._note(e)
        return time.monotonic() - t0

    def flush(self) -> None:
        try:
            self.pub.flush(timeout=10)
        except PublishError as e:
            self._note(e)

    def close(self) -> None:
        try:
            self.pub.close(timeout=10)
        except PublishError as e:
            self._note(e)


def test_publishers_recover_after_broker_restart_and_never_create_topics(own_broker,
                                                                         topic_name):
    servers = own_broker.bootstrap_servers
    assert ensure_topic(servers, topic_name, 2) == 2
    shards = [Shard(servers, topic_name, s) for s in SHARDS]
    for sh in shards:
        sh.publish(0)
        sh.flush()
    assert not any(sh.errors for sh in shards)
    # what a predictor read in each broker lifetime (the broker forgets it on restart)
    lifetimes = [read_all(servers, topic_name)]

    # 1. Outage, then the broker comes back empty; the operator re-creates the topic.
    own_broker.stop()
    # During the outage a publish either returns (its message waits in the producer,
    # retried with backoff) or blocks at most ~send_timeout and raises naming what failed.
    for step in (1, 2):
        for sh in shards:
            assert sh.publish(step) < SEND_TIMEOUT * 2 + 3
    time.sleep(0.5)
    own_broker.start()  # same port, empty: the topic is gone
    assert own_broker.bootstrap_servers == servers
    for step in (3, 4):  # before the operator re-creates the topic
        for sh in shards:
            assert sh.publish(step) < SEND_TIMEOUT * 2 + 3
        time.sleep(0.3)
    assert _partitions(servers, topic_name) is None, "a publisher re-created the topic"
    # had a publisher auto-created it, it would have the broker's default partition count
    # (4 on the embedded broker), and ensure_topic would return that
    assert ensure_topic(servers, topic_name, 2) == 2
    for sh in shards:
        sh.flush()  # what the old producer held is resolved (here: failed, and reported)
    # publishes after the restart are delivered: the failed producer is replaced
    for step in (5, 6, 7):
        for sh in shards:
            sh.publish(step)
            sh.flush()
    for sh in shards:
        assert sh.ok_steps[-3:] == [5, 6, 7] and sh.errors, (sh.shard, sh.errors)
        assert sh.pub.stats()["reconnects"] == 1
    lifetimes.append(read_all(servers, topic_name))

    # 2. A quick restart while publishing goes on (a trainer that never flushes): a
    # message's failure surfaces in the next publish, the one after sends on a new producer.
    own_broker.stop()
    own_broker.start()
    assert ensure_topic(servers, topic_name, 2) == 2
    for step in range(8, 40):
        for sh in shards:
            sh.publish(step)
        if all(sh.ok_steps[-1] == step and sh.pub.stats()["reconnects"] == 2 for sh in shards):
            break
        time.sleep(0.3)
    recovered = step
    for step in range(recovered + 1, recovered + 4):
        for sh in shards:
            sh.publish(step)
        time.sleep(0.1)
    for sh in shards:
        sh.flush()
        assert sh.ok_steps[-4:] == list(range(recovered, recovered + 4)), (sh.shard, sh.errors)
        assert sh.pub.stats()["reconnects"] == 2
        sh.close()
    assert _partitions(servers, topic_name) == 2
    lifetimes.append(read_all(servers, topic_name))

    # One predictor across all three broker lifetimes: per shard, one epoch, seqs in
    # order, every seq delivered or reported, and its gaps are exactly the reported losses.
    applier = Applier("m", {}, SeqTracker())
    for sh in shards:
        seqs, gaps = [], set()
        for records in lifetimes:
            for r in records:  # read_all keeps each partition's offset order
                b = wire.decode(r.value)
                assert r.partition == b.shard % 2
                if b.shard != sh.shard:
                    continue
                assert b.epoch == sh.pub.epoch  # the stream continued: no new epoch
                seqs.append(b.seq)
                out = applier.process(r.value, r.headers)
                assert out.kind == "applied", out
                if out.gap:
                    gaps.update(range(out.gap[0], out.gap[1] + 1))
        last = sh.pub.stats()["next_seq"]["t"] - 1
        assert seqs == sorted(set(seqs)) and seqs[0] == 0 and seqs[-1] == last, seqs
        missing = set(range(last + 1)) - set(seqs)
        assert missing and missing <= sh.reported, (sh.shard, missing, sh.reported)
        assert gaps == missing


def test_no_client_asks_the_broker_to_create_topics(own_broker, topic_name):
    """kafka-python 3.0 ignores allow_auto_create_topics in its metadata requests; the
    embedded broker then creates the topic with 4 partitions. forbid_auto_create fixes it."""
    from kafka import KafkaProducer

    servers = own_broker.bootstrap_servers
    p = KafkaProducer(bootstrap_servers=servers, allow_auto_create_topics=False,
                      max_block_ms=1500)
    try:
        forbid_auto_create(p)
        with pytest.raises(Exception, match="metadata"):
            p.partitions_for(topic_name)
    finally:
        p.close(timeout=1)
    assert _partitions(servers, topic_name) is None
    with pytest.raises(TopicError, match="auto-creation"):
        forbid_auto_create(object())
