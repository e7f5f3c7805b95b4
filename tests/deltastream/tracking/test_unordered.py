"""DeltaTracker.get_delta_unordered: the same rows as get_delta, sorted later, or get_delta's
own rows where the unsorted form does not apply."""

from __future__ import annotations

import pytest
import torch

from deltastream.embedding.optim import SparseAdam
from deltastream.tracking import fresh_rows
from deltastream.tracking.rows import UnorderedRows
from deltastream.tracking.tracker import DeltaTracker
from deltastream.types import DeltaRows, TrackingMode

from .test_tracker import Trainer

EMB = TrackingMode.EMBEDDING

pytestmark = pytest.mark.skipif(not fresh_rows.NATIVE_AVAILABLE,
                                reason="deltastream.tracking.native is not built")


def _same(a: DeltaRows, b: DeltaRows) -> None:
    assert torch.equal(a.ids, b.ids)
    assert torch.equal(a.states, b.states)  # bit for bit
    for x, y in ((a.new, b.new), (a.tombstones, b.tombstones), (a.age, b.age)):
        assert (x is None) == (y is None) and (x is None or torch.equal(x, y))


def _twins():
    """Two identical trainers (same seed, same steps), one tracker each."""
    out = []
    for _ in range(2):
        t = Trainer(seed=3, sparse_opt=SparseAdam)
        out.append((t, DeltaTracker(t.net, consumers=["p"], mode=EMB)))
    return out


def test_the_unordered_read_finishes_into_get_deltas_rows():
    """Intervals with repeats, inserts (new), evictions (tombstones, and a row freed after
    it was looked up: that interval is stored, the unsorted form steps aside) — each read
    equals get_delta's on a twin, bit for bit; positions are where the rows live."""
    (ta, a), (tb, b) = _twins()
    g = torch.Generator().manual_seed(9)
    kinds = set()
    for interval in range(8):
        for _ in range(3):
            u = (torch.rand(60, generator=g) ** 2 * (40 + 30 * interval)).long() * 7919 + 11
            i = torch.randint(0, 64, (20,), generator=g)
            ta.step(u, i, [a])
            tb.step(u, i, [b])
        if interval in (2, 5):  # evict a few ids held now, in both twins
            gone = u[:4].unique()
            ta.net.user.evict(gone)
            tb.net.user.evict(gone)
        want = a.get_delta("p")
        got = b.get_delta_unordered("p")
        assert got.keys() == want.keys()
        for fqn, d in got.items():
            kinds.add((fqn, type(d).__name__))
            if isinstance(d, UnorderedRows):
                table = tb.net.user
                assert torch.equal(table.ids_at(d.positions), d.ids)
                rows, order = d.finish()
                assert torch.equal(rows.ids, d.ids[order])
                d = rows
            _same(d, want[fqn])
    assert ("user", "UnorderedRows") in kinds  # the HashTable: unsorted on most reads
    assert ("user", "DeltaRows") in kinds  # after an eviction: the stored, sorted rows
    assert ("item", "DeltaRows") in kinds  # nn.Embedding with SGD: the scan, as before


def test_the_unsorted_form_steps_aside_where_it_cannot_hold():
    """Two consumers (the records serve both), retained rows (merged with the fresh ones),
    numpy-kept lookups (repeats in the arena): get_delta's rows, sorted here."""
    t = Trainer(seed=1, sparse_opt=SparseAdam)
    two = DeltaTracker(t.net, consumers=["p", "q"], mode=EMB)
    t.step([5, 6, 7], [1], [two])
    assert all(isinstance(d, DeltaRows) for d in two.get_delta_unordered("p").values())
    two.close()

    t = Trainer(seed=1, sparse_opt=SparseAdam)
    tr = DeltaTracker(t.net, consumers=["p"], mode=EMB)
    t.step([5, 6, 7], [1], [tr])
    first = tr.get_delta_unordered("p")["user"]
    assert isinstance(first, UnorderedRows)
    rows, _ = first.finish()
    tr.retain("p", "user", rows)
    t.step([9, 5], [1], [tr])
    again = tr.get_delta_unordered("p")["user"]
    assert isinstance(again, DeltaRows)  # the retained rows come merged, in order
    assert again.ids.tolist() == [5, 6, 7, 9] and again.age.tolist() == [1, 1, 1, 0]

    was = fresh_rows.native_enabled()
    try:
        fresh_rows.use_native(False)
        t.step([3, 3, 4], [1], [tr])
    finally:
        fresh_rows.use_native(was)
    t.step([8], [1], [tr])
    d = tr.get_delta_unordered("p")["user"]
    assert isinstance(d, DeltaRows) and d.ids.tolist() == [3, 4, 8]


def test_owed_rows_are_the_rows_at_the_read_across_evictions_reloads_and_training():
    """``get_delta_unordered(owe=...)``: each read's ``current`` (complete once
    ``capture_rows`` says so) equals the table's rows at the read, bit for bit, although
    training went on — lookups that moved owed rows, an eviction that zeroes owed rows
    (they are copied before), a reload through the model (copied before it), slices of a
    few positions per step."""
    t = Trainer(seed=5, sparse_opt=SparseAdam)
    tr = DeltaTracker(t.net, consumers=["p"], mode=EMB)
    user = t.net.user
    g = torch.Generator().manual_seed(12)

    since_read: list[torch.Tensor] = []  # the user ids looked up since the last read

    def steps(n: int, interval: int) -> None:
        for _ in range(n):
            u = (torch.rand(80, generator=g) ** 2 * (60 + 40 * interval)).long() * 7919 + 3
            since_read.append(u)
            t.step(u, torch.randint(0, 64, (20,), generator=g), [tr])

    deferred = 0
    for interval in range(6):
        steps(3, interval)
        d = tr.get_delta_unordered("p", owe={"user": user.storage.detach()})["user"]
        looked_up = torch.unique(torch.cat(since_read))
        since_read.clear()
        if not isinstance(d, UnorderedRows):
            continue
        # the table at the read (d.positions, d.ids and d.current are written as the marks
        # are walked)
        ids_then = user.position_ids().clone()
        rows_then = user.storage.detach().clone()
        assert d.current is not None and not tr.capture_rows(0)
        deferred += 1
        if interval == 2:  # zeroes rows the read still owes: copied before
            user.evict(looked_up[:5])
        if interval == 4:  # a reload through the model rewrites every row: copied before
            t.net.load_state_dict({k: v.clone() * 2 if k.startswith("user") and
                                   v.is_floating_point() else v
                                   for k, v in t.net.state_dict().items()})
        while not tr.capture_rows(7):
            steps(1, interval)
        assert torch.equal(torch.sort(d.ids).values, looked_up)
        assert torch.equal(d.ids, ids_then[d.positions])
        assert torch.equal(d.current, rows_then[d.positions])
    assert deferred >= 4
    tr.close()
