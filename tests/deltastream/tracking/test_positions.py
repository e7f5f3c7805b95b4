"""deltastream.tracking.positions: UniqueLookups, the pending lookups of a TorchRec shard on
the CPU (new positions only, FIRST rows gathered into one arena)."""

from __future__ import annotations

import torch

from deltastream.tracking.positions import UniqueLookups


class _Rows:
    """Position -> id map of a row-wise shard starting at global row 100."""

    ids_ascending = True

    def ids_at(self, positions: torch.Tensor) -> torch.Tensor:
        return positions + 100


def test_unique_lookups_keep_each_position_once_with_its_first_row():
    w = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    p = UniqueLookups(10, torch.device("cpu"))
    buf = torch.tensor([7, 2, 7, 2, 5])
    p.add(buf, w)
    buf[:] = 0  # the caller reuses its buffer: the recorded positions are a copy
    w[[2, 5, 7]] += 100.0  # the update after the lookup: FIRST keeps the rows before it
    p.add(torch.tensor([5, 2, 9, 9]), w)  # 5 and 2 again: nothing new; 9 is new
    assert p.n == p.n_states == 7  # 7, 2, 7, 2, 5, 9, 9: repeats inside one lookup stay
    ids, states = p.drain(_Rows(), with_states=True)
    assert ids.tolist() == [102, 105, 107, 109]
    torch.testing.assert_close(states, torch.arange(40, dtype=torch.float32).reshape(10, 4)
                               [[2, 5, 7, 9]])
    assert p.n == 0 and not p.marks.any()  # drained: the next interval starts empty
    p.add(torch.tensor([2]), None)  # ids only
    ids, states = p.drain(_Rows(), with_states=False)
    assert ids.tolist() == [102] and states is None


def test_unique_lookups_arena_grows_and_reset_forgets():
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
