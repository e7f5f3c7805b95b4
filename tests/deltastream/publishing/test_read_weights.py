"""Read weights: decayed change counts per id, kept as keys an incremental order can hold."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from deltastream.publishing.pending import PendingTable
from deltastream.publishing.read_weights import REBASE_SPAN, ReadWeights


def _brute_counts(history: list[np.ndarray], decay: float, now: int) -> dict[int, float]:
    """Each id's count at hand-off ``now``: one per hand-off that changed it, decayed."""
    out: dict[int, float] = {}
    for t, ids in enumerate(history[:now + 1]):
        for i in ids.tolist():
            out[i] = out.get(i, 0.0) + decay ** (now - t)
    return out


def test_weights_are_the_root_of_the_decayed_count_up_to_one_factor_per_hand_off():
    """At any hand-off, the weights of all ids (each as of its last change) are
    √(its decayed count now) times one common factor."""
    decay, g = 0.8, np.random.default_rng(0)
    r = ReadWeights(decay)
    history = []
    for t in range(40):
        ids = np.unique(g.integers(0, 60, 12))
        history.append(ids)
        r.touch(torch.from_numpy(ids), t)
    every = np.arange(60)
    truth = _brute_counts(history, decay, 39)
    held = np.array(sorted(truth))
    w = r.weights(torch.from_numpy(held), 39)
    want = np.sqrt([truth[i] for i in held.tolist()])
    ratio = w / want
    np.testing.assert_allclose(ratio, ratio[0], rtol=1e-9)
    # an id never changed weighs as a count of min_count now
    never = np.setdiff1d(every, held)[:1]
    if never.size:
        assert r.weights(torch.from_numpy(never), 39)[0] == pytest.approx(
            math.sqrt(r.min_count) * ratio[0], rel=1e-9)


def test_a_rebase_scales_every_earlier_weight_by_the_factor_it_returns():
    r = ReadWeights(0.5)
    a = torch.tensor([1, 2])
    r.touch(a, 0)
    r.touch(torch.tensor([2]), 3)
    t = 1
    while not r.due(t):
        t += 1
    assert t * -0.5 * math.log(0.5) > REBASE_SPAN * math.log(2)  # due only past the span
    before = r.weights(a, t)
    factor = r.rebase(t)
    assert 0 < factor < 1 and r.base == t
    np.testing.assert_allclose(r.weights(a, t), before * factor, rtol=1e-9)
    # and a weight given now compares to them as counts do: id 3 changed once, now
    w3 = r.touch(torch.tensor([3]), t)[0]
    assert w3 == pytest.approx(1.0)
    assert r.weights(a, t)[1] == pytest.approx(math.sqrt(0.5 ** t + 0.5 ** (t - 3)))


def test_faded_counts_are_forgotten_so_memory_follows_recent_changes():
    """Ids changed once, 500 new ones every hand-off for 400 hand-offs: the store holds
    about the ids of the last log(min_count)/log(decay) hand-offs, not all 200,000."""
    r = ReadWeights(0.9)
    for t in range(400):
        r.touch(torch.arange(t * 500, (t + 1) * 500), t)
    recent = math.ceil(math.log(r.min_count) / math.log(0.9)) * 500
    assert r.sweeps > 0
    assert len(r) <= 2 * recent + 4096 + 500
    # what the sweeps kept is exactly what had not faded at their time: the newest ids
    assert r.weights(torch.tensor([399 * 500]), 399)[0] == pytest.approx(
        r.touch(torch.tensor([10**9]), 399)[0])


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.5])
def test_a_decay_outside_zero_one_is_refused(bad):
    with pytest.raises(ValueError, match="decay must be in"):
        ReadWeights(bad)


def _brute_rank(table: PendingTable, history: list[np.ndarray], decay: float, now: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """Every pending row's id and its key error × √(decayed count now), by a full pass."""
    counts = _brute_counts(history, decay, now)
    slots = table.live_slots()
    ids = table.ids_of(slots).numpy()
    return ids, table.errors(slots) * np.sqrt([counts[i] for i in ids.tolist()])


def test_the_pending_order_by_reads_equals_a_full_rescore_through_rebases_and_puts_back():
    """Merges, takes, failed sends put back and rebases (decay 0.5: one every 128
    hand-offs): ``by_rank`` always lists the pending rows by error × √(decayed count now),
    as a full re-sort does, while ``by_error`` keeps the largest plain error."""
    decay, dim, g = 0.5, 3, torch.Generator().manual_seed(1)
    t = PendingTable(dim, torch.float32, read_decay=decay)
    history = []
    for tick in range(300):
        ids = torch.unique(torch.randint(0, 300, (40,), generator=g))
        history.append(ids.numpy())
        first = torch.randn(ids.numel(), dim, generator=g)
        t.merge(ids, first, first + torch.randn(ids.numel(), dim, generator=g), None, None,
                tick)
        if tick % 3 == 0:  # publish the best few; every other time the send fails
            _, slots, _ = t.by_rank.top(5, t.stamps)
            taken = t.take(slots)
            if tick % 2:
                t.put_back(taken, None)
        if tick % 50 == 49 or tick in (127, 128, 129, 256, 257):
            want_ids, want = _brute_rank(t, history, decay, tick)
            keys, slots, more = t.by_rank.top(len(t) + 1, t.stamps)
            assert not more and keys.size == len(t)
            got_ids = t.ids_of(slots).numpy()
            # same rows, same keys up to the hand-off's common factor, in key order
            by_id = dict(zip(want_ids.tolist(), want.tolist(), strict=True))
            ratio = keys / np.array([by_id[i] for i in got_ids.tolist()])
            np.testing.assert_allclose(ratio, ratio[0], rtol=1e-6)
            assert np.all(np.diff(keys) <= 0)
            assert t.max_error() == pytest.approx(float(t.errors(t.live_slots()).max()))
    assert t.reads.base > 0  # rebases happened


@pytest.mark.parametrize("read_decay, first", [(0.9, 0), (None, 1)])
def test_a_row_changed_at_every_step_goes_before_a_larger_error_changed_once(read_decay,
                                                                               first):
    """Row 1 moved once, at step 1 (error 0.6); row 0 moved a little at every step of ten
    (error 0.4). The bucket pays for its first row at step 10: by error alone row 1 goes;
    weighted by reads (√6.5 against √0.39) row 0 goes, and the bound is still row 1's."""
    from deltastream.publishing.budget import BudgetPolicy, BudgetPublisher
    from tests.deltastream.publishing.budget_cases import move, setup

    model, tracker, serving, pub = setup({"a": 4}, n=10)
    policy = BudgetPolicy(bytes_per_step=30, burst_bytes=300, scale="none",
                          read_decay=read_decay)
    bp = BudgetPublisher(tracker, pub, "p", policy, threaded=False)
    sent = []
    for step in range(1, 11):
        move(model["a"], [0], 0.02)
        if step == 1:
            move(model["a"], [1], 0.3)
        tracker.step()
        rnd = bp.tick(step)
        sent += [(step, t.ids.tolist()) for t in rnd.round.tables if t.published]
    assert sent == [(10, [first])]
    assert bp.last.table_bounds["a"] == pytest.approx(0.6 if first == 0 else 0.4, rel=1e-5)
