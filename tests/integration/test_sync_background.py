"""The sync daemon writes its checkpoints in the background (issue 12): applying and
lookups go on while a checkpoint is being written; the consumer group sees offsets only
once they are durable; a clean stop waits for the write in flight and writes a final one.

Real broker, real files. The write is kept in flight with the ``checkpoint_hold`` fixture
(the background writer waits on it after the freeze: :mod:`tests.held_checkpoints`) —
nothing of the writing is mocked.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from kafka import KafkaConsumer, TopicPartition

from consumers.storage.snapshot import read_snapshot

from .test_sync import MODEL, assert_tables_equal, daemon_for, wait_for

pytestmark = pytest.mark.integration


def _committed(broker, topic: str) -> dict:
    c = KafkaConsumer(bootstrap_servers=broker.bootstrap_servers,
                      group_id=f"deltastream-sync.{MODEL}", enable_auto_commit=False)
    try:
        return {p: c.committed(TopicPartition(topic, p)) for p in (0, 1)}
    finally:
        c.close()


def test_applying_goes_on_while_a_checkpoint_is_written(broker, feed, tmp_path, checkpoint_hold):
    ckpt = tmp_path / "checkpoint"
    d = daemon_for(broker, feed.topic, tmp_path, checkpoint_interval=0.05,
                   checkpoint_messages=1_000_000)
    feed.fill(3)
    assert d.catch_up(timeout=60) and d.checkpoint()
    first = read_snapshot(ckpt).offsets
    assert first == {0: feed.count[0], 1: feed.count[1]}
    s0 = d.stats()
    assert s0["group_commits"] >= 1 and not s0["checkpoint_writing"]

    checkpoint_hold.clear()  # the next checkpoint is frozen, then held before writing
    loop = threading.Thread(target=d.run, name="sync loop")
    loop.start()
    try:
        feed.fill(2)
        wait_for(lambda: d.stats()["checkpoint_writing"], 30, "a checkpoint in flight")
        feed.fill(3)  # all of these arrive while the checkpoint is being written
        assert d.wait_caught_up(timeout=60)
        s = d.stats()
        assert s["checkpoint_writing"] and s["checkpoints"] == s0["checkpoints"]
        assert s["messages"] == s0["messages"] + 2 * 2 * 5  # 2 tables × 2 shards × 5
        assert s["checkpoint_pending"] > 0  # records since the freeze
        assert_tables_equal(d.tables(), feed.expected)  # lookups served the new rows
        assert read_snapshot(ckpt).offsets == first  # nothing half-written is visible
        assert _committed(broker, feed.topic) == first  # the group waits for the disk

        checkpoint_hold.set()
        wait_for(lambda: d.stats()["checkpoints"] > s0["checkpoints"], 30,
                 "the held checkpoint to be written")
        # the group's offsets never pass the disk's (read the group first: both only
        # move forward, a checkpoint every 0.05 s)
        group = _committed(broker, feed.topic)
        on_disk = read_snapshot(ckpt).offsets
        assert on_disk != first
        assert all(first[p] <= group[p] <= on_disk[p] <= feed.count[p] for p in (0, 1))
    finally:
        checkpoint_hold.set()
        d.stop()
        loop.join(30)
    snap = read_snapshot(ckpt)
    assert snap.offsets == {0: feed.count[0], 1: feed.count[1]}
    assert_tables_equal(snap.tables, feed.expected)


def test_stop_waits_for_the_write_in_flight_then_writes_the_last(broker, feed, tmp_path,
                                                                checkpoint_hold):
    d = daemon_for(broker, feed.topic, tmp_path, checkpoint_interval=0.05,
                   checkpoint_messages=1_000_000)
    feed.fill(2)
    assert d.catch_up(timeout=60) and d.checkpoint()
    checkpoint_hold.clear()
    loop = threading.Thread(target=d.run, name="sync loop")
    loop.start()
    feed.fill(2)
    wait_for(lambda: d.stats()["checkpoint_writing"], 30, "a checkpoint in flight")
    feed.fill(1)
    assert d.wait_caught_up(timeout=60)
    release = threading.Timer(0.5, checkpoint_hold.set)
    release.start()
    t0 = time.monotonic()
    d.stop()
    assert time.monotonic() - t0 >= 0.4  # waited for the held write
    loop.join(30)
    release.join()
    s = d.stats()
    assert not s["checkpoint_writing"] and s["checkpoint_pending"] == 0
    snap = read_snapshot(tmp_path / "checkpoint")
    assert snap.offsets == {0: feed.count[0], 1: feed.count[1]}
    assert_tables_equal(snap.tables, feed.expected)
    assert _committed(broker, feed.topic) == snap.offsets
    np.testing.assert_equal(s["positions"], snap.offsets)
