"""DeltaPublisher against a real broker: read back with a raw KafkaConsumer and check every
byte, key, header, partition and the per-partition order; failures surface as PublishError."""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections import defaultdict

import numpy as np
import pytest
from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition

from deltastream import wire
from deltastream.publishing.publisher import (
    DeltaPublisher,
    PublishError,
    TopicError,
    ensure_topic,
)
from deltastream.wire import DeltaBatch, WireError

pytestmark = pytest.mark.integration

# Keep kafka-python's reconnect chatter out of failure reports.
logging.getLogger("kafka").setLevel(logging.CRITICAL)


def read_all(servers: str, topic: str, timeout: float = 20.0) -> list:
    """Every record of ``topic`` up to its current end offsets (assign + seek to the
    beginning; no consumer group)."""
    consumer = KafkaConsumer(bootstrap_servers=servers, enable_auto_commit=False,
                             max_partition_fetch_bytes=4 << 20)
    try:
        parts = consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        end = consumer.end_offsets(tps)
        out: list = []
        deadline = time.monotonic() + timeout
        while any(consumer.position(tp) < end[tp] for tp in tps):
            assert time.monotonic() < deadline, "records did not arrive"
            for records in consumer.poll(timeout_ms=500).values():
                out.extend(records)
        return out
    finally:
        consumer.close()


def expected_message(sent: dict, d: DeltaBatch, row_at: int, tomb_at: int) -> bytes:
    """Encode what the publisher was given for the rows/tombstones ``d`` carries."""
    ids, rows = sent["ids"], sent["rows"]
    order = np.argsort(ids, kind="stable")
    ids, rows = ids[order], rows[order]
    tomb = None
    if d.tombstones is not None:
        tomb = sent["tombstones"][tomb_at:tomb_at + d.tombstones.shape[0]]
    b = DeltaBatch(model=d.model, table=d.table, shard=d.shard, epoch=d.epoch, seq=d.seq,
                   step=sent["step"], ts=sent["ts"], ids=ids[row_at:row_at + d.n],
                   rows=rows[row_at:row_at + d.n], dtype=d.dtype, tombstones=tomb)
    (msg,) = wire.encode(b, max_message_bytes=1 << 24)
    return msg


def test_publish_and_read_back_every_byte(broker, topic_name):
    servers = broker.bootstrap_servers
    assert ensure_topic(servers, topic_name, 3) == 3
    rng = np.random.default_rng(7)
    dtypes = ["f16", "f32", "bf16", "i8", "f16"]
    sent: dict = {}  # (shard, table, step) -> what publish got
    results = []
    epochs = {}
    for shard, dtype in enumerate(dtypes):  # 5 shards on 3 partitions: 0+3 and 1+4 share
        with DeltaPublisher(servers, topic_name, model="ranker", shard=shard, dtype=dtype,
                            max_message_bytes=64 << 10) as pub:
            epochs[shard] = pub.epoch
            assert pub.partition == shard % 3
            for step, (table, n, dim) in enumerate([("user", 50, 16), ("item", 2000, 32),
                                                    ("user", 7, 16)]):
                ids = rng.choice(10**9, size=n, replace=False).astype(np.int64) - 10**8
                rows = (rng.standard_normal((n, dim)) * 3).astype(np.float32)
                tomb = rng.integers(-10**6, 10**6, size=9000 if step == 1 else 3)
                ts = 1_700_000_000_000_000_000 + step
                res = pub.publish(table, ids, rows, step=step, tombstones=tomb, ts=ts)
                sent[(shard, table, step)] = dict(ids=ids, rows=rows, tombstones=tomb,
                                                  step=step, ts=ts)
                results.append((shard, table, step, res))
            if shard == 0:
                split = [r for s, t, _, r in results if s == 0 and t == "item"][0]
                assert split.messages > 3  # 2000 x 32 f16 + 9000 tombstones > 64 KiB
    total = sum(r.messages for *_, r in results)
    records = read_all(servers, topic_name)
    assert len(records) == total

    # offsets reported by the publisher match the records
    by_offset = {(r.partition, r.offset): r for r in records}
    for shard, _table, _step, res in results:
        assert res.done and res.partition == shard % 3
        assert res.offsets is not None and len(res.offsets) == res.messages
        assert res.offsets == sorted(res.offsets)
        for off in res.offsets:
            assert (res.partition, off) in by_offset
    assert sum(r.bytes for *_, r in results) == sum(len(r.value) for r in records)

    seqs = defaultdict(list)
    cursors: dict = defaultdict(lambda: [0, 0])  # (shard, table, step) -> [row, tomb]
    for rec in sorted(records, key=lambda r: (r.partition, r.offset)):
        d = wire.decode(rec.value)
        assert rec.partition == d.shard % 3
        assert rec.key == wire.message_key("ranker", d.table, d.shard)
        assert wire.parse_headers(rec.headers) == {"model": "ranker", "table": d.table,
                                                   "shard": d.shard, "epoch": d.epoch,
                                                   "seq": d.seq}
        assert d.epoch == epochs[d.shard] and d.dtype == dtypes[d.shard]
        seqs[(d.table, d.shard, d.epoch)].append(d.seq)
        key = (d.shard, d.table, d.step)
        cur = cursors[key]
        # every byte: the message equals a fresh encoding of the rows publish was given
        assert rec.value == expected_message(sent[key], d, *cur)
        cur[0] += d.n
        cur[1] += 0 if d.tombstones is None else d.tombstones.shape[0]
    # per partition order: seqs contiguous from 0 per (table, shard, epoch)
    for key, got in seqs.items():
        assert got == list(range(len(got))), key
    for key, s in sent.items():  # all rows and tombstones arrived
        assert cursors[key] == [len(s["ids"]), len(s["tombstones"])], key
    assert len(set(epochs.values())) == len(epochs)


def test_epoch_is_new_per_start_and_seq_restarts(broker, topic_name):
    servers = broker.bootstrap_servers
    ensure_topic(servers, topic_name, 2)
    got = []
    for _ in range(2):
        with DeltaPublisher(servers, topic_name, model="m", shard=1) as pub:
            r1 = pub.publish("t", np.arange(3), np.ones((3, 4)), step=1)
            r2 = pub.publish("t", np.arange(3), np.ones((3, 4)), step=2)
            r3 = pub.publish("other", np.arange(3), np.ones((3, 4)), step=2)
            assert (r1.first_seq, r2.first_seq, r3.first_seq) == (0, 1, 0)
            got.append(pub.epoch)
        stats = pub.stats()  # after close: everything acknowledged
        assert stats["next_seq"] == {"t": 2, "other": 1} and stats["messages"] == 3
        assert stats["acked_messages"] == 3 and stats["pending_messages"] == 0
    assert got[1] > got[0]
    recs = read_all(servers, topic_name)
    assert {r.partition for r in recs} == {1}
    decoded = [wire.decode(r.value) for r in sorted(recs, key=lambda r: r.offset)]
    assert [(d.epoch, d.table, d.seq) for d in decoded] == [
        (got[0], "t", 0), (got[0], "t", 1), (got[0], "other", 0),
        (got[1], "t", 0), (got[1], "t", 1), (got[1], "other", 0)]


def test_torch_tensors_and_wait(broker, topic_name):
    torch = pytest.importorskip("torch")
    servers = broker.bootstrap_servers
    ensure_topic(servers, topic_name, 1)
    rows = torch.randn(100, 8, requires_grad=True) * 100
    ids = torch.arange(100, dtype=torch.int64).flip(0)
    with DeltaPublisher(servers, topic_name, model="m", shard=0) as pub:
        res = pub.publish("emb", ids, rows, step=3, tombstones=torch.tensor([1000]))
        assert res.wait(timeout=10) is res and len(res.offsets) == 1
        res_bf = pub.publish("emb", ids[:5], rows[:5].detach().bfloat16(), step=4)
    recs = sorted(read_all(servers, topic_name), key=lambda r: r.offset)
    d = wire.decode(recs[0].value)
    assert d.dtype == "f16"
    np.testing.assert_array_equal(d.ids, np.arange(100))
    want = rows.detach().flip(0).half().float().numpy()
    np.testing.assert_array_equal(d.rows_f32(), want)
    assert d.tombstones.tolist() == [1000]
    assert res_bf.offsets == [res.offsets[0] + 1]
    np.testing.assert_array_equal(wire.decode(recs[1].value).rows_f32(),
                                  rows[:5].detach().bfloat16().float().flip(0).numpy())


@pytest.mark.gpu
def test_cuda_tensors(broker, topic_name):
    torch = pytest.importorskip("torch")
    servers = broker.bootstrap_servers
    ensure_topic(servers, topic_name, 1)
    rows = torch.randn(64, 16, device="cuda")
    with DeltaPublisher(servers, topic_name, model="m", shard=0) as pub:
        pub.publish("emb", torch.arange(64, device="cuda"), rows, step=0)
    (rec,) = read_all(servers, topic_name)
    np.testing.assert_array_equal(wire.decode(rec.value).rows_f32(),
                                  rows.half().float().cpu().numpy())


def test_nonfinite_rows_and_compression(broker, topic_name):
    servers = broker.bootstrap_servers
    ensure_topic(servers, topic_name, 1)
    rows = np.array([[1.0, np.nan], [np.inf, 2.0]], dtype=np.float32)
    with DeltaPublisher(servers, topic_name, model="m", shard=0, dtype="f32",
                        allow_nonfinite=True, compression="lz4") as pub:
        pub.publish("t", [1, 2], rows, step=0)
    (rec,) = read_all(servers, topic_name)
    got = wire.decode(rec.value).rows_f32()
    assert np.isnan(got[0, 1]) and got[1, 0] == np.inf and got[1, 1] == 2.0


def test_argument_validation(broker, topic_name):
    servers = broker.bootstrap_servers
    ensure_topic(servers, topic_name, 2)
    with pytest.raises(ValueError, match="dtype"):
        DeltaPublisher(servers, topic_name, model="m", shard=0, dtype="f8")
    with pytest.raises(ValueError, match="compression"):
        DeltaPublisher(servers, topic_name, model="m", shard=0, compression="brotli")
    with pytest.raises(ValueError, match="shard"):
        DeltaPublisher(servers, topic_name, model="m", shard=-1)
    with pytest.raises(WireError, match="model"):
        DeltaPublisher(servers, topic_name, model="a/b", shard=0)
    with pytest.raises(ValueError, match="set by DeltaPublisher"):
        DeltaPublisher(servers, topic_name, model="m", shard=0, acks=1)
    with pytest.raises(ValueError, match="max_message_bytes"):
        DeltaPublisher(servers, topic_name, model="m", shard=0, max_message_bytes=100)
    with pytest.raises(ValueError, match="send_timeout"):
        DeltaPublisher(servers, topic_name, model="m", shard=0, send_timeout=0)
    for version in (1, 6):  # v1 is read, never written; v6 does not exist
        with pytest.raises(ValueError, match="wire_version: expected 2 ≤ wire_version ≤ 5"):
            DeltaPublisher(servers, topic_name, model="m", shard=0, wire_version=version)

    pub = DeltaPublisher(servers, topic_name, model="m", shard=0)
    ok_rows = np.ones((2, 4), np.float32)
    cases = [
        (("t", [[1, 2]], ok_rows), {}, ValueError, "ids: expected a 1-D array"),
        (("t", [1.0, 2.0], ok_rows), {}, TypeError, "ids: expected integer ids"),
        (("t", [1, 2], np.ones(2)), {}, ValueError, r"rows: expected shape \[2, dim\]"),
        (("t", [1, 2], np.ones((3, 4))), {}, ValueError, r"rows: expected shape \[2, dim\]"),
        (("t", [1, 2], np.ones((2, 4), int)), {}, TypeError, "rows: expected a float"),
        (("t", [1, 2], [[1.0, np.nan]] * 2), {}, ValueError,
         "2 of 2 rows .* hold inf/NaN .*allow_nonfinite"),
        (("t", [1, 2], [[1.0, 7e4], [0, 0]]), {}, ValueError, "exceeds the f16 range"),
        (("t", [1, 1], ok_rows), {}, WireError, "duplicate ids"),
        (("a/b", [1, 2], ok_rows), {}, WireError, "table"),
        (("", [1, 2], ok_rows), {}, WireError, "table"),
        (("t", [1, 2], ok_rows), {"step": -1}, ValueError, "step"),
        (("t", [1, 2], ok_rows), {"step": 1.5}, TypeError, "step"),
        (("t", [1, 2], ok_rows), {"tombstones": [0.5]}, TypeError, "tombstones"),
        (("t", np.array([2**63], np.uint64), ok_rows[:1]), {}, ValueError, "int64"),
        (("t", [1, 2], ok_rows), {"dtype": "f64"}, WireError, "dtype: expected one of"),
    ]
    for args, kw, exc, match in cases:
        kw.setdefault("step", 0)
        with pytest.raises(exc, match=match):
            pub.publish(*args, **kw)
    assert pub.stats()["messages"] == 0  # nothing was sent by a rejected call
    # one call in i8 (beyond f16's range: refused above in the publisher's f16)
    assert pub.publish("t8", [1, 2], [[1.0, 7e4], [0, 0]], step=0, dtype="i8").messages == 1
    pub.publish("t", [1, 2], ok_rows, step=0)
    with pytest.raises(ValueError, match="table 't' has dim 4"):
        pub.publish("t", [3], np.ones((1, 5)), step=1)
    empty = pub.publish("t", np.zeros(0, np.int64), np.zeros((0, 4)), step=2)
    assert empty.messages == 0 and empty.last_seq == empty.first_seq - 1 == 0
    pub.close()
    pub.close()  # idempotent
    with pytest.raises(PublishError, match="closed"):
        pub.publish("t", [1, 2], ok_rows, step=3)
    i8 = DeltaPublisher(servers, topic_name, model="m", shard=0, dtype="i8",
                        allow_nonfinite=True)
    with pytest.raises(ValueError, match="i8 cannot carry them"):
        i8.publish("t", [1], [[np.inf]], step=0)
    i8.close()


def test_missing_topic_is_an_error_and_not_created(broker, topic_name):
    servers = broker.bootstrap_servers
    with pytest.raises(TopicError, match="does not exist.*ensure_topic"):
        DeltaPublisher(servers, topic_name, model="m", shard=0)
    admin = KafkaAdminClient(bootstrap_servers=servers)
    try:
        assert topic_name not in admin.list_topics()
    finally:
        admin.close()


def test_ensure_topic_idempotent_and_fewer_partitions(broker, topic_name, caplog):
    servers = broker.bootstrap_servers
    assert ensure_topic(servers, topic_name, 2) == 2
    assert ensure_topic(servers, topic_name, 2) == 2
    assert ensure_topic(servers, topic_name, 1) == 2
    with caplog.at_level(logging.WARNING, logger="deltastream.publishing.publisher"):
        assert ensure_topic(servers, topic_name, 4) == 2
    assert "exists with 2 partitions, fewer than the 4" in caplog.text
    with pytest.raises(TopicError, match="fewer than the 4"):
        ensure_topic(servers, topic_name, 4, strict=True)
    with pytest.raises(ValueError, match="partitions"):
        ensure_topic(servers, topic_name, 0)


def _dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_broker_down_at_start_up_is_an_error():
    servers = _dead_address()
    t0 = time.monotonic()
    with pytest.raises(PublishError, match="cannot reach Kafka"):
        DeltaPublisher(servers, "deltas.m", model="m", shard=0, send_timeout=1.0)
    with pytest.raises(PublishError, match="cannot reach Kafka"):
        ensure_topic(servers, "deltas.m", 1, timeout=1.0)
    assert time.monotonic() - t0 < 10


def test_broker_killed_mid_run_raises_publish_error(own_broker, topic_name):
    servers = own_broker.bootstrap_servers
    ensure_topic(servers, topic_name, 1)
    pub = DeltaPublisher(servers, topic_name, model="m", shard=0, send_timeout=1.5)
    pub.publish("t", np.arange(10), np.ones((10, 4)), step=0)
    pub.flush()
    own_broker.stop()
    t0 = time.monotonic()
    with pytest.raises(PublishError) as info:
        ids = np.arange(10, 20)
        pub.publish("t", ids, np.ones((10, 4)), step=1, tombstones=np.array([3, 4]))
        ids[:] = -1  # the caller reuses its buffer: the error still names what was sent
        pub.flush()
    assert time.monotonic() - t0 < 1.5 + 3
    (und,) = info.value.undelivered
    assert (und.table, und.shard, und.first_seq, und.last_seq, und.rows) == ("t", 0, 1, 1, 10)
    # what a trainer needs to resend: the ids (and evicted ids) of that table and shard
    assert und.ids.tolist() == list(range(10, 20))
    assert und.tombstone_ids.tolist() == [3, 4] and und.tombstones == 2
    assert (und.col, und.width) == (0, None)
    assert "shard 0 seq 1..1 (10 rows" in str(info.value)
    # reported once: close does not raise again for the same message
    t0 = time.monotonic()
    pub.close(timeout=0.5)
    assert time.monotonic() - t0 < 3
    stats = pub.stats()
    assert stats["acked_messages"] == 1 and stats["messages"] == 2


@pytest.mark.parametrize("expiry", ["delivery", "buffer"])
def test_slow_broker_backpressure_then_recovery(own_broker, topic_name, expiry):
    """A frozen broker (SIGSTOP) fills the buffer: publish blocks ~send_timeout, then raises
    PublishError naming what was not sent. After it thaws, every seq is either delivered or
    was reported in some PublishError: nothing is lost silently.

    ``delivery``: the oldest message's delivery timeout (= send_timeout) fires first.
    ``buffer``: a longer delivery timeout; publish gives up on the full buffer itself.
    """
    servers = own_broker.bootstrap_servers
    ensure_topic(servers, topic_name, 1)
    timeout = 1.5
    extra = {"delivery_timeout_ms": 8000} if expiry == "buffer" else {}
    pub = DeltaPublisher(servers, topic_name, model="m", shard=0, send_timeout=timeout,
                         buffer_memory=256 << 10, **extra)
    rows = np.ones((1000, 64), np.float32)  # ~136 KB per message: 2 fit in the buffer
    reported: set[int] = set()
    errors = []

    def publish(step):
        try:
            pub.publish("t", np.arange(1000), rows, step=step)
        except PublishError as e:
            errors.append(e)
            for u in e.undelivered:
                reported.update(range(u.first_seq, u.last_seq + 1))

    publish(0)
    pub.flush()
    os.kill(own_broker.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        step = 1
        while not errors and time.monotonic() - t0 < 10 * timeout:
            publish(step)
            step += 1
        elapsed = time.monotonic() - t0
        assert errors, "publish never blocked"
        assert timeout * 0.8 <= elapsed < timeout + 3
        assert pub.stats()["blocked_s"] >= timeout * 0.8
        assert any(u.table == "t" and u.rows == 1000 for u in errors[0].undelivered)
        if expiry == "buffer":
            assert "still full" in str(errors[0])
    finally:
        os.kill(own_broker.pid, signal.SIGCONT)
    for _ in range(5):  # recovery: earlier failures surface once, then publishing works
        publish(step)
        step += 1
    try:
        pub.flush(timeout=10)
    except PublishError as e:
        errors.append(e)
        for u in e.undelivered:
            reported.update(range(u.first_seq, u.last_seq + 1))
    last = pub.publish("t", np.arange(1000), rows, step=step)
    pub.close()
    handed_out = set(range(last.last_seq + 1))
    delivered = {wire.decode(r.value).seq for r in read_all(servers, topic_name)}
    assert last.last_seq in delivered and 0 in delivered
    assert handed_out == delivered | reported, "a seq was neither delivered nor reported"


def test_f16_cast_matches_numpy_bit_for_bit():
    """The publisher's chunked torch cast (used when torch is loaded) rounds exactly like
    numpy's astype (what wire.encode uses): subnormals, ties, the top of the range."""
    torch = pytest.importorskip("torch")
    from deltastream.wire_values import _CAST_CHUNK, to_f16

    assert torch is not None
    rng = np.random.default_rng(3)
    edge = np.array([0.0, -0.0, 65504.0, -65504.0, 65519.99, 2.0**-24, 2.0**-25, 3 * 2.0**-26,
                     6.1e-5, 1 + 2.0**-11, 1 + 3 * 2.0**-11, np.nan, np.inf], dtype=np.float32)
    x = np.concatenate([edge, rng.standard_normal(3 * _CAST_CHUNK + 5).astype(np.float32),
                        (rng.standard_normal(1000) * 1e-6).astype(np.float32)])
    x = x[: x.size // 7 * 7].reshape(-1, 7)
    for arr in (x, x.astype(np.float64), x[:, 1:5]):  # also non-contiguous input
        got = to_f16(arr)
        assert got.dtype == np.float16 and got.shape == arr.shape
        np.testing.assert_array_equal(got.view(np.uint16), arr.astype(np.float16).view(np.uint16))
