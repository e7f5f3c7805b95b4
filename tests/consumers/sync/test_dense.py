"""DenseSide: the consistent view's policies (newest of each; at most N steps ahead, with
a wait that buffers nothing) and the dense gauges."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from consumers.sequencing import SeqTracker
from consumers.sync.dense import DenseSide
from deltastream.dense_wire import chunk_version, decode_dense, encode_dense


def _offer(side: DenseSide, step: int, seq: int, ts: int = 0) -> int:
    t = {"w": np.full((4, 4), step, np.float32)}
    cs = chunk_version(t, model="m", shard=0, epoch=1, seq=seq, step=step, ts=ts,
                       max_message_bytes=600)
    for m in encode_dense(cs):
        side.assembler.offer(decode_dense(m))
    return seq + len(cs)


@pytest.fixture
def side(tmp_path):
    return DenseSide("m", None, tmp_path, None)


def test_newest_of_each_and_the_max_ahead_bound(side):
    seqs = SeqTracker()
    assert side.consistent(seqs).dense is None
    _offer(side, 10, 0)
    seqs.commit("user", 0, 1, 0, step=14)
    seqs.commit("item", 1, 1, 0, step=12)
    v = side.consistent(seqs)
    assert v.dense.step == 10 and v.sparse_steps == {0: 14, 1: 12}
    assert v.ahead_steps == 4 and v.within
    assert side.consistent(seqs, max_ahead=4).within
    assert not side.consistent(seqs, max_ahead=3).within
    with pytest.raises(ValueError, match="max_ahead"):
        side.consistent(seqs, max_ahead=-1)


def test_the_wait_returns_once_a_dense_version_brings_sparse_within_the_bound(side):
    seqs = SeqTracker()
    seq = _offer(side, 10, 0)
    seqs.commit("user", 0, 1, 0, step=30)
    late = threading.Timer(0.3, lambda: _offer(side, 28, seq))
    late.start()
    t0 = time.monotonic()
    v = side.consistent(seqs, max_ahead=5, timeout=10)
    late.join()
    assert v.within and v.dense.step == 28 and v.ahead_steps == 2
    assert 0.2 < time.monotonic() - t0 < 10
    t0 = time.monotonic()
    seqs.commit("user", 0, 1, 1, step=40)
    v = side.consistent(seqs, max_ahead=5, timeout=0.3)  # nothing comes: the last instant
    assert not v.within and v.ahead_steps == 12 and time.monotonic() - t0 >= 0.3


def test_gauges_age_in_seconds_and_steps(side):
    seqs = SeqTracker()
    assert side.stats(seqs)["dense_age_s"] is None
    _offer(side, 10, 0, ts=100 * 10**9)
    seqs.commit("user", 0, 1, 0, step=17)
    s = side.stats(seqs, now=103.5)
    assert s["dense_version"] == [1, 10] and s["dense_age_s"] == pytest.approx(3.5)
    assert s["dense_age_steps"] == 7 and s["dense_sparse_steps"] == 7
    assert s["dense_versions"] == 1


def test_state_is_the_same_bytes_while_nothing_changed(side):
    assert side.state() is None
    seq = _offer(side, 1, 0)
    first = side.state()
    assert side.state() is first
    _offer(side, 2, seq)
    assert side.state() != first
