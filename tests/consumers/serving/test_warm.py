"""The reader's page warmer: ``native.warm_follow`` (the C loop, without the GIL) and the
warmer thread of :class:`TableReader`, which maps what the writer allocated before a lookup
needs it."""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import pytest

from consumers.sched_policy import refusal, set_thread_policy
from consumers.serving import TableReader, accel
from consumers.serving.memory import map_file
from consumers.serving.shm import shm_root
from consumers.serving.table import ServingTable

MIB = 1 << 20
BLOCK = 2 * MIB

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc/self/smaps")


def _follow():
    fn = getattr(accel.native, "warm_follow", None)
    if fn is None:
        pytest.skip("the native extension is not built")
    return fn


def _rss_kib(buf: np.ndarray) -> int:
    """Resident KiB this process maps of the mapping holding ``buf``'s first byte."""
    addr = buf.ctypes.data
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError("mapping not found")


@pytest.fixture
def grown(tmp_path):
    """A 16 MiB file whose first 8 MiB are written, mapped read-only; a header word."""
    path = tmp_path / "rows"
    with open(path, "wb") as f:
        f.truncate(16 * MIB)
        f.write(np.ones(8 * MIB, np.uint8).tobytes())
    return path, map_file(path, writable=False), np.zeros(4, np.int64)


def _call(fn, buf, path, hdr, *, nxt=None, gen=0, done=0, align=BLOCK, timeout=0.2):
    return fn(buf, path, nxt, hdr, 1, gen, done, 4096, align, 4 * MIB, timeout, 0.001, 0.005)


@linux_only
def test_follow_maps_what_is_allocated_and_what_is_added_while_it_runs(grown):
    fn = _follow()
    path, buf, hdr = grown
    before = _rss_kib(buf)
    assert _call(fn, buf, str(path), hdr) == (8 * MIB, "timeout")
    assert _rss_kib(buf) - before >= 8 * 1024  # every page read: mapped now

    def grow() -> None:
        time.sleep(0.05)
        with open(path, "r+b") as f:
            f.seek(8 * MIB)
            f.write(np.ones(5 * MIB, np.uint8).tobytes())

    t = threading.Thread(target=grow)
    t.start()
    done, why = _call(fn, buf, path, hdr, done=8 * MIB, timeout=0.5)
    t.join()
    assert (done, why) == (12 * MIB, "timeout")  # whole 2 MiB blocks only
    assert _call(fn, buf, path, hdr, done=done, align=1) == (13 * MIB, "timeout")


def test_follow_returns_when_the_generation_changes_or_the_next_file_is_complete(grown,
                                                                                 tmp_path):
    fn = _follow()
    path, buf, hdr = grown

    def bump() -> None:
        time.sleep(0.05)
        hdr[1] = 7

    t = threading.Thread(target=bump)
    t.start()
    t0 = time.monotonic()
    assert _call(fn, buf, path, hdr, timeout=5.0) == (8 * MIB, "gen")
    t.join()
    assert time.monotonic() - t0 < 2.0
    assert _call(fn, buf, path, hdr, gen=7, done=8 * MIB, timeout=0.0)[1] == "timeout"

    nxt = tmp_path / "next"
    with open(nxt, "wb") as f:  # created, not yet allocated: the loop goes on
        f.truncate(1 * MIB)
    assert _call(fn, buf, path, hdr, nxt=nxt, gen=7, timeout=0.05)[1] == "timeout"
    with open(nxt, "r+b") as f:
        f.write(b"x" * MIB)
    assert _call(fn, buf, path, hdr, nxt=nxt, gen=7, timeout=5.0)[1] == "next"


def test_follow_says_gone_for_a_removed_file_and_raises_on_other_errors(grown, tmp_path):
    fn = _follow()
    path, buf, hdr = grown
    os.unlink(path)
    assert _call(fn, buf, path, hdr, timeout=5.0) == (0, "gone")
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(NotADirectoryError):
        _call(fn, buf, tmp_path / "f" / "x", hdr)


def test_follow_validates_its_arguments(grown):
    fn = _follow()
    path, buf, hdr = grown
    with pytest.raises(TypeError, match="13 arguments"):
        fn(buf, path)
    with pytest.raises(ValueError, match="word"):
        fn(buf, path, None, hdr, 4, 0, 0, 4096, BLOCK, MIB, 0.1, 0.001, 0.005)
    with pytest.raises(ValueError, match="word"):
        fn(buf, path, None, hdr.astype(np.int32), 0, 0, 0, 4096, BLOCK, MIB, 0.1, 0.001, 0.005)
    for done, page, align, step in ((-1, 4096, 1, MIB), (buf.nbytes + 1, 4096, 1, MIB),
                                    (0, 0, 1, MIB), (0, 4096, 0, MIB), (0, 4096, 1, 100)):
        with pytest.raises(ValueError, match="expected 0 <= done"):
            fn(buf, path, None, hdr, 0, 0, done, page, align, step, 0.1, 0.001, 0.005)
    for bad in (-0.1, float("nan"), 1e9):
        with pytest.raises(ValueError, match="timeout_s"):
            fn(buf, path, None, hdr, 0, 0, 0, 4096, 1, MIB, bad, 0.001, 0.005)
    with pytest.raises(TypeError):
        fn(buf, 3.5, None, hdr, 0, 0, 0, 4096, 1, MIB, 0.1, 0.001, 0.005)


def test_follow_lets_other_threads_run(grown, gil_gap):
    """The loop waits without the GIL: a reader process's lookups never wait for it."""
    fn = _follow()
    path, buf, hdr = grown
    span, gap = gil_gap(lambda: _call(fn, buf, path, hdr, timeout=0.3))
    assert gap < span / 2, (span, gap)


@linux_only
def test_the_warmer_maps_a_growing_tables_rows_before_any_lookup(tmp_path, lookup_path):
    """Both warmers (the C loop, and Python's without the extension) map the rows the
    writer allocates as the table grows, with no lookup in between."""
    state = tmp_path / "state"
    t = ServingTable("emb", 64)
    t.upsert(np.arange(1, 101), np.ones((100, 64), np.float32))
    t.share(state)
    r = TableReader.open(state, "emb")
    try:
        rows = r._m.buf
        n = 200_000  # 51 MB of rows
        t.upsert(np.arange(101, n), np.ones((n - 101, 64), np.float32))
        files = list(shm_root(state).rglob("*.rows"))
        assert len(files) == 1
        st = files[0].stat()
        want = min(st.st_blocks * 512, st.st_size) // BLOCK * BLOCK // 1024  # KiB
        assert want >= 48 * 1024
        deadline = time.monotonic() + 20
        while _rss_kib(rows) < want and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _rss_kib(rows) >= want  # this process read none of it: the warmer did
        assert np.array_equal(r.lookup(np.array([n - 1])), np.ones((1, 64), np.float32))
    finally:
        r.close()
        t.unshare()
    assert not any(shm_root(state).rglob("*.rows"))


@pytest.mark.skipif(refusal("fifo:1") is not None,
                    reason="no CAP_SYS_NICE or RLIMIT_RTPRIO for fifo:1 here")
def test_a_reader_opened_on_a_realtime_thread_warms_at_the_ordinary_policy(tmp_path):
    """The warmer inherits the policy of the thread that opened the reader; a real-time
    warmer would keep ordinary threads off its CPU while it follows the rows, so it
    drops to the ordinary policy (and its nice) at once."""
    state = tmp_path / "state"
    t = ServingTable("emb", 8)
    t.upsert(np.arange(1, 11), np.ones((10, 8), np.float32))
    t.share(state)
    opened: list[TableReader] = []

    def open_realtime() -> None:
        set_thread_policy("fifo:1")
        opened.append(TableReader.open(state, "emb"))
    th = threading.Thread(target=open_realtime)
    th.start()
    th.join()
    try:
        warmers = [w for w in threading.enumerate() if w.name == "warm emb"]
        assert warmers and all(w.native_id for w in warmers)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
                os.sched_getscheduler(w.native_id) != os.SCHED_OTHER for w in warmers):
            time.sleep(0.01)
        assert all(os.sched_getscheduler(w.native_id) == os.SCHED_OTHER for w in warmers)
        assert np.array_equal(opened[0].lookup(np.array([3])), np.ones((1, 8), np.float32))
    finally:
        opened[0].close()
        t.unshare()
