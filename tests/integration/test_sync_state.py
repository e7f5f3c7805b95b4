"""The sync daemon never destroys or loses state and recovers by itself (issue 13).

Real broker, real files, real ``deltastream-sync`` processes: damaged state is refused
loudly unless ``--reset-state``; a fresh start on a topic whose old records were deleted
counts them as lost; a full or read-only state disk is counted and never fatal (injected
``ENOSPC``/``EROFS`` always, and a real size-limited tmpfs where the test may mount one);
quarantine lines are not repeated after ``kill -9``; next offsets are committed to a
consumer group without joining it; tables configured up front are served before their
first message.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from kafka import KafkaConsumer, TopicPartition

from consumers.storage.snapshot import read_snapshot
from tests.disk_faults import DiskFault, mount_namespace

from .test_sync import MODEL, assert_tables_equal, daemon_for, free_port, wait_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
THESIS = "four years of my life\n"
GARBAGE = b"\x00garbage that is no msgpack map"


def _args(broker, topic: str, state: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "consumers.sync.cli", "--bootstrap-servers",
            broker.bootstrap_servers, "--model", MODEL, "--topic", topic, "--state-dir",
            str(state), "--summary-interval", "0", *extra]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELTASTREAM_")}
    env["PYTHONPATH"] = str(REPO)
    return env


def _spawn(cmd: list[str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=log,
                                stderr=subprocess.STDOUT)


def _metrics(port: int) -> dict:
    """Samples of the process's /metrics ({} while it is not up)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _stop(proc: subprocess.Popen, log_path: Path) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, log_path.read_text()[-3000:]


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _quarantined(path: Path) -> list[tuple[int, int]]:
    return [(r["partition"], r["offset"]) for r in
            (json.loads(x) for x in path.read_text().splitlines() if x.strip())]


# ----------------------------------------------------------------------------- point 2


def test_damaged_checkpoint_is_refused_and_reset_state_starts_over(broker, feed, tmp_path):
    n = feed.fill(3)
    state = tmp_path / "state"
    ckpt = state / "checkpoint"
    d = daemon_for(broker, feed.topic, state)
    assert d.catch_up(timeout=60)
    d.stop()
    (ckpt / "manifest.json").unlink()
    left = sorted(os.listdir(ckpt))

    r = subprocess.run(_args(broker, feed.topic, state), cwd=REPO, env=_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr  # the exit-code table: unusable state is an input error
    lines = [ln for ln in r.stderr.splitlines() if "cannot load the state" in ln]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert str(ckpt) in lines[0] and "manifest.json is missing" in lines[0]
    assert "--reset-state" in lines[0]
    assert sorted(os.listdir(ckpt)) == left  # refused: nothing removed

    # --reset-state removes the damaged checkpoint (ours) and re-reads the topic
    port = free_port()
    log_path = tmp_path / "reset.log"
    proc = _spawn(_args(broker, feed.topic, state, "--reset-state", "--checkpoint-interval",
                        "0.2", "--metrics-port", str(port), "--metrics-addr", "127.0.0.1"),
                  log_path)
    try:
        wait_for(lambda: _metrics(port).get("deltastream_sync_messages_applied_total") == n,
                 60, "the reset daemon to re-apply the topic", interval=0.1)
        _stop(proc, log_path)
    finally:
        _kill(proc)
    assert "reset_state: removed" in log_path.read_text()
    snap = read_snapshot(ckpt)
    assert snap.offsets == {0: feed.count[0], 1: feed.count[1]}
    assert_tables_equal(snap.tables, feed.expected)

    # a file where the checkpoint directory should be: refused, even with --reset-state
    shutil.rmtree(ckpt)
    ckpt.write_text(THESIS)
    for extra in ([], ["--reset-state"]):
        r = subprocess.run(_args(broker, feed.topic, state, *extra), cwd=REPO, env=_env(),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (extra, r.stderr)  # unusable state: input error
        assert f"{ckpt}: is a file" in r.stderr and "Traceback" not in r.stderr
        assert ckpt.read_text() == THESIS


def test_fresh_start_counts_records_deleted_before_it_as_lost(broker, feed, tmp_path,
                                                              monkeypatch, caplog):
    """A fresh daemon on a topic whose earliest offset is above 0 (retention deleted the
    first records) says so. The embedded broker cannot delete records, so its earliest
    offset is reported as 4 on partition 0 (the records from 4 on are real); against
    Apache Kafka, test_sync's DeleteRecords test covers the real thing."""
    n = feed.fill(3)  # 6 records per partition
    real = KafkaConsumer.beginning_offsets

    def earliest(self, partitions, *a, **k):
        got = real(self, partitions, *a, **k)
        return {tp: max(o, 4) if (tp.topic, tp.partition) == (feed.topic, 0) else o
                for tp, o in got.items()}

    monkeypatch.setattr(KafkaConsumer, "beginning_offsets", earliest)
    d = daemon_for(broker, feed.topic, tmp_path)
    assert d.source == "empty"
    with caplog.at_level(logging.WARNING):
        assert d.catch_up(timeout=60)
    s = d.stats()
    assert s["offsets_lost"] == 1 and s["applied"] == n - 4
    lost = s["lost_ranges"][0]
    assert (lost["partition"], lost["from"], lost["to"], lost["resume"]) == (0, 0, 4, 4)
    assert "offsets [0, 4) are no longer on the broker" in caplog.text
    d.stop()
    # a restart from the checkpoint has nothing missing: nothing more counted
    d2 = daemon_for(broker, feed.topic, tmp_path)
    assert d2.catch_up(timeout=60) and d2.stats()["offsets_lost"] == 0
    d2.stop()


# ----------------------------------------------------------------------------- point 3


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_full_or_read_only_state_disk_is_counted_and_never_fatal(broker, feed, tmp_path,
                                                                 monkeypatch, code):
    state = tmp_path / "state"
    port = free_port()
    d = daemon_for(broker, feed.topic, state, checkpoint_interval=0.05, metrics_port=port,
                   metrics_addr="127.0.0.1")
    feed.fill(2)
    assert d.catch_up(timeout=60)
    assert d.checkpoint()
    ckpts = d.stats()["checkpoints"]
    disk = DiskFault(state, code).install(monkeypatch)
    disk.active = True

    # good records only: checkpoints fail, are counted and retried; serving goes on
    feed.fill(2)
    assert d.catch_up(timeout=60)
    d.run_for(seconds=0.4)
    s = d.stats()
    assert s["write_errors"]["checkpoint"] >= 1 and s["checkpoints"] == ckpts
    assert_tables_equal(d.tables(), feed.expected)

    # a record that must be quarantined: counted in memory, its line kept for the disk
    bad_offset = feed.count[0]
    feed.send(GARBAGE, partition=0, apply=False)
    feed.fill(1)
    assert d.catch_up(timeout=60)
    d.run_for(seconds=0.4)
    s = d.stats()
    assert s["quarantined"] == 1 and s["quarantine_backlog"] == 1
    assert s["write_errors"]["quarantine"] >= 1 and s["checkpoints"] == ckpts
    assert_tables_equal(d.tables(), feed.expected)
    assert disk.hits > 0
    m = _metrics(port)
    assert m['deltastream_sync_write_errors_total{what="quarantine"}'] >= 1
    assert m['deltastream_sync_write_errors_total{what="checkpoint"}'] >= 1
    assert m["deltastream_sync_quarantine_backlog_records"] == 1
    # the checkpoint on disk still holds the old offsets: it never passed the bad record
    assert read_snapshot(state / "checkpoint").offsets[0] <= bad_offset

    # the disk recovers: the line is written, then the checkpoint, without a restart
    disk.active = False

    def recovered():
        d.run_for(seconds=0.2)
        s = d.stats()
        return s["checkpoints"] > ckpts and s["quarantine_backlog"] == 0 and not s["lag_total"]

    wait_for(recovered, 90, "the daemon to write its quarantine line and checkpoint again")
    d.stop()
    assert _quarantined(state / "quarantine.jsonl") == [(0, bad_offset)]
    snap = read_snapshot(state / "checkpoint")
    assert snap.offsets == {0: feed.count[0], 1: feed.count[1]}
    assert_tables_equal(snap.tables, feed.expected)
    d2 = daemon_for(broker, feed.topic, state)
    assert d2.catch_up(timeout=60) and d2.stats()["messages"] == 0
    d2.stop()
    assert _quarantined(state / "quarantine.jsonl") == [(0, bad_offset)]


def test_full_tmpfs_state_disk_with_a_real_process(broker, feed, tmp_path):
    """A real size-limited filesystem (a 64 KiB tmpfs in a private mount namespace, filled
    up before the daemon starts): the daemon keeps applying, counts its failed writes, and
    writes its quarantine line and checkpoint once space is freed."""
    ns = mount_namespace()
    state = tmp_path / "state"
    state.mkdir()
    probe = subprocess.run(ns + ["sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {state}"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {probe.stderr.strip()}")
    n = feed.fill(2)
    port = free_port()
    cli = " ".join(_args(broker, feed.topic, state, "--checkpoint-interval", "0.2",
                         "--metrics-port", str(port), "--metrics-addr", "127.0.0.1"))
    script = (f"mount -t tmpfs -o size=64k tmpfs {state} && "
              f"{{ dd if=/dev/zero of={state}/filler bs=4k 2>/dev/null; true; }} && "
              f"exec {cli}")
    log_path = tmp_path / "sync.log"
    proc = _spawn(ns + ["sh", "-c", script], log_path)
    inside = Path(f"/proc/{proc.pid}/root") / str(state).lstrip("/")  # its mount namespace
    try:
        def failing(what: str, applied: int, quarantined: int):
            def check():
                m = _metrics(port)
                return m.get("deltastream_sync_messages_applied_total") == applied \
                    and m.get("deltastream_sync_quarantined_total") == quarantined \
                    and m.get(f'deltastream_sync_write_errors_total{{what="{what}"}}', 0) >= 1 \
                    and m
            return check

        # good records: applied, every checkpoint fails with ENOSPC (counted, retried)
        m = wait_for(failing("checkpoint", n, 0), 60, "a failed checkpoint", interval=0.1)
        assert m["deltastream_sync_checkpoints_total"] == 0
        assert (inside / "filler").stat().st_size > 32 << 10  # the disk really is full
        # a record that must be quarantined, and more good ones: serving goes on
        bad_offset = feed.count[0]
        feed.send(GARBAGE, partition=0, apply=False)
        n += feed.fill(1)
        wait_for(failing("quarantine", n, 1), 60, "a failed quarantine write", interval=0.1)
        assert proc.poll() is None
        (inside / "filler").unlink()

        def recovered():
            m = _metrics(port)
            return m.get("deltastream_sync_checkpoints_total", 0) >= 1 \
                and m.get("deltastream_sync_quarantine_backlog_records") == 0 \
                and m.get("deltastream_sync_checkpoint_pending_messages") == 0

        wait_for(recovered, 90, "the checkpoint once space was freed", interval=0.2)
        assert _quarantined(inside / "quarantine.jsonl") == [(0, bad_offset)]
        snap = read_snapshot(inside / "checkpoint")
        assert snap.offsets == {0: feed.count[0], 1: feed.count[1]}
        assert_tables_equal(snap.tables, feed.expected)
        _stop(proc, log_path)
    finally:
        _kill(proc)
    text = log_path.read_text()
    assert "No space left on device" in text and "Traceback" not in text


# ----------------------------------------------------------------------------- point 6


def test_quarantine_lines_are_not_repeated_after_kill_9(broker, feed, tmp_path):
    bad = []
    for i in range(5):
        feed.fill(1)
        p = i % 2
        bad.append((p, feed.count[p]))
        feed.send(GARBAGE + bytes([i]), partition=p, apply=False)
    feed.fill(1)  # good records after the last bad one
    total = feed.count[0] + feed.count[1]
    state = tmp_path / "state"
    port = free_port()
    # no checkpoint before the kill: the restart re-reads (and re-quarantines) everything
    cmd = _args(broker, feed.topic, state, "--checkpoint-interval", "3600",
                "--checkpoint-messages", "100000", "--metrics-port", str(port),
                "--metrics-addr", "127.0.0.1")
    proc = _spawn(cmd, tmp_path / "run1.log")
    try:
        wait_for(lambda: _metrics(port).get("deltastream_sync_messages_total") == total,
                 60, "the first run to read every record", interval=0.1)
        assert _metrics(port)["deltastream_sync_quarantined_total"] == 5
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        _kill(proc)
    assert not (state / "checkpoint").exists()
    assert sorted(_quarantined(state / "quarantine.jsonl")) == sorted(bad)

    log2 = tmp_path / "run2.log"
    proc = _spawn(cmd, log2)
    try:
        wait_for(lambda: _metrics(port).get("deltastream_sync_messages_total") == total,
                 60, "the restart to re-read every record", interval=0.1)
        assert _metrics(port)["deltastream_sync_quarantined_total"] == 5  # counted again
        _stop(proc, log2)
    finally:
        _kill(proc)
    assert sorted(_quarantined(state / "quarantine.jsonl")) == sorted(bad)  # each once
    assert_tables_equal(read_snapshot(state / "checkpoint").tables, feed.expected)


# ----------------------------------------------------------------------------- point 13


def test_next_offsets_are_committed_to_a_consumer_group_without_joining(broker, feed,
                                                                       tmp_path):
    feed.fill(3)
    ends = {p: feed.count[p] for p in (0, 1)}

    def committed(group: str) -> dict:
        c = KafkaConsumer(bootstrap_servers=broker.bootstrap_servers, group_id=group,
                          enable_auto_commit=False)
        try:
            return {p: c.committed(TopicPartition(feed.topic, p)) for p in (0, 1)}
        finally:
            c.close()

    for group, state in ((None, "a"), ("predictor-7", "b")):
        kw = {} if group is None else {"group_id": group}
        d = daemon_for(broker, feed.topic, tmp_path / state, **kw)
        assert d.catch_up(timeout=60) and d.checkpoint()
        s = d.stats()
        name = group or f"deltastream-sync.{MODEL}"
        assert s["group_id"] == name and s["group_commits"] >= 1
        assert s["group_commit_errors"] == 0
        assert committed(name) == ends  # what kafka-consumer-groups --describe shows
        d.stop()
    # shards: only the partitions this daemon reads are committed
    d = daemon_for(broker, feed.topic, tmp_path / "c", group_id="shard-1", shards=[1])
    assert d.catch_up(timeout=60) and d.checkpoint()
    assert committed("shard-1") == {0: None, 1: ends[1]}
    d.stop()
    d = daemon_for(broker, feed.topic, tmp_path / "d", group_id="")  # '' disables
    assert d.catch_up(timeout=60) and d.checkpoint()
    s = d.stats()
    assert s["group_id"] is None and s["group_commits"] == 0
    d.stop()


# ----------------------------------------------------------------------------- point 15


def test_tables_configured_up_front_are_served_before_their_first_message(broker, feed,
                                                                          tmp_path):
    d = daemon_for(broker, feed.topic, tmp_path, tables={"user": 8, "item": 4})
    user = d.table("user")
    assert len(user) == 0
    np.testing.assert_array_equal(user.lookup(np.array([1, 2])), np.zeros((2, 8)))
    with pytest.raises(KeyError, match=r"no table 'ads': known tables are \['item', 'user'\]"):
        d.table("ads")
    feed.fill(1)
    assert d.catch_up(timeout=60)
    assert d.table("user") is user and len(user) > 0
    assert_tables_equal(d.tables(), feed.expected)
    d.stop()
