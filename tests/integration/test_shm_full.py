"""A full shm tmpfs while a shared table grows (issue 27, item 2): the apply fails, the
batch is neither quarantined nor passed over (its offset stays), and it applies once the
tmpfs has room — a real size-limited tmpfs, remounted larger."""

from __future__ import annotations

import os
import subprocess
import time

import numpy as np
import pytest

from deltastream.publishing.publisher import ensure_topic

from .test_sync import Feed, assert_tables_equal, daemon_for

pytestmark = [pytest.mark.integration]

DIM = 64
N = 2048  # rows per message: 0.5 MiB


def _mount(path, size: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join([*extra, f"size={size}"]),
                           "tmpfs", str(path)], capture_output=True, text=True, timeout=30)


def test_a_full_shm_tmpfs_delays_the_batch_and_loses_nothing(broker, topic_name, tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    r = _mount(shm, "6m")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    ensure_topic(broker.bootstrap_servers, topic_name, 1)
    feed = Feed(broker.bootstrap_servers, topic_name, 1, dims={"emb": DIM})
    d = None
    try:
        for i in range(40):  # 80K rows, 20 MiB: far more than the tmpfs holds
            ids = np.arange(i * N, (i + 1) * N) * 2
            feed.publish("emb", 0, ids=ids, rows=np.full((N, DIM), i + 1, np.float32))
        feed.flush()
        d = daemon_for(broker, topic_name, tmp_path / "state", share_tables=True,
                       shm_dir=shm, tables={"emb": DIM})
        deadline = time.monotonic() + 60
        while d.stats()["write_errors"].get("apply", 0) < 3 and not d.stats()["quarantined"]:
            assert time.monotonic() < deadline, f"the tmpfs never filled: {d.stats()}"
            d.run_for(seconds=0.5)
        s = d.stats()
        assert s["quarantined"] == 0 and s["internal_errors"] == 0
        assert s["positions"][0] < feed.count[0]  # not passed over
        stuck = s["positions"][0]
        d.run_for(seconds=1)
        assert d.stats()["positions"][0] == stuck and d.stats()["quarantined"] == 0
        r = subprocess.run(["mount", "-o", "remount,size=256m", str(shm)],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        assert d.catch_up(timeout=60)
        assert d.stats()["quarantined"] == 0
        assert_tables_equal(d.tables(), feed.expected)
    finally:
        if d is not None:
            d.stop()
        feed.close()
        subprocess.run(["umount", "-l", str(shm)], capture_output=True, timeout=30)
    assert not os.listdir(shm)
