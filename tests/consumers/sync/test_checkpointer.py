"""Checkpointer and FailureLog: write failures are counted, logged rate-limited, retried with
backoff, and a checkpoint never passes an unwritten quarantine line (real files; the
failures are injected at the OS-call level)."""

from __future__ import annotations

import errno
import logging
import threading
import time

import numpy as np
import pytest

from consumers.quarantine import Quarantine
from consumers.serving.table import ServingTable
from consumers.storage.checkpoint import CheckpointStore
from consumers.storage.snapshot import read_snapshot
from consumers.sync.checkpointer import RETRY_MAX_S, Checkpointer
from consumers.sync.failures import FailureLog
from tests.disk_faults import DiskFault


def test_failure_log_counts_every_failure_and_logs_rate_limited(caplog):
    flog = FailureLog(("quarantine", "checkpoint"), interval=3600)
    assert flog.counts() == {"quarantine": 0, "checkpoint": 0}
    with caplog.at_level(logging.INFO, logger="consumers.sync.failures"):
        for i in range(50):
            flog.failed("checkpoint", f"disk full #{i}")
        assert flog.failing("checkpoint") and not flog.failing("quarantine")
        flog.recovered("checkpoint", "checkpoint works again")
        flog.recovered("checkpoint", "checkpoint works again")  # logged once
        flog.failed("checkpoint", "full again")
    msgs = [r.getMessage() for r in caplog.records]
    assert flog.counts() == {"quarantine": 0, "checkpoint": 51}
    assert len(msgs) == 3, msgs  # first failure, recovery (with its count), next failure
    assert "disk full #0" in msgs[0] and "write_errors['checkpoint']" in msgs[0]
    assert msgs[1] == "checkpoint works again (after 50 failures)"
    assert "full again" in msgs[2]
    with pytest.raises(ValueError):
        FailureLog(interval=0)


def _setup(tmp_path, interval: float = 0.01):
    store = CheckpointStore(tmp_path / "state" / "checkpoint")
    quarantine = Quarantine(tmp_path / "state" / "quarantine.jsonl")
    flog = FailureLog(("quarantine", "checkpoint"))
    ck = Checkpointer(store, quarantine, flog, None, interval=interval, messages=10)
    t = ServingTable("user", 4)
    t.upsert(np.arange(5), np.ones((5, 4)))
    return ck, quarantine, flog, {"user": t}


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EIO])
def test_failed_checkpoints_back_off_and_recover(tmp_path, monkeypatch, code):
    ck, _, flog, tables = _setup(tmp_path)
    assert ck.write(tables, {0: 1}, {}, {}) is not None
    disk = DiskFault(tmp_path / "state", code).install(monkeypatch)
    disk.active = True
    delays = []
    for i in range(14):
        t0 = time.monotonic()
        assert ck.write(tables, {0: 2 + i}, {}, {}) is None  # never raises
        delays.append(ck.retry_at - t0)
        # backing off: not due, however many records (asked before retry_at: a 10 ms
        # backoff may have passed by now on a loaded machine)
        assert not ck.due(100, True, ck.retry_at - 1e-3)
    want = [min(RETRY_MAX_S, 0.01 * 2 ** k) for k in range(14)]
    assert delays == pytest.approx(want, abs=0.05) and want[-1] == RETRY_MAX_S
    assert flog.counts()["checkpoint"] == 14
    disk.active = False
    assert ck.write(tables, {0: 99}, {}, {}) is not None and ck.retry_at is None
    assert read_snapshot(tmp_path / "state" / "checkpoint").offsets == {0: 99}
    assert not flog.failing("checkpoint")


def test_checkpoint_waits_for_unwritten_quarantine_lines(tmp_path, monkeypatch):
    ck, quarantine, flog, tables = _setup(tmp_path)
    assert ck.write(tables, {0: 1}, {}, {}) is not None
    disk = DiskFault(tmp_path / "state" / "quarantine.jsonl", errno.EROFS).install(monkeypatch)
    disk.active = True  # only the quarantine file fails: the checkpoint alone could be written
    assert not quarantine.add(0, 5, "bad", b"x")
    assert ck.write(tables, {0: 9}, {}, {}) is None
    assert flog.counts()["quarantine"] == 1 and flog.counts()["checkpoint"] == 0
    assert read_snapshot(tmp_path / "state" / "checkpoint").offsets == {0: 1}  # held back
    disk.active = False  # write() itself does not wait for the backoff (due() does)
    assert ck.write(tables, {0: 9}, {}, {}) is not None
    assert [r["offset"] for r in quarantine.read()] == [5]
    assert read_snapshot(tmp_path / "state" / "checkpoint").offsets == {0: 9}


def test_group_commits_pause_after_a_failure(tmp_path):
    from consumers.sync.group_offsets import GroupCommitter, default_group_id
    from consumers.sync.options import SyncOptions

    o = SyncOptions("127.0.0.1:1", "deltas.m", "m", tmp_path, request_timeout=0.5)
    gc = GroupCommitter(o, default_group_id("m"))
    assert gc.group_id == "deltastream-sync.m"
    assert gc.commit({}) is True  # nothing to commit
    t0 = time.monotonic()
    assert gc.commit({0: 5}) is False and gc.errors == 1 and gc.last_error
    assert gc.commit({0: 6}) is False and gc.errors == 1  # paused: no second wait
    assert time.monotonic() - t0 < 30
    gc.close()
    with pytest.raises(ValueError, match="group_id"):
        GroupCommitter(o, "")


# ----------------------------------------------------------------------------- background


class _RecordingCommitter:
    """Stands in for the consumer group (not under test): records, at each commit, the
    offsets the checkpoint on disk holds at that moment."""

    group_id, errors, commits, last_error = "g", 0, 0, None

    def __init__(self, ckpt_dir) -> None:
        self.ckpt_dir, self.seen = ckpt_dir, []

    def commit(self, offsets) -> bool:
        self.seen.append((dict(offsets), read_snapshot(self.ckpt_dir).offsets))
        self.commits += 1
        return True

    def close(self) -> None:
        pass


def _disk_offsets(tmp_path) -> dict:
    return read_snapshot(tmp_path / "state" / "checkpoint").offsets


def _digests(tables) -> dict:
    return {n: t.digest() for n, t in tables.items()}


def test_the_loop_goes_on_while_a_checkpoint_is_written(tmp_path, checkpoint_hold):
    store = CheckpointStore(tmp_path / "state" / "checkpoint")
    committer = _RecordingCommitter(store.path)
    ck = Checkpointer(store, Quarantine(tmp_path / "state" / "q.jsonl"),
                      FailureLog(("quarantine", "checkpoint")), committer,  # type: ignore
                      interval=0.01, messages=1000)
    t = ServingTable("user", 4)
    t.upsert(np.arange(5), np.ones((5, 4)))
    tables = {"user": t}
    assert ck.ready() and ck.checkpoint(tables, {0: 5}, {}, {"n": 1}) and ck.total == 1
    t.upsert(np.arange(5, 10), np.full((5, 4), 2.0))
    ck.note(5)
    frozen = _digests(tables)
    checkpoint_hold.clear()  # the next write stays in flight until released
    assert ck.ready(wait=False)
    assert ck.checkpoint(tables, {0: 10}, {}, {"n": 2}, commit={0: 10}, wait=False)
    assert ck.busy and ck.pending == 0 and not ck.dirty
    for i in range(20):  # applying goes on meanwhile: records, rows, deletes
        t.upsert(np.arange(100 + i * 10, 110 + i * 10), np.full((10, 4), 3.0 + i))
        t.delete(np.array([i % 10]))
        ck.note()
        assert ck.settle() is None and not ck.due_now() and not ck.ready(wait=False)
    assert ck.busy and ck.total == 1 and ck.written == 1 and committer.seen == []
    assert read_snapshot(store.path).offsets == {0: 5}  # the previous one, untouched
    checkpoint_hold.set()
    assert ck.ready()  # waits for it, then counts it
    assert ck.total == 2 and ck.written == 2 and ck.pending == 20 and ck.dirty
    snap = read_snapshot(store.path)
    assert snap.offsets == {0: 10} and snap.meta == {"n": 2}
    assert _digests(snap.tables) == frozen  # the state of the freeze, not of now
    # the group saw the offsets only once they were on disk
    assert committer.seen == [({0: 10}, {0: 10})]
    # due once the interval has passed since that one ended (it may have ended < 10 ms ago)
    assert ck.due_now(time.monotonic() + ck.interval)
    assert ck.checkpoint(tables, {0: 30}, {}, {"n": 3})
    assert _digests(read_snapshot(store.path).tables) == _digests(tables)
    ck.close()


def test_records_past_checkpoint_messages_wait_for_the_one_in_flight(tmp_path, checkpoint_hold):
    ck, _, _, tables = _setup(tmp_path)  # messages=10
    checkpoint_hold.clear()
    assert ck.checkpoint(tables, {0: 1}, {}, {}, wait=False)
    ck.note(9)
    assert not ck.due_now(time.monotonic() + 60)  # interval passed, but one in flight
    ck.note()
    assert ck.due_now()  # 10 pending: due although one is in flight
    timer = threading.Timer(0.3, checkpoint_hold.set)
    timer.start()
    t0 = time.monotonic()
    assert ck.ready(wait=False)  # backpressure: waits for the held write
    assert time.monotonic() - t0 >= 0.25 and not ck.busy and ck.total == 1
    assert ck.checkpoint(tables, {0: 11}, {}, {}) and ck.total == 2 and ck.pending == 0
    timer.join()
    ck.close()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_failed_background_checkpoint_gives_its_records_back(tmp_path, monkeypatch, code, checkpoint_hold):
    ck, _, flog, tables = _setup(tmp_path)
    assert ck.checkpoint(tables, {0: 1}, {}, {}) and ck.total == 1
    ck.note(3)
    disk = DiskFault(tmp_path / "state", code).install(monkeypatch)
    disk.active = True
    checkpoint_hold.clear()
    assert ck.checkpoint(tables, {0: 4}, {}, {}, wait=False) and ck.pending == 0
    ck.note(2)
    checkpoint_hold.set()
    assert ck.ready() and ck.total == 1  # failed: counted, nothing committed
    assert ck.pending == 5 and ck.dirty and flog.counts()["checkpoint"] == 1
    # backing off until retry_at (asked at a fixed instant: a 10 ms backoff may have
    # passed by now on a loaded machine)
    assert ck.retry_at is not None and not ck.due_now(ck.retry_at - 1e-3)
    assert read_snapshot(tmp_path / "state" / "checkpoint").offsets == {0: 1}
    disk.active = False
    time.sleep(max(0.0, ck.retry_at - time.monotonic()))
    assert ck.due_now() and ck.checkpoint(tables, {0: 6}, {}, {})
    assert ck.total == 2 and ck.pending == 0 and ck.retry_at is None
    assert _disk_offsets(tmp_path) == {0: 6}
    assert ck.last is not None and ck.last["kind"] == "base"  # changes taken were lost
    ck.close()


def test_no_checkpoint_starts_past_an_unwritten_quarantine_line(tmp_path, monkeypatch):
    ck, quarantine, flog, tables = _setup(tmp_path)
    assert ck.checkpoint(tables, {0: 1}, {}, {})
    disk = DiskFault(tmp_path / "state" / "quarantine.jsonl", errno.ENOSPC).install(
        monkeypatch)
    disk.active = True
    assert not quarantine.add(0, 3, "bad", b"x")
    ck.note(4)
    assert not ck.checkpoint(tables, {0: 5}, {}, {}, wait=False)
    assert not ck.busy and ck.pending == 4 and ck.dirty  # nothing frozen, nothing lost
    assert flog.counts()["quarantine"] == 1 and _disk_offsets(tmp_path) == {0: 1}
    ck.close()
