from __future__ import annotations

import pytest
import torch

from deltastream import DeltaTracker, TrackingMode
from deltastream.publishing.handoff import Handoff, HostCopier, TableHandoff, take_handoff


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


def test_live_takes_inserted_and_evicted_ids_as_recorded():
    """The tracker hands them over unsorted, repeats kept (an id evicted, re-inserted and
    evicted again in one interval): ``new`` and the tombstones come out as from sorted,
    unique ids, each tombstone once."""
    h = _unordered([40, 7, 19, 3], inserted=[50, 19, 3, 19], tombstones=[40, 8, 1, 8, 7])
    new, tombs = h.live()
    assert new.tolist() == [False, False, True, True]
    assert tombs.tolist() == [1, 8]
    assert h.inserted.tolist() == [3, 19, 50]


def test_an_ordered_hand_off_is_passed_through():
    h = TableHandoff(fqn="t", ids=torch.tensor([1, 2]), first=torch.zeros(2, 2),
                     current=torch.ones(2, 2), new=torch.tensor([True, False]),
                     tombstones=torch.tensor([2]))
    new, tombs = h.live()
    assert new is h.new and tombs is h.tombstones


def test_a_hand_off_with_repeats_keeps_each_id_once_with_its_first_state():
    """An accelerator's lookups as recorded (:class:`RawRows`): the worker keeps each id's
    first occurrence — its FIRST state — and each inserted / evicted id once."""
    ids = [7, 3, 7, 9, 3, 7]
    first = torch.arange(6, dtype=torch.float32).unsqueeze(1).repeat(1, 2)
    current = torch.tensor([[70.0, 0], [30, 0], [70, 0], [90, 0], [30, 0], [70, 0]])
    h = Handoff(tick=1, step=1, ts=0, units=1.0, tables=[TableHandoff(
        fqn="t", ids=torch.tensor(ids), first=first, current=current, new=None,
        tombstones=torch.tensor([9, 5, 5, 1]), inserted=torch.tensor([9, 3, 9]),
        ordered=False, repeats=True)])
    h.wait()
    (t,) = h.tables
    assert t.ids.tolist() == [3, 7, 9] and not t.repeats
    assert t.first[:, 0].tolist() == [1.0, 0.0, 3.0]  # the first occurrence of each id
    assert t.current[:, 0].tolist() == [30.0, 70.0, 90.0]
    new, tombs = t.live()
    assert new.tolist() == [True, False, True]
    assert tombs.tolist() == [1, 5]  # 9 is live again (re-inserted): a row, not a tombstone
    h.wait()  # a second wait changes nothing
    assert t.ids.tolist() == [3, 7, 9]


class _PassThrough(HostCopier):
    """Keeps tensors where they are: what the training thread does with them is the test
    (on the ``meta`` device every read of a value raises)."""

    def host(self, x):
        return x

    def finish(self):
        return None


@pytest.mark.parametrize("consumers", [["p"], ["p", "snapshot"]])
@pytest.mark.parametrize("steps", [1, 3])
def test_the_hand_off_of_an_accelerators_lookups_needs_no_value_from_the_device(
        steps, consumers):
    """The training thread's part of a tick for a table on an accelerator (every lookup as
    recorded, current rows gathered at the recorded positions) on ``meta`` tensors: any
    device -> host read (a sync on CUDA) would raise — with a second consumer too, whose
    records stay. The same on CUDA runs under ``set_sync_debug_mode("error")``
    (test_budget)."""
    emb = torch.nn.Embedding(64, 4, device="meta")
    tracker = DeltaTracker(torch.nn.ModuleDict({"emb": emb}), consumers=consumers,
                           mode=TrackingMode.EMBEDDING, sparse_updates_only=["emb"])
    for _ in range(2):
        for n in range(steps):
            emb(torch.zeros(5 + n, dtype=torch.int64, device="meta"))
            tracker.step()
        (t,) = take_handoff(tracker, "p", tracker.get_tracked_modules(), _PassThrough())
        assert t.repeats and t.ids.shape == (sum(5 + n for n in range(steps)),)
        assert t.first.shape == t.current.shape == (len(t.ids), 4)
        assert take_handoff(tracker, "p", tracker.get_tracked_modules(), _PassThrough()) == []
    held = 2 * sum(5 + n for n in range(steps)) if len(consumers) > 1 else 0
    assert tracker.stats()["rows_tracked"] == held  # the other consumer's, as recorded
