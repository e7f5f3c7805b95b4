"""A restarted daemon never takes readers back in time (issue 27, item 5): a
``deltastream-sync --share-tables`` killed with SIGKILL before any checkpoint, restarted;
a reader that served the complete state never sees an older one (the restarted daemon
shares its tables only once it has caught up with the topic), then follows the new
daemon to newer states."""

from __future__ import annotations

import signal
import sys
import threading
import time

import numpy as np
import pytest

from consumers.serving import TableReader
from consumers.serving.shm import remove_tables

from .test_sync_state import _args, _kill, _spawn, _stop

pytestmark = [pytest.mark.integration]


def _start(broker, feed, state, log_path):
    return _spawn(_args(broker, feed.topic, state, "--share-tables",
                        "--checkpoint-interval", "3600", "--checkpoint-messages",
                        "100000"), log_path)


def _served(reader: TableReader, ids: np.ndarray, want: np.ndarray, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not np.array_equal(reader.lookup(ids), want):
        assert time.monotonic() < deadline, "the reader never served the expected state"
        time.sleep(0.05)


def test_a_restart_never_takes_readers_back_in_time(broker, feed, tmp_path):
    state = tmp_path / "state"
    feed.fill(3)
    proc = _start(broker, feed, state, tmp_path / "a.log")
    older: list[int] = []
    stop = threading.Event()
    try:
        reader = TableReader.open(state, "user", timeout=60)
        ids = np.arange(0, 400)
        _served(reader, ids, feed.expected["user"].lookup(ids), 60)
        _stop(proc, tmp_path / "a.log")  # its checkpoint holds these
        proc = _start(broker, feed, state, tmp_path / "a.log")
        feed.fill(30)
        want = feed.expected["user"].lookup(ids)
        _served(reader, ids, want, 60)
        proc.send_signal(signal.SIGKILL)  # readers saw far more than its checkpoint holds
        proc.wait()

        def watch() -> None:  # its own reader: one per thread
            r = TableReader.open(state, "user")
            while not stop.is_set():
                got = r.lookup(ids)
                if not np.array_equal(got, want):
                    older.append(int((got != want).any(axis=1).sum()))
                time.sleep(0.002)

        t = threading.Thread(target=watch)
        t.start()
        first = reader.incarnation
        proc = _start(broker, feed, state, tmp_path / "b.log")
        deadline = time.monotonic() + 60
        while reader.refresh() is False and reader.incarnation == first:
            assert time.monotonic() < deadline, "the restarted daemon never shared"
            time.sleep(0.05)
        time.sleep(0.3)
        stop.set()
        t.join()
        assert older == [], f"{len(older)} lookups served an older state"
        feed.fill(2)  # and the reader follows the new daemon
        _served(reader, ids, feed.expected["user"].lookup(ids), 60)
        _stop(proc, tmp_path / "b.log")
    finally:
        stop.set()
        _kill(proc)
        remove_tables(state)  # what a killed daemon left in /dev/shm when the test failed


_WATCH = """
import sys, time
from pathlib import Path
import numpy as np
from consumers.serving import TableReader
state, stop, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
r = TableReader.open(state, "user", timeout=60)
ids = np.arange(0, 400)
seen = []
while not stop.exists():
    _, info = r.read(ids)
    if not seen or seen[-1] != (info.version, info.incarnation):
        seen.append((info.version, info.incarnation))
    time.sleep(0.002)
out.write_text("\\n".join(f"{v} {inc}" for v, inc in seen))
"""


def test_a_readers_version_never_goes_back_across_restarts(broker, feed, tmp_path):
    """A reader process reads ``ReadInfo.version`` while the daemon is SIGKILLed and
    restarted (and once stopped cleanly): the versions it sees never decrease, and they
    come from every daemon run."""
    state, stop, out = tmp_path / "state", tmp_path / "stop", tmp_path / "versions"
    feed.fill(3)
    proc = _start(broker, feed, state, tmp_path / "d0.log")
    reader = None
    try:
        TableReader.open(state, "user", timeout=60)
        reader = _spawn([sys.executable, "-c", _WATCH, str(state), str(stop), str(out)],
                        tmp_path / "reader.log")
        ids = np.arange(0, 400)
        for run in range(1, 5):
            feed.fill(5)  # the daemon applies more than its last checkpoint holds
            watch = TableReader.open(state, "user", timeout=60)
            _served(watch, ids, feed.expected["user"].lookup(ids), 60)
            if run == 2:
                _stop(proc, tmp_path / f"d{run - 1}.log")
            else:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
            proc = _start(broker, feed, state, tmp_path / f"d{run}.log")
        feed.fill(2)
        _served(TableReader.open(state, "user", timeout=60), ids,
                feed.expected["user"].lookup(ids), 60)
        time.sleep(0.3)
        stop.touch()
        assert reader.wait(timeout=60) == 0, (tmp_path / "reader.log").read_text()[-3000:]
        seen = [(int(v), inc) for v, inc in
                (line.split() for line in out.read_text().splitlines())]
        _stop(proc, tmp_path / "d5.log")
    finally:
        stop.touch()
        _kill(proc)
        if reader is not None:
            _kill(reader)
        remove_tables(state)
    back = [(a, b) for a, b in zip(seen, seen[1:], strict=False) if b[0] < a[0]]
    assert not back, f"the version went back: {back[:3]}"
    runs = list(dict.fromkeys(inc for _, inc in seen))
    assert len(runs) >= 4, f"the reader followed only {len(runs)} daemon runs: {seen[-5:]}"


def test_a_reader_opened_after_a_clean_stop_is_told_at_once(broker, feed, tmp_path):
    """Decided (issue 31): a clean stop removes the shared tables and leaves a mark; a
    reader opened afterwards fails within a 5 s grace (for a restart underway) saying the
    daemon stopped (it used to wait out its 30 s timeout, then blame the flags); one opened
    before keeps serving the last rows; a reader waiting for the next daemon gets its
    tables."""
    from consumers.errors import ConsumerError

    state = tmp_path / "state"
    feed.fill(3)
    proc = _start(broker, feed, state, tmp_path / "a.log")
    try:
        before = TableReader.open(state, "user", timeout=60)
        ids = np.arange(0, 400)
        want = feed.expected["user"].lookup(ids)
        _served(before, ids, want, 60)
        _stop(proc, tmp_path / "a.log")
        t0 = time.monotonic()
        with pytest.raises(ConsumerError, match="its daemon stopped cleanly at .* start it "
                                                "again to share them"):
            TableReader.open(state, "user", timeout=30)
        assert time.monotonic() - t0 < 15  # the grace, not the 30 s timeout
        assert np.array_equal(before.lookup(ids), want)  # the last rows, still served
        proc = _start(broker, feed, state, tmp_path / "b.log")
        after = TableReader.open(state, "user", timeout=60)  # the mark is gone: it waits
        _served(after, ids, want, 60)
    finally:
        _kill(proc)
