"""Durable writes (consumers.storage.files): what reaches the file, in bounded write() calls."""

from __future__ import annotations

import hashlib
import io

import numpy as np
import pytest

from consumers.storage.files import (
    WRITE_SLICE,
    HashingWriter,
    write_chunks,
    write_file,
    write_npy,
    write_npy_chunks,
)


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
    assert w.h.hexdigest() == hashlib.sha256(bytes(f.data)).hexdigest()


def test_files_written_whole_with_their_digest(tmp_path):
    rows = np.arange(WRITE_SLICE, dtype=np.float32).reshape(-1, 64)  # 4 slices of bytes
    entry = write_chunks(tmp_path / "c.bin", [rows[:100], b"x", rows[100:]])
    want = rows[:100].tobytes() + b"x" + rows[100:].tobytes()
    assert (tmp_path / "c.bin").read_bytes() == want
    assert entry == {"sha256": hashlib.sha256(want).hexdigest(), "bytes": len(want)}
    assert write_file(tmp_path / "f.bin", want) == entry
    npy = write_npy(tmp_path / "n.npy", rows)
    assert npy["bytes"] == (tmp_path / "n.npy").stat().st_size
    assert npy["sha256"] == hashlib.sha256((tmp_path / "n.npy").read_bytes()).hexdigest()
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
    assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    chunked = write_npy_chunks(tmp_path / "b.npy", arr.dtype, arr.shape,
                                     [arr[:2], arr[2:]])
    assert chunked == entry
    with pytest.raises(RuntimeError, match="expected"):  # rows short of the header's shape
        write_npy_chunks(tmp_path / "c.npy", arr.dtype, (arr.shape[0] + 1,) + arr.shape[1:],
                         [arr])
