"""SpareRows: the row buffers a hand-off's reader gives back to the tracker (pure logic)."""

from __future__ import annotations

import threading

import torch

from deltastream.tracking.spare_rows import MAX_BYTES, SLACK, SMALL_BYTES, TOTAL_BYTES, SpareRows


def test_take_allocates_a_power_of_two_rows_then_reuses_what_was_given_back():
    s = SpareRows()
    a = s.take(1000, 8, torch.float32)
    assert a.shape == (1024, 8) and (s.reused, s.allocated) == (0, 1)
    s.give_back(a)
    b = s.take(1020, 8, torch.float32)  # a slightly larger interval still fits
    assert b is a and (s.reused, s.allocated) == (1, 1) and len(s) == 0


def test_the_smallest_fitting_buffer_is_taken_and_the_others_kept():
    s = SpareRows(keep=4)
    big, small = torch.empty(4096, 4), torch.empty(1024, 4)
    s.give_back(big, small, None)  # None: nothing to give (no current rows)
    assert s.take(900, 4, torch.float32) is small
    assert s.take(2000, 4, torch.float32) is big
    assert len(s) == 0


def test_a_buffer_of_another_width_or_dtype_or_too_small_is_not_taken():
    s = SpareRows()
    kept = [torch.empty(64, 4), torch.empty(64, 8, dtype=torch.float16), torch.empty(16, 8)]
    s.give_back(*kept)
    fresh = s.take(64, 8, torch.float32)
    assert all(fresh is not k for k in kept) and len(s) == 3 and s.allocated == 1


def test_a_far_larger_buffer_is_taken_only_when_small_and_a_huge_one_is_never_kept():
    s = SpareRows()
    rows = 16
    modest = torch.empty(rows * SLACK * 2, 8)  # over the slack but small: fine
    assert modest.numel() * 4 <= SMALL_BYTES
    s.give_back(modest)
    assert s.take(rows, 8, torch.float32) is modest
    wide = SMALL_BYTES // (4 * 1024) * 2  # rows of 1024 float32: twice SMALL_BYTES
    large = torch.empty(wide, 1024)
    s.give_back(large)
    assert s.take(wide // (2 * SLACK), 1024, torch.float32) is not large  # > SLACK x rows
    assert s.take(wide // 2, 1024, torch.float32) is large
    huge = torch.empty(MAX_BYTES // 4 + 1024, 1, dtype=torch.float32)
    s.give_back(huge)
    assert len(s) == 0


def test_at_most_keep_buffers_and_total_bytes_the_oldest_dropped():
    s = SpareRows(keep=2)
    a, b, c = (torch.empty(8, 2) for _ in range(3))
    s.give_back(a, b, c)
    assert len(s) == 2
    assert {id(s.take(8, 2, torch.float32)), id(s.take(8, 2, torch.float32))} == {id(b), id(c)}
    s = SpareRows(keep=8)
    rows = MAX_BYTES // 4 // 64  # MAX_BYTES each, dim 64 float32
    bufs = [torch.empty(rows, 64) for _ in range(TOTAL_BYTES // MAX_BYTES + 1)]
    s.give_back(*bufs)
    assert len(s) == TOTAL_BYTES // MAX_BYTES and s.take(rows, 64, torch.float32) is bufs[1]


def test_give_back_from_other_threads_while_the_owner_takes():
    s = SpareRows(keep=8)
    stop = threading.Event()

    def giver():
        while not stop.is_set():
            s.give_back(torch.empty(32, 4))

    threads = [threading.Thread(target=giver) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        got = [s.take(32, 4, torch.float32) for _ in range(2000)]
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert all(g.shape[0] >= 32 and g.shape[1] == 4 for g in got)
    assert len({id(g) for g in got}) == len(got)  # no buffer handed out twice
    assert s.reused > 0 and len(s) <= 8


def test_take_viewed_hands_out_the_buffers_own_memory_kept_with_it():
    s = SpareRows()
    a, view = s.take_viewed(10, 4, torch.float32)
    view[3, 2] = 7.0  # the view is the buffer's memory, not a copy
    assert a[3, 2] == 7.0
    s.give_back(a)
    b, again = s.take_viewed(10, 4, torch.float32)  # given back: the same buffer and memory
    assert b is a and again[3, 2] == 7.0 and again.ctypes.data == a.data_ptr()
