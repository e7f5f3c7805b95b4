"""deltastream.tracking.row_copy: the C gather and scatter and torch's give the same rows, bit
for bit."""

from __future__ import annotations

import pytest
import torch

from deltastream.tracking import fresh_rows
from deltastream.tracking.row_copy import gather_rows, scatter_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("dim", [1, 3, 32, 64])
def test_rows_equal_index_select(fresh_path, dtype, dim):
    g = torch.Generator().manual_seed(dim)
    src = torch.randn(5000, dim, generator=g).to(dtype)
    at = torch.randint(0, 5000, (777,), generator=g)  # repeats and any order
    out = gather_rows(src, at)
    assert out.dtype == dtype and out.shape == (777, dim)
    assert torch.equal(out, src.index_select(0, at))
    assert gather_rows(src, at[:0]).shape == (0, dim)


def test_a_row_outside_the_table_is_an_index_error(fresh_path):
    with pytest.raises(IndexError):
        gather_rows(torch.zeros(10, 4), torch.tensor([3, 10]))


def test_other_layouts_take_index_select():
    src = torch.arange(40.0).reshape(4, 10)[:, ::2]  # not contiguous
    at = torch.tensor([3, 0])
    assert torch.equal(gather_rows(src, at), src[[3, 0]])
    assert torch.equal(gather_rows(src.contiguous(), at.int()), src[[3, 0]])


def test_the_c_copy_runs_when_built():
    if not fresh_rows.NATIVE_AVAILABLE:
        pytest.skip("deltastream.tracking.native is not built")
    import numpy as np

    from deltastream.tracking import native

    src = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = np.zeros((2, 4), dtype=np.float32)
    assert native.gather_rows(src.view(np.uint8).reshape(-1), np.array([2, 0]),
                              out.view(np.uint8).reshape(-1), 16) == 2
    assert out.tolist() == [src[2].tolist(), src[0].tolist()]
    with pytest.raises(ValueError, match="out: 32 bytes, src: 48 bytes: not rows of 12 bytes"):
        native.gather_rows(src.view(np.uint8).reshape(-1), np.array([2, 0]),
                           out.view(np.uint8).reshape(-1), 12)
    with pytest.raises(IndexError, match=r"row 3 \(at 1\) is outside \[0, 3\)"):
        native.gather_rows(src.view(np.uint8).reshape(-1), np.array([2, 3]),
                           out.view(np.uint8).reshape(-1), 16)
    with pytest.raises(TypeError, match="at or out_at"):
        native.gather_rows(src.view(np.uint8).reshape(-1), None,
                           out.view(np.uint8).reshape(-1), 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
@pytest.mark.parametrize("shape", [(), (1,), (32,)])
@pytest.mark.parametrize("indexed", [True, False])
def test_scatter_equals_index_copy(fresh_path, dtype, shape, indexed):
    """``dst[dst_at] = src[src_at]`` (or ``src`` itself): rows of any dtype, 1-D columns
    (a merge's ``age`` and ``new``) included."""
    g = torch.Generator().manual_seed(len(shape))
    dst = torch.randint(0, 2 if dtype == torch.bool else 100, (900, *shape), generator=g)
    dst = dst.to(dtype)
    src = torch.randint(0, 2 if dtype == torch.bool else 100, (600, *shape), generator=g)
    src = src.to(dtype)
    dst_at = torch.randperm(900, generator=g)[:400]  # unique, any order
    src_at = torch.randint(0, 600, (400,), generator=g) if indexed else None
    rows = src[src_at] if indexed else src[:400]
    want = dst.clone().index_copy_(0, dst_at, rows)
    scatter_rows(dst, dst_at, rows if not indexed else src, src_at)
    assert torch.equal(dst, want)
    scatter_rows(dst, dst_at[:0], src, None if src_at is None else src_at[:0])  # nothing
    assert torch.equal(dst, want)


def test_a_scatter_outside_either_table_is_an_error(fresh_path):
    """The C copy checks every index first (an ``IndexError`` naming it; nothing written);
    torch's ``index_copy_`` may have written rows before it raises."""
    dst, src = torch.zeros(10, 4), torch.ones(5, 4)
    for dst_at, src_at in (([3, 10], [0, 1]), ([3, 4], [0, 5])):
        with pytest.raises(IndexError if fresh_path == "native" else (IndexError, RuntimeError)):
            scatter_rows(dst, torch.tensor(dst_at), src, torch.tensor(src_at))
        assert fresh_path != "native" or not dst.any()
