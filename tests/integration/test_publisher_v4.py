"""Wire v4 (int keys) end to end: a real broker, a SyncDaemon, a replay ``rebuild``."""

from __future__ import annotations

import numpy as np
import pytest
from kafka import KafkaConsumer

from consumers.replay import rebuild
from consumers.sync import SyncDaemon
from deltastream import DeltaPublisher, ensure_topic, wire
from deltastream.wire_codec import FIELD_KEYS

MODEL = "m4"
DIMS = {"user": 8, "user_bias": 1}


def _publish(servers: str, topic: str) -> dict:
    """Three steps of both tables in v4 (f16, the user table's last step as i8), one
    tombstone; returns the rows each id was last sent with."""
    rng = np.random.default_rng(11)
    last: dict = {name: {} for name in DIMS}
    with DeltaPublisher(servers, topic, model=MODEL, shard=0, dtype="f16",
                        wire_version=4) as pub:
        for step in range(3):
            for name, dim in DIMS.items():
                ids = np.unique(rng.integers(0, 60, 25))
                rows = rng.standard_normal((ids.size, dim)).astype(np.float32)
                tomb = np.array([min(last[name])]) if step == 2 and last[name] else None
                pub.publish(name, ids, rows, step=step, tombstones=tomb,
                            dtype="i8" if step == 2 and name == "user" else None)
                if tomb is not None:
                    last[name].pop(int(tomb[0]), None)
                last[name].update(zip(ids.tolist(), rows, strict=True))
        pub.flush()
    return last


@pytest.mark.slow
def test_v4_messages_are_served_and_rebuilt_bit_identically(broker, topic_name, tmp_path):
    servers = broker.bootstrap_servers
    ensure_topic(servers, topic_name, 1)
    last = _publish(servers, topic_name)
    consumer = KafkaConsumer(topic_name, bootstrap_servers=servers, auto_offset_reset="earliest",
                             consumer_timeout_ms=5000, enable_auto_commit=False)
    values = [r.value for r in consumer]
    consumer.close()
    assert len(values) == 6
    for v in values:  # the map header (fixmap up to 15 fields), then key 0 ("v") = 4
        at = 1 if 0x80 <= v[0] <= 0x8F else 3
        assert v[at:at + 2] == bytes([FIELD_KEYS["v"], 4]) and wire.decode(v).table in DIMS

    daemon = SyncDaemon(servers, topic_name, model=MODEL, state_dir=tmp_path / "state",
                        summary_interval=0)
    try:
        assert daemon.catch_up(timeout=60)
        served = daemon.tables()
        for name, rows_by_id in last.items():
            ids = np.array(sorted(rows_by_id), np.int64)
            np.testing.assert_array_equal(served[name].ids(), ids)
            want = np.stack([rows_by_id[i] for i in ids.tolist()])
            # f16 relative 2^-11; the i8 rows max|row| / 254 (+ float32 rounding)
            bound = np.maximum(np.abs(want) * 2.0 ** -11,
                               np.abs(want).max(1, keepdims=True) / 254 * 1.001)
            assert (np.abs(served[name].lookup(ids) - want) <= bound).all(), name
        res = rebuild(servers, topic_name, model=MODEL)
        assert sorted(res.tables) == sorted(served)
        for name, table in served.items():
            ia, ra = table.items()
            ib, rb = res.tables[name].items()
            np.testing.assert_array_equal(ia, ib)
            assert np.array_equal(ra.view(np.uint8), rb.view(np.uint8)), name
        assert res.counters["records"] == 6 and res.counters["quarantined"] == 0
    finally:
        daemon.stop()


def test_residuals_need_a_v4_publisher_and_nothing_is_sent_otherwise(broker, topic_name):
    servers = broker.bootstrap_servers
    ensure_topic(servers, topic_name, 1)
    rows = np.ones((2, 8), np.float32)
    with DeltaPublisher(servers, topic_name, model=MODEL, shard=0) as pub:  # v2
        with pytest.raises(ValueError, match="needs wire_version 4"):
            pub.publish("user", np.array([1, 2]), rows, step=1, dtype="r1")
        assert pub.next_seqs() == {}
        res = pub.publish("user", np.array([1, 2]), rows, step=1)  # the stream is intact
        res.wait(30)
        assert (res.first_seq, res.messages) == (0, 1)
