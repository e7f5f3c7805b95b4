"""deltastream.wire_values: sizes per dtype, and the whole-row error bound the budget
publisher compares a residual's leftover with."""

from __future__ import annotations

import numpy as np
import pytest

from deltastream import wire
from deltastream.wire_values import error_bound, rows_nbytes, scale_nbytes


@pytest.mark.parametrize("dtype,rows,scale", [("f32", 4 * 12 * 5, 0), ("f16", 2 * 12 * 5, 0),
                                              ("bf16", 2 * 12 * 5, 0), ("i8", 12 * 5, 4 * 5),
                                              ("r1", 2 * 5, 2 * 5)])
def test_bin_sizes_per_dtype(dtype, rows, scale):
    assert (rows_nbytes(5, 12, dtype), scale_nbytes(5, dtype)) == (rows, scale)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "i8"])
def test_error_bound_holds_for_what_the_wire_carries(dtype):
    rng = np.random.default_rng(3)
    rows = np.concatenate([rng.standard_normal((200, 32)) * 10.0 ** rng.integers(-6, 4, (200, 1)),
                           np.zeros((1, 32))]).astype(np.float32)
    b = wire.DeltaBatch("m", "t", 0, 1, 0, 0, 0, np.arange(rows.shape[0]), rows, dtype=dtype)
    got = wire.decode(wire.encode(b)[0]).rows_f32()
    err = np.linalg.norm(got.astype(np.float64) - rows, axis=1)
    bound = error_bound(rows, dtype)
    assert (err <= bound).all()
    if dtype == "f32":
        assert (bound == 0).all()
    else:  # not loose by orders of magnitude either
        assert err.max() > bound.max() / 1000
    with pytest.raises(wire.WireError, match="dtype"):
        error_bound(rows, "r1")
