from __future__ import annotations

import numpy as np
import pytest
import torch

from deltastream.publishing import row_moves
from deltastream.publishing.row_moves import move_rows

NATIVE = row_moves._NATIVE.available


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_rows_land_where_the_indices_say_and_nothing_else_moves(native, dtype):
    g = torch.Generator().manual_seed(1)
    src = torch.randn(40, 5, generator=g).to(dtype)
    dst = torch.randn(30, 5, generator=g).to(dtype)
    src_at = torch.randint(0, 40, (12,), generator=g)  # repeats are fine on the source side
    dst_at = torch.randperm(30, generator=g)[:12]
    want = dst.clone()
    want[dst_at] = src[src_at]
    move_rows(dst, dst_at, src, src_at)
    assert torch.equal(dst, want)
    # one side without an index: aligned rows
    out = torch.zeros(12, 5, dtype=dtype)
    move_rows(out, None, src, src_at)
    assert torch.equal(out, src[src_at])
    move_rows(dst, dst_at, out, None)
    assert torch.equal(dst[dst_at], src[src_at])
    move_rows(dst, dst_at[:0], src, src_at[:0])  # nothing to move


def test_a_wider_source_dtype_is_converted(native):
    dst = torch.zeros(3, 2, dtype=torch.float16)
    move_rows(dst, torch.tensor([2, 0]), torch.tensor([[1.5, 2.0], [3.0, 4.0]]), None)
    assert dst.tolist() == [[3.0, 4.0], [0.0, 0.0], [1.5, 2.0]]


def test_bad_indices_are_refused_before_anything_is_written():
    if not NATIVE:
        pytest.skip(f"deltastream.publishing.native is not built ({row_moves._NATIVE.why})")
    fn = row_moves._NATIVE.module.move_rows
    dst, src = np.zeros((4, 2), np.float32), np.ones((3, 2), np.float32)
    with pytest.raises(IndexError, match="dst_at: row 4 .at 1. is outside"):
        fn(dst.view(np.uint8), np.array([0, 4]), src.view(np.uint8), np.array([0, 1]), 8)
    with pytest.raises(IndexError, match="src_at: row -1"):
        fn(dst.view(np.uint8), np.array([0, 1]), src.view(np.uint8), np.array([0, -1]), 8)
    with pytest.raises(ValueError, match="src: 3 rows for 2 dst rows"):
        fn(dst.view(np.uint8), np.array([0, 1]), src.view(np.uint8), None, 8)
    with pytest.raises(ValueError, match="at least one index"):
        fn(dst.view(np.uint8), None, src.view(np.uint8), None, 8)
    with pytest.raises(ValueError, match="not rows of 5 bytes"):
        fn(dst.view(np.uint8), np.array([0]), src.view(np.uint8), np.array([0]), 5)
    assert not dst.any()
    with pytest.raises(ValueError, match="needs dst_at or src_at"):
        move_rows(torch.zeros(2, 2), None, torch.zeros(2, 2), None)
