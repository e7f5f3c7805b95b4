"""Durable writes (consumers.files): what reaches the file, in bounded write() calls."""

from __future__ import annotations

import hashlib
import io
import re
from pathlib import Path

import crc32c
import numpy as np
import pytest

from consumers.errors import SnapshotError
from consumers.files import (
    WRITE_SLICE,
    HashingWriter,
    check_format,
    read_verified,
    write_chunks,
    write_file,
    write_npy,
    write_npy_chunks,
)


def _crc(b: bytes) -> str:
    return f"{crc32c.crc32c(b):08x}"


class _Calls:
    """A file object that records the size of every write() it gets."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.data = bytearray()

    def write(self, b) -> int:
        self.sizes.append(len(b))
        self.data += b
        return len(b)


def test_hashing_writer_writes_in_bounded_slices_and_hashes_everything():
    big = np.random.default_rng(0).integers(0, 255, 3 * WRITE_SLICE + 17, dtype=np.uint8)
    f = _Calls()
    w = HashingWriter(f)
    assert w.write(big) == big.nbytes
    assert w.write(b"") == 0
    assert w.write(b"tail") == 4
    assert max(f.sizes) <= WRITE_SLICE
    assert f.sizes[:4] == [WRITE_SLICE] * 3 + [17]
    assert bytes(f.data) == big.tobytes() + b"tail"
    assert w.n == big.nbytes + 4
    assert w.entry() == {"crc32c": _crc(bytes(f.data)), "bytes": big.nbytes + 4}


def test_files_written_whole_with_their_digest(tmp_path):
    rows = np.arange(WRITE_SLICE, dtype=np.float32).reshape(-1, 64)  # 4 slices of bytes
    entry = write_chunks(tmp_path / "c.bin", [rows[:100], b"x", rows[100:]])
    want = rows[:100].tobytes() + b"x" + rows[100:].tobytes()
    assert (tmp_path / "c.bin").read_bytes() == want
    assert entry == {"crc32c": _crc(want), "bytes": len(want)}
    assert write_file(tmp_path / "f.bin", want) == entry
    npy = write_npy(tmp_path / "n.npy", rows)
    assert npy["bytes"] == (tmp_path / "n.npy").stat().st_size
    assert npy["crc32c"] == _crc((tmp_path / "n.npy").read_bytes())
    np.testing.assert_array_equal(np.load(tmp_path / "n.npy"), rows)


@pytest.mark.parametrize("arr", [np.arange(7, dtype="<i8"),
                                 np.arange(24, dtype="<f4").reshape(6, 4),
                                 np.zeros((0, 3), "<f2")])
def test_npy_files_hold_the_bytes_np_save_writes(tmp_path, arr):
    """write_npy writes from the array's memory, not np.save's copies: same bytes."""
    ref = io.BytesIO()
    np.save(ref, arr, allow_pickle=False)
    entry = write_npy(tmp_path / "a.npy", arr)
    data = (tmp_path / "a.npy").read_bytes()
    assert data == ref.getvalue()
    assert entry == {"crc32c": _crc(data), "bytes": len(data)}
    chunked = write_npy_chunks(tmp_path / "b.npy", arr.dtype, arr.shape,
                                     [arr[:2], arr[2:]])
    assert chunked == entry
    with pytest.raises(RuntimeError, match="expected"):  # rows short of the header's shape
        write_npy_chunks(tmp_path / "c.npy", arr.dtype, (arr.shape[0] + 1,) + arr.shape[1:],
                         [arr])


def test_reads_verify_either_checksum_and_name_the_one_that_failed(tmp_path):
    """Entries written now carry a CRC-32C; those of format version 1 a sha256: both read,
    both catch a damaged byte."""
    path = tmp_path / "f.bin"
    data = bytes(range(256)) * 1000
    entry = write_file(path, data)
    legacy = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    assert read_verified(path, entry) == data
    assert read_verified(path, legacy) == data
    path.write_bytes(data[:500] + b"\xff" + data[501:])
    with pytest.raises(SnapshotError, match="crc32c checksum mismatch"):
        read_verified(path, entry)
    with pytest.raises(SnapshotError, match="sha256 checksum mismatch"):
        read_verified(path, legacy)
    for bad in ({"bytes": len(data)}, {"md5": "00", "bytes": len(data)},
                {"crc32c": 5, "bytes": len(data)}, {"crc32c": entry["crc32c"]}, None):
        with pytest.raises(SnapshotError, match="malformed.*crc32c or sha256"):
            read_verified(path, bad)


def test_every_format_version_up_to_the_current_one_is_read():
    where = Path("m")
    for v in (1, 2):
        check_format(where, {"format": "f", "version": v}, "f", 2)
    for v in (3, 0, True, "2", None):
        with pytest.raises(SnapshotError, match=re.escape(
                f"version {v!r} is not supported (this reader knows 1 to 2)")):
            check_format(where, {"format": "f", "version": v}, "f", 2)
    with pytest.raises(SnapshotError, match="expected 'f'"):
        check_format(where, {"format": "g", "version": 1}, "f", 2)
