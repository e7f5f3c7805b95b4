"""SyncDaemon and deltastream-sync against a real broker, real files and real processes.

Messages are produced with a raw KafkaProducer (key, headers and partition as the
publisher sets them) so tests control seq and epoch exactly: duplicates, gaps, new epochs
and garbage are sent on purpose. The expected tables are built independently by applying
each intended message once, in order, to fresh ServingTables.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from kafka import KafkaProducer

from consumers.serving.table import ServingTable
from consumers.storage.snapshot import read_snapshot, snapshot_exists, write_snapshot
from consumers.sync import SyncDaemon
from consumers.sync.cli import build_parser
from deltastream import wire
from deltastream.publishing.publisher import ensure_topic

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
MODEL = "m"
DIMS = {"user": 8, "item": 4}


class Feed:
    """Produce wire messages with explicit (table, shard, epoch, seq) into a topic, and
    keep the expected tables: each message meant to apply is applied once, in send order."""

    def __init__(self, bootstrap: str, topic: str, partitions: int, *, model: str = MODEL,
                 dims: dict | None = None, seed: int = 0) -> None:
        self.topic, self.partitions, self.model = topic, partitions, model
        self.dims = dict(DIMS if dims is None else dims)
        self.producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=2)
        self.rng = np.random.default_rng(seed)
        self.expected = {t: ServingTable(t, d) for t, d in self.dims.items()}
        self.next_seq: dict[tuple[str, int, int], int] = {}
        self.count = [0] * partitions  # records sent per partition

    def message(self, table: str, shard: int, *, epoch: int = 1, seq: int | None = None,
                n: int = 6, num_shards: int = 2, dtype: str = "f32", ids=None, rows=None,
                tombstones=None, model: str | None = None, dim: int | None = None,
                step: int = 0) -> bytes:
        """Encode one message; ids default to random ids owned by ``shard``."""
        key = (table, shard, epoch)
        if seq is None:
            seq = self.next_seq.get(key, 0)
        self.next_seq[key] = max(self.next_seq.get(key, 0), seq + 1)
        if ids is None:
            ids = np.unique(self.rng.integers(0, 200, n) * num_shards + shard)
        ids = np.asarray(ids, np.int64)
        if rows is None:
            rows = self.rng.standard_normal((ids.size, dim or self.dims[table]))
        batch = wire.DeltaBatch(model=model or self.model, table=table, shard=shard,
                                epoch=epoch, seq=seq, step=step, ts=time.time_ns(), ids=ids,
                                rows=np.asarray(rows, np.float32), dtype=dtype,
                                tombstones=tombstones)
        (msg,) = wire.encode(batch)
        return msg

    def send(self, msg: bytes, *, partition: int, apply: bool = True,
             headers: bool = True) -> None:
        """Send one record; ``apply`` adds it to the expected tables."""
        h = None
        key = None
        if headers:
            try:
                b = wire.decode(msg)
                h = wire.kafka_headers(b)
                key = wire.message_key(b.model, b.table, b.shard)
            except wire.WireError:
                pass
        self.producer.send(self.topic, value=msg, key=key, headers=h, partition=partition)
        self.count[partition] += 1
        if apply:
            b = wire.decode(msg)
            self.expected[b.table].apply(b)

    def publish(self, table: str, shard: int, **kw) -> bytes:
        """Encode, send to ``shard % partitions`` and expect one message."""
        apply = kw.pop("apply", True)
        msg = self.message(table, shard, **kw)
        self.send(msg, partition=shard % self.partitions, apply=apply)
        return msg

    def fill(self, per_stream: int, shards=(0, 1), tables=None, epoch: int = 1,
             num_shards: int = 2) -> int:
        """``per_stream`` messages for every (table, shard), interleaved; mixed dtypes and
        a few tombstones. Returns the number sent."""
        dtypes = ["f32", "f16", "bf16", "i8"]
        sent = 0
        for i in range(per_stream):
            for table in tables or self.dims:
                for shard in shards:
                    tomb = None
                    if i % 5 == 4:
                        tomb = np.unique(self.rng.integers(0, 200, 3) * num_shards + shard)
                        tomb = tomb.astype(np.int64)
                    msg = self.message(table, shard, epoch=epoch, dtype=dtypes[i % 4],
                                       tombstones=tomb, num_shards=num_shards)
                    b = wire.decode(msg)
                    if tomb is not None:
                        # the tracker never sends an id as row and tombstone at once
                        keep = ~np.isin(b.ids, tomb)
                        msg = self.message(table, shard, epoch=epoch, seq=b.seq,
                                           dtype=dtypes[i % 4], ids=b.ids[keep],
                                           rows=b.rows_f32()[keep], tombstones=tomb)
                    self.send(msg, partition=shard % self.partitions)
                    sent += 1
        self.flush()
        return sent

    def flush(self) -> None:
        self.producer.flush(timeout=30)

    def close(self) -> None:
        self.producer.close(timeout=10)


def assert_tables_equal(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for name, t in expected.items():
        g = got[name]
        gi, gr = g.items()
        ei, er = t.items()
        np.testing.assert_array_equal(gi, ei, err_msg=f"table {name}: ids differ")
        np.testing.assert_array_equal(gr, er, err_msg=f"table {name}: rows differ")
        assert g.digest() == t.digest()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def daemon_for(broker, topic, state_dir, **kw) -> SyncDaemon:
    kw.setdefault("summary_interval", 0)
    return SyncDaemon(broker.bootstrap_servers, topic, model=MODEL, state_dir=state_dir, **kw)


# ----------------------------------------------------------------------------- in-process


def test_tables_match_reference_and_restart_resumes_without_reapplying(broker, feed, tmp_path):
    n1 = feed.fill(12)  # 2 tables × 2 shards × 12
    d = daemon_for(broker, feed.topic, tmp_path, checkpoint_messages=10)
    assert d.catch_up(timeout=60)
    assert_tables_equal(d.tables(), feed.expected)
    s = d.stats()
    assert s["messages"] == s["applied"] == n1
    assert s["duplicates"] == s["gaps"] == s["quarantined"] == s["offsets_lost"] == 0
    assert s["rows"] > 0 and s["deleted"] > 0 and s["bytes"] > 0
    assert s["positions"] == {0: feed.count[0], 1: feed.count[1]}
    assert s["checkpoints"] >= n1 // 10  # every 10 records
    assert s["broker"] == "connected"
    assert s["freshness_p50_s"] is not None and 0 <= s["freshness_p50_s"] <= s["freshness_p99_s"]
    d.stop()
    snap = read_snapshot(tmp_path / "checkpoint")
    assert snap.offsets == {0: feed.count[0], 1: feed.count[1]}
    assert_tables_equal(snap.tables, feed.expected)

    n2 = feed.fill(5)
    d2 = daemon_for(broker, feed.topic, tmp_path)
    assert d2.source == "checkpoint"
    before = {k: t.digest() for k, t in d2.tables().items()}
    assert before == {k: t.digest() for k, t in snap.tables.items()}
    assert d2.catch_up(timeout=60)
    s2 = d2.stats()
    # only the new records were read; nothing was reapplied or seen twice
    assert s2["messages"] == s2["applied"] == n2
    assert s2["duplicates"] == 0 and s2["gaps"] == 0
    assert_tables_equal(d2.tables(), feed.expected)
    d2.stop()
    assert s2["checkpoints_total"] > s["checkpoints"]


def test_end_to_end_from_delta_publishers(broker, topic_name, tmp_path):
    """Two trainer shards publish with the real DeltaPublisher (f16 on the wire); the
    daemon serves each id's last published row, f16-rounded, and evicted ids read zero."""
    from deltastream.publishing.publisher import DeltaPublisher

    ensure_topic(broker.bootstrap_servers, topic_name, 2)
    rng = np.random.default_rng(7)
    last: dict[int, np.ndarray] = {}
    evicted: set[int] = set()
    pubs = [DeltaPublisher(broker.bootstrap_servers, topic_name, model=MODEL, shard=s)
            for s in (0, 1)]
    try:
        for step in range(6):
            for s, pub in enumerate(pubs):
                ids = np.unique(rng.integers(0, 100, 20)) * 2 + s
                rows = rng.standard_normal((ids.size, 8)).astype(np.float32)
                tomb = None
                if step == 4:  # evict ids not updated this step
                    tomb = np.array(sorted(i for i in last if i % 2 == s
                                           and i not in set(ids.tolist()))[:5], np.int64)
                    evicted.update(tomb.tolist())
                    for i in tomb.tolist():
                        last.pop(i)
                pub.publish("user", ids, rows, step=step, tombstones=tomb)
                for i, r in zip(ids.tolist(), rows, strict=True):
                    last[i] = r
                    evicted.discard(i)
        for pub in pubs:
            pub.flush()
    finally:
        for pub in pubs:
            pub.close()
    d = daemon_for(broker, topic_name, tmp_path, tables={"user": 8})
    assert d.catch_up(timeout=60)
    s = d.stats()
    assert s["applied"] == 12 and s["gaps"] == s["duplicates"] == s["quarantined"] == 0
    ids = np.array(sorted(last), np.int64)
    want = np.stack([last[i] for i in ids.tolist()]).astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(d.table("user").ids(), ids)
    np.testing.assert_array_equal(d.table("user").lookup(ids), want)
    assert evicted and not d.table("user").contains(np.array(sorted(evicted))).any()
    d.stop()


def test_base_snapshot_bootstraps_tables_offsets_and_seqs(broker, feed, tmp_path):
    feed.fill(6)
    d = daemon_for(broker, feed.topic, tmp_path / "a")
    assert d.catch_up(timeout=60)
    d.stop()
    n2 = feed.fill(3)
    d2 = daemon_for(broker, feed.topic, tmp_path / "b", base=tmp_path / "a" / "checkpoint")
    assert d2.source == "base"
    assert d2.catch_up(timeout=60)
    s = d2.stats()
    assert s["messages"] == s["applied"] == n2 and s["duplicates"] == 0 and s["gaps"] == 0
    assert_tables_equal(d2.tables(), feed.expected)
    d2.stop()
    assert snapshot_exists(tmp_path / "b" / "checkpoint")
    with pytest.raises(ValueError, match="holds no snapshot"):
        daemon_for(broker, feed.topic, tmp_path / "c", base=tmp_path / "nothing")


def test_duplicates_gaps_new_epoch_and_stale(broker, feed, tmp_path):
    ids = np.array([0, 2, 4], np.int64)

    def rows(v):
        return np.full((3, DIMS["user"]), v, np.float32)

    for seq in range(3):
        feed.publish("user", 0, epoch=7, seq=seq, ids=ids, rows=rows(seq))
    # producer retries: same seqs again, different rows that must NOT land
    feed.publish("user", 0, epoch=7, seq=1, ids=ids, rows=rows(100), apply=False)
    feed.publish("user", 0, epoch=7, seq=2, ids=ids, rows=rows(100), apply=False)
    # seqs 3 and 4 lost: a gap, still applied
    feed.publish("user", 0, epoch=7, seq=5, ids=ids, rows=rows(5))
    # the trainer restarted: new epoch, seq from 0
    feed.publish("user", 0, epoch=8, seq=0, ids=ids, rows=rows(80))
    # a zombie of the old epoch: stale, skipped
    feed.publish("user", 0, epoch=7, seq=6, ids=ids, rows=rows(200), apply=False)
    feed.flush()
    d = daemon_for(broker, feed.topic, tmp_path)
    assert d.catch_up(timeout=60)
    s = d.stats()
    assert s["messages"] == 8 and s["applied"] == 5
    assert s["duplicates"] == 2
    assert s["gaps"] == 1 and s["gap_messages"] == 2
    assert s["last_gap"]["missing"] == [3, 4] and s["last_gap"]["table"] == "user"
    assert s["new_epochs"] == 1 and s["stale"] == 1 and s["quarantined"] == 0
    np.testing.assert_array_equal(d.table("user").lookup(ids), rows(80))
    assert_tables_equal({"user": d.table("user")}, {"user": feed.expected["user"]})
    d.stop()


def test_bad_messages_are_quarantined_and_nothing_is_applied(broker, feed, tmp_path, caplog):
    feed.publish("user", 0, seq=0)
    good_rows = feed.expected["user"].items()
    bad = [
        (b"\x00garbage that is no msgpack map", "decode"),
        (feed.message("ads", 0, seq=0, dim=8), "unknown table"),
        (feed.message("user", 0, seq=1, dim=5), "dim"),
    ]
    # a truncated copy of a good message: the CRC/length check refuses it
    ok = feed.message("user", 0, seq=1)
    bad.append((ok[:-7], "decode"))
    feed.send(bad[0][0], partition=0, apply=False)
    # messages of another model are not corrupt: skipped and counted, never quarantined
    for seq in range(3):
        feed.send(feed.message("user", 1, seq=seq, model="other-model"), partition=0,
                  apply=False)
    for value, _ in bad[1:]:
        feed.send(value, partition=0, apply=False)
    feed.publish("user", 0, seq=1)
    feed.flush()
    d = daemon_for(broker, feed.topic, tmp_path, tables={"user": 8})
    with caplog.at_level(logging.WARNING, logger="consumers.sync.daemon"):
        assert d.catch_up(timeout=60)
    s = d.stats()
    assert s["quarantined"] == len(bad) and s["applied"] == 2
    assert s["foreign_model"] == 3 and s["foreign_models"] == {"other-model": 3}
    assert s["gaps"] == 0  # quarantined messages do not advance the seq
    foreign = [r.getMessage() for r in caplog.records if "other-model" in r.getMessage()]
    assert len(foreign) == 1, foreign  # one line, not one per message
    assert "--model 'm'" in foreign[0] and "--model other-model" in foreign[0]
    lines = [json.loads(x) for x in (tmp_path / "quarantine.jsonl").read_text().splitlines()]
    assert [ln["offset"] for ln in lines] == [1, 5, 6, 7]
    assert all(ln["partition"] == 0 for ln in lines)
    for ln, (value, why) in zip(lines, bad, strict=True):
        assert why in ln["reason"], (why, ln["reason"])
        assert ln["first_bytes_hex"] == value[:64].hex()
    assert sorted(d.tables()) == ["user"]  # "ads" never created
    assert len(d.table("user")) > len(good_rows[0])  # the good message after the bad ones
    assert_tables_equal(d.tables(), {"user": feed.expected["user"]})
    d.stop()


def test_shards_filter_reads_only_their_partitions(broker, topic_name, tmp_path):
    ensure_topic(broker.bootstrap_servers, topic_name, 2)
    f = Feed(broker.bootstrap_servers, topic_name, 2, dims={"user": 8})
    try:
        # four trainer shards on two partitions: shards 1 and 3 share partition 1
        for seq in range(4):
            for shard in range(4):
                f.publish("user", shard, seq=seq, num_shards=4, apply=shard == 1)
        f.flush()
        d = daemon_for(broker, topic_name, tmp_path, shards=[1])
        assert d.catch_up(timeout=60)
        s = d.stats()
        assert sorted(s["positions"]) == [1]
        assert s["applied"] == 4 and s["skipped"] == 4  # shard 3's records
        ids = d.table("user").ids()
        assert len(ids) and np.all(ids % 4 == 1)
        assert_tables_equal(d.tables(), f.expected)
        d.stop()
    finally:
        f.close()


def test_stored_offset_beyond_the_log_is_reported_and_nothing_is_applied_twice(
        broker, feed, tmp_path):
    n = feed.fill(4)
    d = daemon_for(broker, feed.topic, tmp_path)
    assert d.catch_up(timeout=60)
    d.stop()
    # pretend the broker lost its log under us: the checkpoint points far past the end
    snap = read_snapshot(tmp_path / "checkpoint")
    write_snapshot(tmp_path / "checkpoint", tables=snap.tables,
                   offsets={p: o + 1000 for p, o in snap.offsets.items()}, seqs=snap.seqs,
                   meta=snap.meta)
    d2 = daemon_for(broker, feed.topic, tmp_path)
    assert d2.catch_up(timeout=60)
    s = d2.stats()
    assert s["offsets_lost"] == 2
    assert {r["partition"] for r in s["lost_ranges"]} == {0, 1}
    assert all(r["resume"] == 0 and "beyond the end" in r["reason"] for r in s["lost_ranges"])
    # everything was read again from the earliest offset, and skipped by seq
    assert s["messages"] == s["duplicates"] == n and s["applied"] == 0
    assert_tables_equal(d2.tables(), feed.expected)
    d2.stop()


def test_metrics_endpoint_serves_prometheus_text(broker, feed, tmp_path):
    n = feed.fill(3)
    port = free_port()
    d = daemon_for(broker, feed.topic, tmp_path, metrics_port=port, metrics_addr="127.0.0.1",
                   checkpoint_interval=0.5)
    assert d.metrics_port == port
    assert d.catch_up(timeout=60)
    d.run_for(seconds=1.2)  # one end-offset probe after catching up
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples["deltastream_sync_messages_applied_total"] == n
    assert samples["deltastream_sync_rows_applied_total"] == d.stats()["rows"]
    assert samples["deltastream_sync_duplicates_total"] == 0
    assert samples['deltastream_sync_partition_lag_messages{partition="0"}'] == 0
    assert samples['deltastream_sync_partition_lag_messages{partition="1"}'] == 0
    assert samples["deltastream_sync_lag_messages"] == 0
    assert samples["deltastream_sync_broker_connected"] == 1
    assert samples["deltastream_sync_freshness_seconds_count"] == n
    assert samples['deltastream_sync_freshness_seconds_bucket{le="+Inf"}'] == n
    assert samples['deltastream_sync_write_errors_total{what="checkpoint"}'] == 0
    assert samples['deltastream_sync_table_rows{table="user"}'] == len(feed.expected["user"])
    assert samples["deltastream_sync_checkpoint_age_seconds"] >= 0
    assert "# TYPE deltastream_sync_gaps_total counter" in text
    d.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_on_apply_hook_sees_every_record_in_order(broker, feed, tmp_path):
    n = feed.fill(3)
    feed.send(b"junk", partition=1, apply=False)
    feed.flush()
    seen = []

    def hook(outcome, partition, offset):
        seen.append((partition, offset, outcome.kind, outcome.ts))
        if len(seen) == 2:
            raise RuntimeError("a broken hook must not stop syncing")

    d = daemon_for(broker, feed.topic, tmp_path, on_apply=hook)
    assert d.catch_up(timeout=60)
    d.stop()
    assert len(seen) == n + 1
    for p in (0, 1):
        offsets = [o for q, o, _, _ in seen if q == p]
        assert offsets == list(range(feed.count[p]))  # partition order, each once
    kinds = [k for _, _, k, _ in seen]
    assert kinds.count("applied") == n and kinds.count("quarantined") == 1
    assert all(ts > 0 for _, _, k, ts in seen if k == "applied")
    assert d.stats()["applied"] == n
    with pytest.raises(TypeError, match="on_apply"):
        daemon_for(broker, feed.topic, tmp_path, on_apply=42)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux affinity")
def test_cpus_pin_the_loop_while_it_runs_and_the_callers_thread_gets_its_cpus_back(
        broker, feed, tmp_path):
    n = feed.fill(2)
    mine = os.sched_getaffinity(0)
    one = {max(mine)}
    seen = set()
    d = daemon_for(broker, feed.topic, tmp_path, cpus=str(max(mine)), checkpoint_messages=2,
                   on_apply=lambda *_: seen.add(frozenset(os.sched_getaffinity(0))))
    assert d.options.cpus == one
    assert d.catch_up(timeout=60)
    assert seen == {frozenset(one)} and d.stats()["applied"] == n
    assert os.sched_getaffinity(0) == mine
    d.stop()
    assert os.sched_getaffinity(0) == mine
    with pytest.raises(ValueError, match="cpus: 'x' in 'x' is not a CPU number"):
        daemon_for(broker, feed.topic, tmp_path, cpus="x")


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux affinity")
def test_cpus_gone_since_the_start_fail_the_run_and_leave_the_daemon_usable(broker, feed,
                                                                           tmp_path):
    feed.fill(1)
    d = daemon_for(broker, feed.topic, tmp_path, cpus=str(min(os.sched_getaffinity(0))))
    ok = d.options.cpus
    object.__setattr__(d.options, "cpus", frozenset({9999}))  # as if taken offline since
    with pytest.raises(ValueError, match="cpus: cannot run on 9999"):
        d.run_for(seconds=0.1)
    assert not d.running
    object.__setattr__(d.options, "cpus", ok)
    assert d.catch_up(timeout=60)  # not left "already running"
    d.stop()


def test_periodic_one_line_summary(broker, feed, tmp_path, caplog):
    n = feed.fill(2)
    d = daemon_for(broker, feed.topic, tmp_path, summary_interval=0.2)
    with caplog.at_level("INFO", logger="consumers.sync"):
        assert d.catch_up(timeout=60)
        d.run_for(seconds=0.5)
    d.stop()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sync ")]
    assert len(lines) >= 2
    assert all("\n" not in ln for ln in lines)
    last = lines[-1]
    assert f"applied={n}" in last and "lag=0" in last and "fresh p50=" in last, last


def test_lookups_from_other_threads_while_running(broker, feed, tmp_path):
    feed.fill(2)
    d = daemon_for(broker, feed.topic, tmp_path)
    t = threading.Thread(target=d.run, daemon=True)
    t.start()
    try:
        assert d.wait_caught_up(timeout=60)
        before = d.table("user").digest()
        n = feed.fill(20)
        ids = np.arange(0, 400, dtype=np.int64)
        deadline = time.monotonic() + 60
        while not d.caught_up():  # lookups while the loop applies in its thread
            assert d.table("user").lookup(ids).shape == (400, DIMS["user"])
            assert time.monotonic() < deadline, "the daemon did not catch up"
        assert d.table("user").digest() != before
        assert_tables_equal(d.tables(), feed.expected)
        assert d.stats()["applied"] == 2 * 4 + n
        with pytest.raises(RuntimeError, match="already running"):
            d.run_for(seconds=0.1)
    finally:
        d.stop()
        t.join(timeout=30)
    assert not t.is_alive()
    assert d.stats()["broker"] == "stopped"
    with pytest.raises(RuntimeError, match="stopped"):
        d.run()


def test_bad_arguments_are_clear(broker, tmp_path):
    bs = broker.bootstrap_servers
    with pytest.raises(ValueError, match="checkpoint_interval"):
        SyncDaemon(bs, "t", model=MODEL, state_dir=tmp_path, checkpoint_interval=0)
    with pytest.raises(ValueError, match="shards"):
        SyncDaemon(bs, "t", model=MODEL, state_dir=tmp_path, shards=[-1])
    with pytest.raises(ValueError, match="tables"):
        SyncDaemon(bs, "t", model=MODEL, state_dir=tmp_path, tables={"user": 0})
    with pytest.raises(TypeError, match="not_a_setting"):
        SyncDaemon(bs, "t", model=MODEL, state_dir=tmp_path, not_a_setting=1)
    with pytest.raises(ValueError, match="model"):
        SyncDaemon(bs, "t", model="", state_dir=tmp_path)


def test_checkpoint_of_another_topic_is_refused(broker, feed, tmp_path):
    feed.fill(1)
    d = daemon_for(broker, feed.topic, tmp_path)
    assert d.catch_up(timeout=60)
    d.stop()
    with pytest.raises(ValueError, match="checkpoint of topic"):
        daemon_for(broker, feed.topic + "-other", tmp_path)


# ----------------------------------------------------------------------------- broker restart


def test_broker_restart_keeps_serving_and_resumes(own_broker, tmp_path):
    bs = own_broker.bootstrap_servers
    topic = "deltas.restart"
    ensure_topic(bs, topic, 2)
    f = Feed(bs, topic, 2)
    f.fill(5)
    d = SyncDaemon(bs, topic, model=MODEL, state_dir=tmp_path, request_timeout=1.0,
                   backoff_max=0.5, probe_interval=0.3, summary_interval=0)
    t = threading.Thread(target=d.run, daemon=True)
    t.start()
    try:
        assert d.wait_caught_up(timeout=60)
        assert_tables_equal(d.tables(), f.expected)
        ids = d.table("user").ids()
        served = d.table("user").lookup(ids)
        f.close()

        own_broker.stop()
        wait_for(lambda: d.stats()["broker"] == "disconnected", 20, "disconnected state")
        # still serving while the broker is down
        np.testing.assert_array_equal(d.table("user").lookup(ids), served)
        time.sleep(1.0)  # a few reconnect attempts with backoff
        assert d.stats()["broker"] in ("disconnected", "connecting")
        assert d.stats()["disconnects"] == 1  # logged and counted once per change

        own_broker.start()  # same port, empty log (in-memory storage)
        ensure_topic(bs, topic, 2)  # the restarted trainer recreates the topic
        f2 = Feed(bs, topic, 2, seed=1)
        f2.expected = f.expected  # the tables continue
        f2.next_seq = f.next_seq  # same trainer epoch: seqs continue, no gap
        n_new = f2.fill(3)
        wait_for(lambda: d.stats()["applied"] == 4 * 5 + n_new, 60, "the new messages")
        s = d.stats()
        assert s["broker"] == "connected"
        assert s["offsets_lost"] >= 1 and s["lost_ranges"]
        assert s["gaps"] == 0 and s["duplicates"] == 0
        assert_tables_equal(d.tables(), f2.expected)
        f2.close()
    finally:
        d.stop()
        t.join(timeout=30)
    snap = read_snapshot(tmp_path / "checkpoint")
    assert_tables_equal(snap.tables, f.expected)


# ----------------------------------------------------------------------------- the CLI


def _cli(*args, env=None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "consumers.sync.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60, env=env, **kw)


def test_cli_help_lists_every_flag():
    out = _cli("--help")
    assert out.returncode == 0
    flags = [o for a in build_parser()._actions for o in a.option_strings if o.startswith("--")]
    for flag in ["--bootstrap-servers", "--topic", "--model", "--state-dir", "--shards",
                 "--tables", "--checkpoint-interval", "--checkpoint-messages",
                 "--metrics-port", "--base", "--log-level"]:
        assert flag in flags
    env_out = _cli("--help-env").stdout  # the variables, one line per flag
    for flag in flags:
        assert flag in out.stdout, flag
        if flag not in ("--help", "--help-env"):  # each flag's own variable
            env = "DELTASTREAM_SYNC_" + flag[2:].upper().replace("-", "_")
            assert re.search(rf"^{flag} +{env}\b", env_out, re.M), env


@pytest.mark.parametrize("args, message", [
    (["--model", "m", "--state-dir", "x"], "--bootstrap-servers"),
    (["--bootstrap-servers", "h:1", "--model", "m", "--state-dir", "x", "--shards", "0,a"],
     "--shards"),
    (["--bootstrap-servers", "h:1", "--model", "m", "--state-dir", "x", "--tables", "user"],
     "name:dim"),
    (["--bootstrap-servers", "h:1", "--model", "m", "--state-dir", "x",
      "--checkpoint-interval", "0"], "positive"),
])
def test_cli_bad_arguments_exit_2(args, message):
    out = _cli(*args)
    assert out.returncode == 2
    assert message in out.stderr


def test_cli_env_defaults_and_sigterm_leaves_checkpoint(broker, feed, tmp_path):
    n = feed.fill(4)
    port = free_port()
    env = dict(os.environ, DELTASTREAM_BOOTSTRAP_SERVERS=broker.bootstrap_servers,
               DELTASTREAM_SYNC_MODEL=MODEL, DELTASTREAM_SYNC_METRICS_PORT=str(port),
               PYTHONPATH=str(REPO))
    log = open(tmp_path / "sync.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "consumers.sync.cli", "--topic", feed.topic,
         "--state-dir", str(tmp_path / "state"), "--metrics-addr", "127.0.0.1",
         "--checkpoint-interval", "60"],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        def applied():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    text = r.read().decode()
            except OSError:
                return False
            for line in text.splitlines():
                if line.startswith("deltastream_sync_messages_applied_total "):
                    return float(line.split()[1]) == n
            return False

        wait_for(applied, 60, "the CLI to apply every message", interval=0.2)
        # checkpoint interval is 60 s: the checkpoint below comes from the SIGTERM path
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    text = (tmp_path / "sync.log").read_text()
    assert "SIGTERM received" in text, text
    snap = read_snapshot(tmp_path / "state" / "checkpoint")
    assert snap.offsets == {0: feed.count[0], 1: feed.count[1]}
    assert snap.meta["model"] == MODEL and snap.meta["topic"] == feed.topic
    assert_tables_equal(snap.tables, feed.expected)


def test_topic_created_after_start_is_picked_up_and_never_auto_created(broker, topic_name,
                                                                        tmp_path):
    d = daemon_for(broker, topic_name, tmp_path, request_timeout=1.0, backoff_max=0.3)
    t = threading.Thread(target=d.run, daemon=True)
    t.start()
    try:
        wait_for(lambda: d.stats()["broker"] == "topic_missing", 30, "topic_missing state")
        time.sleep(0.5)  # a few more metadata requests: none may create the topic
        # the daemon never auto-created it (with the broker's default partition count)
        assert ensure_topic(broker.bootstrap_servers, topic_name, 2) == 2
        f = Feed(broker.bootstrap_servers, topic_name, 2)
        n = f.fill(2)
        f.close()
        wait_for(lambda: d.stats()["applied"] == n, 60, "the messages")
        assert d.stats()["broker"] == "connected" and d.stats()["offsets_lost"] == 0
        assert_tables_equal(d.tables(), f.expected)
    finally:
        d.stop()
        t.join(timeout=30)


def test_starts_and_serves_from_checkpoint_while_the_broker_is_down(own_broker, tmp_path):
    bs = own_broker.bootstrap_servers
    ensure_topic(bs, "deltas.down", 2)
    f = Feed(bs, "deltas.down", 2)
    f.fill(3)
    f.close()
    d = SyncDaemon(bs, "deltas.down", model=MODEL, state_dir=tmp_path, summary_interval=0)
    assert d.catch_up(timeout=60)
    d.stop()
    own_broker.stop()

    d2 = SyncDaemon(bs, "deltas.down", model=MODEL, state_dir=tmp_path, request_timeout=1.0,
                    backoff_max=0.5, summary_interval=0)
    assert_tables_equal(d2.tables(), f.expected)  # serving before any broker contact
    t = threading.Thread(target=d2.run, daemon=True)
    t.start()
    try:
        wait_for(lambda: d2.stats()["broker"] == "disconnected", 20, "disconnected state")
        assert not d2.caught_up()
        ids = f.expected["user"].ids()
        np.testing.assert_array_equal(d2.table("user").lookup(ids),
                                      f.expected["user"].lookup(ids))
    finally:
        t0 = time.monotonic()
        d2.stop()
        t.join(timeout=30)
    assert time.monotonic() - t0 < 10  # stop does not wait for the broker
    assert read_snapshot(tmp_path / "checkpoint").offsets == {0: f.count[0], 1: f.count[1]}


def test_offsets_deleted_by_retention_are_reported_as_lost(broker, feed, tmp_path):
    """Needs DeleteRecords (Apache Kafka, e.g. DELTASTREAM_KAFKA_BOOTSTRAP); the embedded
    broker lacks it, so there the test is skipped."""
    from kafka import TopicPartition
    from kafka.admin import KafkaAdminClient

    feed.fill(3)  # partition 0: user/item seq 0, 1, 2 of shard 0 (6 records)
    d = daemon_for(broker, feed.topic, tmp_path, shards=[0])
    assert d.run_for(seconds=30, messages=2) == 2
    d.stop()
    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap_servers)
    try:
        admin.delete_records({TopicPartition(feed.topic, 0): 4}, timeout_ms=5000)
    except Exception as e:  # the embedded broker drops the connection on DeleteRecords
        pytest.skip(f"broker does not support DeleteRecords: {type(e).__name__}")
    finally:
        admin.close()
    d2 = daemon_for(broker, feed.topic, tmp_path, shards=[0])
    assert d2.catch_up(timeout=60)
    s = d2.stats()
    assert s["offsets_lost"] == 1
    lost = s["lost_ranges"][0]
    assert (lost["partition"], lost["from"], lost["to"], lost["resume"]) == (0, 2, 4, 4)
    assert s["applied"] == 2 and s["gaps"] == 2 and s["gap_messages"] == 2
    d2.stop()
    # a fresh state directory: the deleted records [0, 4) were never seen, so they count
    d3 = daemon_for(broker, feed.topic, tmp_path / "fresh", shards=[0])
    assert d3.catch_up(timeout=60)
    lost = d3.stats()["lost_ranges"]
    assert [(x["partition"], x["from"], x["to"], x["resume"]) for x in lost] == [(0, 0, 4, 4)]
    d3.stop()
