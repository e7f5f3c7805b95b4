"""deltastream.tracking.owed_rows: a deferred read's current rows are the rows at the read,
bit for bit, however late each one is copied — by the next lookup of its position (before
the update), by bounded slices, or when the next drain settles them — on the C code and on
numpy; bad input to the C code is an error that writes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltastream.tracking import fresh_rows
from deltastream.tracking.fresh_rows import FreshRows


def _lookups(g: torch.Generator, capacity: int, k: int = 2) -> list[torch.Tensor]:
    return [(torch.rand(400, generator=g) ** 3 * capacity).long() for _ in range(k)]


def _train_step(f: FreshRows, weight: torch.Tensor, lookups: list[torch.Tensor],
                by_occurrence: bool) -> None:
    """Each lookup recorded (FIRST rows from the weight, or from the lookup's output),
    then the rows looked up move, as an optimizer moves them."""
    for q in lookups:
        if by_occurrence:
            f.add(q, weight[q].clone(), by_occurrence=True)
        else:
            f.add(q, weight)
    touched = torch.unique(torch.cat(lookups))
    weight[touched] += torch.randn(touched.numel(), weight.shape[1]).to(weight.dtype)


def _take(f: FreshRows, storage: torch.Tensor) -> tuple:
    """A deferred unordered drain (the C code: the only one that drains unordered)."""
    was = fresh_rows.native_enabled()
    fresh_rows.use_native(True)
    try:
        return f.take_unordered(storage)
    finally:
        fresh_rows.use_native(was)


needs_native = pytest.mark.skipif(not fresh_rows.NATIVE_AVAILABLE,
                                  reason="deltastream.tracking.native is not built")


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dim", [1, 33])
@pytest.mark.parametrize("by_occurrence", [False, True])
def test_owed_rows_are_the_rows_at_the_read(fresh_path, dtype, dim, by_occurrence):
    """Marked and drained by the C code; while the rows are owed, training goes on (its
    lookups and the slices on ``fresh_path``): lookups copy their owed rows before the
    update, slices walk at most what they are given."""
    g = torch.Generator().manual_seed(dim)
    capacity = 3000
    weight = torch.randn(capacity, dim, generator=g).to(dtype)
    f = FreshRows(capacity)
    for _ in range(3):
        before = weight.clone()
        was = fresh_rows.native_enabled()
        fresh_rows.use_native(True)
        try:
            for _ in range(3):
                _train_step(f, weight, _lookups(g, capacity), by_occurrence)
        finally:
            fresh_rows.use_native(was)
        at_read = weight.clone()
        pos, at, arena, current, _ = _take(f, weight)
        assert torch.equal(arena[at], before[pos])
        walks = []
        while f.owes:
            _train_step(f, weight, _lookups(g, capacity, 1), by_occurrence)
            walks.append(f.capture(97))
        assert 0 < max(walks) <= 97
        assert not torch.equal(weight[pos], at_read[pos])  # rows moved while owed
        assert torch.equal(current, at_read[pos])  # yet each is its value at the read
        f.drain(True)  # the next interval starts from C marking


@needs_native
def test_a_lookup_copies_its_owed_rows_and_the_next_drain_the_rest(fresh_path):
    weight = torch.randn(1000, 4, generator=torch.Generator().manual_seed(3))
    f = FreshRows(1000)
    fresh_rows.use_native(True)
    _train_step(f, weight, [torch.arange(0, 600)], False)
    fresh_rows.use_native(fresh_path == "native")
    pos, _, _, current, _ = _take(f, weight)
    at_read = weight.clone()
    _train_step(f, weight, [torch.arange(0, 50)], False)  # copied by the lookup, then moved
    assert f.owes == 550
    f.drain(True)  # a drain (a flush, an eviction, a reload) settles what is owed first
    assert f.owes == 0 and torch.equal(current, at_read[pos])


def test_native_capture_refuses_bad_input_and_writes_nothing():
    if not fresh_rows.NATIVE_AVAILABLE:
        pytest.skip("deltastream.tracking.native is not built")
    from deltastream.tracking import native

    owed = np.zeros(8, np.int32)
    owed[[2, 5]] = [1, 3]  # position 5 names row 2 of a 2-row out
    src, out = np.arange(32, dtype=np.uint8), np.zeros(8, np.uint8)
    with pytest.raises(IndexError, match=r"ids: position 8 \(at 1\) is outside \[0, 8\)"):
        native.capture_owed(owed, np.array([2, 8]), src, False, out, 4)
    with pytest.raises(ValueError, match="owed: position 5 names row 2 of a 2-row out"):
        native.capture_owed(owed, np.array([2, 5]), src, False, out, 4)
    with pytest.raises(ValueError, match="one src row per id"):
        native.capture_owed(owed, np.array([2, 2, 2, 2, 2, 2, 2, 2, 2]), src, True, out, 4)
    assert not out.any() and owed[2] == 1 and owed[5] == 3
    owed[5] = 2
    assert native.capture_owed(owed, np.array([5, 2, 2, 7], np.int32), src, False, out, 4) == 2
    assert out.tolist() == [8, 9, 10, 11, 20, 21, 22, 23] and not owed.any()
    slot, bits = np.zeros(8, np.int32), np.zeros(1, np.uint8)
    with pytest.raises(ValueError, match="owed: int32, one per position like slot"):
        native.drain_marked(slot, bits, None, np.zeros(2, np.int64), None,
                            np.zeros(2, np.int64), np.zeros(4, np.int32))
