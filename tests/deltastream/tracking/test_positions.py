"""deltastream.tracking.positions: UniqueLookups, the pending lookups of a TorchRec shard on
the CPU (new positions only, FIRST rows gathered into one arena)."""

from __future__ import annotations

import pytest
import torch

from deltastream.tracking.positions import UniqueLookups


class _Rows:
    """Position -> id map of a row-wise shard starting at global row 100."""

    ids_ascending = True

    def ids_at(self, positions: torch.Tensor) -> torch.Tensor:
        return positions + 100


def test_unique_lookups_keep_each_position_once_with_its_first_row(fresh_path):
    w = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    p = UniqueLookups(10, torch.device("cpu"))
    buf = torch.tensor([7, 2, 7, 2, 5])
    p.add(buf, w)
    buf[:] = 0  # the caller reuses its buffer: the recorded positions are a copy
    w[[2, 5, 7]] += 100.0  # the update after the lookup: FIRST keeps the rows before it
    p.add(torch.tensor([5, 2, 9, 9]), w)  # 5 and 2 again: nothing new; 9 is new
    assert p.n == p.n_states == 4  # 7, 2, 5, then 9: each position once
    ids, states = p.drain(_Rows(), with_states=True)
    assert ids.tolist() == [102, 105, 107, 109]
    torch.testing.assert_close(states, torch.arange(40, dtype=torch.float32).reshape(10, 4)
                               [[2, 5, 7, 9]])
    assert p.n == 0 and not p.marks.any()  # drained: the next interval starts empty
    p.add(torch.tensor([2]), None)  # ids only
    ids, states = p.drain(_Rows(), with_states=False)
    assert ids.tolist() == [102] and states is None


def test_unique_lookups_arena_grows_and_reset_forgets(fresh_path):
    w = torch.randn(5000, 3)
    p = UniqueLookups(5000, torch.device("cpu"))
    for lo in range(0, 5000, 700):  # past the first arena (1024 rows)
        p.add(torch.arange(lo, min(lo + 700, 5000)).flip(0), w)
    ids, states = p.drain(_Rows(), with_states=True)
    assert torch.equal(ids, torch.arange(5000) + 100)
    torch.testing.assert_close(states, w)
    p.add(torch.tensor([1, 2]), w)
    p.reset()
    assert p.n == 0 and not p.marks.any()


class _Hashed:
    """Position -> id map of a hash table: ids in no particular order of positions."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = torch.tensor(ids)

    def ids_at(self, positions: torch.Tensor) -> torch.Tensor:
        return self.ids.index_select(0, positions)

    def position_ids(self) -> torch.Tensor:
        return self.ids


def test_unique_lookups_from_output_rows_sorted_by_id(fresh_path):
    """A HashTable's lookups: rows from the forward's output, ids not in position order;
    the drain sorts by id and pairs each id with the row of its earliest lookup."""
    p = UniqueLookups(6, torch.device("cpu"))
    table = _Hashed([50, 10, 40, 20, 30, 60])
    out1 = torch.tensor([[4.0], [1.0], [4.0]])  # positions 4, 1, 4: one lookup's copies
    p.add(torch.tensor([4, 1, 4]), rows=out1)
    out1.mul_(0)  # the output changed after the lookup: the copy is unaffected
    p.add(torch.tensor([1, 0, 3]), rows=torch.tensor([[-1.0], [0.0], [3.0]]))  # 1 again
    ids, states = p.drain(table, with_states=True)
    assert ids.tolist() == [10, 20, 30, 50]  # positions 1, 3, 4, 0
    assert states.flatten().tolist() == [1.0, 3.0, 4.0, 0.0]
    assert not p.marks.any() and p.n == 0


def test_unique_lookups_grow_keeps_marks_of_the_interval(fresh_path):
    """The table grew between two lookups: marks set before the growth still hold."""
    p = UniqueLookups(4, torch.device("cpu"))
    p.add(torch.tensor([3]), rows=torch.tensor([[3.0]]))
    p.grow(9)
    p.add(torch.tensor([8, 3]), rows=torch.tensor([[8.0], [-3.0]]))  # 3: not new
    ids, states = p.drain(_Hashed(list(range(100, 109))), with_states=True)
    assert ids.tolist() == [103, 108] and states.flatten().tolist() == [3.0, 8.0]


def test_a_lookup_given_the_table_capacity_grows_the_marks_first(fresh_path):
    """``add(capacity=...)``: a lookup of a position past the marks (the table grew since
    the last lookup) grows them before marking, and keeps the marks set before."""
    p = UniqueLookups(4, torch.device("cpu"))
    p.add(torch.tensor([3]), rows=torch.tensor([[3.0]]), capacity=4)
    with pytest.raises(IndexError):  # without the capacity: out of range, nothing marked
        p.add(torch.tensor([8]), rows=torch.tensor([[8.0]]))
    p.add(torch.tensor([8, 3]), rows=torch.tensor([[8.0], [-3.0]]), capacity=9)
    assert p.marks.numel() == 9
    ids, states = p.drain(_Hashed(list(range(100, 109))), with_states=True)
    assert ids.tolist() == [103, 108] and states.flatten().tolist() == [3.0, 8.0]


def test_a_drain_maps_ids_by_the_table_it_is_given_not_the_one_before(fresh_path):
    """Whether a table's ids are its positions is read once per table object (a hash
    table's missing attribute costs a raise inside ``getattr``, per table in a tick): a
    different table object (a row map replaced) is read anew."""
    p = UniqueLookups(6, torch.device("cpu"))
    w = torch.arange(6, dtype=torch.float32).reshape(6, 1)
    p.add(torch.tensor([4, 1]), w)
    assert p.drain(_Rows(), with_states=True)[0].tolist() == [101, 104]
    p.add(torch.tensor([4, 1]), w)
    ids, states = p.drain(_Hashed([50, 10, 40, 20, 30, 60]), with_states=True)
    assert ids.tolist() == [10, 30] and states.flatten().tolist() == [1.0, 4.0]
    p.add(torch.tensor([3]), w)
    assert p.drain(_Rows(), with_states=True)[0].tolist() == [103]


def test_an_unordered_drain_reads_the_ids_the_table_holds_now(fresh_path):
    """A hash table's ids per position are read through a numpy view kept between drains
    while the table hands out the same ``position_ids`` tensor: one it replaced (same size,
    other ids: a reload, a move) is read anew."""
    if fresh_path != "native":
        pytest.skip("an unordered drain is the C code's")
    p = UniqueLookups(6, torch.device("cpu"))
    w = torch.arange(6, dtype=torch.float32).reshape(6, 1)
    table = _Hashed([50, 10, 40, 20, 30, 60])
    for ids in ([50, 10, 40, 20, 30, 60], [50, 10, 40, 20, 30, 60], [5, 1, 4, 2, 3, 6]):
        table.ids = torch.tensor(ids) if ids[0] != table.ids[0] else table.ids
        p.add(torch.tensor([4, 1]), w)
        got = p.drain_unordered(table, w)
        p.fresh.settle()  # the owed rows' walk writes the ids
        assert sorted(got[0].tolist()) == sorted([ids[1], ids[4]])
        got[-1]()
