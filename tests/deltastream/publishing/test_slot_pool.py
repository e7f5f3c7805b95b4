"""deltastream.publishing.slot_pool: ids keep their slot and columns through growth, freed
slots are reused and their stamps move on."""

from __future__ import annotations

import numpy as np
import torch

from deltastream.publishing.slot_pool import SlotPool


def test_columns_grow_with_the_slots_and_freed_slots_are_reused():
    pool = SlotPool({"row": torch.zeros(4, 2), "flag": np.zeros(4, dtype=bool)}, "test")
    ids = torch.arange(10) * 7
    slots = pool.add(ids)  # past the first capacity: every column grows
    pool.cols["row"].index_copy_(0, slots, ids[:, None].float().expand(-1, 2))
    pool.cols["flag"][slots.numpy()] = True
    assert len(pool) == 10 and pool.capacity >= 10
    assert torch.equal(pool.find(ids), slots) and pool.find(torch.tensor([1])).tolist() == [-1]
    assert torch.equal(pool.cols["row"][slots, 0], ids.float())  # kept through the growth
    stamp = pool.stamp.copy()
    gone = pool.remove(torch.tensor([14, 999]))  # one held, one not
    assert gone.tolist() == [int(slots[2])] and pool.stamp[gone[0]] == stamp[gone[0]] + 1
    assert not pool.live[gone[0]] and len(pool) == 9
    again = pool.add(torch.tensor([5]))
    assert again.tolist() == gone.tolist()  # the freed slot first
    pool.remove_slots(again.numpy())
    assert sorted(pool.live_slots().tolist()) == sorted(set(slots.tolist()) - set(gone.tolist()))
