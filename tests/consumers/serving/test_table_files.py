"""A serving table's own directory: written whole or streamed from a frozen view (same
bytes), read back verified; ServingTable.save/load use it."""

from __future__ import annotations

import numpy as np
import pytest

from consumers.errors import SnapshotError
from consumers.serving.table import ServingTable
from consumers.serving.table_files import (
    TableData,
    read_table_dir,
    write_table_dir,
    write_table_stream,
)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_streamed_and_whole_table_dirs_are_the_same_bytes(tmp_path, dtype):
    t = ServingTable.from_arrays("emb", np.array([5, 1, 9]), np.arange(12).reshape(3, 4),
                                 dtype=dtype)
    ids, rows = t.export()
    write_table_dir(tmp_path / "whole", TableData("emb", dtype, ids, rows))
    with t.frozen() as view:
        write_table_stream(tmp_path / "stream", view)
    for name in ("ids.npy", "rows.npy", "manifest.json"):
        assert (tmp_path / "whole" / name).read_bytes() == \
            (tmp_path / "stream" / name).read_bytes()
    got = read_table_dir(tmp_path / "stream")
    assert got.name == "emb" and got.dtype == dtype
    assert np.array_equal(got.ids, ids) and np.array_equal(got.rows, rows)


def test_a_damaged_table_dir_is_refused(tmp_path):
    ServingTable.from_arrays("emb", [1, 2], np.ones((2, 3))).save(tmp_path / "t")
    with open(tmp_path / "t" / "rows.npy", "r+b") as f:
        f.seek(-1, 2)
        f.write(b"\x01")
    with pytest.raises(SnapshotError, match="rows.npy"):
        ServingTable.load(tmp_path / "t")
