"""deltastream.tracking.owed_rows: a deferred read's current rows are the rows at the read,
bit for bit, however late each one is copied — by the next lookup of its position (before
the update), by bounded slices, by a walk on the C code's lane thread while training goes
on, or when the next drain settles them — on the C code and on numpy; bad input to the C
code is an error that writes nothing."""

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


def _take(f: FreshRows, storage: torch.Tensor, offset: int = 0) -> tuple:
    """A deferred unordered drain (the C code: the only one that drains unordered)."""
    was = fresh_rows.native_enabled()
    fresh_rows.use_native(True)
    try:
        return f.take_unordered(storage, offset=offset)
    finally:
        fresh_rows.use_native(was)


needs_native = pytest.mark.skipif(not fresh_rows.NATIVE_AVAILABLE,
                                  reason="deltastream.tracking.native is not built")


@pytest.fixture(params=["here", "lane"])
def walk_where(request, monkeypatch):
    """Bounded walks on the calling thread, or (``lane``: as where torch leaves a core
    spare) queued whole on the C code's lane thread."""
    monkeypatch.setattr(fresh_rows, "spare_core", lambda: request.param == "lane")
    return request.param


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [1, 33])
@pytest.mark.parametrize("by_occurrence", [False, True])
def test_owed_rows_are_the_rows_at_the_read(fresh_path, walk_where, dtype, dim,
                                            by_occurrence):
    """Marked and drained by the C code; while the rows are owed, training goes on (its
    lookups and the slices on ``fresh_path``): lookups copy their owed rows before the
    update, slices walk at most what they are given (on the lane: the whole walk, once it
    ran)."""
    g = torch.Generator().manual_seed(dim)
    capacity = 3000
    weight = torch.randn(capacity, dim, generator=g).to(dtype)
    f = FreshRows(capacity)
    for _ in range(3):
        before = weight.clone()
        was = fresh_rows.native_enabled()
        fresh_rows.use_native(True)
        looked_up = []
        try:
            for _ in range(3):
                looked_up += _lookups(g, capacity)
                _train_step(f, weight, looked_up[-2:], by_occurrence)
        finally:
            fresh_rows.use_native(was)
        at_read = weight.clone()
        ids, pos, at, arena, current, _ = _take(f, weight)
        walks = []
        while f.owes:
            _train_step(f, weight, _lookups(g, capacity, 1), by_occurrence)
            walks.append(f.capture(97))
        if walk_where == "here" or fresh_path == "numpy":
            assert 0 < max(walks) <= 97 + 63  # whole 64-bit words of the marks
        else:
            assert walks[-1] == ids.numel() and not any(walks[:-1])
        # the positions (and ids: id = position here) are written as the marks are walked
        assert torch.equal(torch.sort(pos).values, torch.unique(torch.cat(looked_up)))
        assert torch.equal(ids, pos) and torch.equal(arena[at], before[pos])
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
    _, pos, _, _, current, _ = _take(f, weight)
    at_read = weight.clone()
    _train_step(f, weight, [torch.arange(0, 50)], False)  # copied by the lookup, then moved
    assert f.owes == 550
    f.drain(True)  # a drain (a flush, an eviction, a reload) settles what is owed first
    assert f.owes == 0 and torch.equal(current, at_read[pos])


@needs_native
def test_a_table_that_grows_while_its_marks_are_walked(fresh_path, walk_where):
    """The owed set grows with the table (new positions unmarked): lookups of the new
    positions mark the next interval only, the walk finishes, and the next hand-off marks
    a set of the new size."""
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(500, 3, generator=g)
    f = FreshRows(500)
    fresh_rows.use_native(True)
    before = weight.clone()
    _train_step(f, weight, [torch.arange(100, 400, 3)], False)
    fresh_rows.use_native(fresh_path == "native")
    ids, pos, at, arena, current, give_back = _take(f, weight)
    at_read = weight.clone()
    f.capture(10)
    weight = torch.cat([weight, torch.randn(300, 3, generator=g)])  # the table grew
    f.grow(800)
    if walk_where == "lane" and fresh_path == "native":  # the walk queued: finished first
        assert not f.owed.walking and not f.owes
    else:
        assert f.owed.owed.size == 800 and f.owed.bits.size == 100
    fresh_rows.use_native(True)  # C marking: the next interval can be handed over
    _train_step(f, weight, [torch.tensor([150, 600, 799])], False)
    fresh_rows.use_native(fresh_path == "native")
    while f.owes:
        f.capture(16)
    assert torch.equal(pos, torch.arange(100, 400, 3)) and torch.equal(ids, pos)
    assert torch.equal(current, at_read[pos]) and torch.equal(arena[at], before[pos])
    give_back()
    fresh_rows.use_native(True)
    ids2, pos2, _, _, current2, _ = _take(f, weight, offset=1000)  # 150, 600, 799
    f.settle()
    assert pos2.tolist() == [150, 600, 799] and torch.equal(current2, weight[pos2])
    assert ids2.tolist() == [1150, 1600, 1799]  # a row-wise shard's: position + offset
    assert f.slot.size == 800 and not f.marks.any()


def test_native_walk_refuses_bad_input():
    if not fresh_rows.NATIVE_AVAILABLE:
        pytest.skip("deltastream.tracking.native is not built")
    from deltastream.tracking import native

    owed, bits, words = np.zeros(16, np.int32), np.zeros(2, np.uint8), np.ones(1, np.uint8)
    owed[[1, 9]], bits[:] = [1, 5], [0b10, 0b10]  # position 9 names row 4 of a 2-row out
    src, rows = np.arange(64, dtype=np.uint8), np.zeros(8, np.uint8)
    out = [np.zeros(2, np.int64) for _ in range(3)]
    with pytest.raises(ValueError, match="owed: position 9 names row 4 of a 2-row early"):
        native.walk_owed(owed, bits, words, 0, 100, src, rows.copy(), rows, 4, None, *out, 0, 0)
    assert owed.tolist()[:10] == [0, 1, 0, 0, 0, 0, 0, 0, 0, 5] and bits.tolist() == [2, 2]
    with pytest.raises(ValueError, match="ids_out, pos_out and at_out: 2 entries each"):
        native.walk_owed(owed, bits, words, 0, 100, src, rows.copy(), rows, 4, None,
                         out[0], out[1], np.zeros(3, np.int64), 0, 0)
    with pytest.raises(ValueError, match=r"bits: 1 bytes for 16 positions \(want 2\)"):
        native.walk_owed(owed, bits[:1], words, 0, 100, src, rows.copy(), rows, 4, None,
                         *out, 0, 0)
    owed[9] = -2  # captured by a lookup: its row comes from early
    early = np.arange(100, 108, dtype=np.uint8)
    assert native.walk_owed(owed, bits, words, 0, 100, src, early, rows, 4,
                            np.arange(16, dtype=np.int64) * 10, *out, 0, 0) == (1, 2, 1)
    assert rows.tolist() == [4, 5, 6, 7, 104, 105, 106, 107]  # src row 1, early row 1
    assert [o.tolist() for o in out] == [[10, 90], [1, 9], [0, 1]]  # ids, positions, at
    assert not owed.any() and not bits.any()
    # early holds a row per arena row: more than the entries where a mark was forgotten
    # (arena row 1's position was freed): two entries name arena rows 0 and 2
    owed[[1, 9]], bits[:] = [1, -3], [0b10, 0b10]
    early = np.arange(100, 112, dtype=np.uint8)
    assert native.walk_owed(owed, bits, words, 0, 100, src, early, rows, 4, None, *out,
                            0, 0) == (1, 2, 1)
    assert rows.tolist() == [4, 5, 6, 7, 108, 109, 110, 111]  # src row 1, early row 2
    assert [o.tolist() for o in out] == [[1, 9], [1, 9], [0, 2]]


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
    assert out.tolist() == [8, 9, 10, 11, 20, 21, 22, 23]
    assert owed.tolist() == [0, 0, -1, 0, 0, -2, 0, 0]  # captured: negated (walk_owed)


@needs_native
def test_a_walk_on_the_lane_races_the_lookups_and_tears_no_row(monkeypatch):
    """The lane thread walks a large hand-off while the training thread looks up the very
    positions the walk is about to reach and moves each row right after its lookup, as an
    optimizer does: every row handed over is still its value at the read, bit for bit (a
    row the walk is copying is waited for by the lookup; a row the lookup copied first is
    taken from there)."""
    monkeypatch.setattr(fresh_rows, "spare_core", lambda: True)
    fresh_rows.use_native(True)
    g = torch.Generator().manual_seed(11)
    capacity, dim = 1 << 17, 16
    weight = torch.randn(capacity, dim, generator=g)
    f = FreshRows(capacity)
    raced = 0
    for _ in range(6):
        f.add(torch.randperm(capacity, generator=g)[:capacity // 2], weight)
        _, pos, _, _, current, give_back = _take(f, weight)
        at_read = weight.clone()
        owed = f.owed.owed
        fresh_rows.native.hold_lane(True)  # the walk queued, not yet running
        try:
            assert f.capture(1) == 0 and f.owed.queued
            q = torch.from_numpy(np.flatnonzero(owed > 0)[:64].astype(np.int64))
            f.add(q, weight)  # copied by the lookup: the walk takes them from there
            weight[q] += 1.0
            raced += int(q.numel())
        finally:
            fresh_rows.native.hold_lane(False)
        while f.capture(1) == 0 and f.owed.queued:
            front = np.flatnonzero(owed > 0)[:16]  # what the walk reaches next
            q = torch.from_numpy(front.astype(np.int64))
            f.add(q, weight)  # the lookup copies what is still owed, or waits for the walk
            weight[q] += 1.0  # then the optimizer moves the rows
            raced += int(q.numel())
        while f.owes:
            f.capture(97)
        assert torch.equal(current, at_read[pos])
        give_back()
        f.drain(True)
    assert raced > 0
