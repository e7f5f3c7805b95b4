"""Quarantine: JSON lines with partition, offset, reason, first bytes; bounded by rotation."""

from __future__ import annotations

import errno
import json
import threading

import pytest

from consumers.quarantine import FIRST_BYTES, Quarantine
from tests.disk_faults import DiskFault


def test_appends_json_lines(tmp_path):
    q = Quarantine(tmp_path / "sub" / "quarantine.jsonl")
    value = bytes(range(200))
    q.add(3, 17, "decode: crc: CRC-32C mismatch", value)
    q.add(0, 0, "unknown table 'x'", b"\x01\x02")
    assert q.count == 2
    lines = (tmp_path / "sub" / "quarantine.jsonl").read_text().splitlines()
    assert len(lines) == 2
    rec = json.loads(lines[0])
    assert rec["partition"] == 3 and rec["offset"] == 17
    assert rec["reason"] == "decode: crc: CRC-32C mismatch"
    assert rec["size"] == 200
    assert bytes.fromhex(rec["first_bytes_hex"]) == value[:FIRST_BYTES]
    assert isinstance(rec["time"], float)
    assert json.loads(lines[1])["first_bytes_hex"] == "0102"
    assert q.read() == [json.loads(ln) for ln in lines]


def test_non_bytes_value_and_long_reason(tmp_path):
    q = Quarantine(tmp_path / "q.jsonl")
    q.add(0, 1, "x" * 10_000, None)
    q.add(0, 2, "bad", 12345)
    recs = q.read()
    assert len(recs[0]["reason"]) < 2100 and recs[0]["size"] == 0
    assert recs[1]["first_bytes_hex"] == b"12345".hex()


def test_bounded_by_rotation(tmp_path):
    path = tmp_path / "q.jsonl"
    q = Quarantine(path, max_bytes=4096)
    for i in range(200):
        q.add(0, i, "reason", b"\xff" * 100)
    assert q.count == 200 and q.rotations >= 2
    assert path.stat().st_size <= 4096
    assert (tmp_path / "q.jsonl.1").stat().st_size <= 4096
    recs = q.read()
    offsets = [r["offset"] for r in recs]
    assert offsets == sorted(offsets) and offsets[-1] == 199  # newest kept, in order
    assert len(recs) < 200  # the oldest were dropped, the count still says 200


def test_thread_safe(tmp_path):
    q = Quarantine(tmp_path / "q.jsonl", max_bytes=1 << 20)

    def work(p):
        for i in range(100):
            q.add(p, i, "r", b"abc")

    threads = [threading.Thread(target=work, args=(p,)) for p in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    recs = q.read()
    assert q.count == 400 and len(recs) == 400
    assert sorted((r["partition"], r["offset"]) for r in recs) == \
        [(p, i) for p in range(4) for i in range(100)]


def test_validates_max_bytes(tmp_path):
    with pytest.raises(ValueError, match="max_bytes"):
        Quarantine(tmp_path / "q", max_bytes=10)


def test_records_quarantined_before_a_restart_are_not_appended_again(tmp_path):
    path = tmp_path / "q.jsonl"
    q = Quarantine(path)
    for off in (3, 7, 9):
        q.add(0, off, "bad", b"x")
    q.add(1, 4, "bad", b"y")
    # a restart re-reads from the last checkpoint (offset 2 of partition 0, 0 of 1)
    q2 = Quarantine(path)
    assert q2.quarantined_up_to(0) == 9 and q2.quarantined_up_to(1) == 4
    for off in (3, 7, 9, 12):
        assert q2.add(0, off, "bad", b"x")
    q2.add(1, 4, "bad", b"y")
    q2.add(1, 5, "bad", b"y")
    assert q2.duplicates == 4 and q2.count == 2
    got = [(r["partition"], r["offset"]) for r in q2.read()]
    assert got == [(0, 3), (0, 7), (0, 9), (1, 4), (0, 12), (1, 5)]
    # a replaced log (offsets start over) is quarantined again from its offset 0
    q2.forget(0)
    q2.add(0, 3, "bad", b"z")
    assert [(r["partition"], r["offset"]) for r in q2.read()][-1] == (0, 3)


def test_marks_survive_rotation_and_a_torn_last_line(tmp_path):
    path = tmp_path / "q.jsonl"
    q = Quarantine(path, max_bytes=2048)
    for off in range(30):
        q.add(2, off, "r", b"\xff" * 40)
    assert q.rotations >= 1
    with open(path, "ab") as f:  # a crash in the middle of a line
        f.write(b'{"partition": 2, "offs')
    q2 = Quarantine(path, max_bytes=2048)
    assert q2.quarantined_up_to(2) == 29
    q2.add(2, 29, "r", b"")  # already there
    q2.add(2, 30, "r", b"")
    recs = q2.read()
    assert recs[-1]["offset"] == 30 and [r["offset"] for r in recs].count(29) == 1


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_write_failures_are_counted_kept_and_retried(tmp_path, monkeypatch, code):
    path = tmp_path / "state" / "q.jsonl"
    q = Quarantine(path, backlog_max=3)
    q.add(0, 1, "before", b"a")
    disk = DiskFault(tmp_path / "state", code).install(monkeypatch)
    disk.active = True
    assert q.add(0, 2, "during", b"b") is False  # never raises
    assert q.add(0, 3, "during", b"c") is False
    assert q.write_errors == 2 and q.backlog == 2 and q.last_error.errno == code
    assert not q.flush(sync=True)
    disk.active = False
    assert q.flush(sync=True) and q.backlog == 0
    assert [r["offset"] for r in q.read()] == [1, 2, 3]
    # a backlog over its bound drops lines: flush stays False (records re-read on restart)
    disk.active = True
    for off in range(4, 9):
        q.add(0, off, "r", b"")
    disk.active = False
    assert q.dropped == 2 and not q.flush() and q.backlog == 0
    assert [r["offset"] for r in q.read()] == [1, 2, 3, 4, 5, 6]


def test_a_planted_link_is_never_written_through(tmp_path):
    """Issue 27, item 8: another user's ``quarantine.jsonl`` link to a file the daemon
    may write (it runs as root) is not followed: the write fails, is counted, the target
    is untouched."""
    target = tmp_path / "root-only"
    target.write_bytes(b"secret\n")
    (tmp_path / "quarantine.jsonl").symlink_to(target)
    q = Quarantine(tmp_path / "quarantine.jsonl")
    assert q.add(0, 1, "bad", b"x") is False
    assert q.write_errors >= 1 and q.backlog == 1
    assert target.read_bytes() == b"secret\n"
