"""Quarantine: JSON lines with partition, offset, reason, first bytes; bounded by rotation."""

from __future__ import annotations

import json
import threading

import pytest

from consumers.quarantine import FIRST_BYTES, Quarantine


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
