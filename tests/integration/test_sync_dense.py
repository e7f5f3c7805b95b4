"""Dense versions through a real broker into SyncDaemon: served only whole, a missing chunk
(never served, counted), a damaged chunk (quarantined), checkpoint and restart, the
consistent view, and a reader process switching versions while it reads (never a mix)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from consumers.dense_assembly import DenseAssembler
from consumers.serving.dense_shm import DenseReader, dense_file, remove_dense
from consumers.storage.checkpoint import read_checkpoint
from deltastream.dense_wire import (
    DenseChunk,
    chunk_version,
    decode_dense,
    dense_headers,
    dense_key,
    encode_dense,
)

from .test_sync import MODEL, assert_tables_equal, daemon_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def dense_tensors(seed: int, scale: int = 1) -> dict[str, np.ndarray]:
    """A small MLP's dense state (``scale`` multiplies the sizes)."""
    rng = np.random.default_rng(seed)
    return {"mlp.0.weight": rng.standard_normal((32 * scale, 16)).astype(np.float32),
            "mlp.0.bias": rng.standard_normal(32 * scale).astype(np.float32),
            "mlp.2.weight": rng.standard_normal((1, 32 * scale)).astype(np.float32)}


class DenseFeed:
    """Publishes dense versions of shard ``shard`` to a feed's topic (its seq stream)."""

    def __init__(self, feed, shard: int = 0, epoch: int = 1) -> None:
        self.feed, self.shard, self.epoch, self.seq = feed, shard, epoch, 0
        self.sent: list[DenseChunk] = []  # decoded, in send order (the reference)

    def chunks(self, tensors: dict, step: int, *, base_step=None,
               max_bytes: int = 1024) -> list[bytes]:
        """Encode one version into messages (seqs taken from the stream)."""
        cs = chunk_version(tensors, model=MODEL, shard=self.shard, epoch=self.epoch,
                           seq=self.seq, step=step, ts=time.time_ns(), base_step=base_step,
                           max_message_bytes=max_bytes)
        self.seq += len(cs)
        return encode_dense(cs)

    def send(self, msg: bytes, value: bytes | None = None) -> None:
        """Send ``msg`` (or ``value`` in its place, e.g. damaged, under its headers)."""
        c = decode_dense(msg)
        partition = self.shard % self.feed.partitions
        self.feed.producer.send(self.feed.topic, value=msg if value is None else value,
                                key=dense_key(MODEL, self.shard), headers=dense_headers(c),
                                partition=partition)
        self.feed.count[partition] += 1
        self.sent.append(c)

    def second_version_with(self, t1: dict, t2: dict, change) -> None:
        """Version 10 of ``t1`` whole, then version 20 of ``t2`` with ``change(index,
        message)`` sent for each chunk (None: the chunk is lost on the way)."""
        self.version(t1, step=10)
        for i, m in enumerate(self.chunks(t2, step=20)):
            value = change(i, m)
            if value is not None:
                self.send(m, value)
        self.feed.producer.flush()

    def version(self, tensors: dict, step: int, **kw) -> int:
        """Publish one whole version; returns its chunk count."""
        msgs = self.chunks(tensors, step, **kw)
        for m in msgs:
            self.send(m)
        return len(msgs)


def reference(chunks: list[DenseChunk]) -> DenseAssembler:
    """The assembler every chunk applied once, in order, gives."""
    a = DenseAssembler()
    for c in chunks:
        a.offer(c)
    return a


def same(view, tensors: dict) -> bool:
    return sorted(view.tensors) == sorted(tensors) and all(
        np.array_equal(view[k], v) for k, v in tensors.items())


def test_versions_are_served_whole_and_survive_a_restart(broker, feed, tmp_path):
    dense = DenseFeed(feed)
    t1, t2 = dense_tensors(1), dense_tensors(2)
    feed.fill(3, shards=(0, 1))
    assert dense.version(t1, step=100) > 3  # multi-chunk
    feed.publish("user", 0, step=105)
    changed = {"mlp.0.bias": t1["mlp.0.bias"] + 1}
    dense.version(changed, step=110, base_step=100)  # partial, over version 100
    feed.publish("user", 1, step=112)
    feed.producer.flush()
    d = daemon_for(broker, feed.topic, tmp_path / "state")
    assert d.catch_up(timeout=60)
    v = d.dense()
    assert v.version == (1, 110) and same(v, {**t1, **changed})
    assert_tables_equal(d.tables(), feed.expected)
    view = d.consistent()
    assert view.dense is v and view.sparse_steps == {0: 105, 1: 112} and view.within
    assert view.ahead_steps == 2
    assert not d.consistent(max_ahead=1).within and d.consistent(max_ahead=2).within
    s = d.stats()
    assert s["dense_versions"] == 2 and s["dense_version"] == [1, 110]
    assert s["dense_sparse_steps"] == 2 and s["dense_age_steps"] == 2
    assert s["dense_age_s"] is not None and s["quarantined"] == 0
    d.stop()
    dense.version(t2, step=120)  # after the restart: read from the checkpoint's offsets
    feed.producer.flush()
    d2 = daemon_for(broker, feed.topic, tmp_path / "state")
    try:
        assert d2.dense().version == (1, 110)  # restored from the checkpoint
        assert d2.catch_up(timeout=60)
        assert d2.dense().version == (1, 120) and same(d2.dense(), t2)
        assert d2.stats()["dense_duplicates"] == 0  # nothing re-applied
    finally:
        d2.stop()


def test_a_missing_chunk_is_never_served_and_counted(broker, feed, tmp_path):
    dense = DenseFeed(feed)
    t1, t2, t3 = dense_tensors(3), dense_tensors(4), dense_tensors(5)
    dense.second_version_with(t1, t2, lambda i, m: None if i == 1 else m)
    d = daemon_for(broker, feed.topic, tmp_path / "state")
    try:
        assert d.catch_up(timeout=60)
        assert d.dense().version == (1, 10) and same(d.dense(), t1)
        s = d.stats()
        assert s["dense_gaps"] == 1 and s["dense_missing_chunks"] == 1
        assert s["dense_incomplete"] == 1 and s["dense_versions"] == 1
        dense.version(t3, step=30)
        feed.producer.flush()
        assert d.catch_up(timeout=60)
        assert d.dense().version == (1, 30) and same(d.dense(), t3)
    finally:
        d.stop()


def test_a_damaged_chunk_is_quarantined_and_its_version_never_served(broker, feed,
                                                                     tmp_path):
    dense = DenseFeed(feed)
    t1, t2 = dense_tensors(6), dense_tensors(7)

    def damage(i: int, m: bytes) -> bytes:
        if i != 2:
            return m
        bad = bytearray(m)
        bad[len(bad) // 2] ^= 0xFF  # a flipped byte: the CRC catches it
        return bytes(bad)

    dense.second_version_with(t1, t2, damage)
    d = daemon_for(broker, feed.topic, tmp_path / "state")
    try:
        assert d.catch_up(timeout=60)
        assert d.dense().version == (1, 10) and same(d.dense(), t1)
        s = d.stats()
        assert s["quarantined"] == 1 and s["dense_incomplete"] == 1
        lines = (tmp_path / "state" / "quarantine.jsonl").read_text().splitlines()
        assert len(lines) == 1 and "crc" in lines[0].lower()
    finally:
        d.stop()


def _spawn_sync(bootstrap: str, topic: str, state: Path, log_path: Path, delay: float,
                *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = ["-m", "tests.integration.slow_sync", str(delay)] if delay else \
        ["-m", "consumers.sync.cli"]
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [sys.executable, *cmd, "--bootstrap-servers", bootstrap, "--model", MODEL,
             "--topic", topic, "--state-dir", str(state), "--checkpoint-interval", "0.05",
             "--checkpoint-messages", "3", "--summary-interval", "0", "--log-level",
             "DEBUG", *extra], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_kill_9_in_the_middle_of_a_multi_chunk_version(broker, feed, tmp_path):
    """SIGKILL while the daemon is inside a version of many chunks: readers keep the
    previous complete version, and after a restart the state equals a run without the
    crash (dense state and tables)."""
    dense = DenseFeed(feed)
    t1, t2 = dense_tensors(8), dense_tensors(9, scale=4)
    feed.fill(2, shards=(0, 1))
    dense.version(t1, step=10)
    feed.publish("user", 0, step=12)
    first = len(dense.sent)
    n2 = dense.version(t2, step=20)
    assert n2 >= 12
    feed.publish("item", 1, step=21)
    feed.producer.flush()
    state = tmp_path / "state"
    log_path = tmp_path / "sync.log"
    p = _spawn_sync(broker.bootstrap_servers, feed.topic, state, log_path, 0.05,
                    "--share-tables")
    try:
        # wait until the daemon has taken several chunks of version 20, not all
        reader, deadline = None, time.monotonic() + 60
        while time.monotonic() < deadline:
            text = log_path.read_text()
            taken = text.count(" dense taken")  # version 10's first - 1, then 20's
            if taken >= first - 1 + n2 // 2:
                break
            assert p.poll() is None, text[-3000:]
            time.sleep(0.01)
        else:
            raise AssertionError(log_path.read_text()[-3000:])
        reader = DenseReader.open(state, 0, timeout=10)
        assert reader.version == (1, 10) and same(reader.current(), t1)
        os.kill(p.pid, 9)
        p.wait(10)
        assert reader.version == (1, 10)  # the killed daemon's last complete version
        assert not reader.refresh() and same(reader.current(), t1)
        # the last checkpoint holds version 10 served and chunks of version 20 taken
        mid = DenseAssembler.from_state(read_checkpoint(state / "checkpoint").dense)
        assert mid.view().version == (1, 10) and mid.seqs.steps() == {("", 0): 20}
    finally:
        if p.poll() is None:
            p.kill()
    p = _spawn_sync(broker.bootstrap_servers, feed.topic, state, tmp_path / "sync2.log", 0)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                body = json.loads((state / "checkpoint" / "manifest.json").read_text())
            except (OSError, ValueError):
                body = {"offsets": {}}
            if sum(body["offsets"].values()) == sum(feed.count):
                break
            time.sleep(0.1)
        p.send_signal(15)
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.kill()
        remove_dense(state)
    snap = read_checkpoint(state / "checkpoint")
    assert sum(snap.offsets.values()) == sum(feed.count)
    restored = DenseAssembler.from_state(snap.dense)
    ref = reference(dense.sent)
    assert restored.view().version == (1, 20) and same(restored.view(), t2)
    assert restored.state() == ref.state()
    assert_tables_equal(snap.tables, feed.expected)
    assert first < len(dense.sent)


READER = r"""
import json, sys, time
import numpy as np
from consumers.serving.dense_shm import DenseReader
r = DenseReader.open(sys.argv[1], 0, timeout=30)
seen, mixed, reads, held = set(), 0, 0, []
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    r.refresh()
    cur = r.current()
    if len(held) < 3:
        held.append(cur)  # versions kept across later switches must stay whole
    vals = {float(v) for a in cur.tensors.values() for v in np.unique(a)}
    reads += 1
    seen.add(cur.step)
    if vals != {float(cur.step)}:
        mixed += 1
for h in held:
    if {float(v) for a in h.tensors.values() for v in np.unique(a)} != {float(h.step)}:
        mixed += 1
print(json.dumps({"seen": sorted(seen), "mixed": mixed, "reads": reads}))
"""


def test_a_reader_process_never_sees_a_mix_of_two_versions(broker, feed, tmp_path):
    """Every tensor of version s holds only the value s: a reader in another process
    that mixed two versions would see two values."""
    dense = DenseFeed(feed)
    shapes = {"a": (256, 64), "b": (512,), "c": (64, 64)}

    def version(step: int) -> dict:
        return {k: np.full(s, step, np.float32) for k, s in shapes.items()}

    dense.version(version(1), step=1, max_bytes=16384)
    feed.producer.flush()
    d = daemon_for(broker, feed.topic, tmp_path / "state", share_tables=True)
    stop = threading.Event()
    runner = threading.Thread(target=lambda: [d.run_for(seconds=0.2)
                                              for _ in iter(stop.is_set, True)])
    try:
        assert d.catch_up(timeout=60)
        runner.start()
        reader = subprocess.Popen(
            [sys.executable, "-c", READER, str(tmp_path / "state"), "3"], cwd=REPO,
            env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, text=True)
        for step in range(2, 200):
            dense.version(version(step), step=step, max_bytes=16384)
            feed.producer.flush()
            if reader.poll() is not None:
                break
            time.sleep(0.02)
        out = json.loads(reader.communicate(timeout=60)[0])
    finally:
        stop.set()
        if runner.is_alive():
            runner.join(30)
        d.stop()
        remove_dense(tmp_path / "state")
    assert out["mixed"] == 0
    assert len(out["seen"]) >= 3, out  # it did read across switches


def test_a_sharing_daemon_writes_a_version_once(broker, feed, tmp_path):
    """Sharing rounds do not rewrite the shared file: only a new version replaces it."""
    dense = DenseFeed(feed)
    dense.version(dense_tensors(20), step=5)
    feed.producer.flush()
    d = daemon_for(broker, feed.topic, tmp_path / "state", share_tables=True)
    try:
        assert d.catch_up(timeout=60)
        path = dense_file(tmp_path / "state", 0)
        inode = os.stat(path).st_ino
        d.run_for(seconds=0.5)  # several housekeeping rounds
        assert os.stat(path).st_ino == inode
        dense.version(dense_tensors(21), step=6)
        feed.producer.flush()
        assert d.catch_up(timeout=60)
        assert os.stat(path).st_ino != inode
    finally:
        d.stop()
        remove_dense(tmp_path / "state")


def test_a_restart_after_kill_9_shares_no_older_dense_version(broker, feed, tmp_path):
    """A killed daemon shared version 20 but checkpointed none: the next one re-reads the
    topic and would share version 10 on its way; it waits until it has caught up."""
    dense = DenseFeed(feed)
    dense.version(dense_tensors(30), step=10)
    dense.version(dense_tensors(31), step=20)
    feed.producer.flush()
    state = tmp_path / "state"
    p = _spawn_sync(broker.bootstrap_servers, feed.topic, state, tmp_path / "a.log", 0,
                    "--share-tables", "--checkpoint-interval", "3600",
                    "--checkpoint-messages", "1000000")
    try:
        reader = DenseReader.open(state, 0, timeout=30)
        deadline = time.monotonic() + 30
        while reader.version != (1, 20) and time.monotonic() < deadline:
            reader.refresh()
            time.sleep(0.02)
        assert reader.version == (1, 20)
        os.kill(p.pid, 9)
        p.wait(10)
    finally:
        if p.poll() is None:
            p.kill()
    d = daemon_for(broker, feed.topic, state, share_tables=True)
    try:
        assert d.source == "empty" and d.stats()["share_waiting"]
        assert not reader.refresh()  # nothing shared before it caught up
        assert d.catch_up(timeout=60)
        d.run_for(seconds=0.3)  # the round that opens the gate
        assert not d.stats()["share_waiting"]
        reader.refresh()
        assert reader.version == (1, 20) and same(reader.current(), dense_tensors(31))
    finally:
        d.stop()
        remove_dense(state)


def test_a_clean_stop_leaves_no_dense_file_or_dir_behind(broker, feed, tmp_path):
    """A clean stop removes what the daemon shared, as it does for tables (issue 27 item 9:
    nothing of a stopped daemon stays in /dev/shm); a reader opened before keeps its
    version."""
    dense = DenseFeed(feed)
    dense.version(dense_tensors(30), step=5)
    feed.producer.flush()
    state = tmp_path / "state"
    d = daemon_for(broker, feed.topic, state, share_tables=True)
    try:
        assert d.catch_up(timeout=60)
        root = dense_file(state, 0).parent.parent
        reader = DenseReader.open(state, 0, timeout=10)
        before = {n: np.array(reader[n]) for n in reader.names()}
    finally:
        d.stop()
    assert not root.exists(), sorted(str(p) for p in root.rglob("*"))
    assert all(np.array_equal(reader[n], v) for n, v in before.items())
