from __future__ import annotations

import torch

from deltastream.publishing.handoff import TableHandoff


def _unordered(ids, inserted, tombstones) -> TableHandoff:
    n = len(ids)
    return TableHandoff(fqn="t", ids=torch.tensor(ids, dtype=torch.int64),
                        first=torch.zeros(n + 2, 2), current=torch.ones(n, 2), new=None,
                        tombstones=torch.tensor(tombstones, dtype=torch.int64),
                        inserted=None if inserted is None
                        else torch.tensor(inserted, dtype=torch.int64),
                        first_at=torch.arange(n), ordered=False)


def test_live_gives_new_flags_in_the_ids_order_and_drops_tombstones_of_live_ids():
    """Ids in storage order (not sorted): ``new`` follows them; an id both evicted and
    changed in the interval was re-inserted, so its tombstone is dropped."""
    h = _unordered([40, 7, 19, 3], inserted=[3, 19, 50], tombstones=[1, 7, 8, 40])
    new, tombs = h.live()
    assert new.tolist() == [False, False, True, True]
    assert tombs.tolist() == [1, 8]
    new, tombs = _unordered([5, 2], inserted=[], tombstones=[]).live()
    assert new.tolist() == [False, False] and tombs.tolist() == []
    new, tombs = _unordered([5, 2], inserted=None, tombstones=[2]).live()
    assert new is None and tombs.tolist() == []


def test_an_ordered_hand_off_is_passed_through():
    h = TableHandoff(fqn="t", ids=torch.tensor([1, 2]), first=torch.zeros(2, 2),
                     current=torch.ones(2, 2), new=torch.tensor([True, False]),
                     tombstones=torch.tensor([2]))
    new, tombs = h.live()
    assert new is h.new and tombs is h.tombstones
