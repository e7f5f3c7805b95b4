"""deltastream.tracking.row_copy: the C gather and torch's give the same rows, bit for bit."""

from __future__ import annotations

import pytest
import torch

from deltastream.tracking import fresh_rows
from deltastream.tracking.row_copy import gather_rows


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
    with pytest.raises(ValueError, match="out: 32 bytes are not 2 rows of 12 bytes"):
        native.gather_rows(src.view(np.uint8).reshape(-1), np.array([2, 0]),
                           out.view(np.uint8).reshape(-1), 12)
    with pytest.raises(IndexError, match=r"row 3 \(at 1\) is outside \[0, 3\)"):
        native.gather_rows(src.view(np.uint8).reshape(-1), np.array([2, 3]),
                           out.view(np.uint8).reshape(-1), 16)
