"""The pending set and its orders: kept up to date by merges, equal to a full re-sort."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from deltastream import wire
from deltastream.publishing.pending import SENT_BIRTH, PendingTable
from deltastream.publishing.score_order import ScoreOrder, bucket_of


def test_score_order_top_equals_a_full_sort_through_updates_and_removals():
    rng = np.random.default_rng(0)
    n = 5000
    stamps = np.zeros(n, dtype=np.int64)
    key = np.full(n, np.nan)
    order = ScoreOrder()
    for _ in range(60):
        slots = rng.choice(n, size=300, replace=False)
        stamps[slots] += 1
        key[slots] = rng.exponential(size=300)
        live = int(np.count_nonzero(~np.isnan(key)))
        order.add(key[slots], slots, stamps[slots].copy(), stamps, live)
        gone = rng.choice(n, size=100, replace=False)  # published or removed
        stamps[gone] += 1
        key[gone] = np.nan
        for m in (1, 17, 600):
            k, s, more = order.top(m, stamps)
            want = np.sort(key[~np.isnan(key)])[::-1][:m]
            assert np.array_equal(k, want)
            assert np.array_equal(key[s], k)  # every entry returned is live and current
            assert more == (np.count_nonzero(~np.isnan(key)) > m) or more
    assert order.entries <= 2 * np.count_nonzero(~np.isnan(key)) + 4096 + 300


def test_score_order_top_is_the_live_entries_by_key_then_by_addition():
    """Ties (repeated keys, +inf, keys on bucket edges) come out in the order they were
    added, whatever bucket they share; dead entries never come out; rebuilds keep it."""
    rng = np.random.default_rng(1)
    n = 3000
    stamps = np.zeros(n, dtype=np.int64)
    key = np.full(n, np.nan)
    seq = np.zeros(n, dtype=np.int64)  # when each live slot's entry was added
    pool = np.array([np.inf, 1.0, 2.0, 2.0 ** 0.25, 1e-300, 5e-324, 3.0, 1e300, 0.75])
    order, clock = ScoreOrder(), 0
    for rnd in range(80):
        slots = rng.choice(n, size=200, replace=False)
        stamps[slots] += 1
        key[slots] = pool[rng.integers(0, pool.size, 200)] if rnd % 2 else \
            rng.exponential(size=200) * 10.0 ** rng.integers(-5, 5, 200)
        seq[slots] = clock + np.arange(200)
        clock += 200
        live = int(np.count_nonzero(~np.isnan(key)))
        order.add(key[slots], slots, stamps[slots].copy(), stamps, live)
        gone = rng.choice(n, size=60, replace=False)
        stamps[gone] += 1
        key[gone] = np.nan
        alive = np.flatnonzero(~np.isnan(key))
        want = alive[np.lexsort((seq[alive], -key[alive]))]
        for m in (1, 5, 333, 5000):
            k, s, more = order.top(m, stamps)
            assert np.array_equal(s, want[:m]) and np.array_equal(k, key[want[:m]])
            assert more or alive.size <= m
        if rnd % 10 == 9:
            order.rebuild(stamps)
            assert order.entries == alive.size


def test_score_order_buckets_are_monotone_in_the_key():
    keys = np.sort(np.concatenate([np.random.default_rng(2).exponential(size=5000) *
                                   10.0 ** np.random.default_rng(3).integers(-300, 300, 5000),
                                   [0.0, 5e-324, 1e-308, 1.0, 1.7e308, np.inf]]))
    b = bucket_of(keys).astype(np.int64)
    assert np.all(np.diff(b) >= 0) and b[-1] > b[-2]  # +inf above every finite key
    low = int(bucket_of(np.array([0.0]))[0])
    assert bucket_of(np.array([np.nan, -1.0, -0.0])).tolist() == [low] * 3
    x = keys[(keys > 1e-300) & (keys < 1e300)]
    assert np.all(bucket_of(x) < bucket_of(x * 1.25))  # a bucket spans less than 1.25x


def _table(dim: int = 4, **kw) -> PendingTable:
    return PendingTable(dim, torch.float32, capacity=4, **kw)


def _rows(*values: float, dim: int = 4) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)[:, None].repeat(1, dim)


def test_a_pending_row_keeps_what_predictors_hold_and_takes_the_newest_value():
    t = _table()
    ids = torch.tensor([1, 2, 3])
    c = t.merge(ids, _rows(0, 0, 5), _rows(1, 0, 5), None, None, tick=1)
    assert (c.scored, c.exact, c.rejected) == (3, 2, 0)  # 2 and 3 did not move
    assert len(t) == 1 and t.max_error() == pytest.approx(2.0)  # ‖(1,1,1,1)‖
    # row 1 moves again: its FIRST is now 1, but predictors still hold 0
    c = t.merge(torch.tensor([1]), _rows(1), _rows(3), None, None, tick=2)
    assert c.coalesced == 1 and len(t) == 1
    assert t.max_error() == pytest.approx(6.0)
    taken = t.take(t.live_slots())
    assert taken.ids.tolist() == [1] and taken.current[0].tolist() == [3.0] * 4
    assert taken.served[0].tolist() == [0.0] * 4 and taken.birth.tolist() == [1]
    assert len(t) == 0 and t.max_error() == 0.0


def test_growth_beyond_the_first_capacity_keeps_every_row():
    t = _table(dim=2)
    ids = torch.arange(1000) * 7
    cur = torch.randn(1000, 2) + 10
    t.merge(ids, torch.zeros(1000, 2), cur, None, None, tick=1)
    assert len(t) == 1000
    taken = t.take(t.live_slots())
    assert taken.ids.tolist() == ids.tolist() and torch.equal(taken.current, cur)


def test_rows_beyond_the_wire_range_and_nonfinite_rows_are_rejected_not_blocking():
    t = _table(range_limit=wire.F16_MAX)
    ids = torch.tensor([1, 2, 3, 4])
    cur = _rows(1, 99999.8, float("nan"), 2)
    c = t.merge(ids, _rows(0, 0, 0, 0), cur, None, None, tick=1)
    assert (c.rejected, c.out_of_range) == (2, 1)
    assert t.take(t.live_slots()).ids.tolist() == [1, 4]


def test_new_rows_score_against_zeros_and_tombstones_drop_pending_rows():
    t = _table()
    new = torch.tensor([True, False])
    t.merge(torch.tensor([5, 6]), _rows(9, 0), _rows(9, 1), new, None, tick=1)
    assert len(t) == 2 and t.max_error() == pytest.approx(18.0)  # new: served zeros
    t.merge(torch.empty(0, dtype=torch.int64), _rows(), _rows(), None,
            torch.tensor([5]), tick=2)
    assert len(t) == 1 and t.tombstones.tolist() == [5]
    # re-inserted before its tombstone went out: scored against zeros, tombstone withdrawn
    t.merge(torch.tensor([5]), _rows(0), _rows(2), torch.tensor([False]), None, tick=3)
    assert t.tombstones.tolist() == [] and t.max_error() == pytest.approx(4.0)


def test_put_back_restores_the_served_state_under_a_newer_value():
    t = _table()
    t.merge(torch.tensor([1, 2]), _rows(0, 0), _rows(1, 1), None, None, tick=1)
    sent = t.take(t.live_slots())
    t.merge(torch.tensor([1]), _rows(1), _rows(4), None, None, tick=5)  # moved meanwhile
    t.put_back(sent, torch.tensor([9]))  # delivery failed
    taken = t.take(t.live_slots())
    assert taken.ids.tolist() == [1, 2]
    assert taken.current[:, 0].tolist() == [4.0, 1.0]  # newest value kept
    assert taken.served[:, 0].tolist() == [0.0, 0.0]  # what predictors still hold
    assert taken.birth.tolist() == [1, 1]
    assert t.take_tombstones().tolist() == [9]


def _mixed_hand_off(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """``(ids, first, current, new)`` of dim 3 over ids < 400: rows that changed, rows that
    did not (exact), NaN rows and rows beyond f16's range."""
    ids = torch.unique(torch.randint(0, 400, (300,), generator=g))
    n = ids.numel()
    first = torch.randn(n, 3, generator=g)
    cur = first + torch.randn(n, 3, generator=g) * (torch.rand(n, 1, generator=g) > 0.2)
    cur[::37] = float("nan")
    cur[5::41] = 1e6
    return ids, first, cur, torch.rand(n, generator=g) < 0.3


def test_a_merge_in_chunks_equals_one_merge(monkeypatch):
    """A hand-off larger than a merge's chunk (bounded temporaries) leaves the same pending
    set, counts and table scale as one pass over it."""
    from deltastream.publishing import pending

    g = torch.Generator().manual_seed(5)

    def run() -> tuple:
        t = _table(dim=3, range_limit=wire.F16_MAX)
        for tick in range(3):  # rows pending already, new rows, rejected and exact rows
            ids, first, cur, new = _mixed_hand_off(g)
            c = t.merge(ids, first, cur, new, torch.tensor([tick * 1000 + 7]), tick=tick)
        taken = t.take(t.live_slots())
        return (c.scored, c.exact, c.rejected, c.out_of_range, c.coalesced), t.scale.value, \
            taken.ids, taken.served, taken.current, taken.new, taken.birth

    g.manual_seed(5)
    whole = run()
    monkeypatch.setattr(pending, "MERGE_CHUNK_ROWS", 7)
    g.manual_seed(5)
    chunked = run()
    assert whole[0] == chunked[0] and whole[0][0] > 7
    assert whole[1] == pytest.approx(chunked[1], rel=1e-12)
    for a, b in zip(whole[2:], chunked[2:], strict=True):
        assert torch.equal(a, b)


def test_a_merge_in_storage_order_with_first_rows_in_an_arena_equals_the_sorted_merge():
    """The worker merges a hash table's hand-off as the tracker gave it: ids in any order,
    each FIRST row read in place from the tracker's arena (``first_at``). The pending set,
    counts, scale and tombstones equal those of the same rows merged sorted (rows pending
    already, new, rejected, exact, and ids re-inserted before their tombstone went out)."""
    def run(shuffled: bool) -> tuple:
        g = torch.Generator().manual_seed(9)
        t = _table(dim=3, range_limit=wire.F16_MAX)
        counts = []
        for tick in range(4):
            ids, first, cur, new = _mixed_hand_off(g)
            n = ids.numel()
            tombs = torch.unique(torch.randint(0, 400, (20,), generator=g))
            tombs = tombs[~torch.isin(tombs, ids)]
            if not shuffled:
                c = t.merge(ids, first, cur, new, tombs, tick=tick)
            else:
                p = torch.randperm(n, generator=torch.Generator().manual_seed(tick))
                arena = torch.randn(n + 5, 3)  # rows the merge must not read stay random
                at = torch.randperm(n + 5, generator=torch.Generator().manual_seed(50 + tick))[:n]
                arena[at] = first[p]
                c = t.merge(ids[p], arena, cur[p], new[p], tombs, tick=tick, first_at=at)
            counts.append((c.scored, c.exact, c.rejected, c.out_of_range, c.coalesced))
        tombstones = t.take_tombstones()
        taken = t.take(t.live_slots())
        return counts, t.scale.value, tombstones, taken.ids, taken.served, taken.current, \
            taken.new, taken.birth

    sorted_, shuffled = run(False), run(True)
    assert sorted_[0] == shuffled[0] and sorted_[0][-1][4] > 0 and sorted_[0][-1][2] > 0
    assert sorted_[1] == pytest.approx(shuffled[1], rel=1e-12)
    for a, b in zip(sorted_[2:], shuffled[2:], strict=True):
        assert torch.equal(a, b)


def test_rows_a_residual_left_age_from_their_next_change_only():
    """A row put back with ``SENT_BIRTH`` (every change of it went out as a residual) is
    never in the age order's overdue part; a later change gives it the merge's tick."""
    t = PendingTable(4, torch.float32)
    ids = torch.arange(6)
    t.merge(ids, torch.zeros(6, 4), torch.ones(6, 4), None, None, tick=1)
    rows = t.take(t.live_slots())
    t.put_back(replace(rows, served=rows.current * 0.5,
                       birth=torch.full_like(rows.birth, SENT_BIRTH)), None)
    assert len(t) == 6 and list(t.by_age.oldest(1 << 40, t.lives)) == []
    t.merge(ids[:2], torch.ones(2, 4), 2 * torch.ones(2, 4), None, None, tick=7)
    got = [(b, sorted(t.take(s).ids.tolist())) for b, s in t.by_age.oldest(1 << 40, t.lives)]
    assert got == [(7, [0, 1])]
    assert torch.equal(t.take(t.live_slots()).served, torch.full((4, 4), 0.5))
