"""DriftScan: the exact, bitwise drift scan of a dense table against its shadow."""

from __future__ import annotations

import math

import pytest
import torch

from deltastream.tracking.scan import DriftScan, bits_view


def test_reports_exactly_the_changed_and_the_looked_up_rows_with_their_old_values():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1000, 6, generator=g)
    sc = DriftScan(w, chunk_rows=64)  # many chunks, a partial last one
    old = w.clone()
    moved = torch.tensor([0, 63, 64, 500, 999])
    w[moved] += torch.randn(5, 6, generator=g)
    sc.note(torch.tensor([[7, 64], [7, 998]]))  # looked up: 7, 998 unchanged, 64 moved
    res = sc.scan(w, with_states=True)
    want = torch.tensor([0, 7, 63, 64, 500, 998, 999])
    assert torch.equal(res.ids, want)
    assert torch.equal(res.states, old[want])  # FIRST: the value at the previous scan
    assert (res.changed, res.unlooked) == (5, 4)
    assert torch.equal(sc.shadow, w)
    again = sc.scan(w, with_states=False)  # nothing since: marks were consumed
    assert again.ids.numel() == 0 and again.states is None
    assert sc.scans == 2 and sc.unlooked == 4


def test_bitwise_compare_sees_signed_zeros_and_keeps_stable_nans():
    w = torch.tensor([[0.0, 1.0], [math.nan, 2.0], [3.0, 4.0]])
    sc = DriftScan(w)
    w2 = w.clone()
    w2[0, 0] = -0.0  # == 0.0 for float compare, a different value on the wire
    res = sc.scan(w2, with_states=True)
    assert res.ids.tolist() == [0]  # the NaN row, still NaN, is unchanged
    w2[2, 1] = math.nan
    assert sc.scan(w2, with_states=True).ids.tolist() == [2]


@pytest.mark.parametrize("dtype,dim", [(torch.float16, 3), (torch.bfloat16, 5),
                                       (torch.float32, 7), (torch.float64, 2)])
def test_any_float_dtype_and_odd_widths(dtype, dim):
    w = torch.zeros(50, dim, dtype=dtype)
    assert bits_view(w).shape[0] == 50
    sc = DriftScan(w, chunk_rows=16)
    w[[3, 17, 49], dim - 1] = 1.0
    res = sc.scan(w, with_states=True)
    assert res.ids.tolist() == [3, 17, 49] and res.states.dtype == dtype
    assert bool((res.states == 0).all())


def test_non_contiguous_weight_and_resync():
    base = torch.randn(40, 8)
    w = base[:, ::2]  # a strided view
    sc = DriftScan(w)
    base[5, 2] += 1
    assert sc.scan(w, with_states=False).ids.tolist() == [5]
    base[6, 0] += 1
    sc.note(torch.tensor([9]))
    sc.resync(w)  # everything counts as read
    assert sc.scan(w, with_states=False).ids.numel() == 0


def test_a_reshaped_weight_reports_every_row_without_states(caplog):
    sc = DriftScan(torch.zeros(4, 2))
    res = sc.scan(torch.ones(6, 2), with_states=True)
    assert res.reset and res.ids.tolist() == list(range(6)) and res.states is None
    assert "every row is reported" in caplog.text
    assert sc.scan(torch.ones(6, 2), with_states=True).ids.numel() == 0
