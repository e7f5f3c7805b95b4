"""The backer (consumers.serving.backer): files on the real /dev/shm tmpfs, backed ahead of
their writer on a thread of its own; checked in the file's own allocation (st_blocks).
A full tmpfs is tested for real in tests/integration/test_shared_tables_full.py."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from consumers.serving import hugemap
from consumers.serving.backer import Backer
from consumers.serving.memory import HEADER_BYTES, map_file
from consumers.serving.shm import read_current, rows_file
from consumers.serving.table import ServingTable
from deltastream.wire import DeltaBatch

MIB = 1 << 20

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")


@pytest.fixture
def sparse(tmp_path):
    """A sparse 16 MiB file on /dev/shm and its (2 MiB-aligned) mapping."""
    path = Path("/dev/shm") / f"ds-test-backer-{os.getpid()}-{tmp_path.name}"
    buf = map_file(path, 16 * MIB, create=True)
    yield path, buf
    path.unlink(missing_ok=True)


def _backed(path: Path) -> int:
    """Bytes of ``path`` that are allocated (the backer allocates from the start; SEEK_HOLE
    would not do: tmpfs counts allocated pages never written as a hole)."""
    return os.stat(path).st_blocks * 512


def _wait(cond, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def _backer_threads(name: str = "t") -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"deltastream-backer-{name}"]


def test_want_returns_with_what_is_needed_and_the_rest_follows(sparse):
    path, buf = sparse
    b = Backer("t")
    b.add("f", path, buf, 0)
    assert _backed(path) == 0
    done = b.want("f", 3 * MIB, 12 * MIB)
    assert done >= 3 * MIB and _backed(path) >= done  # backed in order, from the start
    assert b.want("f", 12 * MIB, 0) == 12 * MIB  # waits for the rest; target stays
    assert _backed(path) == 12 * MIB  # up to the target, not beyond
    assert _wait(lambda: not _backer_threads())  # the thread ends when it is done
    assert b.want("f", 16 * MIB, 64 * MIB) == 16 * MIB  # capped at the mapping
    if hugemap.collapsing():
        assert b.huge_blocks >= 6  # whole 2 MiB blocks went into huge pages
    b.close()


def _fds_on(path: Path) -> int:
    """This process's open fds on ``path`` (other threads of the suite open and close
    fds of their own meanwhile: a count of all of them is not this job's)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == str(path)
        except OSError:  # closed meanwhile
            pass
    return n


def test_a_dropped_job_stops_and_closes_its_file(sparse):
    path, buf = sparse
    fds = _fds_on(path)
    b = Backer("t")
    b.add("f", path, buf, 0)
    assert _fds_on(path) == fds + 1  # its own fd, not the caller's
    b.want("f", 0, 16 * MIB)
    b.drop("f")
    b.drop("f")  # no-op
    assert _wait(lambda: not _backer_threads())
    assert _fds_on(path) == fds
    with pytest.raises(KeyError):
        b.want("f", 0, MIB)


def test_keys_are_registered_once(sparse):
    path, buf = sparse
    b = Backer("t")
    b.add("f", path, buf, 0)
    with pytest.raises(ValueError, match="registered already"):
        b.add("f", path, buf, 0)
    with pytest.raises(KeyError):
        b.want("g", 0, MIB)
    with pytest.raises(FileNotFoundError):
        b.add("h", path.with_name(path.name + "-missing"), buf, 0)
    b.close()


def test_a_growing_shared_tables_rows_are_backed_ahead_of_its_writer(tmp_path):
    t = ServingTable("emb", 64)
    loc = t.share(tmp_path / "state")
    try:
        rows_path = rows_file(loc, read_current(loc))
        written = HEADER_BYTES
        for k in range(8):  # 8 x 4096 rows of 256 bytes: 8 MiB
            ids = np.arange(k * 4096, (k + 1) * 4096, dtype=np.int64)
            t.apply(DeltaBatch("b", "emb", 0, 0, k, k, 0, ids=ids,
                               rows=np.ones((4096, 64), np.float32), dtype="f32"))
            written += 4096 * 256
            assert _backed(rows_path) >= written  # before the apply wrote them
        # and beyond, by the backer, while the writer does nothing (a generous wait: after a
        # long suite the kernel may compact memory for each huge page it is asked for)
        # (up to the file's end: slots are reserved smaller where address space is short)
        want = min(written + hugemap.BLOCK, os.stat(rows_path).st_size)
        ok = _wait(lambda: _backed(rows_path) >= want, 30.0)
        assert ok, (f"{_backed(rows_path)} bytes backed, {written} written, file "
                    f"{os.stat(rows_path).st_size}; threads "
                    f"{[th.name for th in threading.enumerate()]}")
    finally:
        t.unshare()


def test_inline_backs_whole_blocks_up_to_need_in_the_callers_thread(sparse, monkeypatch):
    path, buf = sparse
    monkeypatch.setenv("DELTASTREAM_SHM_BACKER", "0")
    b = Backer("t")
    assert not b.threaded
    b.add("f", path, buf, 0)
    assert b.want("f", 3 * MIB, 12 * MIB) == 4 * MIB  # to the end of need's block only
    assert _backed(path) == 4 * MIB
    assert b.want("f", 16 * MIB, 0) == 16 * MIB  # need raises the target
    with pytest.raises(ValueError, match="beyond its mapping"):
        b.want("f", 16 * MIB + 1, 0)
    b.close()
