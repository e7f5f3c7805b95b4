"""Checkpointer and FailureLog: write failures are counted, logged rate-limited, retried with
backoff, and a checkpoint never passes an unwritten quarantine line (real files; the
failures are injected at the OS-call level)."""

from __future__ import annotations

import errno
import logging
import time

import numpy as np
import pytest

from consumers.quarantine import Quarantine
from consumers.serving_table import ServingTable
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
        assert not ck.due(100, True)  # backing off: not due, however many records
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
