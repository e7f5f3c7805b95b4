"""deltastream.tracking.fresh_rows: the C code and numpy keep the same FIRST rows (the
contract), for every row dtype, width and id dtype; bad input is an error that changes
nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import torch

from deltastream.tracking import fresh_rows
from deltastream.tracking.fresh_rows import FreshRows, as_bytes

REPO = Path(__file__).resolve().parents[3]


def _interval(lookups: list[torch.Tensor], weight: torch.Tensor | None, capacity: int,
              switch_at: int | None = None, by_occurrence: bool = False):
    """Record ``lookups`` (the weight moving after each, as an optimizer moves it), then
    drain in position order. ``switch_at``: the other path takes over from that lookup on;
    ``by_occurrence``: rows come from each lookup's output, not from the table."""
    f = FreshRows(capacity)
    for i, q in enumerate(lookups):
        if i == switch_at:
            fresh_rows.use_native(not fresh_rows.native_enabled())
        if by_occurrence:  # the lookup's output: the rows at its ids, as they are now
            f.add(q, weight[q.long()], by_occurrence=True)
        else:
            f.add(q, weight)
        if weight is not None:
            weight.index_add_(0, q.long(), torch.ones(q.numel(), weight.shape[1],
                                                       dtype=weight.dtype))
    return f.drain(weight is not None) + (f.marks,)


def _expected(lookups: list[torch.Tensor], weight0: torch.Tensor | None):
    """Each distinct id ascending, and its row before the first lookup that had it."""
    ids = torch.unique(torch.cat(lookups).long())
    return ids, None if weight0 is None else weight0[ids]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [1, 3, 32, 33, 64])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("by_occurrence", [False, True])
def test_first_rows_exact_on_both_paths(fresh_path, dtype, dim, id_dtype, by_occurrence):
    g = torch.Generator().manual_seed(dim)
    capacity = 3000
    # Zipf-like: many repeats inside and across lookups, and ids near both ends
    # (several arena growths: the first holds 1024 rows)
    lookups = [(torch.rand(700, generator=g) ** 4 * capacity).to(id_dtype) for _ in range(6)]
    lookups.append(torch.tensor([0, capacity - 1, capacity - 1], dtype=id_dtype))
    weight = torch.randn(capacity, dim, generator=g).to(dtype)
    want_ids, want_rows = _expected(lookups, weight.clone())
    ids, rows, marks = _interval(lookups, weight, capacity, by_occurrence=by_occurrence)
    assert torch.equal(ids, want_ids)
    assert rows.dtype == dtype and torch.equal(rows, want_rows)  # bit for bit
    assert not marks.any()


def _state(f: FreshRows) -> tuple:
    """What a marking leaves: the marks, the arena rows written and their positions."""
    return (f.slot.copy(), f.bits.copy(), f.words.copy(), f.order[:f.used].copy(),
            None if f.arena is None else f.arena[:f.used].clone(), f.used)


def _same(a: tuple, b: tuple) -> bool:
    return all(np.array_equal(x, y) if isinstance(x, np.ndarray) else
               torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
               for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_a_lookups_output_in_one_call_equals_add_or_changes_nothing(fresh_path, dtype,
                                                                     id_dtype):
    """``add_output`` (the hook's one C call) leaves what ``add(by_occurrence=True)``
    leaves; where it cannot (numpy runs, no arena yet or too small, bf16, positions past the
    marks of a table that grew, a marking on the lane, owed rows) it returns None and
    nothing changed, and ``add`` then records the lookup."""
    g = torch.Generator().manual_seed(5)
    capacity = 3000
    weight = torch.randn(capacity + 500, 16, generator=g).to(dtype)
    lookups = [(torch.rand(700, generator=g) ** 4 * capacity).to(id_dtype) for _ in range(8)]
    lookups.insert(5, torch.tensor([capacity + 9, 2], dtype=id_dtype))  # the table grew
    a, b = FreshRows(capacity), FreshRows(capacity)
    fast = 0
    for q in lookups:
        rows = weight[q.long()]
        if int(q.max()) >= a.slot.size:
            a.grow(capacity + 500), b.grow(capacity + 500)
        before = _state(b)
        k = b.add_output(q, rows)
        if k is None:
            assert _same(_state(b), before)
            b.add(q, rows, by_occurrence=True)
        fast += k is not None
        assert k is None or k == a.add(q, rows, by_occurrence=True)
        if k is None:
            a.add(q, rows, by_occurrence=True)
        assert _same(_state(a), _state(b))
        weight.index_add_(0, q.long(), torch.ones(q.numel(), 16, dtype=dtype))
    # the C code takes every lookup that finds room in the arena (not the first: none yet;
    # nor one that grows it) where numpy has the dtype
    if not fresh_rows.native_enabled() or dtype is torch.bfloat16:
        assert fast == 0
    else:
        assert len(lookups) // 2 <= fast < len(lookups)
    past = FreshRows(10)
    past.add(torch.tensor([1]), torch.ones(1, 16, dtype=dtype), by_occurrence=True)
    before = _state(past)
    assert past.add_output(torch.tensor([3, 12]), torch.ones(2, 16, dtype=dtype)) is None
    assert _same(_state(past), before)


@pytest.mark.skipif(not fresh_rows.NATIVE_AVAILABLE, reason="deltastream.tracking.native "
                    "is not built")
def test_a_lookups_output_waits_for_add_while_a_marking_is_late_or_rows_are_owed():
    weight = torch.randn(100, 8)
    f = FreshRows(100)
    f.add(torch.tensor([1, 2]), weight, later=True)  # on the lane: add syncs it first
    assert f.add_output(torch.tensor([3]), weight[[3]]) is None
    f.sync()
    assert f.add_output(torch.tensor([3]), weight[[3]]) == 1
    f.take_unordered(weight)  # the marks handed over, their current rows owed
    assert f.owes and f.add_output(torch.tensor([4]), weight[[4]]) is None


def test_a_lookups_output_of_another_dtype_than_the_arena_goes_to_add(fresh_path):
    """Rows of another dtype than the arena's (bf16 included, which numpy lacks) are left
    to ``add``: no error, nothing changed."""
    f = FreshRows(100)
    f.add(torch.tensor([1]), torch.ones(1, 8), by_occurrence=True)
    before = _state(f)
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        assert f.add_output(torch.tensor([2]), torch.ones(1, 8, dtype=dtype)) is None
        assert _same(_state(f), before)


def test_both_paths_agree_and_may_follow_each_other():
    if not fresh_rows.NATIVE_AVAILABLE:
        pytest.skip("deltastream.tracking.native is not built")
    was = fresh_rows.native_enabled()
    try:
        g = torch.Generator().manual_seed(7)
        lookups = [torch.randint(0, 5000, (900,), generator=g) for _ in range(8)]
        w0 = torch.randn(5000, 16, generator=g)
        results = []
        for native, switch in ((True, None), (False, None), (True, 4), (False, 4)):
            fresh_rows.use_native(native)
            results.append(_interval(lookups, w0.clone(), 5000, switch)[:2])
            fresh_rows.use_native(native)
            results.append(_unordered(lookups, w0.clone(), 5000, switch))
        want_ids, want_rows = results[0]
        for ids, rows in results[2::2]:
            assert torch.equal(ids, want_ids) and torch.equal(rows, want_rows)
        for ids, rows in results[1::2]:  # each position once, in some lookup order
            order = ids.argsort()
            assert torch.equal(ids[order], want_ids) and torch.equal(rows[order], want_rows)
    finally:
        fresh_rows.use_native(was)


def _unordered(lookups: list[torch.Tensor], weight: torch.Tensor, capacity: int,
               switch_at: int | None):
    """:func:`_interval`, drained in lookup order (:meth:`FreshRows.drain_unordered`)."""
    f = FreshRows(capacity)
    for i, q in enumerate(lookups):
        if i == switch_at:
            fresh_rows.use_native(not fresh_rows.native_enabled())
        f.add(q, weight)
        weight.index_add_(0, q, torch.ones(q.numel(), weight.shape[1]))
    touched, at = f.drain_unordered()
    assert not f.marks.any()
    return torch.from_numpy(touched), f.rows(at)


def _record_switching(f: FreshRows, lookups: list[torch.Tensor], weight: torch.Tensor,
                      switch_at: int | None) -> None:
    """Record ``lookups`` of ``weight`` (moved after each, as an optimizer moves it); from
    lookup ``switch_at`` on, the other path (when the extension is built)."""
    for i, q in enumerate(lookups):
        if i == switch_at and fresh_rows.NATIVE_AVAILABLE:
            fresh_rows.use_native(not fresh_rows.native_enabled())
        f.add(q, weight)
        weight.index_add_(0, q, torch.ones(q.numel(), weight.shape[1]))


@pytest.mark.parametrize("keys_kind", ["hashed", "negative", "narrow", "one"])
@pytest.mark.parametrize("switch_at", [None, 3])
def test_drain_by_key_sorts_by_the_id_at_each_position(fresh_path, keys_kind, switch_at):
    """A hash table's positions hold ids in no order: the drain gives the touched positions
    by ascending id, with their FIRST rows, on both paths (and after a switch of path, which
    leaves numpy's repeats in the arena)."""
    g = torch.Generator().manual_seed(11)
    capacity = 4000
    keys = {"hashed": torch.randint(-2**62, 2**62, (capacity,), generator=g),
            "negative": -torch.randperm(capacity, generator=g) - 5,
            "narrow": torch.randperm(capacity, generator=g) + 2**40,  # one radix digit set
            "one": torch.arange(capacity)}[keys_kind]
    lookups = [(torch.rand(900, generator=g) ** 3 * capacity).long() for _ in range(6)]
    if keys_kind == "one":
        lookups = [torch.tensor([17, 17])]
    weight = torch.randn(capacity, 8, generator=g)
    w0 = weight.clone()
    f, was = FreshRows(capacity), fresh_rows.native_enabled()
    try:
        _record_switching(f, lookups, weight, switch_at)
        ids, pos, rows = f.drain_by_key(keys, True)
    finally:
        fresh_rows.use_native(was)
    touched = torch.unique(torch.cat(lookups))
    want = keys[touched].sort()
    assert torch.equal(ids, want.values)
    assert torch.equal(pos, touched[want.indices])
    assert torch.equal(rows, w0[pos])  # bit for bit, each position's row before its update
    assert not f.marks.any() and not f.bits.any() and f.used == 0
    ids2, pos2, rows2 = f.drain_by_key(keys, True)  # nothing since: empty, not stale
    assert ids2.numel() == pos2.numel() == rows2.shape[0] == 0


def test_drain_by_key_ids_only(fresh_path):
    f = FreshRows(6)
    f.add(torch.tensor([5, 1, 5]))
    ids, pos, rows = f.drain_by_key(torch.tensor([0, 30, 0, 0, 0, 20]), False)
    assert ids.tolist() == [20, 30] and pos.tolist() == [5, 1] and rows is None


def test_ids_only(fresh_path):
    lookups = [torch.tensor([9, 4, 9]), torch.tensor([4, 2])]
    ids, rows, marks = _interval(lookups, None, 10)
    assert ids.tolist() == [2, 4, 9] and rows is None and not marks.any()


@pytest.mark.parametrize("bad", [10, -1, 2**40])
def test_an_id_outside_the_table_is_named_and_changes_nothing(fresh_path, bad):
    f = FreshRows(10)
    w = torch.randn(10, 4)
    assert f.add(torch.tensor([3]), w) == 1
    with pytest.raises(IndexError, match=rf"lookup id {bad} \(at 2\) is outside the table's "
                                         r"rows \[0, 10\)"):
        f.add(torch.tensor([5, 6, bad, 7]), w)
    assert f.marks.nonzero().flatten().tolist() == [3]  # 5 and 6 were not marked
    ids, rows = f.drain(True)
    assert ids.tolist() == [3] and torch.equal(rows, w[[3]])


def test_a_weight_seen_before_is_read_where_it_is_now(fresh_path):
    f = FreshRows(4)
    w = torch.zeros(4, 2)
    f.add(torch.tensor([0]), w)
    w = torch.ones(4, 2)  # another tensor (the old one freed): its rows are read, not stale ones
    f.add(torch.tensor([1]), w)
    ids, rows = f.drain(True)
    assert ids.tolist() == [0, 1] and rows.tolist() == [[0.0, 0.0], [1.0, 1.0]]


def test_native_refuses_short_buffers_and_a_bad_slot():
    if not fresh_rows.NATIVE_AVAILABLE:
        pytest.skip("deltastream.tracking.native is not built")
    from deltastream.tracking import native

    slot, bits = np.zeros(10, dtype=np.int32), np.zeros(2, dtype=np.uint8)
    order, w = np.zeros(3, dtype=np.int64), np.zeros(10 * 8, dtype=np.uint8)
    ids = np.array([1, 2, 3])
    with pytest.raises(ValueError, match="arena: 16 bytes do not hold 3 rows"):
        native.mark_fresh(slot, bits, order, ids, w, False, 8, np.zeros(16, np.uint8), 0)
    with pytest.raises(ValueError, match="src: 80 bytes do not hold 10 rows of 16 bytes"):
        native.mark_fresh(slot, bits, order, ids, w, False, 16, np.zeros(64, np.uint8), 0)
    with pytest.raises(ValueError, match=r"order: 3 entries for 1 \+ 3 rows"):
        native.mark_fresh(slot, bits, order, ids, None, False, 0, None, 1)
    with pytest.raises(ValueError, match=r"bits: 1 bytes for 10 positions \(want 2\)"):
        native.mark_fresh(slot, bits[:1], order, ids, None, False, 0, None, 0)
    assert not slot.any() and not bits.any()
    slot[4], bits[0] = 100, 1 << 4  # names arena row 99, past the arena: refused, kept
    with pytest.raises(ValueError, match="slot of position 4 names arena row 99"):
        native.drain_marked(slot, bits, np.zeros(80, np.uint8), np.zeros(1, np.int64),
                            np.zeros(8, np.uint8))
    assert slot[4] == 100 and bits[0] == 1 << 4
    slot[4], slot[:2], bits[0] = 0, 1, 0b11  # two positions naming one row: refused, kept
    with pytest.raises(ValueError, match="slot of position 1 names arena row 0: not one of "
                                         "the 2 rows written, or another position's"):
        native.drain_marked(slot, bits, np.zeros(16, np.uint8), np.zeros(2, np.int64),
                            np.zeros(16, np.uint8))
    assert slot.tolist()[:5] == [1, 1, 0, 0, 0] and bits[0] == 0b11
    for arena, at in ((None, np.zeros(1, np.int64)), (np.zeros(16, np.uint8),
                                                       np.zeros(2, np.int64))):
        with pytest.raises(ValueError, match="out_at: int64 as long as out_ids, no arena"):
            native.drain_marked(slot, bits, arena, np.zeros(2, np.int64),
                                None if arena is None else np.zeros(16, np.uint8), at)
    assert slot.tolist()[:5] == [1, 1, 0, 0, 0] and bits[0] == 0b11
    slot[1], at2 = 2, np.zeros(2, np.int64)  # valid marks: positions 0 and 1
    with pytest.raises(ValueError, match="keys and out_keys: both or neither"):
        native.drain_marked(slot, bits, None, np.zeros(2, np.int64), None, at2, None,
                            np.zeros(10, np.int64), None)
    with pytest.raises(ValueError, match="keys: position 1 is marked, keys has 1"):
        native.drain_marked(slot, bits, None, np.zeros(2, np.int64), None, at2, None,
                            np.zeros(1, np.int64), np.zeros(2, np.int64))
    assert slot.tolist()[:5] == [1, 2, 0, 0, 0] and bits[0] == 0b11  # kept
    out_keys = np.zeros(2, np.int64)
    assert native.drain_marked(slot, bits, None, np.zeros(2, np.int64), None, at2, None,
                               np.arange(10, dtype=np.int64) * 10, out_keys) == 2
    assert out_keys.tolist() == [0, 10] and at2.tolist() == [0, 1] and not bits.any()
    slot[:2], bits[0] = 1, 0b11
    keys = np.zeros(10, np.int64)
    with pytest.raises(ValueError, match=r"order, out_keys, out_pos: fewer than 5 entries"):
        native.drain_by_key(slot, bits, order, 5, keys, None, np.zeros(5, np.int64),
                            np.zeros(5, np.int64), None)
    with pytest.raises(ValueError, match="or keys: fewer than 10"):
        native.drain_by_key(slot, bits, order, 2, keys[:9], None, np.zeros(2, np.int64),
                            np.zeros(2, np.int64), None)
    with pytest.raises(ValueError, match="order: arena row 0 names position 99"):
        native.drain_by_key(slot, bits, np.array([99, 0, 0]), 2, keys, None,
                            np.zeros(2, np.int64), np.zeros(2, np.int64), None)
    assert slot.tolist()[:5] == [1, 1, 0, 0, 0] and bits[0] == 0b11  # refused: kept


@pytest.mark.parametrize("switch_at", [None, 2])
@pytest.mark.parametrize("unordered", [False, True])
@pytest.mark.parametrize("grow", [False, True])
def test_sparse_marks_in_a_large_table_all_drained(fresh_path, switch_at, unordered, grow):
    """A large table whose lookups touch a few scattered positions (the ends of words and
    of the 512-position groups the drain skips whole, the last position), growing
    mid-interval or not: every marked position is drained once with its FIRST row,
    whichever path marked it, and nothing stays marked (bits and their words)."""
    g = torch.Generator().manual_seed(3)
    capacity = 200_000
    edges = torch.tensor([0, 63, 64, 511, 512, 4095, 4096, 99_999, capacity - 1])
    lookups = [edges, torch.randint(0, capacity, (300,), generator=g), edges[::2],
               torch.tensor([capacity + 5, 2 * capacity - 1]) if grow else edges[1::3]]
    weight = torch.randn(2 * capacity, 8, generator=g)
    w0 = weight.clone()
    f = FreshRows(capacity)
    was = fresh_rows.native_enabled()
    try:
        for i, q in enumerate(lookups):
            if i == 3 and grow:
                f.grow(2 * capacity)
            if i == switch_at and fresh_rows.NATIVE_AVAILABLE:
                fresh_rows.use_native(not fresh_rows.native_enabled())
            f.add(q, weight)
            weight.index_add_(0, q, torch.ones(q.numel(), weight.shape[1]))
        if unordered:
            got = f.take_unordered()
            if got is None:  # refused: numpy marked rows this interval
                assert not fresh_rows.native_enabled() or switch_at is not None
                ids, rows = f.drain(True)
            else:
                _, pos, at, arena, _, _ = got
                ids, rows = pos, arena[at]
        else:
            ids, rows = f.drain(True)
    finally:
        fresh_rows.use_native(was)
    want = torch.unique(torch.cat(lookups))
    assert torch.equal(ids, want) and torch.equal(rows, w0[want])
    assert not f.marks.any() and not f.bits.any() and not f.words.any()


def test_native_drain_reads_only_the_words_named():
    """With ``words`` the drain reads the words of bits it names and no others (the work
    follows the positions marked); a ``words`` of the wrong size is refused, naming it."""
    if not fresh_rows.NATIVE_AVAILABLE:
        pytest.skip("deltastream.tracking.native is not built")
    from deltastream.tracking import native

    capacity = 4096 + 70  # 66 words of bits, 9 bytes of words
    slot, bits = np.zeros(capacity, np.int32), np.zeros((capacity + 7) // 8, np.uint8)
    words = np.zeros(9, np.uint8)
    order = np.zeros(4, np.int64)
    used = native.mark_fresh(slot, bits, order, np.array([5, 4160, 5]), None, False, 0, None,
                             0, words)
    assert used == 2 and words.tolist() == [1, 0, 0, 0, 0, 0, 0, 0, 2]  # words 0 and 65
    slot[700], bits[700 >> 3] = 3, 1 << (700 & 7)  # a mark its word's bit does not name
    out, at = np.zeros(3, np.int64), np.zeros(3, np.int64)
    k = native.drain_marked(slot, bits, None, out, None, at, words)
    assert out[:k].tolist() == [5, 4160] and at[:k].tolist() == [0, 1]
    assert not words.any() and slot[700] == 3 and bits[700 >> 3]  # not read, not cleared
    with pytest.raises(ValueError, match=r"words: 8 bytes for 521 bytes of bits \(want 9\)"):
        native.mark_fresh(slot, bits, order, np.array([1]), None, False, 0, None, 0,
                          words[:8])
    with pytest.raises(ValueError, match=r"words: 8 bytes"):
        native.drain_marked(slot, bits, None, out, None, at, words[:8])


def test_without_the_extension_numpy_runs(tmp_path):
    """An install without a C compiler: the module still imports, numpy does the work."""
    script = tmp_path / "no_native.py"
    script.write_text(textwrap.dedent("""
        import importlib.abc, sys
        import torch

        class NoNative(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "deltastream.tracking.native":
                    raise ImportError("not built (test)")

        sys.meta_path.insert(0, NoNative())
        from deltastream.tracking import fresh_rows
        assert not fresh_rows.NATIVE_AVAILABLE and not fresh_rows.native_enabled()
        try:
            fresh_rows.use_native(True)
        except RuntimeError as e:
            assert "not built (test)" in str(e)
        else:
            raise AssertionError("use_native(True) without the extension")
        f = fresh_rows.FreshRows(6)
        w = torch.arange(12.0).reshape(6, 2)
        f.add(torch.tensor([5, 1, 5]), w)
        ids, rows = f.drain(True)
        assert ids.tolist() == [1, 5] and rows.tolist() == [[2.0, 3.0], [10.0, 11.0]]
        print("ok")
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("by_key", [False, True])
def test_an_arena_far_larger_than_an_interval_needs_is_released(fresh_path, monkeypatch, by_key):
    """One interval with many lookups (a long pause between reads) must not hold its
    memory for the rest of the run: after a drain that used a quarter of it or less, an
    arena over KEEP_BYTES is released, and the next interval still keeps exact rows."""
    monkeypatch.setattr(fresh_rows, "KEEP_BYTES", 1 << 16)
    f = FreshRows(100_000)
    w = torch.randn(100_000, 8)
    keys = torch.arange(100_000) * 3

    def drain():
        return f.drain_by_key(keys, True)[2] if by_key else f.drain(True)[1]

    f.add(torch.arange(50_000), w)
    assert torch.equal(drain(), w[:50_000])  # used it all: kept
    assert f.arena is not None and f.arena.shape[0] >= 50_000
    f.add(torch.tensor([7, 3]), w)
    assert torch.equal(drain(), w[[3, 7]])
    assert f.arena is None and f.order.size == 0  # 2 rows used of 50K+: released
    f.add(torch.tensor([9, 1]), w)
    assert torch.equal(drain(), w[[1, 9]])


@pytest.mark.parametrize("switch_at", [None, 2])
def test_take_unordered_hands_over_the_arena_or_refuses(fresh_path, switch_at):
    """The C code's interval: each position once, ascending, with the arena row of its
    FIRST row, the arena handed over (a later interval writes a new one, the taken rows
    stay as they were); numpy's marks (or a switch to them) may hold repeats: None,
    nothing drained."""
    g = torch.Generator().manual_seed(5)
    capacity = 3000
    lookups = [(torch.rand(800, generator=g) ** 3 * capacity).long() for _ in range(5)]
    weight = torch.randn(capacity, 8, generator=g)
    w0 = weight.clone()
    f, was = FreshRows(capacity), fresh_rows.native_enabled()
    try:
        _record_switching(f, lookups, weight, switch_at)
        numpy_marked = not (fresh_rows.native_enabled() and switch_at is None)
        got = f.take_unordered()
    finally:
        fresh_rows.use_native(was)
    if numpy_marked:  # refused: the interval is still there for drain_by_key
        assert got is None and f.used > 0
        ids, _, rows = f.drain_by_key(torch.arange(capacity), True)
        assert torch.equal(ids, torch.unique(torch.cat(lookups)))
        assert torch.equal(rows, w0[ids])
        return
    ids, pos, at, arena, current, give_back = got
    assert current is None and ids is None  # not owed: the reader gathers the rows
    assert torch.equal(pos, torch.unique(torch.cat(lookups)))
    assert sorted(at.tolist()) == list(range(pos.numel()))  # one arena row each
    assert torch.equal(arena[at], w0[pos])  # bit for bit
    assert not f.marks.any() and not f.bits.any() and f.used == 0 and f.arena is None
    kept = arena.clone()
    keys = torch.randperm(capacity, generator=g) * 7  # a hash table's id at each position
    f.add(torch.tensor([7, 3]), weight)  # the next interval: a new arena
    assert torch.equal(arena, kept)
    ids2, pos2, at2, arena2, _, give_back2 = f.take_unordered(keys=keys.numpy())
    assert torch.equal(ids2, keys[pos2])  # the ids held at the positions, from the drain
    assert pos2.tolist() == [3, 7] and torch.equal(arena2[at2], weight[[3, 7]])
    assert f.take_unordered() is None  # nothing marked since
    give_back()  # the reader is done with the first arena: the next interval writes it
    f.add(torch.tensor([5]), weight)
    assert f.arena.data_ptr() == arena.data_ptr() and f.spares.reused == 1
    assert torch.equal(arena2[at2], weight[[3, 7]])  # not given back: untouched
    assert torch.equal(ids2, keys[[3, 7]]) and pos2.tolist() == [3, 7]
    # the first interval's positions were given back with its arena: the next drain
    # writes them (no buffer allocated in the tick)
    _, pos3, _, _, _, _ = f.take_unordered()
    assert pos3.tolist() == [5] and pos3.data_ptr() == pos.data_ptr()
    assert f.spares.reused == 2


def _later_interval(lookups: list[torch.Tensor], weight: torch.Tensor, capacity: int):
    """:func:`_interval` with every marking run later: synced before the weight moves (as
    the tracker's hook after a fused kernel's forward runs before its backward), then drained."""
    f = FreshRows(capacity)
    counted = 0
    for q in lookups:
        k = f.add(q, weight, later=True)  # None when it runs later (the C code)
        counted += q.numel() if k is None else k
        f.sync()
        weight.index_add_(0, q.long(), torch.ones(q.numel(), weight.shape[1],
                                                   dtype=weight.dtype))
    marked = counted - f.overcount  # the positions marked, from the lookups' id counts
    return f.drain(True) + (marked,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_markings_run_later_equal_markings_now(fresh_path, dtype, id_dtype):
    g = torch.Generator().manual_seed(7)
    capacity = 3000
    lookups = [(torch.rand(900, generator=g) ** 4 * capacity).to(id_dtype) for _ in range(6)]
    weight = torch.randn(capacity, 33, generator=g).to(dtype)
    want_ids, want_rows = _expected(lookups, weight.clone())
    ids, rows, marked = _later_interval(lookups, weight, capacity)
    assert torch.equal(ids, want_ids) and torch.equal(rows, want_rows)
    assert marked == want_ids.numel()


def test_every_method_waits_for_a_marking_run_later(fresh_path):
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(500, 8, generator=g)
    q1, q2 = torch.tensor([4, 9, 4, 7]), torch.tensor([9, 1, 499])
    for finish in ("add", "drain", "drain_by_key", "grow", "clear"):
        f = FreshRows(500)
        f.add(q1, weight, later=True)
        if finish == "add":  # a second lookup: the first's marks must be in place
            f.add(q2, weight, later=True)
            ids, rows = f.drain(True)
            assert ids.tolist() == [1, 4, 7, 9, 499] and torch.equal(rows, weight[ids])
        elif finish == "drain":
            ids, rows = f.drain(True)
            assert ids.tolist() == [4, 7, 9] and torch.equal(rows, weight[ids])
        elif finish == "drain_by_key":
            ids, pos, rows = f.drain_by_key(torch.arange(500) * -1, True)
            assert ids.tolist() == [-9, -7, -4] and torch.equal(rows, weight[pos])
        elif finish == "grow":
            f.grow(800)
            assert f.drain(False)[0].tolist() == [4, 7, 9]
        else:
            f.clear()
            assert f.drain(False)[0].numel() == 0 and f.overcount == 0


@pytest.mark.skipif(not fresh_rows.NATIVE_AVAILABLE, reason="deltastream.tracking.native "
                    "is not built")
def test_a_marking_on_the_lane_copies_the_rows_as_they_are_when_it_runs():
    """The lane copies a row when it runs, not when the marking is queued: a change of the
    table before :meth:`FreshRows.sync` would be taken as the FIRST state (what the tracker's
    hook after the kernel's forward exists to prevent), and ``sync`` waits for a held lane."""
    import threading

    native = fresh_rows.native
    weight = torch.zeros(100, 4)
    f = FreshRows(100)
    native.hold_lane(True)
    try:
        f.add(torch.tensor([3, 5]), weight, later=True)
        weight[3] = 1.0  # an update before the sync
        threading.Timer(0.2, native.hold_lane, (False,)).start()
        f.sync()  # waits for the timer to release the lane
    finally:
        native.hold_lane(False)
    ids, rows = f.drain(True)
    assert ids.tolist() == [3, 5] and rows[0].tolist() == [1.0] * 4 and not rows[1].any()
    # a marking dropped before anyone waited for it still runs before its buffers go
    slot, bits = np.zeros(100, np.int32), np.zeros(13, np.uint8)
    order, arena = np.empty(8, np.int64), torch.empty(8, 4)
    native.hold_lane(True)
    m = native.mark_fresh_later(slot, bits, order, np.array([7, 7, 2]), as_bytes(weight),
                                False, 16, as_bytes(arena), 0)
    assert not m.done
    threading.Timer(0.1, native.hold_lane, (False,)).start()
    del m  # the deallocation waits for the lane
    assert order[:2].tolist() == [7, 2] and slot[7] == 1 and slot[2] == 2


@pytest.mark.skipif(not fresh_rows.NATIVE_AVAILABLE or not hasattr(os, "fork"),
                    reason="needs deltastream.tracking.native and fork()")
def test_a_forked_child_runs_markings_on_a_lane_of_its_own():
    weight = torch.randn(50, 4)
    f = FreshRows(50)
    f.add(torch.tensor([1, 2]), weight, later=True)  # the parent's lane is up
    pid = os.fork()
    if pid == 0:  # the child: no lane thread was copied; a marking starts one
        code = 1
        try:
            f.add(torch.tensor([2, 30]), weight, later=True)
            ids, rows = f.drain(True)
            code = 0 if ids.tolist() == [1, 2, 30] and torch.equal(rows, weight[ids]) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert f.drain(False)[0].tolist() == [1, 2]


def _lane_tid() -> Optional[int]:
    """The thread id of this process's lane thread (named ``ds-lane``), if it runs."""
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().strip() == "ds-lane":
                return int(task.name)
        except OSError:
            continue
    return None


@pytest.mark.skipif(not fresh_rows.NATIVE_AVAILABLE or not sys.platform.startswith("linux"),
                    reason="deltastream.tracking.native is not built, or not Linux")
def test_a_wait_runs_the_marking_itself_while_another_process_keeps_the_lane_off_its_cpu():
    """The lane thread runs at SCHED_IDLE: a busy process on its CPU (a publisher's worker,
    a broker) keeps it from running. A caller that then waits for a marking the lane has not
    started runs it on its own thread instead of sleeping until the lane gets the CPU; the
    rows are marked and copied as the lane would have."""
    native = fresh_rows.native
    weight = torch.randn(1000, 8)
    f = FreshRows(1000)
    f.add(torch.tensor([0]), weight, later=True)  # the lane thread starts
    f.sync()
    tid = _lane_tid()
    assert tid is not None
    cpu = min(os.sched_getaffinity(0))
    everywhere = os.sched_getaffinity(tid)
    spin = subprocess.Popen([sys.executable, "-c",
                             f"import os\nos.sched_setaffinity(0, {{{cpu}}})\n"
                             "print('pinned', flush=True)\nwhile True: pass"],
                            stdout=subprocess.PIPE, text=True)
    try:
        os.sched_setaffinity(tid, {cpu})
        # the spinner runs on the lane's only CPU: wait for it (an interpreter's start on a
        # loaded machine can outlast any fixed sleep, and the lane ran freely until then)
        assert spin.stdout.readline() == "pinned\n"
        time.sleep(0.1)
        before = native.lane_jobs()
        rng = np.random.default_rng(0)
        for _ in range(20):
            f.add(torch.from_numpy(rng.integers(1, 1000, 50)), weight, later=True)
            f.sync()
        by_lane, by_waiters = (a - b for a, b in zip(native.lane_jobs(), before, strict=True))
    finally:
        spin.kill()
        spin.wait()
        os.sched_setaffinity(tid, everywhere)
    assert by_lane + by_waiters == 20 and by_waiters >= 15, (by_lane, by_waiters)
    ids, rows = f.drain(True)
    torch.testing.assert_close(rows, weight[ids], rtol=0, atol=0)


@pytest.mark.parametrize("owed", [False, True])
def test_forgotten_marks_are_not_drained_and_a_reused_position_marks_afresh(fresh_path, owed):
    """Rows freed mid-interval (their ids evicted): their marks go, the others stay; a
    position reused by a new id marks afresh with that id's row. Every drain agrees: by
    position, by key and — the C code's — unordered, with the current rows owed or not.
    Duplicates and unmarked positions among the freed ones count nothing."""
    if owed and not fresh_rows.native_enabled():
        pytest.skip("an owed drain is the C code's")
    capacity = 64
    weight = torch.arange(capacity * 4, dtype=torch.float32).reshape(capacity, 4)
    f = FreshRows(capacity)
    f.add(torch.tensor([3, 9, 12, 40]), weight)
    weight[[3, 9, 12, 40]] += 1000  # the optimizer moves them
    assert f.forget(np.array([9, 40, 40, 50])) == 2  # 50 was not marked
    assert f.forget(np.array([9])) == 0  # forgotten already
    weight[9] = -7.0  # reused by a new id: its row as inserted
    f.add(torch.tensor([9, 3, 5]), weight)
    weight[[9, 5]] += 1000
    want_pos, want_first = [3, 5, 9, 12], torch.stack([weight[3], weight[5] - 1000,
                                                       torch.full((4,), -7.0), weight[12]])
    want_first[0] -= 1000
    want_first[3] -= 1000
    if fresh_rows.native_enabled():
        got = f.take_unordered(weight if owed else None, np.arange(capacity) * 10)
        ids, pos, at, arena, current, _ = got
        if owed:
            f.capture(None)
            assert torch.equal(current[torch.argsort(pos)], weight[want_pos])
        order = torch.argsort(pos)
        assert pos[order].tolist() == want_pos and ids[order].tolist() == [30, 50, 90, 120]
        assert torch.equal(arena[at[order]], want_first)
    else:
        ids, pos, rows = f.drain_by_key(torch.arange(capacity) * 10, True)
        assert pos.tolist() == want_pos and torch.equal(rows, want_first)
    assert f.forgotten == 0 and f.used == 0
    f.add(torch.tensor([1, 2]), weight)  # the next interval: nothing forgotten carried over
    f.forget(np.array([2]))
    positions, rows = f.drain(True)
    assert positions.tolist() == [1] and torch.equal(rows, weight[[1]])
