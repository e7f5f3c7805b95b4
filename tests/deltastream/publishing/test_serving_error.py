"""serving_errors and TableScale: the error predictors serve, comparable across tables."""

from __future__ import annotations

import math

import pytest
import torch

from deltastream import HashTable
from deltastream.publishing import serving_error
from deltastream.publishing.serving_error import TableScale, row_errors, serving_errors
from deltastream.types import DeltaRows


def _table(rows: torch.Tensor) -> HashTable:
    t = HashTable(rows.shape[1], name="t")
    t.insert(torch.arange(len(rows)), rows)
    return t


def test_errors_are_against_first_or_zeros_for_new_rows_and_chunking_does_not_matter():
    cur = torch.tensor([[3.0, 4.0], [1.0, 1.0], [0.0, 2.0], [5.0, 0.0]])
    first = torch.tensor([[0.0, 0.0], [1.0, 1.0], [0.0, 1.0], [1.0, 0.0]])
    new = torch.tensor([False, False, False, True])
    d = DeltaRows(ids=torch.arange(4), states=first, new=new, age=torch.zeros(4, dtype=torch.int64))
    t = _table(cur)
    e = serving_errors(d, t)
    assert e.error.tolist() == [5.0, 0.0, 1.0, 5.0]  # the new row: served as zeros
    assert e.norm.tolist() == pytest.approx([5.0, math.sqrt(2), 2.0, 5.0])
    assert e.finite.all()
    e3 = serving_errors(d, t, chunk_rows=3)
    assert torch.equal(e3.error, e.error) and torch.equal(e3.norm, e.norm)
    assert serving_errors(d, t, new_rows="first").error[3] == math.inf


def test_non_finite_rows_and_recovered_rows():
    cur = torch.tensor([[math.nan, 0.0], [1.0, 0.0]])
    first = torch.tensor([[0.0, 0.0], [math.inf, 0.0]])
    e = serving_errors(DeltaRows(ids=torch.arange(2), states=first), _table(cur))
    assert e.finite.tolist() == [False, True]
    assert math.isnan(e.error[0]) and e.error[1] == math.inf


def test_id_only_and_wrong_width_are_refused():
    t = _table(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="EMBEDDING"):
        serving_errors(DeltaRows(ids=torch.arange(2)), t)
    with pytest.raises(ValueError, match=r"expected \(2, 3\)"):
        serving_errors(DeltaRows(ids=torch.arange(2), states=torch.zeros(2, 4)), t)
    with pytest.raises(ValueError, match="new_rows"):
        serving_errors(DeltaRows(ids=torch.arange(2), states=torch.zeros(2, 3)), t,
                       new_rows="zero")


def _scaled(rows: torch.Tensor, moved: torch.Tensor) -> torch.Tensor:
    n = len(rows)
    e = serving_errors(DeltaRows(ids=torch.arange(n), states=rows), _table(moved))
    s = TableScale()
    s.update(e.norm)
    return s.normalize(e.error)


@pytest.mark.parametrize("dim", [1, 64])
@pytest.mark.parametrize("c", [0.01, 100.0])
def test_scaled_errors_do_not_depend_on_value_scale(c, dim):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(500, dim, generator=g)
    moved = base + 0.1 * torch.randn(500, dim, generator=g)
    # equal up to float32 rounding of c × rows (unscaled they would differ c-fold)
    assert torch.allclose(_scaled(base * c, moved * c), _scaled(base, moved), rtol=1e-3,
                          atol=1e-6)


def test_scaled_errors_do_not_depend_on_width():
    """Rows of a dim-1 and a dim-64 table at their table's typical norm, each moved by
    10 % of it, score 0.1 in both (raw L2 would differ by the norms, here 0.01 vs 8)."""
    g = torch.Generator().manual_seed(1)
    for dim, norm in ((1, 0.01), (64, 8.0)):
        unit = torch.randn(300, dim, generator=g)
        unit /= torch.linalg.vector_norm(unit, dim=1, keepdim=True)
        step = torch.randn(300, dim, generator=g)
        step /= torch.linalg.vector_norm(step, dim=1, keepdim=True)
        rows = unit * norm
        moved = rows + 0.1 * norm * step
        assert _scaled(rows, moved).mean().item() == pytest.approx(0.1, rel=0.05)


def test_table_scale_averages_and_ignores_nan():
    s = TableScale(alpha=0.5)
    assert s.value is None and s.normalize(torch.tensor([2.0])).item() == 2.0
    s.update(torch.tensor([3.0, 4.0, math.nan]))
    assert s.value == pytest.approx(math.sqrt(12.5))
    s.update(torch.tensor([0.0]))  # an all-zero round does not reset the scale
    assert s.value == pytest.approx(math.sqrt(12.5))
    with pytest.raises(ValueError, match="alpha"):
        TableScale(0.0)


NATIVE = serving_error._NATIVE.available


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_row_errors_equal_the_reference_norms_for_every_float_dtype(dtype, native):
    g = torch.Generator().manual_seed(3)
    cur = (torch.randn(64, 12, generator=g) * 50).to(dtype)
    srv = (torch.randn(64, 12, generator=g) * 50).to(dtype)
    cur[3, 4], cur[5, 0], srv[7, 2], srv[8, 1] = float("nan"), float("inf"), float("inf"), \
        float("nan")
    if dtype == torch.float64:  # finite values whose squares overflow: the norm is +inf
        cur[9, 0], srv[11, 3] = 1e200, -1e200
    zero = torch.zeros(64, dtype=torch.bool)
    zero[::5] = True
    amax = torch.full((64,), -1.0, dtype=torch.float64)
    err, norm, finite = row_errors(cur, srv, zero, amax)
    c, s = cur.double(), srv.double().masked_fill(zero[:, None], 0.0)
    ref_finite = torch.isfinite(c).all(dim=1)
    assert torch.equal(finite, ref_finite)
    ok = ref_finite & torch.isfinite(s).all(dim=1)
    torch.testing.assert_close(err[ok], torch.linalg.vector_norm(c - s, dim=1)[ok])
    torch.testing.assert_close(norm[ref_finite], torch.linalg.vector_norm(c, dim=1)[ref_finite])
    assert err[~ref_finite].isnan().all() and norm[~ref_finite].isnan().all()
    assert err[ref_finite & ~ok].isinf().all()  # recovered from a non-finite served value
    assert (err[ref_finite & ~ok] > 0).all()
    assert torch.equal(amax[ref_finite], c.abs().amax(dim=1)[ref_finite])
    assert amax[~ref_finite].isnan().all()
    if dtype == torch.float64:
        assert norm[9] == math.inf and err[9] == math.inf and err[11] == math.inf


def test_native_and_torch_row_errors_agree_on_a_large_hand_off():
    """The C pass and torch's on the same rows (with rows held as zeros, both dtypes):
    the same finiteness and range maxima, the errors and norms equal up to the order of
    their float64 sums."""
    if not NATIVE:
        pytest.skip(f"deltastream.publishing.native is not built ({serving_error._NATIVE.why})")
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.float64):
        cur = torch.randn(5000, 32, generator=g).to(dtype)
        srv = (cur + 1e-3 * torch.randn(5000, 32, generator=g).to(dtype))
        zero = torch.rand(5000, generator=g) < 0.2
        out = []
        for on in (True, False):
            serving_error.use_native(on)
            amax = torch.empty(5000, dtype=torch.float64)
            out.append((*row_errors(cur, srv, zero, amax), amax))
        serving_error.use_native(NATIVE)
        (e1, n1, f1, a1), (e2, n2, f2, a2) = out
        assert torch.equal(f1, f2) and torch.equal(a1, a2)
        torch.testing.assert_close(e1, e2, rtol=1e-14, atol=0.0)
        torch.testing.assert_close(n1, n2, rtol=1e-14, atol=0.0)


def test_rows_read_through_indices_equal_the_gathered_rows(native):
    """``current_at`` / ``served_at`` read the rows where they lie: the same errors, norms,
    finiteness and maxima as the gathered rows (repeated and unsorted indices, a NaN row,
    rows held as zeros)."""
    g = torch.Generator().manual_seed(6)
    cur, srv = torch.randn(300, 8, generator=g), torch.randn(50, 8, generator=g)
    cur[7, 3] = math.nan
    c_at = torch.randint(0, 300, (200,), generator=g)
    s_at = torch.randint(0, 50, (200,), generator=g)
    c_at[0] = 7
    zero = torch.rand(200, generator=g) < 0.3
    a1, a2 = torch.empty(200, dtype=torch.float64), torch.empty(200, dtype=torch.float64)
    got = row_errors(cur, srv, zero, a1, current_at=c_at, served_at=s_at)
    want = row_errors(cur[c_at], srv[s_at], zero, a2)
    for x, y in zip((*got, a1), (*want, a2), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-14, atol=0.0, equal_nan=True)
    assert not bool(got[2][0]) and int(got[2].sum()) == int((c_at != 7).sum())
    e, _, _ = row_errors(cur, cur, current_at=c_at[1:], served_at=c_at[1:])
    assert bool((e == 0).all())


def test_native_row_errors_refuse_mismatched_buffers():
    """The C function names the buffer it cannot use instead of reading out of bounds."""
    if not NATIVE:
        pytest.skip(f"deltastream.publishing.native is not built ({serving_error._NATIVE.why})")
    import numpy as np

    fn = serving_error._NATIVE.module.row_errors
    cur, srv = np.zeros((4, 3), np.float32), np.zeros((4, 3), np.float32)
    err, norm, fin = np.zeros(4), np.zeros(4), np.zeros(4, np.bool_)
    fn(cur, srv, None, 3, err, norm, fin, None)
    with pytest.raises(ValueError, match="served"):
        fn(cur, np.zeros((4, 3), np.float64), None, 3, err, norm, fin, None)
    with pytest.raises(ValueError, match="err"):
        fn(cur, srv, None, 3, np.zeros(3), norm, fin, None)
    with pytest.raises(ValueError, match="zero"):
        fn(cur, srv, np.zeros(5, np.bool_), 3, err, norm, fin, None)
    with pytest.raises(ValueError, match="amax"):
        fn(cur, srv, None, 3, err, norm, fin, np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="current"):
        fn(cur.astype(np.float16), srv, None, 3, err, norm, fin, None)
    with pytest.raises(ValueError, match="finite"):
        fn(cur, srv, None, 3, err, norm, np.zeros(4, np.bool_)[::1].copy()[:3], None)
    at = np.array([3, 0, 1, 2])
    with pytest.raises(IndexError, match="cur_at: row 4 .at 1. is outside"):
        fn(cur, srv, None, 3, err, norm, fin, None, np.array([0, 4, 1, 2]), at)
    with pytest.raises(IndexError, match="srv_at: row -1"):
        fn(cur, srv, None, 3, err, norm, fin, None, at, np.array([0, 1, 2, -1]))
    with pytest.raises(ValueError, match="served: 3 rows for 4"):
        fn(cur, srv, None, 3, err, norm, fin, None, at, at[:3])
    with pytest.raises(ValueError, match="cur_at: wrong element type"):
        fn(cur, srv, None, 3, err, norm, fin, None, at.astype(np.int32), at)
