"""``bench trainer-cost``'s pure logic: which configurations run, and how its chunks become
ratios (no training)."""

from __future__ import annotations

import argparse
import statistics
from types import SimpleNamespace

import pytest

from bench import trainer_cost


def _run(with_s: list[tuple[float, float]], alone_at: list[int]) -> SimpleNamespace:
    return SimpleNamespace(with_s=with_s, alone_at=alone_at)


def test_the_bracketed_ratio_cancels_a_step_time_that_drifts_over_the_run():
    """Alone chunks at 10, 11, 12 ... ms (the VM slowing down 1 ms a pair) and deltastream
    costing 5 %: a pair's chunk lies halfway between its alone chunk and the next, so the
    bracketed ratio reads 1.05 exactly where the chunk before alone reads it too high."""
    alones = [(10e-3 + i * 1e-3, 5e-3 + i * 1e-3) for i in range(6)]
    r = _run([(1.05 * (10.5e-3 + i * 1e-3), 1.05 * (5.5e-3 + i * 1e-3)) for i in (0, 2, 4)],
             [0, 2, 4])
    for col in (0, 1):  # wall and CPU time alike
        assert trainer_cost._pair_ratios(r, alones, col, bracketed=True) == \
            pytest.approx([1.05] * 3)
        adjacent = trainer_cost._pair_ratios(r, alones, col, bracketed=False)
        assert all(x > 1.05 for x in adjacent)


def test_the_last_pair_of_a_run_has_only_its_own_alone_chunk():
    alones = [(10e-3, 1e-3), (20e-3, 2e-3)]
    r = _run([(11e-3, 1e-3), (21e-3, 2e-3)], [0, 1])
    assert trainer_cost._pair_ratios(r, alones, 0, bracketed=True) == \
        pytest.approx([11 / 15, 21 / 20])
    assert trainer_cost._pair_ratios(r, alones, 0, bracketed=False) == \
        pytest.approx([11 / 10, 21 / 20])
    assert statistics.median(trainer_cost._pair_ratios(r, alones, 1, bracketed=True)) == \
        pytest.approx((1 / 1.5 + 1) / 2)


def test_the_extra_time_splits_into_the_phases_of_the_step_and_the_rest():
    """Two alone steps of 10 ms (4 forward, 4 backward, 2 optimizer) against three steps
    with deltastream (two in the chunk, one in the tail) of 12 ms: 5 forward, 4.5
    backward, 2 optimizer and 0.5 ms outside the phases (the tick)."""
    r = SimpleNamespace(times=[12e-3, 12e-3], tail_steps=[1], tail_s=[12e-3],
                        alone=[10e-3, 10e-3], phases_alone=[8e-3, 8e-3, 4e-3],
                        phases_with=[15e-3, 13.5e-3, 6e-3])
    got = trainer_cost._extra_us(r)
    assert got == pytest.approx({"forward": 1000, "backward": 500, "optimizer": 0,
                                 "rest": 500})


def _args(**kw) -> argparse.Namespace:
    base = dict(budgets=[50000, 5000], sync=True, thread=False, uncapped=False,
                residuals=False, unweighted=True, only=None)
    return argparse.Namespace(**{**base, **kw})


def test_the_configurations_take_turns_in_a_fixed_order():
    names = [n for n, _ in trainer_cost._configurations(_args())]
    assert names == ["tracker", "tracker-idle", "budget-50000", "budget-5000",
                     "budget-50000-sync", "budget-50000-unweighted", "delta-10", "rounds-10"]
    kw = dict(trainer_cost._configurations(_args()))
    assert kw["budget-50000-sync"] == {"budget": 50000, "threaded": False}
    assert kw["tracker-idle"] == {"reads_every": None} and kw["rounds-10"] == {"rounds_every": 10}


def test_only_runs_the_named_configurations_in_its_order_and_refuses_unknown_names():
    got = trainer_cost._configurations(_args(only=["rounds-10", "tracker-idle"]))
    assert got == [("rounds-10", {"rounds_every": 10}), ("tracker-idle", {"reads_every": None})]
    with pytest.raises(SystemExit, match="budget-7"):
        trainer_cost._configurations(_args(only=["budget-7"]))
